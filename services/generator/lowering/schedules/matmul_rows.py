"""Schedule ``matmul`` with a row reduction as its epilogue: ``sum``/``mean``/``amax``/
``amin``/``max.dim``/``min.dim`` over the columns of a 2-D product (``x @ w.T`` then
``.sum(dim=1)``, Linear then ``max(dim=1).values``), the element-wise chain between them
included, in one kernel; and ``logsumexp`` over them, as core ATen spells it
(``amax``; ``m' = where(|amax| == inf, 0, amax)``; ``sum(exp(x - m'))``), with an online
max and sum (the sum rescaled when the max grows), so the columns are read once.

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

from typing import TYPE_CHECKING, Any

import torch
import torch.fx

from services.generator.launch_configs import autotune, on_gpu
from services.generator.lowering.emit import add_kernel, tile_epilogue
from services.generator.lowering.ir import PendingMatmul, Value, bind_args, meta_val
from services.generator.lowering.ops import CONSTANTS, RULES
from services.generator.lowering.schedules import matmul
from services.generator.lowering.schedules.rows import index_read

if TYPE_CHECKING:
    from services.generator.lowering.lowerer import Lowerer

# Reduction operator -> how a row's values combine.
_KINDS = {"aten.sum.dim_IntList": "sum", "aten.mean.dim": "mean",
          "aten.amax.default": "max", "aten.amin.default": "min",
          "aten.max.dim": "max", "aten.min.dim": "min"}
_IDENTITY = {"sum": "0.0", "mean": "0.0", "max": '-float("inf")', "min": 'float("inf")',
             "logsumexp": '-float("inf")'}


def _plan(lw: Lowerer, node: torch.fx.Node, op: str
          ) -> tuple[torch.fx.Node, torch.fx.Node | None, str, dict[str, Any] | None] | None:
    """(product, chain root or None, kind, the logsumexp's nodes or None) when ``node``
    reduces the columns of a pending 2-D float32 matmul product that nothing else
    reads (but the logsumexp's subtraction); else None."""
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
    lse = _plan_logsumexp(lw, node, op, src)
    if lse is not None:
        return product, chain, "logsumexp", lse
    # the reduction is the only reader of what it reduces
    if any(u is not node and (u in lw.needed or u.op == "output") for u in src.users):
        return None
    return product, chain, kind, None


def _pointwise_from(lw: Lowerer, top: torch.fx.Node, source: torch.fx.Node
                    ) -> set[torch.fx.Node] | None:
    """The element-wise nodes computing ``top`` from ``source`` and constants alone
    (``where(|amax| == inf, 0, amax)``), or None when ``top`` reads anything else."""
    nodes: set[torch.fx.Node] = set()
    stack = [top]
    while stack:
        n = stack.pop()
        if n is source or n in nodes:
            continue
        op = str(n.target)
        if op not in RULES and op not in CONSTANTS:
            return None  # not element-wise
        if n in lw.values and (lw.values[n].kind != "pointwise" or op not in CONSTANTS):
            return None  # lowered already (a constant deferred earlier may be read)
        nodes.add(n)
        if str(n.target) not in CONSTANTS:
            stack.extend(n.all_input_nodes)
    return nodes


def _plan_logsumexp(lw: Lowerer, node: torch.fx.Node, op: str, src: torch.fx.Node
                    ) -> dict[str, Any] | None:
    """The nodes of ``logsumexp`` over ``src``'s columns starting at ``node`` (its
    ``amax``): ``shift`` (m', a function of the max alone), ``sub``, ``exp`` and
    ``sum`` of ``exp(src - shift)``; None unless ``src`` is read by the amax and the
    subtraction alone and each step by the next alone."""
    if op != "aten.amax.default" or not bind_args(node).get("keepdim", False):
        return None
    users = [u for u in src.users if u is not node]
    if len(users) != 1 or str(users[0].target) != "aten.sub.Tensor" or users[0].args[0] is not src:
        return None
    sub = users[0]
    shift = sub.args[1]
    if not isinstance(shift, torch.fx.Node) or len(sub.users) != 1:
        return None
    exp = next(iter(sub.users))
    if str(exp.target) != "aten.exp.default" or len(exp.users) != 1:
        return None
    total = next(iter(exp.users))
    dims = bind_args(total).get("dim") if str(total.target) == "aten.sum.dim_IntList" else None
    if not dims or [d % 2 for d in dims] != [1]:
        return None
    inner = _pointwise_from(lw, shift, node)
    if inner is None or any(u not in inner | {sub} and u in lw.needed
                            for n in inner - {shift} | {node} for u in n.users):
        return None  # the max, or a step to the shift, is read elsewhere
    return {"shift": shift, "inner": inner, "sub": sub, "exp": exp, "sum": total}


def try_lower(lw: Lowerer, node: torch.fx.Node, op: str) -> bool:
    """Lower the row reduction ``node`` with the matmul it reads as one kernel when
    :func:`_plan` allows; returns whether it did (else nothing was written)."""
    planned = _plan(lw, node, op)
    if planned is None:
        return False
    product, chain, kind, lse = planned
    pm = lw.pending.pop(product)
    m = f"{pm.a}.shape[0]"
    keepdim = bool(bind_args(lse["sum"] if lse else node).get("keepdim", False))
    out = lw.alloc(f"({m}, 1)" if keepdim else f"({m},)", torch.float32)
    tile, params, launch = matmul.product_tile(lw, pm, out, (m, f"{pm.b}.shape[1]"), ([], []))
    ops = [pm.op]
    result = "acc"
    if chain is not None:
        result = tile_epilogue(lw, product, chain, tile, ops, params, launch, torch.float32,
                               matmul.leaf_loader(pm.out_shape, batched=False))
    ident = _IDENTITY[kind]
    tile.append(f"x = tl.where(mask, {result}, {ident})")
    if kind in ("sum", "mean"):
        tile.append("racc = racc + tl.sum(x, axis=1)")
    else:
        pick = "tl.minimum" if kind == "min" else "tl.maximum"
        tile += [f"racc_next = {pick}(racc, tl.{'min' if kind == 'min' else 'max'}(x, axis=1))",
                 "nan = tl.maximum(nan, tl.max((x != x).to(tl.int32), axis=1))"]
        if kind == "logsumexp":  # s = sum of exp(x - safe(max so far)), rescaled as it grows
            tile += ["safe_next = tl.where(tl.abs(racc_next) == float('inf'), 0.0, racc_next)",
                     "s = s * tl.exp(safe - safe_next) + tl.sum(tl.exp(x - safe_next[:, None]), axis=1)",
                     "safe = safe_next"]
        tile.append("racc = racc_next")
    lines = ["rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)",
             "batch = tl.program_id(1).to(tl.int64)",
             f"racc = tl.full([BLOCK_M], {ident}, tl.float32)"]
    if kind not in ("sum", "mean"):
        lines.append("nan = tl.zeros([BLOCK_M], tl.int32)")
    if kind == "logsumexp":
        lines += ["s = tl.zeros([BLOCK_M], tl.float32)", "safe = tl.zeros([BLOCK_M], tl.float32)"]
    lines += ["for n0 in range(0, N, BLOCK_N):", "    rn = n0 + tl.arange(0, BLOCK_N)",
              *("    " + line for line in tile)]
    res = {"mean": "racc / N", "sum": "racc"}.get(kind, "tl.where(nan > 0, float('nan'), racc)")
    ops.append(op)
    if kind == "logsumexp":
        # the shift torch subtracts, from the max alone; then sum(exp(x - shift))
        lines.append(f"m = {res}")
        for n in lse["inner"]:  # nodes after this one in the graph: not visited yet
            lw.values.setdefault(n, Value("pointwise"))
        body: list[str] = []
        shift = lw.kernel_chain(lse["shift"], {node: "m"}, "[BLOCK_M]", body, ops, params, launch)
        shift_out = lw.alloc(f"({m}, 1)", torch.float32)
        params.append("shift_ptr")
        launch.append(shift_out)
        lines += [*body, f"tl.store(shift_ptr + rm, {shift}, mask=rm < M)"]
        res = f"s * tl.exp(safe - {shift})"
        ops += ["aten.sub.Tensor", "aten.exp.default", "aten.sum.dim_IntList"]
    lines.append(f"tl.store(c_ptr + rm, ({res}).to(c_ptr.dtype.element_ty), mask=rm < M)")
    kname = lw.fresh("matmul_rows_kernel_")
    add_kernel(lw, kname, [*params, "BLOCK_M: tl.constexpr", "BLOCK_N: tl.constexpr",
                           "BLOCK_K: tl.constexpr"],
               f"Matmul with a row reduction: {' -> '.join(dict.fromkeys(ops))}.\n\n"
               f"c[m] = {kind} over n of epilogue(sum_k a[m, k] * b[k, n]"
               + (" + bias" if pm.bias else "") + "); the product is never stored.",
               lines, ops)
    bm, bn, bk = lw.p["block_m"], lw.p["block_n"], lw.p["block_k"]
    if on_gpu(lw):  # tiles, num_warps and num_stages from the table, keyed on M, N, K
        autotune(lw, kname, "matmul", ["M", "N", "K"], ("BLOCK_M", "BLOCK_N", "BLOCK_K"))
        lw.forward += [
            f"if {out}.numel() > 0:",
            f"    {kname}[lambda META: (triton.cdiv({out}.shape[0], META['BLOCK_M']), 1)](",
            f"        {', '.join(launch)},",
            "    )",
        ]
    else:
        lw.forward += [
            f"if {out}.numel() > 0:",
            f"    {kname}[(triton.cdiv({out}.shape[0], {bm}), 1)](",
            f"        {', '.join(launch)},",
            f"        BLOCK_M={bm}, BLOCK_N={bn}, BLOCK_K={bk}, num_warps={lw.p['num_warps']}, "
            f"num_stages={lw.p['num_stages']})",
        ]
    lw.values[product] = Value("fused")
    if lse is not None:
        for n in (node, *lse["inner"], lse["sub"], lse["exp"]):
            lw.values[n] = Value("fused")
        lw.values[lse["shift"]] = Value("tensor", shift_out)
        lw.values[lse["sum"]] = Value("tensor", out)
    elif isinstance(meta_val(node), tuple | list):  # max.dim's indices: read by nothing
        lw.values[node] = Value("tuple", items=[Value("tensor", out), Value("fused")])
    else:
        lw.values[node] = Value("tensor", out)
    return True
