"""The ``(outer, R, inner)`` row view that the reduction-family schedules share
(:mod:`.reduction`, :mod:`.scan`, :mod:`.fused_rows`, :mod:`.matmul_rows`): forward
lines viewing each leaf that way (:func:`rows`), the kernel's tile loads of it
(:func:`row_loads`), the tile sizes (:func:`row_tiles`), and whether a max/min's
indices are read (:func:`index_read`).
"""

from __future__ import annotations

import math
import operator
from typing import TYPE_CHECKING

import torch
import torch.fx

from services.generator.lowering.emit import computed, prod, triton_next_pow2
from services.generator.lowering.ir import meta_val

if TYPE_CHECKING:
    from services.generator.lowering.lowerer import Lowerer


def rows(lw: Lowerer, node: torch.fx.Node, dims: list[int]) -> tuple[str, list[str], list[tuple[torch.fx.Node, str]]]:
    """Forward lines viewing each leaf of ``node`` as (outer, R, inner) with the reduced
    ``dims`` in the middle; returns the (outer, R, inner) sizes variable and views."""
    val = meta_val(node)
    rank = len(val.shape)
    dims = sorted({d % rank for d in dims}) if rank else []
    shape = lw.shape_of(node)
    contiguous = dims == list(range(dims[0], dims[-1] + 1)) if dims else True
    if contiguous:
        perm = None
        a, b = (dims[0], dims[-1] + 1) if dims else (0, 0)
        outer = prod([f"{shape}[{d}]" for d in range(a)])
        red = prod([f"{shape}[{d}]" for d in range(a, b)])
        inner = prod([f"{shape}[{d}]" for d in range(b, rank)])
    else:
        keep = [d for d in range(rank) if d not in dims]
        perm = keep + dims
        outer = prod([f"{shape}[{d}]" for d in keep])
        red = prod([f"{shape}[{d}]" for d in dims])
        inner = "1"
    sizes = lw.fresh("rows")
    lw.forward.append(f"{sizes} = ({outer}, {red}, {inner})")
    leaves, _ = lw.leaves(node)
    views = []
    for leaf in leaves:
        if not lw.used_by_value(node, leaf) and lw.values[node].kind != "tensor":
            continue
        expr = f"{lw.values[leaf].expr}.expand({shape})"
        if perm:
            expr += f".permute({perm})"
        var = lw.fresh("rows_view")
        lw.forward.append(f"{var} = {expr}.reshape({sizes})")
        views.append((leaf, var))
    return sizes, dims, views


def row_loads(lw: Lowerer, src: torch.fx.Node, views: list[tuple[torch.fx.Node, str]]
               ) -> tuple[list[str], list[str], list[str], str, list[str], list[str]]:
    """Loads of the leaves ``views`` as ``[BLOCK_R, BLOCK_I]`` tiles of the
    ``(outer, R, inner)`` layout, and the element-wise chain computing ``src`` from
    them: kernel params, launch args, load lines, the chain's expression, its body
    lines and the ATen ops it covers."""
    load: dict[torch.fx.Node, str] = {}
    params, launch, loads = [], [], []
    for k, (leaf, var) in enumerate(views):
        params += [f"in{k}_ptr", f"in{k}_so", f"in{k}_sr", f"in{k}_si"]
        launch += [var, f"*{var}.stride()"]
        ld = (f"tl.load(in{k}_ptr + o * in{k}_so + r[:, None] * in{k}_sr "
              f"+ i[None, :] * in{k}_si, mask=mask, other=0)")
        loads.append(f"v_in{k} = {computed(leaf, ld)}")
        load[leaf] = f"v_in{k}"
    body: list[str] = []
    ops: list[str] = []
    x = lw.kernel_chain(src, load, "[BLOCK_R, BLOCK_I]", body, ops, params, launch)
    return params, launch, loads, x, body, ops


def row_tiles(lw: Lowerer, src: torch.fx.Node, dims: list[int]) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_I) from block_size: all of it along R for last-dim rows."""
    shape = [int(s) if not isinstance(s, torch.SymInt) else int(s.node.hint or 64)
             for s in meta_val(src).shape]
    inner = math.prod(shape[dims[-1] + 1:]) if dims and dims == list(
        range(dims[0], dims[-1] + 1)) else 1
    block = lw.p["block_size"]
    block_i = 1 if inner == 1 else min(32, triton_next_pow2(inner), block)
    return max(1, block // block_i), block_i


def index_read(lw: Lowerer, node: torch.fx.Node) -> bool:
    """Whether anything the Model's outputs need reads ``node``'s indices (item 1)."""
    return any(u.op == "output" or (u.target is operator.getitem and u.args[1] == 1
                                    and u in lw.needed)
               for u in node.users)
