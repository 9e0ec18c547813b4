"""Schedule ``convolution``: ``aten.convolution`` (forward) as an implicit GEMM on ``tl.dot``.

1-D, 2-D and 3-D; stride, padding, dilation, groups (depthwise included), bias, and
transposed convolution with output_padding. Per group ``g`` the convolution is the
matrix product ``out[m, n] = sum_k A[m, k] * W[k, n]`` where

- ``m`` runs over the output pixels ``(batch, o_0, ..., o_{d-1})`` (M = N * prod(O)),
- ``n`` over the group's output channels (COG = C_out / groups),
- ``k`` over the group's input channels times the kernel window
  ``(c, q_0, ..., q_{d-1})`` (KTOT = C_in / groups * prod(kernel)),

and ``A`` is never built: each BLOCK_M x BLOCK_K tile is loaded straight from the input
at the addresses the window gives. Forward: input pixel ``i = o * stride - padding +
q * dilation``, masked outside ``[0, L)`` (the zero padding). Transposed: output pixel
``o`` gathers input pixel ``i = (o + padding - q * dilation) / stride`` where that
division is exact and ``0 <= i < L`` (masks on divisibility), weight
``[C_in, C_out / groups, *kernel]``. Output extents follow ATen's
``conv_output_size`` / ``conv_input_size`` (aten/src/ATen/native/ConvUtils.h).

Like a matmul, the kernel is written when its output is first read (``Value`` kind
``matmul``, a pending ``tl.dot`` product, :class:`PendingConv`), so an element-wise
chain reading only the output (bias add, activation, scale, residual, clamp) becomes
its epilogue (:func:`.matmul.epilogue_of`, :func:`emit`). Tile sizes are the matmul's
launch parameters (block_m, block_n, block_k, num_warps, num_stages). Sizes (batch,
channels, extents, kernel window) are read from the tensors at run time; the kernel
window extents are constexpr launch arguments (Triton specializes on them), stride,
padding and dilation literals of the operator.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.fx

from services.generator.launch_configs import autotune, on_gpu
from services.generator.lowering.emit import add_kernel, tile_epilogue
from services.generator.lowering.ir import PendingConv, Value, bind_args, meta_val
from services.generator.lowering.ops import check_dtype, refuse

if TYPE_CHECKING:
    from services.generator.lowering.lowerer import Lowerer


def _ints(op: str, name: str, value: Any, n: int) -> list[int]:
    """One int per spatial dim of the operator argument ``name`` (a list, or one int)."""
    values = list(value) if isinstance(value, list | tuple) else [value]
    if len(values) == 1:
        values = values * n
    if len(values) != n or not all(type(v) is int for v in values):
        raise refuse(op, f"convolution {name} {value!r} (ints, one per spatial dim)")
    return values


def lower(lw: Lowerer, node: torch.fx.Node, op: str) -> None:
    """Schedule ``convolution``: input and weight are materialized and the output's
    shape written in forward now; the kernel is written when the output is first read
    (:func:`emit`), so an element-wise chain over it can become its epilogue.

    Raises:
        LoweringError: the input is not batched (rank = spatial dims + 2), a window
            argument is not one int per spatial dim, or a dtype is not lowerable.
    """
    raw = bind_args(node)
    xval, wval = meta_val(raw["input"]), meta_val(raw["weight"])
    check_dtype(xval.dtype, f"{op}'s input")
    check_dtype(wval.dtype, f"{op}'s weight")
    if torch.bool in (xval.dtype, wval.dtype):
        raise refuse(op, "convolution of bool tensors")
    n = len(wval.shape) - 2
    if n not in (1, 2, 3) or len(xval.shape) != n + 2:
        raise refuse(op, f"a {len(xval.shape)}-d input with a {len(wval.shape)}-d weight "
                     "(batched 1-D, 2-D or 3-D convolutions only)")
    stride = _ints(op, "stride", raw["stride"], n)
    padding = _ints(op, "padding", raw["padding"], n)
    dilation = _ints(op, "dilation", raw["dilation"], n)
    transposed = bool(raw["transposed"])
    output_padding = _ints(op, "output_padding", raw["output_padding"], n)
    groups = raw["groups"]
    if type(groups) is not int or groups < 1:
        raise refuse(op, f"convolution groups {groups!r}")
    x, w = lw.materialize(raw["input"]), lw.materialize(raw["weight"])
    bias = lw.materialize(raw["bias"]) if raw.get("bias") is not None else None
    g = lw.fresh("groups")
    if not transposed:
        # C_in = groups * (C_in / groups), and the weight holds C_in / groups channels.
        lw.forward.append(f"{g} = {x}.shape[1] // {w}.shape[1]")
    elif groups > 1 and groups == xval.shape[1]:
        lw.forward.append(f"{g} = {x}.shape[1]")  # groups = channels (depthwise)
    else:
        lw.forward.append(f"{g} = {groups}")
    outs = []
    for d in range(n):
        length, window = f"{x}.shape[{d + 2}]", f"{w}.shape[{d + 2}]"
        o = lw.fresh("conv_len")
        if transposed:  # ConvUtils.h conv_input_size
            lw.forward.append(f"{o} = ({length} - 1) * {stride[d]} - {2 * padding[d]} + "
                              f"{dilation[d]} * ({window} - 1) + {output_padding[d] + 1}")
        else:  # ConvUtils.h conv_output_size
            lw.forward.append(f"{o} = ({length} + {2 * padding[d] - 1} - {dilation[d]} * "
                              f"({window} - 1)) // {stride[d]} + 1")
        outs.append(o)
    channels = f"{w}.shape[1] * {g}" if transposed else f"{w}.shape[0]"
    out_shape = f"({x}.shape[0], {channels}, {', '.join(outs)})"
    # Few output channels per group (depthwise: one): a tl.dot tile of 16 or more
    # columns would be mostly padding, so each program sums its channels directly.
    direct = groups > 1 and int(meta_val(node).shape[1]) // groups < 16
    lw.pending[node] = PendingConv(op, x, w, bias, out_shape, n, transposed, stride,
                                   padding, dilation, output_padding, g, outs, direct)
    lw.values[node] = Value("matmul")


def _affine(terms: list[tuple[str, int]], offset: int) -> str:
    """``sum(name * factor) + offset`` written without factors of 1 or an offset of 0."""
    text = ""
    for name, f in terms:
        term = name if abs(f) == 1 else f"{name} * {abs(f)}"
        text += (f" - {term}" if f < 0 else f" + {term}") if text else (
            f"-{term}" if f < 0 else term)
    return text + (f" + {offset}" if offset > 0 else f" - {-offset}" if offset < 0 else "")


def _window_lines(pc: PendingConv, direct: bool) -> tuple[list[str], str]:
    """Loop-body lines giving the reduction index's input channel ``ci``, window
    offsets ``q<d>`` and input pixels ``i<d>``; returns them and the mask of the pixels
    that exist (padding and, transposed, divisibility). Implicit GEMM: ``rk`` is a
    [BLOCK_K] slice and the pixels [BLOCK_M, BLOCK_K]; direct: ``r`` is one index and
    the pixels [BLOCK_M]."""
    o, q = ("o{}", "q{}") if direct else ("o{}[:, None]", "q{}[None, :]")
    # its own name: a variable keeps one type through a loop (rest is [BLOCK_M] here)
    lines = ["    kr = r" if direct else "    kr = rk"]
    for d in reversed(range(pc.n)):
        lines += [f"    q{d} = kr % KS{d}", f"    kr = kr // KS{d}"]
    lines.append("    ci = kr")
    masks = ["(rm < M)" if direct else "(rm[:, None] < M) & (rk[None, :] < KTOT)"]
    for d in range(pc.n):
        s, p, dil = pc.stride[d], pc.padding[d], pc.dilation[d]
        if not pc.transposed:
            lines.append(f"    i{d} = {_affine([(o.format(d), s), (q.format(d), dil)], -p)}")
            if p > 0:  # without padding every window of an output pixel is inside
                masks.append(f"(i{d} >= 0) & (i{d} < L{d})")
        else:
            lines.append(f"    t{d} = {_affine([(o.format(d), 1), (q.format(d), -dil)], p)}")
            if s == 1:
                lines.append(f"    i{d} = t{d}")
                masks.append(f"(t{d} >= 0) & (t{d} < L{d})")
            else:
                lines.append(f"    i{d} = t{d} // {s}")
                masks.append(f"(t{d} >= 0) & (t{d} % {s} == 0) & (i{d} < L{d})")
    return lines, " & ".join(masks)


def _gemm_lines(pc: PendingConv, precision: str) -> list[str]:
    """Implicit GEMM: program axis 2 is the group, columns its COG output channels,
    ``tl.dot`` over BLOCK_K slices of CIG x kernel window. Forward, an input address is
    a row part (pixel) plus a column part (channel, window offset), added once per tile;
    the row parts are computed before the loop."""
    spatial = range(pc.n)
    lines = ["g = tl.program_id(2)",
             "rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # output channel in the group",
             "co = g * COG + rn",
             "cmask = rn < COG",
             "row_ok = rm < M",
             "x_row = b * sxn + (g * CIG).to(tl.int64) * sxc"]
    if not pc.transposed:
        for d in spatial:
            lines += [f"h{d} = {_affine([(f'o{d}', pc.stride[d])], -pc.padding[d])}"
                      "  # window start", f"x_row += h{d} * sx{d}"]
    # weight [C_out, C_in / groups, *kernel]; transposed [C_in, C_out / groups, *kernel]
    w_out, w_in = ("rn", "(g * CIG + ci)") if pc.transposed else ("co", "ci")
    lines += [f"w_col = {w_out} * swo",
              "acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)",
              "for k0 in range(0, KTOT, BLOCK_K):",
              "    rk = k0 + tl.arange(0, BLOCK_K)",
              "    kr = rk  # its own name: a loop variable keeps one type",
              *(line for d in reversed(spatial)
                for line in (f"    q{d} = kr % KS{d}", f"    kr = kr // KS{d}")),
              "    ci = kr"]
    masks = ["row_ok[:, None] & (rk < KTOT)[None, :]"]
    if not pc.transposed:
        x_col = " + ".join(["ci * sxc", *(f"q{d} * sx{d}" if pc.dilation[d] == 1
                                          else f"q{d} * (sx{d} * {pc.dilation[d]})"
                                          for d in spatial)])
        for d in spatial:
            if pc.padding[d] > 0:  # without padding every window of a pixel is inside
                terms = [(f"h{d}[:, None]", 1), (f"q{d}[None, :]", pc.dilation[d])]
                lines.append(f"    i{d} = {_affine(terms, 0)}")
                masks.append(f"(i{d} >= 0) & (i{d} < L{d})")
        x_addr = f"x_row[:, None] + ({x_col})[None, :]"
    else:
        window, a_mask = _window_lines(pc, direct=False)
        lines += [line for line in window if not line.lstrip().startswith(("kr", "q", "ci"))]
        masks = [a_mask]
        x_addr = " + ".join(["x_row[:, None] + ci[None, :] * sxc",
                             *(f"i{d} * sx{d}" for d in spatial)])
    w_k = " + ".join([f"{w_in} * swi", *(f"q{d} * sw{d}" for d in spatial)])
    return [*lines,
            f"    a = tl.load(x_ptr + {x_addr},",
            f"                mask={' & '.join(masks)}, other=0.0)",
            f"    wt = tl.load(w_ptr + ({w_k})[:, None] + w_col[None, :],",
            "                 mask=(rk < KTOT)[:, None] & cmask[None, :], other=0.0)",
            "    acc += tl.dot(a.to(tl.float32), wt.to(tl.float32), "
            f"input_precision=\"{precision}\")"]


def _direct_lines(pc: PendingConv) -> list[str]:
    """Direct: columns are BLOCK_N of all COUT output channels, each reading its own
    group's channels; one multiply-add of [BLOCK_M, BLOCK_N] per input channel x window
    offset. For few output channels per group (depthwise), where a ``tl.dot`` tile of
    at least 16 columns would be mostly padding."""
    spatial = range(pc.n)
    lines = ["co = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # output channel",
             "cmask = co < COUT",
             "g = co // COG",
             "rn = co - g * COG  # output channel in its group",
             "x_col = (g * CIG).to(tl.int64) * sxc",
             "x_row = b * sxn",
             "acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)",
             "for r in range(0, KTOT):"]
    window, a_mask = _window_lines(pc, direct=True)
    x_addr = " + ".join(["x_row", *(f"i{d} * sx{d}" for d in spatial)])
    w_out, w_in = ("rn", "(g * CIG + ci)") if pc.transposed else ("co", "ci")
    w_addr = " + ".join([f"{w_out} * swo", f"{w_in} * swi",
                         *(f"q{d} * sw{d}" for d in spatial)])
    return [*lines, *window,
            f"    a = tl.load(x_ptr + ({x_addr})[:, None] + x_col[None, :] + ci * sxc,",
            f"                mask=({a_mask})[:, None] & cmask[None, :], other=0.0)",
            f"    wt = tl.load(w_ptr + {w_addr}, mask=cmask, other=0.0)",
            "    acc += a.to(tl.float32) * wt.to(tl.float32)[None, :]"]


def emit(lw: Lowerer, node: torch.fx.Node, epilogue: torch.fx.Node | None = None) -> None:
    """Write and launch a pending convolution: BLOCK_M output pixels x BLOCK_N output
    channels per program, float32 accumulation over the group's input channels x kernel
    window (``tl.dot`` over BLOCK_K slices, or one multiply-add per step where a group
    has fewer than 16 output channels: :func:`_direct_lines`); then in registers the
    bias and the element-wise chain ``epilogue``, whose other operands are loaded as
    tiles broadcast to the output's shape. With an epilogue, its value is stored."""
    pc: PendingConv = lw.pending.pop(node)
    n, x, w = pc.n, pc.x, pc.w
    root = epilogue if epilogue is not None else node
    dtype = meta_val(root).dtype
    out = lw.alloc(pc.out_shape, dtype)
    spatial = range(n)
    lines = ["pid_m = tl.program_id(0)", "pid_n = tl.program_id(1)",
             "rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # output pixel",
             "rest = rm"]
    for d in reversed(spatial):
        lines += [f"o{d} = rest % O{d}", f"rest = rest // O{d}"]
    lines.append("b = rest.to(tl.int64)  # int64: batch offsets may pass 2**31")
    lines += _direct_lines(pc) if pc.direct else _gemm_lines(pc, lw.p["precision"])
    lines += ["mask = (rm[:, None] < M) & cmask[None, :]",
              "o_row = " + " + ".join(["b * son", *(f"o{d} * so{d}" for d in spatial)])]
    sizes = [f"L{d}" for d in spatial] + [f"O{d}" for d in spatial]
    w_strides = (["swi", "swo"] if pc.transposed else ["swo", "swi"]) + [f"sw{d}" for d in spatial]
    params = ["x_ptr", "w_ptr", "out_ptr", "M", *(["COUT"] if pc.direct else []),
              "COG", "CIG", "KTOT", *sizes,
              "sxn", "sxc", *(f"sx{d}" for d in spatial), *w_strides,
              "son", "soc", *(f"so{d}" for d in spatial)]
    cig = f"({x}.shape[1] // {pc.groups})"
    cog = f"{w}.shape[1]" if pc.transposed else f"({w}.shape[0] // {pc.groups})"
    ktot = " * ".join([cig, *(f"{w}.shape[{d + 2}]" for d in spatial)])
    m = " * ".join([f"{x}.shape[0]", *pc.outs])
    launch = [x, w, out, m, *([f"{out}.shape[1]"] if pc.direct else []), cog, cig, ktot, *(f"{x}.shape[{d + 2}]" for d in spatial),
              *pc.outs, f"*{x}.stride()", f"*{w}.stride()", f"*{out}.stride()"]
    ops = [pc.op]
    if pc.bias is not None:
        params.append("bias_ptr")
        launch.append(pc.bias)
        lines.append("acc = acc + tl.load(bias_ptr + co, mask=cmask, other=0.0)"
                     ".to(tl.float32)[None, :]")
    result = "acc"
    if epilogue is not None:
        def load_leaf(k: int, expr: str) -> tuple[list[str], list[str], str]:
            strides = [f"e{k}_sn", f"e{k}_sc", *(f"e{k}_s{d}" for d in spatial)]
            row = " + ".join([f"b * e{k}_sn", *(f"o{d} * e{k}_s{d}" for d in spatial)])
            return ([f"e{k}_ptr", *strides], [expr, f"*_strides({expr}, {pc.out_shape})"],
                    f"tl.load(e{k}_ptr + ({row})[:, None] + co[None, :] * e{k}_sc, "
                    "mask=mask, other=0)")

        result = tile_epilogue(lw, node, epilogue, lines, ops, params, launch, dtype,
                               load_leaf)
    lines.append("tl.store(out_ptr + o_row[:, None] + co[None, :] * soc, "
                 f"({result}).to(out_ptr.dtype.element_ty), mask=mask)")
    kname = lw.fresh("conv_kernel_")
    kind = "transposed " if pc.transposed else ""
    what = (f"{kind}{n}-D, stride {tuple(pc.stride)}, padding {tuple(pc.padding)}, "
            f"dilation {tuple(pc.dilation)}"
            + (f", output_padding {tuple(pc.output_padding)}" if pc.transposed else "")
            + (", bias" if pc.bias is not None else ""))
    if epilogue is not None:
        what += f"; epilogue: {' -> '.join(dict.fromkeys(ops[1:]))}"
    gather = ("output pixel o gathers input pixel (o + padding - q * dilation) / stride "
              "where exact" if pc.transposed else
              "input pixel o * stride - padding + q * dilation")
    if pc.direct:
        how = ("Direct: rows are output pixels (batch, o...), columns output channels,\n"
               "each summing its group's CIG input channels x kernel window (KS...), ")
    else:
        how = ("Implicit GEMM per group (program axis 2): rows are output pixels (batch, "
               "o...),\ncolumns the group's COG output channels, tl.dot over its CIG input "
               "channels x kernel window (KS...),\n")
    doc = (f"Convolution: {pc.op}: {what}.\n\n{how}{gather};\n"
           "masks cover the padding and the ragged edges.")
    add_kernel(lw, kname, [*params, *(f"KS{d}: tl.constexpr" for d in spatial),
                           "BLOCK_M: tl.constexpr", "BLOCK_N: tl.constexpr",
                           *([] if pc.direct else ["BLOCK_K: tl.constexpr"])], doc, lines, ops)
    bm, bn, bk = lw.p["block_m"], lw.p["block_n"], lw.p["block_k"]
    cols, grid_z = (f"{out}.shape[1]", "1") if pc.direct else (cog, pc.groups)
    # No wider than the output channels (a group's): 8 channels in 128 columns left 15
    # of 16 lanes masked; interpreted, a transposed 3-D convolution took minutes.
    # tl.dot needs 16 columns at least. The direct kernel takes as many more output
    # pixels as it has columns fewer (the same tile size): each program walks the whole
    # window once, so fewer programs make fewer steps.
    if on_gpu(lw):  # tiles, num_warps and num_stages from the table
        names = ("BLOCK_M", "BLOCK_N") if pc.direct else ("BLOCK_M", "BLOCK_N", "BLOCK_K")
        autotune(lw, kname, "conv", ["M", "COG", "KTOT"], names)
        lw.forward += [
            f"if {out}.numel() > 0:",
            f"    {kname}[lambda META: (triton.cdiv({m}, META['BLOCK_M']), "
            f"triton.cdiv({cols}, META['BLOCK_N']), {grid_z})](",
            f"        {', '.join(launch)},",
            f"        {''.join(f'KS{d}={w}.shape[{d + 2}], ' for d in spatial)}",
            "    )",
        ]
        lw.values[root] = Value("tensor", out)
        if epilogue is not None:
            lw.values[node] = Value("fused")
        return
    block_n = lw.fresh("block_n")
    fit = f"min({bn}, triton.next_power_of_2({cols}))"
    forward = [f"{block_n} = {fit if pc.direct else f'max(16, {fit})'}"]
    block_m = str(bm)
    if pc.direct:
        block_m = lw.fresh("block_m")
        forward.append(f"{block_m} = {bm} * {bn} // {block_n}")
    lw.forward += [
        *forward,
        f"if {out}.numel() > 0:",
        f"    {kname}[(triton.cdiv({m}, {block_m}), triton.cdiv({cols}, {block_n}), {grid_z})](",
        f"        {', '.join(launch)},",
        f"        {''.join(f'KS{d}={w}.shape[{d + 2}], ' for d in spatial)}"
        f"BLOCK_M={block_m}, BLOCK_N={block_n}, {'' if pc.direct else f'BLOCK_K={bk}, '}"
        f"num_warps={lw.p['num_warps']}, "
        f"num_stages={lw.p['num_stages']})",
    ]
    lw.values[root] = Value("tensor", out)
    if epilogue is not None:
        lw.values[node] = Value("fused")  # read only by the epilogue, now stored
