"""Schedule ``row reduction``: sum, mean, amax/amin, max/min (values and indices),
argmax/argmin, prod, var/var_mean, any/all over any dims.

The input is seen as ``(outer, R, inner)`` with the reduced dims in the middle (permuted
there when they are not adjacent); one program per outer row and BLOCK_I inner columns
loops over R in BLOCK_R chunks, with the element-wise chain producing the input fused
into its loads. When nothing is inner (the reduced dims are the last), the tile's
columns are BLOCK_I outer rows instead and BLOCK_R is the row's power of two at run
time (at most block_size), so short rows share a program. max/min give NaN when a
column holds one, as torch does. The row views and tiles are :mod:`.rows`'s (shared
with :mod:`.scan`, :mod:`.fused_rows` and :mod:`.matmul_rows`).
"""

from __future__ import annotations

import textwrap
from typing import TYPE_CHECKING

import torch
import torch.fx

from services.generator.launch_configs import launch_options
from services.generator.lowering.emit import add_kernel, cast_out
from services.generator.lowering.ir import Value, bind_args, meta_val
from services.generator.lowering.schedules import fused_rows, matmul_rows
from services.generator.lowering.schedules.rows import index_read, row_loads, row_tiles, rows

if TYPE_CHECKING:
    from services.generator.lowering.lowerer import Lowerer


def lower(lw: Lowerer, node: torch.fx.Node, op: str) -> None:
    """Schedule ``row reduction``: the input seen as (outer, R, inner); one program
    per outer row and BLOCK_I inner columns loops over R in BLOCK_R chunks."""
    if matmul_rows.try_lower(lw, node, op):  # the product it reduces in the same kernel
        return
    if fused_rows.try_lower(lw, node):  # with the nodes on the same rows, one kernel
        return
    raw = bind_args(node)
    src = raw["self"]
    sval = meta_val(src)
    rank = len(sval.shape)
    name = op.split(".")[1]
    dims = raw.get("dim", None)
    if dims is None or dims == []:
        dims = list(range(rank))
    elif isinstance(dims, int):
        dims = [dims]
    dims = list(dims)
    keepdim = bool(raw.get("keepdim", False))
    if rank == 0:
        dims = []
    sizes, dims, views = rows(lw, src, dims)
    if lw.values[src].kind == "tensor" and not views:
        views = []
    out_vals = meta_val(node)
    out_vals = list(out_vals) if isinstance(out_vals, tuple | list) else [out_vals]
    if name in ("max", "min") and len(out_vals) == 2 and not index_read(lw, node):
        out_vals = out_vals[:1]  # max.dim's indices read by nothing: the values alone
    src_shape = lw.shape_of(src)
    kept = [(f"{src_shape}[{d}]" if d not in dims else "1") for d in range(rank)
            if keepdim or d not in dims]
    out_shape = "(" + "".join(f"{k}, " for k in kept) + ")"
    outs = [lw.alloc(out_shape, v.dtype) for v in out_vals]
    # leaves loaded as tiles [BLOCK_R, BLOCK_I]
    params, launch, loads, x, body, ops = row_loads(lw, src, views)
    if sval.dtype == torch.bool:
        x = f"({x}).to(tl.float32)"
    loop_head = ["for r0 in range(0, R, BLOCK_R):",
                 "    r = r0 + tl.arange(0, BLOCK_R)",
                 "    mask = (r[:, None] < R) & i_mask[None, :]"]
    loop_body = [*loads, *body]
    kind = {"sum": "sum", "mean": "sum", "amax": "max", "amin": "min", "max": "max",
            "min": "min", "argmax": "argmax", "argmin": "argmin", "prod": "prod",
            "var": "var", "var_mean": "var", "any": "max", "all": "min"}[name]
    # Reduced dims at the end (nothing inner): the columns of a tile are BLOCK_I outer
    # rows, so short rows (a global average pool over 7 x 7) fill the tile instead of
    # one program per row masking all but R of its BLOCK_R lanes.
    outer_cols = not dims or dims[-1] == rank - 1 or dims != list(range(dims[0], dims[-1] + 1))
    if outer_cols:
        lines = ["o_cols = tl.program_id(0).to(tl.int64) * BLOCK_I + tl.arange(0, BLOCK_I)",
                 "i_mask = o_cols < OUTER",
                 "o = o_cols[None, :]",
                 "i = tl.zeros([BLOCK_I], tl.int64)"]
    else:
        lines = ["o = tl.program_id(0).to(tl.int64)",
                 "i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)",
                 "i_mask = i < INNER"]
    row = "o_cols" if outer_cols else "o"
    ident = {"sum": "0.0", "prod": "1.0", "max": '-float("inf")', "min": 'float("inf")',
             "argmax": '-float("inf")', "argmin": 'float("inf")', "var": "0.0"}[kind]
    results: list[str] = []
    if name in ("max", "min") and len(outs) == 2:
        kind = "arg" + name  # values and indices: both from the index loop below
    if kind in ("sum", "prod", "max", "min"):
        lines.append(f"acc = tl.full([BLOCK_R, BLOCK_I], {ident}, tl.float32)")
        combine = {"sum": "acc + x", "prod": "acc * x",
                   "max": "tl.where((x > acc) | (x != x), x, acc)",
                   "min": "tl.where((x < acc) | (x != x), x, acc)"}[kind]
        lines += loop_head + textwrap.indent("\n".join(
            [*loop_body, f"x = tl.where(mask, {x}, {ident})", f"acc = {combine}"]),
            "    ").split("\n")
        reducer = {"sum": "tl.sum(acc, axis=0)", "prod": "tl.reduce(acc, 0, _mul_combine)",
                   "max": "tl.max(acc, axis=0)", "min": "tl.min(acc, axis=0)"}[kind]
        if kind in ("max", "min"):  # NaN anywhere in a column gives NaN, as torch
            lines.append("has_nan = tl.max((acc != acc).to(tl.int32), axis=0)")
            lines.append(f"res = tl.where(has_nan > 0, float('nan'), {reducer})")
        else:
            lines.append(f"res = {reducer}")
        if name == "mean":
            lines.append("res = res / R")
        results.append("res")
    if kind in ("argmax", "argmin"):
        better = ">" if kind == "argmax" else "<"
        lines += [f"best = tl.full([BLOCK_R, BLOCK_I], {ident}, tl.float32)",
                  "best_r = tl.zeros([BLOCK_R, BLOCK_I], tl.int64)"]
        lines += loop_head + textwrap.indent("\n".join(
            [*loop_body, f"x = tl.where(mask, {x}, {ident})",
             f"take = ((x {better} best) | ((x != x) & (best == best))) & mask",
             "best = tl.where(take, x, best)",
             "best_r = tl.where(take, r[:, None].to(tl.int64) + tl.zeros_like(best_r), best_r)"]),
            "    ").split("\n")
        pick = "tl.max" if kind == "argmax" else "tl.min"
        lines += [f"top = {pick}(tl.where(best != best, {ident}, best), axis=0)",
                  "col_nan = tl.max((best != best).to(tl.int32), axis=0) > 0",
                  "is_top = tl.where(col_nan[None, :], best != best, best == top[None, :])",
                  "idx = tl.min(tl.where(is_top, best_r, 2**62), axis=0)"]
        if name in ("max", "min"):  # the values from the same loop: one pass
            lines.append("res = tl.where(col_nan, float('nan'), top)")
            results = ["res", "idx"]
        else:
            results = ["idx"]
    if kind == "var":
        correction = raw.get("correction")
        if correction is None:
            correction = 0 if raw.get("unbiased") is False else 1
        lines.append("acc = tl.zeros([BLOCK_R, BLOCK_I], tl.float32)")
        lines += loop_head + textwrap.indent("\n".join(
            [*loop_body, f"acc = acc + tl.where(mask, {x}, 0.0)"]), "    ").split("\n")
        lines.append("mean = tl.sum(acc, axis=0) / R")
        lines.append("acc = tl.zeros([BLOCK_R, BLOCK_I], tl.float32)")
        lines += loop_head + textwrap.indent("\n".join(
            [*loop_body, f"d = tl.where(mask, {x} - mean[None, :], 0.0)",
             "acc = acc + d * d"]), "    ").split("\n")
        lines.append(f"var = tl.sum(acc, axis=0) / tl.maximum(R - {float(correction)}, 0.0)")
        results = ["var", "mean"] if name == "var_mean" else ["var"]
    stores = []
    for k, (res, v) in enumerate(zip(results, out_vals, strict=True)):
        stores.append(f"tl.store(out{k}_ptr + {row} * INNER + i, "
                      f"({cast_out(res, v.dtype, '')}).to(out{k}_ptr.dtype.element_ty), mask=i_mask)")
    lines += stores
    kname = lw.fresh("reduce_kernel_")
    kparams = [*params, *(f"out{k}_ptr" for k in range(len(outs))), "R", "INNER",
               *(["OUTER"] if outer_cols else []),
               "BLOCK_R: tl.constexpr", "BLOCK_I: tl.constexpr"]
    doc = (f"Row reduction: {' -> '.join(dict.fromkeys([*ops, op]))}.\n\n"
           "Input k is read as [outer, R, inner] through strides in{k}_so/sr/si; "
           "out[o, i] reduces over r.")
    if outer_cols:
        doc += "\nNothing is inner: a program reduces BLOCK_I outer rows, one a column."
    add_kernel(lw, kname, kparams, doc, lines, [*ops, op])
    if outer_cols:
        block = lw.p["block_size"]
        block_r, block_i = lw.fresh("block_r"), lw.fresh("block_i")
        lw.forward += [
            f"{block_r} = min({block}, triton.next_power_of_2(max(1, {sizes}[1])))",
            f"{block_i} = {block} // {block_r}",
            f"if {sizes}[0] > 0:",
            f"    {kname}[(triton.cdiv({sizes}[0], {block_i}),)](",
            f"        {', '.join([*launch, *outs, f'{sizes}[1]', '1', f'{sizes}[0]'])},",
        ]
    else:
        block_r, block_i = row_tiles(lw, src, dims)
        lw.forward += [
            f"if {sizes}[0] * {sizes}[2] > 0:",
            f"    {kname}[({sizes}[0], triton.cdiv({sizes}[2], {block_i}))](",
            f"        {', '.join([*launch, *outs, f'{sizes}[1]', f'{sizes}[2]'])},",
        ]
    lw.forward.append(f"        BLOCK_R={block_r}, BLOCK_I={block_i}, "
                      f"{launch_options(lw, kname, 'reduction', ['R', 'INNER'])})")
    if len(outs) == 1 and not isinstance(meta_val(node), tuple | list):
        lw.values[node] = Value("tensor", outs[0])
    else:  # (an output nothing reads is not computed: fused away)
        items = [Value("tensor", o) for o in outs]
        lw.values[node] = Value("tuple", items=items + [Value("fused")] * (
            len(meta_val(node)) - len(items)))


