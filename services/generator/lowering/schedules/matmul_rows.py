"""Schedule ``matmul`` with a row reduction as its epilogue: ``sum``/``mean``/``amax``/
``amin``/``max.dim``/``min.dim`` over the columns of a 2-D product (``x @ w.T`` then
``.sum(dim=1)``, Linear then ``max(dim=1).values``), the element-wise chain between them
included, in one kernel.

One program owns BLOCK_M rows: it walks the N columns in BLOCK_N tiles, computes each
product tile with ``tl.dot`` over BLOCK_K slices of K (:func:`.matmul.product_tile`),
applies alpha, the bias and the element-wise chain in registers, and folds the tile
into a running row result; only the M reduced values are stored. The M x N product
never goes through memory: against a matmul kernel followed by a reduction kernel it
saves writing and reading M x N elements. The operands are read as the tiled matmul
reads them (A once per column tile, B once per row tile).

Taken only when nothing else reads the product or the chain, the product is 2-D
float32 (``mm``/``addmm``), and ``row_fusion`` is 1 (0: the matmul stores its product
and a reduction kernel reads it, a point evolve can compare). max/min give NaN for a
row holding one, as torch does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.fx

from services.generator.lowering.emit import add_kernel, tile_epilogue
from services.generator.lowering.ir import PendingMatmul, Value, bind_args, meta_val
from services.generator.lowering.schedules import matmul

if TYPE_CHECKING:
    from services.generator.lowering.lowerer import Lowerer

# Reduction operator -> how a row's values combine.
_KINDS = {"aten.sum.dim_IntList": "sum", "aten.mean.dim": "mean",
          "aten.amax.default": "max", "aten.amin.default": "min",
          "aten.max.dim": "max", "aten.min.dim": "min"}
_IDENTITY = {"sum": "0.0", "mean": "0.0", "max": '-float("inf")', "min": 'float("inf")'}


def _plan(lw: Lowerer, node: torch.fx.Node, op: str
          ) -> tuple[torch.fx.Node, torch.fx.Node | None, str] | None:
    """(product, chain root or None, kind) when ``node`` reduces the columns of a pending
    2-D float32 matmul product that nothing else reads; else None."""
    from services.generator.lowering.schedules.reduction import index_read

    kind = _KINDS.get(op)
    if kind is None or not lw.p.get("row_fusion", 1):
        return None
    raw = bind_args(node)
    src = raw["self"]
    if not isinstance(src, torch.fx.Node):
        return None
    if lw.values[src].kind == "matmul":
        product, chain = src, None
    elif lw.values[src].kind == "pointwise":
        product, chain = matmul.epilogue_of(lw, src), src
        if product is None:
            return None
    else:
        return None
    pm = lw.pending.get(product)
    if not isinstance(pm, PendingMatmul) or pm.batched:
        return None
    if any(meta_val(n).dtype != torch.float32 or len(meta_val(n).shape) != 2
           for n in (src, product)):
        return None
    dims = raw.get("dim")
    dims = [dims] if isinstance(dims, int) else list(dims or [])
    if [d % 2 for d in dims] != [1]:
        return None
    if op in ("aten.max.dim", "aten.min.dim") and index_read(lw, node):
        return None
    # the reduction is the only reader of what it reduces
    if any(u is not node and (u in lw.needed or u.op == "output") for u in src.users):
        return None
    return product, chain, kind


def try_lower(lw: Lowerer, node: torch.fx.Node, op: str) -> bool:
    """Lower the row reduction ``node`` with the matmul it reads as one kernel when
    :func:`_plan` allows; returns whether it did (else nothing was written)."""
    planned = _plan(lw, node, op)
    if planned is None:
        return False
    product, chain, kind = planned
    pm = lw.pending.pop(product)
    keepdim = bool(bind_args(node).get("keepdim", False))
    out = lw.alloc(f"({pm.a}.shape[0], 1)" if keepdim else f"({pm.a}.shape[0],)", torch.float32)
    ident = _IDENTITY[kind]
    tile, params, launch = matmul.product_tile(
        lw, pm, out, (f"{pm.a}.shape[0]", f"{pm.b}.shape[1]"), ([], []))
    ops = [pm.op]
    result = "acc"
    if chain is not None:
        result = tile_epilogue(lw, product, chain, tile, ops, params, launch, torch.float32,
                               matmul.leaf_loader(pm.out_shape, batched=False))
    tile.append(f"x = tl.where(mask, {result}, {ident})")
    if kind in ("sum", "mean"):
        tile.append("racc = racc + tl.sum(x, axis=1)")
    else:
        pick = "tl.maximum" if kind == "max" else "tl.minimum"
        tile += [f"racc = {pick}(racc, tl.{kind}(x, axis=1))",
                 "nan = tl.maximum(nan, tl.max((x != x).to(tl.int32), axis=1))"]
    lines = ["rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)",
             "batch = tl.program_id(1).to(tl.int64)",
             f"racc = tl.full([BLOCK_M], {ident}, tl.float32)",
             *(["nan = tl.zeros([BLOCK_M], tl.int32)"] if kind in ("max", "min") else []),
             "for n0 in range(0, N, BLOCK_N):",
             "    rn = n0 + tl.arange(0, BLOCK_N)",
             *("    " + line for line in tile)]
    res = "racc / N" if kind == "mean" else (
        "racc" if kind == "sum" else "tl.where(nan > 0, float('nan'), racc)")
    lines.append(f"tl.store(c_ptr + rm, ({res}).to(c_ptr.dtype.element_ty), mask=rm < M)")
    ops.append(op)
    kname = lw.fresh("matmul_rows_kernel_")
    add_kernel(lw, kname, [*params, "BLOCK_M: tl.constexpr", "BLOCK_N: tl.constexpr",
                           "BLOCK_K: tl.constexpr"],
               f"Matmul with a row reduction: {' -> '.join(dict.fromkeys(ops))}.\n\n"
               f"c[m] = {kind} over n of epilogue(sum_k a[m, k] * b[k, n]"
               + (" + bias" if pm.bias else "") + "); the product is never stored.",
               lines, ops)
    bm, bn, bk = lw.p["block_m"], lw.p["block_n"], lw.p["block_k"]
    lw.forward += [
        f"if {out}.numel() > 0:",
        f"    {kname}[(triton.cdiv({out}.shape[0], {bm}), 1)](",
        f"        {', '.join(launch)},",
        f"        BLOCK_M={bm}, BLOCK_N={bn}, BLOCK_K={bk}, num_warps={lw.p['num_warps']}, "
        f"num_stages={lw.p['num_stages']})",
    ]
    lw.values[product] = Value("fused")
    if isinstance(meta_val(node), tuple | list):  # max.dim's indices: read by nothing
        lw.values[node] = Value("tuple", items=[Value("tensor", out), Value("fused")])
    else:
        lw.values[node] = Value("tensor", out)
    return True
