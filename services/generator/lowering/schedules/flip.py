"""Schedule ``flip``: a copy kernel reading index ``size - 1 - i`` along the flipped
dims (torch has no negative strides, so a flip is not a view).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch.fx

from services.generator.lowering.emit import add_kernel, flat_index_lines, launch_blocks
from services.generator.lowering.ir import Value, bind_args, meta_val

if TYPE_CHECKING:
    from services.generator.lowering.lowerer import Lowerer


def lower(lw: Lowerer, node: torch.fx.Node, op: str) -> None:
    """Schedule ``flip``: a copy whose loads read index ``size - 1 - i`` along the
    flipped dims (torch has no negative strides, so a flip is not a view); one
    program per BLOCK_SIZE output elements, the output contiguous."""
    raw = bind_args(node)
    src = lw.materialize(raw["self"])
    val = meta_val(node)
    rank = len(val.shape)
    dims = sorted({d % rank for d in raw["dims"]}) if rank else []
    out = lw.alloc(f"{src}.shape", val.dtype)
    lines = flat_index_lines(rank, ["src = offsets * 0"], lambda d: [
        f"src += {f'(size{d} - 1 - i{d})' if d in dims else f'i{d}'} * s{d}"])
    lines.append("tl.store(out_ptr + offsets, tl.load(in_ptr + src, mask=mask), mask=mask)")
    kname = lw.fresh("flip_kernel_")
    add_kernel(lw, kname, ["in_ptr", *(f"s{d}" for d in range(rank)), "out_ptr",
                           "n_elements", *(f"size{d}" for d in range(rank)),
                           "BLOCK_SIZE: tl.constexpr"],
               f"Flip: {op} along dims {dims}: out[i] = in[..., size - 1 - i, ...]; "
               "in is read through its strides.", lines, [op])
    launch_blocks(lw, kname, out, [src, f"*{src}.stride()", out, "n", f"*{src}.shape"])
    lw.values[node] = Value("tensor", out)
