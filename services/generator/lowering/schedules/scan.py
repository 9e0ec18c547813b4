"""Schedule ``scan``: cumsum and cumprod along any dim.

The input is seen as ``(outer, R, inner)`` rows (:func:`.rows.rows`); one program
per row and BLOCK_I columns walks R in BLOCK_R chunks, carrying the running total.
"""

from __future__ import annotations

import textwrap
from typing import TYPE_CHECKING

import torch.fx

from services.generator.launch_configs import launch_options
from services.generator.lowering.emit import add_kernel
from services.generator.lowering.ir import Value, bind_args, meta_val
from services.generator.lowering.ops import refuse
from services.generator.lowering.schedules.rows import row_loads, row_tiles, rows

if TYPE_CHECKING:
    from services.generator.lowering.lowerer import Lowerer


def lower(lw: Lowerer, node: torch.fx.Node, op: str) -> None:
    """Schedule ``scan``: (outer, R, inner) rows; one program per row and BLOCK_I
    columns walks R in BLOCK_R chunks, carrying the running total."""
    raw = bind_args(node)
    src = raw["self"]
    rank = len(meta_val(src).shape)
    dim = raw["dim"] % rank if rank else 0
    if raw.get("dtype") not in (None, meta_val(node).dtype):
        raise refuse(op, "dtype argument")
    sizes, _, views = rows(lw, src, [dim] if rank else [])
    out = lw.alloc(lw.shape_of(src), meta_val(node).dtype)
    params, launch, loads, x, body, ops = row_loads(lw, src, views)
    is_sum = op == "aten.cumsum.default"
    ident = "0.0" if is_sum else "1.0"
    lines = ["o = tl.program_id(0).to(tl.int64)",
             "i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)",
             "i_mask = i < INNER",
             f"carry = tl.full([BLOCK_I], {ident}, tl.float32)",
             "for r0 in range(0, R, BLOCK_R):",
             "    r = r0 + tl.arange(0, BLOCK_R)",
             "    mask = (r[:, None] < R) & i_mask[None, :]"]
    step = [*loads, *body, f"x = tl.where(mask, ({x}).to(tl.float32), {ident})"]
    if is_sum:
        step += ["y = tl.cumsum(x, axis=0) + carry[None, :]",
                 "carry = carry + tl.sum(x, axis=0)"]
    else:
        step += ["y = tl.associative_scan(x, 0, _mul_combine) * carry[None, :]",
                 "carry = carry * tl.reduce(x, 0, _mul_combine)"]
    step.append("tl.store(out_ptr + o * R * INNER + r[:, None] * INNER + i[None, :], "
                "y.to(out_ptr.dtype.element_ty), mask=mask)")
    lines += textwrap.indent("\n".join(step), "    ").split("\n")
    kname = lw.fresh("scan_kernel_")
    add_kernel(lw, kname, [*params, "out_ptr", "R", "INNER", "BLOCK_R: tl.constexpr",
                           "BLOCK_I: tl.constexpr"],
               f"Scan: {' -> '.join(dict.fromkeys([*ops, op]))} along R of "
               "[outer, R, inner] rows; out is contiguous.", lines, [*ops, op])
    block_r, block_i = row_tiles(lw, src, [dim] if rank else [])
    lw.forward += [
        f"if {out}.numel() > 0:",
        f"    {kname}[({sizes}[0], triton.cdiv({sizes}[2], {block_i}))](",
        f"        {', '.join([*launch, out, f'{sizes}[1]', f'{sizes}[2]'])},",
        f"        BLOCK_R={block_r}, BLOCK_I={block_i}, "
        f"{launch_options(lw, kname, 'reduction', ['R', 'INNER'])})",
    ]
    lw.values[node] = Value("tensor", out)
