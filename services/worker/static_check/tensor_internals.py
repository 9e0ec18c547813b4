"""Rules on reaching past the dynamic checks through tensors and torch's machinery
(S022 host reads and type walks, S023 dispatch and subclass instruments).

The dynamic checks (:mod:`services.worker.rules`) record the ATen ops a candidate
runs and guard the tensor methods that hand data to numpy or Python. A candidate
must not read tensor data on the host (``.numpy()``, ``.tolist()``, ``__dlpack__``
...), walk a type's bases to torch's C tensor type (``__mro__``, ``super(torch.Tensor,
...)``), or use torch's dispatch and override machinery or tensor subclasses, which
hide ops from the op record or reach the recorder.
"""

from __future__ import annotations

import ast
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.worker.static_check.checker import Checker

# S022: tensor methods whose result is the tensor's data in numpy or Python (no ATen op
# records the computation that follows), and the attributes that reach
# torch._C.TensorBase, whose methods the child's host-read guard cannot wrap.
HOST_READ_ATTRS = frozenset({"numpy", "tolist", "__array__", "__array_interface__",
                             "__array_struct__", "__dlpack__", "untyped_storage", "storage",
                             "_typed_storage", "__base__", "__bases__", "__mro__", "mro",
                             "getmro"})
# S023: torch namespaces that run ops past the op recorder or reach it, and the tensor
# subclass hooks that run code whenever the harness touches an output.
INSTRUMENT_SPACES = ("torch._C", "torch.utils._python_dispatch", "torch._dispatch",
                     "torch.overrides", "torch._subclasses", "torch._ops",
                     "torch.utils._mode_utils", "torch._functorch", "torch.fx",
                     # The interpreter's own loads and stores read memory at raw
                     # addresses (numpy out, no tensor method, no ATen op).
                     "triton._C", "triton.runtime.interpreter")
INSTRUMENT_ATTRS = frozenset({"__torch_function__", "__torch_dispatch__", "as_subclass",
                              "_make_subclass", "_make_wrapper_subclass",
                              "DisableTorchFunction", "DisableTorchFunctionSubclass",
                              "_DisableTorchDispatch", "_disable_current_modes",
                              "_get_current_dispatch_mode", "_pop_mode", "_push_mode"})
_INSTRUMENT_PREFIXES = tuple(p + "." for p in INSTRUMENT_SPACES)


def host_read_why(attr: str) -> str:
    """Why an S022 name is refused, for its finding."""
    if attr in ("__base__", "__bases__", "__mro__", "mro"):
        return (" (walking a type's bases reaches torch's C tensor methods past the "
                "sandbox's host-read guard)")
    return (" (it hands tensor data to numpy or Python, where no kernel computes; do the "
            "work in a Triton kernel: pass the tensor to it and tl.load the values, or "
            "read a scalar parameter with .item())")


def check_definition(ctx: Checker, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
    """A function named like a subclass hook or a host-read method (S023)."""
    if node.name in INSTRUMENT_ATTRS or node.name in HOST_READ_ATTRS:
        ctx.add(node.lineno, f"{node.name} defined (numpy or torch would call it "
                "on the candidate's objects, past the op record and the host-read "
                "guard)", "S023")


def check_import(ctx: Checker, node: ast.Import | ast.ImportFrom, module: str) -> None:
    """An import of one of :data:`INSTRUMENT_SPACES` or below (S023)."""
    if module in INSTRUMENT_SPACES or module.startswith(_INSTRUMENT_PREFIXES):
        ctx.add(node.lineno, f"import of {module} is not allowed (torch's dispatch "
                "machinery and Triton's interpreter internals run work past the op "
                "record)", "S023")


def check_super_call(ctx: Checker, node: ast.Call, name: str) -> None:
    """``super(torch.Tensor, x)``: torch's C tensor methods past the guard (S022)."""
    if name == "super" and node.args and (ctx.qual(node.args[0]) or "").startswith("torch"):
        ctx.add(node.lineno, f"super({ctx.qual(node.args[0])}, ...) called (it reaches "
                "torch's C tensor methods past the sandbox's host-read guard)", "S022")


def check_attribute(ctx: Checker, node: ast.Attribute, name: str | None) -> bool:
    """A host-read attribute (S022) or an instrument (S023); whether it was one."""
    if node.attr in HOST_READ_ATTRS:
        ctx.add(node.lineno, f".{node.attr} used{host_read_why(node.attr)}", "S022")
        return True
    if node.attr in INSTRUMENT_ATTRS or (name and name.startswith(_INSTRUMENT_PREFIXES)):
        ctx.add(node.lineno, f"{name or '.' + node.attr} used (torch's dispatch and "
                "subclass machinery hides work from the op record; do the work in a "
                "Triton kernel)", "S023")
        return True
    return False
