"""Schedule ``pointwise``: an element-wise chain written as one kernel, one program per
BLOCK_SIZE output elements.

An element-wise node is not written where the graph has it (:func:`defer`): the kernels
that read it compute it (:meth:`Lowerer.chain`), and this kernel is written only when a
tensor must exist (:meth:`Lowerer.materialize` calls :func:`lower`).

Each operand is loaded through its strides broadcast to the output's shape, or, when
forward finds every operand dense in the output's shape (``FLAT``, a compile-time
branch), at the output's own flat offsets. A chain over a pending matmul's product
becomes that matmul's epilogue instead (:func:`.matmul.epilogue_of`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.fx

from services.generator.lowering.emit import add_kernel, cast_out, computed, launch_blocks
from services.generator.lowering.ir import Value, meta_val
from services.generator.lowering.ops import TL_DTYPES, check_dtype
from services.generator.lowering.schedules import matmul

if TYPE_CHECKING:
    from services.generator.lowering.lowerer import Lowerer


def defer(lw: Lowerer, node: torch.fx.Node, op: str) -> None:
    """Schedule ``pointwise``, deferred: an element-wise node is computed inside the
    kernels that read it (:meth:`Lowerer.chain`), written when a tensor must exist
    (:meth:`Lowerer.materialize`).

    Raises:
        LoweringError: an operand tensor has a dtype no kernel loads (:func:`check_dtype`).
    """
    for arg in node.all_input_nodes:
        if (lw.values[arg].kind == "tensor"
                and meta_val(arg).dtype not in (*TL_DTYPES, torch.int64)):
            check_dtype(meta_val(arg).dtype, f"{op}'s operand")
    lw.values[node] = Value("pointwise")


def lower(lw: Lowerer, node: torch.fx.Node) -> None:
    """Schedule ``pointwise``: one program per BLOCK_SIZE output elements; each
    operand is loaded through its strides broadcast to the output's shape, or, when
    forward finds every operand dense in the output's shape (``FLAT``), at the
    output's own flat offsets.

    A chain over a matmul's product becomes that matmul's epilogue instead
    (:func:`.matmul.epilogue_of`)."""
    product = matmul.epilogue_of(lw, node)
    if product is not None:
        matmul.emit(lw, product, node)
        return
    val = meta_val(node)
    rank = len(val.shape)
    leaves, _ = lw.leaves(node)
    loaded = [leaf for leaf in leaves if lw.used_by_value(node, leaf)]
    shape = lw.shape_of(node)
    out = lw.alloc(shape, val.dtype)
    name = lw.fresh("pointwise_kernel_")
    dims = [f"size{d}" for d in range(rank)]
    body: list[str] = []
    ops: list[str] = []
    load: dict[torch.fx.Node, str] = {}
    lines = ["pid = tl.program_id(0).to(tl.int64)  # int64: more than 2**31 elements fit",
             "offsets = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)",
             "mask = offsets < n_elements"]
    # Two load paths only where there is index arithmetic to skip: a rank-0 output
    # has none, and a chain that loads nothing (full_like) needs no indices.
    flat = bool(rank and loaded)
    strided = ["rest = offsets"] if flat else []
    for d in reversed(range(rank if flat else 0)):
        if d:
            strided += [f"i{d} = rest % size{d}", f"rest = rest // size{d}"]
        else:
            strided.append("i0 = rest")
    flat_loads: list[str] = []
    params = []
    launch = []
    for k, leaf in enumerate(loaded):
        strides = [f"s{k}_{d}" for d in range(rank)]
        params += [f"in{k}_ptr", *strides]
        expr = lw.values[leaf].expr
        launch += [expr, f"*_strides({expr}, {shape})"] if rank else [expr]
        offset = " + ".join(f"i{d} * s{k}_{d}" for d in range(rank)) or "offsets * 0"
        strided.append(f"v_in{k} = {computed(leaf, f'tl.load(in{k}_ptr + {offset}, mask=mask)')}")
        flat_loads.append(f"v_in{k} = {computed(leaf, f'tl.load(in{k}_ptr + offsets, mask=mask)')}")
        load[leaf] = f"v_in{k}"
    if flat:
        lines += ["# FLAT (a compile-time branch): forward found every input contiguous in",
                  "# out's shape, so element i of each input is at offset i, and the int64",
                  "# div/mod per element that turns offsets into per-dim indices is skipped.",
                  "if FLAT:",
                  *(f"    {line}" for line in flat_loads),
                  "else:",
                  *(f"    {line}" for line in strided)]
    else:
        lines += strided
    result = lw.kernel_chain(node, load, "[BLOCK_SIZE]", body, ops, params, launch)
    store = cast_out(result, val.dtype, "[BLOCK_SIZE]")
    kernel_params = [*params, "out_ptr", "n_elements", *dims, "BLOCK_SIZE: tl.constexpr",
                     *(["FLAT: tl.constexpr"] if flat else [])]
    lines += [*body,
              f"tl.store(out_ptr + offsets, ({store}).to(out_ptr.dtype.element_ty), mask=mask)"]
    doc = (f"Element-wise: {' -> '.join(dict.fromkeys(ops)) or 'copy'}.\n\n"
           "out is contiguous; input k is read through strides s{k}_* (0 along broadcast dims)"
           + (",\nor at out's offsets when FLAT." if flat else "."))
    add_kernel(lw, name, kernel_params, doc, lines, ops)
    dims_launch = [f"{shape}[{d}]" for d in range(rank)]
    inputs = ", ".join(lw.values[leaf].expr for leaf in loaded)
    launch_blocks(lw, name, out, [*launch, out, "n", *dims_launch],
                  [f"FLAT=_flat({shape}, {inputs})"] if flat else [])
    lw.values[node] = Value("tensor", out)
