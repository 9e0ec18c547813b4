"""Schedules ``view``, ``arange`` and ``copy``: nodes that are a line of forward, no
kernel (a view or reshape of a tensor that exists, ``torch.arange``, a copy that is its
source itself).
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import torch.fx

from services.generator.lowering.ir import Value, bind_args, meta_val
from services.generator.lowering.ops import refuse

if TYPE_CHECKING:
    from services.generator.lowering.lowerer import Lowerer


def view(lw: Lowerer, node: torch.fx.Node, op: str) -> None:
    """Schedule ``view``: the view as a method call on its (materialized) source, e.g.
    ``buf3.permute((0, 2, 1))``; sizes are read at run time where they can be.

    Raises:
        LoweringError: a view operator this schedule does not write (:func:`refuse`).
    """
    raw = bind_args(node)
    src = lw.materialize(raw["self"])
    name = op.split(".")[1]
    # Views that are one method call of the same name: its arguments.
    calls = {
        "unsqueeze": lambda: f"{raw['dim']}",
        "permute": lambda: lw.sym(list(raw["dims"])),
        "expand": lambda: lw.size_list(raw["size"]),
        "t": lambda: "",
        "transpose": lambda: f"{raw['dim0']}, {raw['dim1']}",
        "select": lambda: f"{raw['dim']}, {lw.sym(raw['index'])}",
    }
    if name in calls:
        expr = f"{src}.{name}({calls[name]()})"
    elif name in ("view", "_unsafe_view", "reshape"):
        expr = f"{src}.reshape({lw.reshape_sizes(raw.get('size', raw.get('shape')))})"
    elif name == "alias":
        expr = src
    elif name == "squeeze":
        dims = raw.get("dim", raw.get("dims"))
        expr = f"{src}.squeeze()" if dims is None else (
            f"{src}.squeeze({lw.sym(dims)})")
    elif name == "slice":
        dim = raw.get("dim", 0)
        start = raw.get("start")
        end = raw.get("end")
        step = raw.get("step", 1)
        part = (f"{'' if start is None else lw.sym(start)}:"
                f"{'' if end is None or end == sys.maxsize else lw.sym(end)}:{lw.sym(step)}")
        expr = f"{src}[{':, ' * dim}{part}]"
    else:
        raise refuse(op)
    var = lw.fresh("view")
    lw.forward.append(f"{var} = {expr}  # {op}")
    lw.values[node] = Value("tensor", var)


def arange(lw: Lowerer, node: torch.fx.Node, op: str) -> None:
    """Schedule ``arange``: ``torch.arange`` in forward (its bounds may be sizes known
    at run time)."""
    raw = bind_args(node)
    args = [lw.sym(raw.get(k)) if isinstance(raw.get(k), torch.fx.Node) else repr(raw.get(k))
            for k in ("start", "end", "step") if k in raw]
    var = lw.fresh("buf")
    lw.forward.append(f"{var} = torch.arange({', '.join(args)}, device={lw.device})")
    lw.values[node] = Value("tensor", var)


def copy(lw: Lowerer, node: torch.fx.Node, op: str) -> None:
    """Schedule ``copy``: ``aten.copy(self, src)`` (``t.copy_(src)`` made functional: a
    Model's tensor attribute overwritten by an input) is ``src`` itself, no kernel, when
    it has ``self``'s shape and dtype.

    Raises:
        LoweringError: the copy broadcasts or casts (:func:`refuse`).
    """
    raw = bind_args(node)
    dst, src = meta_val(raw["self"]), meta_val(raw["src"])
    if ([str(s) for s in dst.shape] != [str(s) for s in src.shape]
            or dst.dtype != src.dtype):
        raise refuse(op, f"a copy from {src.dtype}{list(src.shape)} into "
                     f"{dst.dtype}{list(dst.shape)}, which broadcasts or casts")
    lw.values[node] = Value("tensor", lw.materialize(raw["src"]))
