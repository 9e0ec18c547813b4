"""Schedule ``pooling``: max and average pooling, 1-D/2-D/3-D, with stride, padding,
dilation (max), ceil_mode, count_include_pad, divisor_override and max's indices.

Output extents, window starts and the average's divisor follow ATen's
``pooling_output_shape`` and ``avg_pool2d`` CPU kernel (aten/src/ATen/native/Pool.h,
AvgPoolKernel.cpp).
"""

from __future__ import annotations

import math
import operator
import re
from typing import TYPE_CHECKING, Any

import torch
import torch.fx

from services.generator.lowering.emit import add_kernel, cast_out, launch_blocks, literal
from services.generator.lowering.ir import Value, bind_args, meta_val
from services.generator.lowering.ops import check_dtype, refuse

if TYPE_CHECKING:
    from services.generator.lowering.lowerer import Lowerer

# Window elements up to which the window loops are unrolled at compile time.
_UNROLLED_WINDOW = 32


def lower(lw: Lowerer, node: torch.fx.Node, op: str) -> None:
    """Schedule ``pooling``: max or average over a 1-D/2-D/3-D window.

    One program per BLOCK_SIZE output elements (the input seen as [B, *spatial]);
    each walks the window with a mask on every boundary. Output extents, window
    starts and the average's divisor follow ATen's ``pooling_output_shape`` and
    ``avg_pool2d`` CPU kernel (aten/src/ATen/native/Pool.h, AvgPoolKernel.cpp);
    max pooling takes NaN as the maximum, as ATen does.
    """
    match = re.fullmatch(r"aten\.(max|avg)_pool([123])d(_with_indices)?\.default", op)
    if not match:
        raise refuse(op)
    kind, n = match.group(1), int(match.group(2))
    raw = bind_args(node)
    src = raw["self"]
    sval = meta_val(src)
    check_dtype(sval.dtype, f"{op}'s input")
    if sval.dtype == torch.bool:
        raise refuse(op, "pooling over bool tensors")

    def per_dim(value: Any, default: list[int]) -> list[int]:
        values = list(value) if isinstance(value, list | tuple) else [value]
        if not values:
            values = default
        if len(values) == 1:
            values = values * n
        if len(values) != n or not all(isinstance(v, int) and not isinstance(v, bool)
                                       for v in values):
            raise refuse(op, f"window arguments {value!r}")
        return [int(v) for v in values]

    kernel = per_dim(raw["kernel_size"], [])
    stride = per_dim(raw.get("stride", []), kernel)
    padding = per_dim(raw.get("padding", 0), [0])
    dilation = per_dim(raw.get("dilation", 1), [1]) if kind == "max" else [1] * n
    ceil_mode = bool(raw.get("ceil_mode", False))
    count_include_pad = bool(raw.get("count_include_pad", True))
    divisor = raw.get("divisor_override")
    if divisor is not None and not isinstance(divisor, int):
        raise refuse(op, f"divisor_override {divisor!r}")
    indices_used = False
    if match.group(3):
        for user in node.users:
            if user.target is not operator.getitem or user.args[1] != 0:
                indices_used = True
    x = lw.materialize(src)
    rank = len(sval.shape)
    lengths = [f"{x}.shape[{rank - n + d}]" for d in range(n)]
    view = lw.fresh("pool_in")
    lw.forward.append(f"{view} = {x}.reshape(-1, {', '.join(lengths)})")
    outs = []
    for d in range(n):
        o = lw.fresh("pool_len")
        span = 2 * padding[d] - dilation[d] * (kernel[d] - 1) - 1 + (stride[d] - 1 if ceil_mode else 0)
        shift = f" + {span}" if span > 0 else f" - {-span}" if span < 0 else ""
        lw.forward.append(f"{o} = ({lengths[d]}{shift}) // {stride[d]} + 1")
        if ceil_mode:
            # ATen drops a last window that would start in the right padding.
            lw.forward.append(f"{o} = {o} - 1 if ({o} - 1) * {stride[d]} >= "
                              f"{lengths[d]} + {padding[d]} else {o}")
        outs.append(o)
    lead = "".join(f"{x}.shape[{d}], " for d in range(rank - n))
    out_shape = f"({lead}{', '.join(outs)})"
    out = lw.alloc(out_shape, sval.dtype)
    idx_out = lw.alloc(out_shape, torch.int64) if indices_used else None

    sizes = [f"L{d}" for d in range(n)]
    osizes = [f"O{d}" for d in range(n)]
    strides = [f"s{d}" for d in range(n)]
    lines = ["pid = tl.program_id(0).to(tl.int64)  # int64: more than 2**31 elements fit",
             "offsets = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)",
             "mask = offsets < n_elements",
             "rest = offsets"]
    for d in reversed(range(n)):
        lines += [f"o{d} = rest % O{d}", f"rest = rest // O{d}"]
    lines.append("b = rest")
    if kind == "max":
        lines.append('acc = tl.full([BLOCK_SIZE], -float("inf"), tl.float32)')
        if indices_used:
            lines.append("arg = tl.full([BLOCK_SIZE], -1, tl.int64)")
    else:
        lines.append("acc = tl.zeros([BLOCK_SIZE], tl.float32)")
    # A small window is unrolled (tl.static_range); a large one stays a loop: 11 x 11
    # unrolled loads took Triton's GPU compiler 150 s (KernelBench level 1's average
    # pooling 2-D), as a loop well under a second.
    loop = "tl.static_range" if math.prod(kernel) <= _UNROLLED_WINDOW else "range"
    indent = ""
    for d in range(n):
        lines += [f"{indent}for k{d} in {loop}({kernel[d]}):",
                  f"{indent}    i{d} = o{d} * {stride[d]} - {padding[d]} + k{d} * {dilation[d]}",
                  f"{indent}    ok{d} = {'mask' if d == 0 else f'ok{d - 1}'} "
                  f"& (i{d} >= 0) & (i{d} < L{d})"]
        indent += "    "
    address = " + ".join(["b * sb", *(f"i{d} * s{d}" for d in range(n))])
    last = f"ok{n - 1}"
    if kind == "max":
        lines.append(f"{indent}v = tl.load(x_ptr + {address}, mask={last}, "
                     'other=-float("inf")).to(tl.float32)')
        take = f"{last} & ((v > acc) | (v != v)"
        take += " | (arg < 0))" if indices_used else ")"
        lines += [f"{indent}take = {take}", f"{indent}acc = tl.where(take, v, acc)"]
        if indices_used:
            flat = " + ".join(
                f"i{d}" + "".join(f" * L{e}" for e in range(d + 1, n)) for d in range(n))
            lines.append(f"{indent}arg = tl.where(take, {flat}, arg)")
        result = "acc"
    else:
        lines.append(f"{indent}acc += tl.load(x_ptr + {address}, mask={last}, "
                     "other=0.0).to(tl.float32)")
        if divisor is not None:
            lines.append(f"result = acc / {literal(divisor)}")
        else:
            factors = []
            for d in range(n):
                lines += [f"start{d} = o{d} * {stride[d]} - {padding[d]}",
                          f"end{d} = tl.minimum(start{d} + {kernel[d]}, L{d} + {padding[d]})"]
                if count_include_pad:
                    factors.append(f"(end{d} - start{d})")
                else:
                    factors.append(f"(tl.minimum(end{d}, L{d}) - tl.maximum(start{d}, 0))")
            lines.append(f"result = acc / ({' * '.join(factors)}).to(tl.float32)")
        result = "result"
    store = cast_out(result, sval.dtype, "[BLOCK_SIZE]")
    lines.append(f"tl.store(out_ptr + offsets, ({store}).to(out_ptr.dtype.element_ty), mask=mask)")
    params = ["x_ptr", "sb", *strides, "out_ptr"]
    launch = [view, f"*{view}.stride()", out]
    if indices_used:
        lines.append("tl.store(idx_ptr + offsets, arg, mask=mask)")
        params.append("idx_ptr")
        launch.append(idx_out)
    params += ["n_elements", *sizes, *osizes, "BLOCK_SIZE: tl.constexpr"]
    launch += ["n", *lengths, *outs]
    window = (f"kernel {tuple(kernel)}, stride {tuple(stride)}, padding {tuple(padding)}"
              + (f", dilation {tuple(dilation)}" if kind == "max" else "")
              + (", ceil_mode" if ceil_mode else ""))
    if kind == "max":
        what = "maximum (NaN wins; padding is -inf)" + (
            "; idx holds the argmax's flat index in the input plane" if indices_used else "")
    elif divisor is not None:
        what = f"sum / {divisor} (divisor_override)"
    else:
        what = "sum / " + ("window size within the padded input (count_include_pad)"
                           if count_include_pad else "in-bounds element count")
    doc = (f"{'Max' if kind == 'max' else 'Average'} pooling {n}-D: {op}.\n\n"
           f"{window}; out = {what}.\n"
           f"x is read as [B, {', '.join(sizes)}] through strides sb, "
           f"{', '.join(strides)}; out is contiguous [B, {', '.join(osizes)}].")
    kname = lw.fresh("pool_kernel_")
    add_kernel(lw, kname, params, doc, lines, [op])
    launch_blocks(lw, kname, out, launch)
    if match.group(3):
        items = [Value("tensor", out)]
        if indices_used:
            items.append(Value("tensor", idx_out))
        lw.values[node] = Value("tuple", items=items)
    else:
        lw.values[node] = Value("tensor", out)
