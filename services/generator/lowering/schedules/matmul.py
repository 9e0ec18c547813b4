"""Schedule ``matmul``: mm, bmm, addmm, baddbmm as ``tl.dot`` tiles.

BLOCK_M x BLOCK_N output tiles, ``tl.dot`` over BLOCK_K slices of K, float32
accumulation; alpha, the bias (addmm/baddbmm) and an element-wise chain that reads only
the product (activation, scaling, residual add, clamp) run in registers as the
kernel's epilogue, so the product never goes through memory. The kernel is written when
the product is first read (:func:`emit`), which is when the epilogue is known.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.fx

from services.generator.launch_configs import autotune, on_gpu
from services.generator.lowering.emit import add_kernel, literal, tile_epilogue
from services.generator.lowering.ir import PendingConv, PendingMatmul, Value, bind_args, meta_val
from services.generator.lowering.ops import CONSTANTS
from services.generator.lowering.schedules import conv

if TYPE_CHECKING:
    from services.generator.lowering.lowerer import Lowerer


def lower(lw: Lowerer, node: torch.fx.Node, op: str) -> None:
    """Schedule ``matmul`` (mm, bmm, addmm, baddbmm): operands are materialized now;
    the kernel is written when the product is first read (:func:`emit`), so
    an element-wise chain consuming it can become its epilogue."""
    raw = bind_args(node)
    name = op.split(".")[1]
    a = lw.materialize(raw["mat1" if name == "addmm" else ("self" if name in ("mm", "bmm") else "batch1")])
    b = lw.materialize(raw["mat2" if name in ("addmm", "mm", "bmm") else "batch2"])
    batched = name in ("bmm", "baddbmm")
    if batched:
        out_shape = f"({a}.shape[0], {a}.shape[1], {b}.shape[2])"
    else:
        out_shape = f"({a}.shape[0], {b}.shape[1])"
    bias = lw.materialize(raw["self"]) if name in ("addmm", "baddbmm") else None
    bias_row = bias is not None and not batched and len(meta_val(raw["self"]).shape) == 1
    lw.pending[node] = PendingMatmul(op, a, b, bias, out_shape, batched,
                                     float(raw.get("alpha", 1)), float(raw.get("beta", 1)),
                                     bias_row)
    lw.values[node] = Value("matmul")


def epilogue_of(lw: Lowerer, node: torch.fx.Node) -> torch.fx.Node | None:
    """The pending matmul whose epilogue the element-wise chain ``node`` can be.

    The chain qualifies when it has the product's shape (no broadcasting past it)
    and when neither the product nor any intermediate value of the chain is read by
    anything outside the chain: then fusing computes each value once, and the
    product never goes through memory.
    """
    chain: set[torch.fx.Node] = set()
    products: list[torch.fx.Node] = []
    stack = [node]
    while stack:
        n = stack.pop()
        if n in chain:
            continue
        kind = lw.values[n].kind
        if kind == "matmul":
            if n not in products:
                products.append(n)
            continue
        if kind != "pointwise":
            continue
        chain.add(n)
        if str(n.target) not in CONSTANTS:
            stack.extend(n.all_input_nodes)
    shape = [str(s) for s in meta_val(node).shape]
    for product in products:
        if [str(s) for s in meta_val(product).shape] != shape:
            continue
        inside = chain | {product}
        if all(user in chain or (user not in lw.needed and user.op != "output")
               for n in inside - {node} for user in n.users):
            return product
    return None


def product_tile(lw: Lowerer, pm: PendingMatmul, out: str, m_n: tuple[str, str],
                 out_strides: tuple[list[str], list[str]]
                 ) -> tuple[list[str], list[str], list[str]]:
    """Kernel lines computing the float32 product tile ``acc`` of rows ``rm`` and columns
    ``rn`` of batch ``batch`` (variables the caller defines first), alpha and the bias
    applied, and ``mask`` (the tile's in-bounds elements); with the kernel parameters
    and launch arguments they need (``out``: the output tensor; ``m_n``: forward
    expressions of the product's M and N; ``out_strides``: the output's stride
    parameters and their launch arguments, which come before the bias's).
    """
    a, b, batched = pm.a, pm.b, pm.batched
    av, bv = (f"{t}.unsqueeze(0)" if not batched else t for t in (a, b))
    lines = ["acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)",
             "for k0 in range(0, K, BLOCK_K):",
             "    rk = k0 + tl.arange(0, BLOCK_K)",
             "    a = tl.load(a_ptr + batch * sab + rm[:, None] * sam + rk[None, :] * sak,",
             "                mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)",
             "    b = tl.load(b_ptr + batch * sbb + rk[:, None] * sbk + rn[None, :] * sbn,",
             "                mask=(rk[:, None] < K) & (rn[None, :] < N), other=0.0)",
             f"    acc += tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=\"{lw.p['precision']}\")",
             "mask = (rm[:, None] < M) & (rn[None, :] < N)"]
    params = ["a_ptr", "b_ptr", "c_ptr", "M", "N", "K", "sab", "sam", "sak", "sbb", "sbk", "sbn"]
    params += out_strides[0]
    launch = [a, b, out, *m_n, f"{a}.shape[-1]", f"*{av}.stride()", f"*{bv}.stride()",
              *out_strides[1]]
    if pm.alpha != 1.0:
        lines.append(f"acc = acc * {literal(pm.alpha)}")
    if pm.bias is not None:
        bias_view = f"{pm.bias}.expand({pm.out_shape})" + ("" if batched else ".unsqueeze(0)")
        params += ["bias_ptr", "sxb", "sxm", "sxn"]
        launch += [pm.bias, f"*{bias_view}.stride()"]
        # nn.Linear's bias: one row, loaded once per tile instead of once per tile row
        lines += (["bias = tl.load(bias_ptr + rn * sxn, mask=rn < N, other=0.0)"
                   ".to(tl.float32)[None, :]"] if pm.bias_row else
                  ["bias = tl.load(bias_ptr + batch * sxb + rm[:, None] * sxm + rn[None, :] * sxn,",
                   "               mask=mask, other=0.0).to(tl.float32)"])
        lines.append(f"acc = acc + bias * {literal(pm.beta)}" if pm.beta != 1.0
                     else "acc = acc + bias")
    return lines, params, launch


def leaf_loader(out_shape: str, batched: bool) -> Callable[[int, str], tuple[list[str], list[str], str]]:
    """How an epilogue loads its other operand ``k`` (forward expression ``expr``) as a
    tile of the product (rows ``rm``, columns ``rn``, batch ``batch``), broadcast to the
    product's shape ``out_shape``: (kernel parameters, launch arguments, load)."""
    def load_leaf(k: int, expr: str) -> tuple[list[str], list[str], str]:
        return ([f"e{k}_ptr", f"e{k}_sb", f"e{k}_sm", f"e{k}_sn"],
                [expr, f"*_strides({expr}, {out_shape})" if batched
                 else f"0, *_strides({expr}, {out_shape})"],
                f"tl.load(e{k}_ptr + batch * e{k}_sb + rm[:, None] * e{k}_sm "
                f"+ rn[None, :] * e{k}_sn, mask=mask, other=0)")

    return load_leaf


def emit(lw: Lowerer, node: torch.fx.Node, epilogue: torch.fx.Node | None = None) -> None:
    """Write and launch a pending matmul: BLOCK_M x BLOCK_N output tiles, tl.dot over
    BLOCK_K slices of K, float32 accumulation, then in registers: alpha, the bias
    (addmm/baddbmm) and the element-wise chain ``epilogue`` (activation, scaling,
    residual add, clamp, ...), whose other operands are loaded as tiles broadcast
    to the product's shape. With an epilogue, its value is stored, not the product.
    A pending convolution is written by :func:`.conv.emit` instead.
    """
    if isinstance(lw.pending[node], PendingConv):
        conv.emit(lw, node, epilogue)
        return
    pm = lw.pending.pop(node)
    op, batched, out_shape = pm.op, pm.batched, pm.out_shape
    root = epilogue if epilogue is not None else node
    dtype = meta_val(root).dtype
    out = lw.alloc(out_shape, dtype)
    lines, params, launch = product_tile(
        lw, pm, out, (f"{out}.shape[-2]", f"{out}.shape[-1]"),
        (["scb", "scm", "scn"], [f"*{out if batched else out + '.unsqueeze(0)'}.stride()"]))
    lines[:0] = ["pid_m = tl.program_id(0)", "pid_n = tl.program_id(1)",
                 "batch = tl.program_id(2).to(tl.int64)",
                 "rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)",
                 "rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)"]
    ops = [op]
    result = "acc"
    if epilogue is not None:
        result = tile_epilogue(lw, node, epilogue, lines, ops, params, launch, dtype,
                               leaf_loader(out_shape, batched))
    lines.append("tl.store(c_ptr + batch * scb + rm[:, None] * scm + rn[None, :] * scn, "
                 f"({result}).to(c_ptr.dtype.element_ty), mask=mask)")
    kname = lw.fresh("matmul_kernel_")
    what = "c[b, m, n] = sum_k a[b, m, k] * b[b, k, n]" + (" + bias" if pm.bias else "")
    if epilogue is not None:
        what = ("c = epilogue(sum_k a[b, m, k] * b[b, k, n]"
                + (" + bias" if pm.bias else "") + f"), epilogue: {' -> '.join(dict.fromkeys(ops[1:]))}")
    add_kernel(lw, kname, [*params, "BLOCK_M: tl.constexpr", "BLOCK_N: tl.constexpr",
                           "BLOCK_K: tl.constexpr"],
               f"Matmul: {op}: {what}.\n\nOperands are read through "
               "their strides, so transposed views cost nothing; masks cover the "
               "ragged M, N and K edges.", lines, ops)
    bm, bn, bk = lw.p["block_m"], lw.p["block_n"], lw.p["block_k"]
    batch = f"{out}.shape[0]" if batched else "1"
    if on_gpu(lw):  # tiles, num_warps and num_stages from the table, keyed on M, N, K
        autotune(lw, kname, "matmul", ["M", "N", "K"], ("BLOCK_M", "BLOCK_N", "BLOCK_K"))
        lw.forward += [
            f"if {out}.numel() > 0:",
            f"    {kname}[lambda META: (triton.cdiv({out}.shape[-2], META['BLOCK_M']), "
            f"triton.cdiv({out}.shape[-1], META['BLOCK_N']), {batch})](",
            f"        {', '.join(launch)},",
            "    )",
        ]
    else:
        lw.forward += [
            f"if {out}.numel() > 0:",
            f"    {kname}[(triton.cdiv({out}.shape[-2], {bm}), triton.cdiv({out}.shape[-1], {bn}), {batch})](",
            f"        {', '.join(launch)},",
            f"        BLOCK_M={bm}, BLOCK_N={bn}, BLOCK_K={bk}, num_warps={lw.p['num_warps']}, "
            f"num_stages={lw.p['num_stages']})",
        ]
    lw.values[root] = Value("tensor", out)
    if epilogue is not None:
        lw.values[node] = Value("fused")  # read only by the epilogue, now stored
