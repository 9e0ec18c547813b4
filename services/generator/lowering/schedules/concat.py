"""Schedules ``concat`` and ``split``: ``torch.cat`` as one strided copy kernel launched
once per input into its slice of the output, and ``split`` / ``split_with_sizes`` /
``chunk`` / ``unbind`` as views in forward (no kernel).

Sizes are read at run time: the output's extent along the concatenated dim is the sum
of the inputs' extents, each slice's offset the sum of the extents before it, and a
split into equal parts divides the extent it splits.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.fx

from services.generator.lowering.emit import add_kernel, flat_index_lines, launch_blocks
from services.generator.lowering.errors import LoweringError
from services.generator.lowering.ir import Value, bind_args, meta_val

if TYPE_CHECKING:
    from services.generator.lowering.lowerer import Lowerer


def lower_cat(lw: Lowerer, node: torch.fx.Node, op: str) -> None:
    """``aten.cat.default(tensors, dim)``: the output (contiguous, the inputs' shape
    with the extents along ``dim`` summed, the promoted dtype) is allocated in forward;
    one copy kernel, launched per input with one program per BLOCK_SIZE of its
    elements, reads the input through its strides and writes its slice of the output
    (``out.narrow(dim, offset, extent)``) through the slice's strides. Inputs of any
    float dtype or bool; legacy empty 1-D inputs (``torch.cat`` skips them) are
    refused (:class:`LoweringError`) when the output has another rank."""
    raw = bind_args(node)
    val = meta_val(node)
    rank = len(val.shape)
    dim = raw.get("dim", 0) % rank
    parts = list(raw["tensors"])
    for part in parts:
        if len(meta_val(part).shape) != rank:
            raise LoweringError(op, f"built-in coder cannot lower {op} of inputs of "
                                "another rank (legacy empty tensors); use the LLM coder")
    srcs = [lw.materialize(part) for part in parts]
    first = srcs[0]
    total = " + ".join(f"{s}.shape[{dim}]" for s in srcs)
    shape = f"(*{first}.shape[:{dim}], {total}, *{first}.shape[{dim + 1}:])"
    out = lw.alloc(shape, val.dtype)
    kname = lw.fresh("cat_kernel_")
    lines = flat_index_lines(rank, ["src = offsets * 0", "dst = offsets * 0"],
                             lambda d: [f"src += i{d} * s{d}", f"dst += i{d} * t{d}"])
    lines.append("tl.store(out_ptr + dst, tl.load(in_ptr + src, mask=mask)"
                 ".to(out_ptr.dtype.element_ty), mask=mask)")
    add_kernel(lw, kname, ["in_ptr", *(f"s{d}" for d in range(rank)), "out_ptr",
                           *(f"t{d}" for d in range(rank)), "n_elements",
                           *(f"size{d}" for d in range(rank)), "BLOCK_SIZE: tl.constexpr"],
               f"Concatenation: {op} along dim {dim}, one input a launch: its element i "
               "(read through its strides s*)\nis written to out's slice at i (through "
               "the slice's strides t*).", lines, [op])
    offset = lw.fresh("offset")
    lw.forward.append(f"{offset} = 0")
    for src in srcs:
        part = lw.fresh("view")
        lw.forward.append(f"{part} = {out}.narrow({dim}, {offset}, {src}.shape[{dim}])")
        launch_blocks(lw, kname, part, [src, f"*{src}.stride()", part, f"*{part}.stride()",
                                        "n", f"*{src}.shape"])
        lw.forward.append(f"{offset} += {src}.shape[{dim}]")
    lw.values[node] = Value("tensor", out)


def lower_split(lw: Lowerer, node: torch.fx.Node, op: str) -> None:
    """``split_with_sizes`` / ``split`` / ``chunk`` / ``unbind``: views in forward, one
    tuple item each (read by the graph's ``getitem`` nodes). A split into equal fixed
    parts is written as ``chunk`` of their count (the qkv split of a fused projection
    follows the model's width; ``x.chunk(2)`` of an odd extent gives torch's parts);
    other sizes are read at run time where an input extent explains them."""
    raw = bind_args(node)
    src = lw.materialize(raw["self"])
    val = meta_val(node)
    rank = len(meta_val(raw["self"]).shape)
    dim = raw.get("dim", 0) % max(rank, 1)
    name = op.split(".")[1]
    if name == "unbind":
        expr = f"{src}.unbind({dim})"
    elif name == "chunk":
        expr = f"{src}.chunk({raw['chunks']}, {dim})"
    else:
        sizes = raw.get("split_sizes", raw.get("split_size"))
        if isinstance(sizes, list | tuple):
            sizes = list(sizes)
            if len(sizes) > 1 and all(type(s) is int for s in sizes) and len(set(sizes)) == 1:
                expr = f"{src}.chunk({len(sizes)}, {dim})"
            else:
                expr = f"{src}.split({lw.size_list(sizes)}, {dim})"
        else:
            expr = f"{src}.split({lw.sym(sizes)}, {dim})"
    var = lw.fresh("parts")
    lw.forward.append(f"{var} = {expr}  # {op}")
    count = len(val) if isinstance(val, tuple | list) else 1
    lw.values[node] = Value("tuple", var, [Value("tensor", f"{var}[{k}]") for k in range(count)])
