"""Writing Triton and Python source text: the helpers every schedule shares.

What a kernel is made of besides its schedule's own lines: float literals Triton reads
as float32 (:func:`literal`), the small ``@triton.jit`` helpers an expression may call
(``_expm1``, ``_tanh``, ... in ``_HELPERS``: libdevice is avoided, its functions are
None under ``TRITON_INTERPRET=1``), loads as float32 (:func:`computed`), stores in the
output's dtype (:func:`cast_out`), a kernel's ``def`` and docstring (:func:`add_kernel`),
a one-program-per-block launch (:func:`launch_blocks`), and the candidate module itself
(:func:`render`: header, imports, forward's support functions, helpers, kernels,
``class ModelNew``).
"""

from __future__ import annotations

import math
import re
import textwrap
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.fx

from services.generator.launch_configs import autotune, on_gpu
from services.generator.lowering.ir import Kernel, meta_val
from services.generator.lowering.parameters import init_lines

if TYPE_CHECKING:
    from services.generator.lowering.lowerer import Lowerer

def literal(value: float | bool) -> str:
    """A Python number as a float literal Triton reads as float32."""
    value = float(value)
    if math.isnan(value):
        return 'float("nan")'
    if math.isinf(value):
        return 'float("inf")' if value > 0 else '-float("inf")'
    return repr(value)


# Small @triton.jit helpers the expressions above may call. libdevice is avoided: its
# functions are None under TRITON_INTERPRET=1. Each is within a few float32 ulps.
_HELPERS: dict[str, str] = {
    "_expm1": '''
@triton.jit
def _expm1(x):
    # exp(x) - 1 cancels for |x| << 1. There, Horner's form of the Taylor series to
    # x**9 / 9! (error under 1e-9 relative for |x| < 0.5): multiply-add only, so it is
    # as exact on GPUs, whose fast tl.log is too coarse near 1 for Kahan's trick.
    p = 1.0 + x * 0.1111111111111111
    p = 1.0 + x * 0.125 * p
    p = 1.0 + x * 0.14285714285714285 * p
    p = 1.0 + x * 0.16666666666666666 * p
    p = 1.0 + x * 0.2 * p
    p = 1.0 + x * 0.25 * p
    p = 1.0 + x * 0.3333333333333333 * p
    p = 1.0 + x * 0.5 * p
    return tl.where(tl.abs(x) < 0.5, x * p, tl.exp(x) - 1.0)
''',
    "_log1p": '''
@triton.jit
def _log1p(x):
    # log(1 + x) cancels for |x| << 1. There, 2 * atanh(s) with s = x / (2 + x), |s| <= 1/3,
    # by its odd series to s**15 (error under 1e-8 relative): multiply-add only.
    s = x / (2.0 + x)
    s2 = s * s
    p = 0.07692307692307693 + s2 * 0.06666666666666667
    p = 0.09090909090909091 + s2 * p
    p = 0.1111111111111111 + s2 * p
    p = 0.14285714285714285 + s2 * p
    p = 0.2 + s2 * p
    p = 0.3333333333333333 + s2 * p
    return tl.where(tl.abs(x) < 0.5, 2.0 * s * (1.0 + s2 * p), tl.log(1.0 + x))
''',
    "_tanh": '''
@triton.jit
def _tanh(x):
    # tanh|x| = -expm1(-2|x|) / (2 + expm1(-2|x|)): no overflow, exact near 0.
    e = _expm1(-2.0 * tl.abs(x))
    t = -e / (2.0 + e)
    return tl.where(x < 0.0, -t, t)
''',
    "_round_to_bf16": '''
@triton.jit
def _round_to_bf16(x):
    # Round to nearest even onto bfloat16's 7 mantissa bits, in float32: exact on every
    # backend (Triton's interpreter truncates float32 -> bfloat16 casts).
    bits = x.to(tl.uint32, bitcast=True)
    bits = bits + 0x7FFF + ((bits >> 16) & 1)
    rounded = ((bits >> 16) << 16).to(tl.float32, bitcast=True)
    return tl.where(x != x, x, rounded)
''',
    # associative_scan / reduce combine function (cumprod, prod)
    "_mul_combine": '''
@triton.jit
def _mul_combine(a, b):
    return a * b
''',
    # tl.reduce combine of Welford partials (mean, M2, count): Chan et al.'s pairwise
    # formula ("Updating formulae and a pairwise algorithm for computing sample
    # variances", 1979); an empty partial (count 0) leaves the other as it is.
    "_welford_combine": '''
@triton.jit
def _welford_combine(mean_a, m2_a, n_a, mean_b, m2_b, n_b):
    n = n_a + n_b
    w = tl.where(n == 0.0, 0.0, n_b / tl.maximum(n, 1.0))
    delta = mean_b - mean_a
    return mean_a + delta * w, m2_a + m2_b + delta * delta * n_a * w, n
''',
    "_trunc": '''
@triton.jit
def _trunc(x):
    return tl.where(x < 0.0, tl.ceil(x), tl.floor(x))
''',
    "_round_half_even": '''
@triton.jit
def _round_half_even(x):
    # torch.round rounds halves to even. x - floor(x) is exact, unlike x + 0.5, and
    # |x| >= 2**23 is already an integer.
    f = tl.floor(x)
    d = x - f
    odd = (f - 2.0 * tl.floor(f * 0.5)) != 0.0
    r = tl.where((d > 0.5) | ((d == 0.5) & odd), f + 1.0, f)
    return tl.where(tl.abs(x) >= 8388608.0, x, r)
''',
}
# A helper is named where it is called (``_tanh(x)``) or passed as a combine function
# (``tl.reduce(x, 0, _mul_combine)``).
_HELPER_CALL = re.compile(r"\b(" + "|".join(_HELPERS) + r")\b")


_SUPPORT = '''
def _broadcast_shape(rank, *shapes):
    """The shape torch broadcasting gives ``shapes`` (right-aligned; 1 stretches)."""
    out = [1] * rank
    for shape in shapes:
        for k, size in enumerate(shape):
            d = rank - len(shape) + k
            if size != 1:
                out[d] = size
    return tuple(out)


def _strides(t, shape):
    """Strides of ``t`` broadcast to ``shape``: 0 along the dims it is expanded over."""
    return t.expand(shape).stride()


def _flat(shape, *tensors):
    """Whether every tensor has ``shape`` and is contiguous (row-major), so a kernel may
    read it at the output's flat offsets: not a broadcast operand, a transposed view or
    a slice. Strides of size-1 dims do not matter (their index is always 0), which is
    what Tensor.is_contiguous() checks too."""
    return all(tuple(t.shape) == tuple(shape) and t.is_contiguous() for t in tensors)
'''


def prod(items: list[str]) -> str:
    """The product of Python expressions ``items`` as one expression (``"1"`` if none)."""
    return " * ".join(items) if items else "1"


def triton_next_pow2(n: int) -> int:
    """The smallest power of two at least ``n`` (1 for ``n <= 1``)."""
    return 1 << max(0, (n - 1).bit_length())


def torch_dtype_name(dtype: torch.dtype) -> str:
    """``dtype`` as the generated forward spells it, e.g. ``torch.float16``."""
    return str(dtype)


def computed(leaf: torch.fx.Node, load: str) -> str:
    """``load`` as the kernel computes with it: float32, except booleans (masks)."""
    return load if meta_val(leaf).dtype == torch.bool else f"{load}.to(tl.float32)"


def _needed_helpers(code: str) -> list[str]:
    """Helpers called by ``code`` and by each other, callees before callers."""
    order: list[str] = []

    def visit(name: str) -> None:
        if name in order:
            return
        for callee in _HELPER_CALL.findall(_HELPERS[name]):
            if callee != name:  # its own def line
                visit(callee)
        order.append(name)

    for name in _HELPER_CALL.findall(code):
        visit(name)
    return order


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def cast_out(result: str, dtype: torch.dtype, tile: str) -> str:
    """The float32 expression ``result`` as it is stored into a ``dtype`` output: a
    comparison for bool, bfloat16's round to nearest even (``_round_to_bf16``)."""
    if dtype == torch.bool:
        return f"({result}) != 0"
    if dtype == torch.bfloat16:
        return f"_round_to_bf16({result})"
    return result


def add_kernel(lw: Lowerer, name: str, params: list[str], doc: str, lines: list[str],
               ops: list[str]) -> None:
    """Append the ``@triton.jit`` kernel ``name`` (``params``, docstring ``doc``, body
    ``lines``) to the lowerer's kernels; ``ops`` are the ATen ops it computes."""
    docstring = '"""' + doc.replace("\n", "\n    ") + '\n    """' if "\n" in doc else f'"""{doc}"""'
    source = (f"@triton.jit\ndef {name}({', '.join(params)}):\n    {docstring}\n"
              + textwrap.indent("\n".join(lines), "    "))
    lw.kernels.append(Kernel(name, source, ops))


def flat_index_lines(rank: int, init: list[str], per_dim: Callable[[int], list[str]]
                     ) -> list[str]:
    """Kernel lines of a one-program-per-BLOCK_SIZE-elements copy: ``offsets`` into a
    contiguous output of ``rank`` dims (extents ``size<d>``) split into per-dim indices
    ``i<d>``, innermost first; ``init`` lines start the address accumulators and
    ``per_dim(d)`` adds dim ``d``'s term to them."""
    lines = ["pid = tl.program_id(0).to(tl.int64)  # int64: more than 2**31 elements fit",
             "offsets = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)",
             "mask = offsets < n_elements",
             "rest = offsets",
             *init]
    for d in reversed(range(rank)):
        lines.append(f"i{d} = rest % size{d}" if d else "i0 = rest")
        if d:
            lines.append(f"rest = rest // size{d}")
        lines += per_dim(d)
    return lines


def launch_blocks(lw: Lowerer, kname: str, out: str, args: list[str],
                  constexprs: list[str] | None = None) -> None:
    """Emit ``kname``'s launch with one program per BLOCK_SIZE elements of ``out``
    (skipped when ``out`` is empty; ``n`` is its element count); ``args`` are the
    kernel's run-time arguments, ``constexprs`` further ``NAME=expr`` ones. On a GPU
    the kernel is autotuned over the ``elementwise`` list
    (:mod:`services.generator.launch_configs`), keyed on ``n_elements``, and its grid
    reads BLOCK_SIZE from the chosen config."""
    if on_gpu(lw):  # BLOCK_SIZE, num_warps, num_stages from the table
        autotune(lw, kname, "elementwise", ["n_elements"], ("BLOCK_SIZE",))
        lw.forward += [
            f"n = {out}.numel()",
            "if n > 0:",
            f"    {kname}[lambda META: (triton.cdiv(n, META['BLOCK_SIZE']),)](",
            f"        {', '.join(args)},",
            *(f"        {c}," for c in constexprs or []),
            "    )",
        ]
        return
    block = lw.p["block_size"]
    lw.forward += [
        f"n = {out}.numel()",
        "if n > 0:",
        f"    {kname}[(triton.cdiv(n, {block}),)](",
        f"        {', '.join(args)},",
        *(f"        {c}," for c in constexprs or []),
        f"        BLOCK_SIZE={block}, num_warps={lw.p['num_warps']}, "
        f"num_stages={lw.p['num_stages']})",
    ]


def render(lw: Lowerer) -> str:
    """The candidate module's source from the lowerer's kernels and forward lines."""
    code = "\n".join(k.source for k in lw.kernels)
    helpers = _needed_helpers(code)
    all_ops = [op for k in lw.kernels for op in k.ops]
    names = lw.task.arg_names
    arg_count = len(lw.task.inputs)
    shapes = ", ".join(
        f"{n}: {_dtype_name(x.dtype)}{list(x.shape)}" if isinstance(x, torch.Tensor)
        else f"{n}: {type(x).__name__}" for n, x in zip(names, lw.task.inputs, strict=False))
    header = [
        "# Generated by the AIKG built-in coder (no LLM) from the task's core-ATen graph.",
        f"# Fused op chain: {' -> '.join(dict.fromkeys(all_ops)) or '(copy)'}",
        f"# Lowered at {shapes}; sizes are read from the inputs at run time.",
        f"# Kernels: {', '.join(k.name for k in lw.kernels)}.",
    ]
    init = init_lines(lw.task)
    forward = (f"def forward(self, {', '.join(names[:arg_count])}):\n"
               + textwrap.indent("\n".join(lw.forward), "    "))
    model_new = (
        "class ModelNew(nn.Module):\n"
        '    """Runs the task\'s core-ATen graph as Triton kernels; forward only '
        'allocates, views and launches."""\n\n'
        "    def __init__(self, *args, **kwargs):\n"
        "        super().__init__()\n"
        + "".join(f"        {line}\n" for line in init) + "\n"
        + textwrap.indent(forward, "    ")
    )
    parts = ["\n".join(header)
             + "\nimport torch\nimport torch.nn as nn\nimport triton\nimport triton.language as tl",
             _SUPPORT.strip(),
             *(_HELPERS[h].strip() for h in helpers),
             *(k.source for k in lw.kernels),
             model_new]
    return "\n\n\n".join(parts) + "\n"


def tile_epilogue(lw: Lowerer, node: torch.fx.Node, epilogue: torch.fx.Node, lines: list[str],
                  ops: set[str], params: list[str], launch: list[str], dtype: torch.dtype,
                  load_leaf) -> str:
    """The element-wise chain after a ``tl.dot`` product (a matmul's or a convolution's)
    on the tile ``acc``: the product rounded as torch stores it, each other leaf the chain
    reads by value loaded as ``load_leaf(k, expr)`` says (``(params, launch args, load
    expression)``), then the chain itself; returns the result, cast for the store."""
    product_dtype = meta_val(node).dtype
    if product_dtype == torch.float16:  # the chain reads the product as torch stores it
        lines.append("acc = acc.to(tl.float16).to(tl.float32)")
    elif product_dtype == torch.bfloat16:
        lines.append("acc = _round_to_bf16(acc)")
    leaves, _ = lw.leaves(epilogue, keep=node)
    load: dict[torch.fx.Node, str] = {node: "acc"}
    for k, leaf in enumerate(leaf for leaf in leaves
                             if leaf is not node and lw.used_by_value(epilogue, leaf)):
        more_params, more_launch, ld = load_leaf(k, lw.values[leaf].expr)
        params += more_params
        launch += more_launch
        lines.append(f"v_e{k} = {computed(leaf, ld)}")
        load[leaf] = f"v_e{k}"
    body: list[str] = []
    result = lw.kernel_chain(epilogue, load, "[BLOCK_M, BLOCK_N]", body, ops, params, launch)
    lines += body
    return cast_out(result, dtype, "")
