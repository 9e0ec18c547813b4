"""Built-in coder: lowers a task's core-ATen graph to Triton kernels, without an LLM.

The task (KernelBench format: ``class Model``, ``get_inputs()``, ``get_init_inputs()``)
is run, exported with ``torch.export.export(...).run_decompositions()`` and its core-ATen
graph is walked node by node. Element-wise operators from ``_RULES`` are fused into the
kernel that consumes them; every other node is emitted by one schedule: ``pointwise``,
``row reduction``, ``matmul``, ``scan`` or ``pooling`` (max/avg, 1-D/2-D/3-D, stride,
padding, dilation, ceil_mode, count_include_pad, divisor_override, max's indices).
Views stay views in the generated forward. Anything else (convolutions, adaptive
pooling, indexing, sorting, ...) raises :class:`LoweringError` naming the operator and
its family, so the caller can hand the task to the LLM coder.

The coder runs the task's code in this process: call it where task code is trusted, or
from a subprocess.

Why one module: the schedules share one emitter (index arithmetic, masks, fused
element-wise chains, parameter plumbing); splitting it per schedule would copy that
emitter or thread it through every file.
"""

from __future__ import annotations

import inspect
import itertools
import math
import operator
import re
import sys
import textwrap
import types
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx

from services.common.records import REQUIRED_TASK_NAMES
from services.generator.coders.errors import LoweringError

__all__ = ["LoweringError", "lower_task"]

_KERNEL_NAME = "fused_elementwise_kernel"

# Tensor dtypes a candidate may load or store. float64 and integer tensors are refused:
# the kernel computes in float32, which would not match them.
_TL_DTYPES: dict[torch.dtype, str] = {
    torch.float32: "tl.float32",
    torch.float16: "tl.float16",
    torch.bfloat16: "tl.bfloat16",
    torch.bool: "tl.int1",
}
_TORCH_DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float32: "torch.float32",
    torch.float16: "torch.float16",
    torch.bfloat16: "torch.bfloat16",
    torch.bool: "torch.bool",
}

# Ops that reshape without moving elements: on contiguous tensors the flat order is
# unchanged, so the kernel passes the value through.
_RESHAPES = frozenset(
    {
        "aten.view.default",
        "aten._unsafe_view.default",
        "aten.alias.default",
        "aten.squeeze.default",
        "aten.squeeze.dim",
        "aten.squeeze.dims",
        "aten.unsqueeze.default",
    }
)
# Ops whose value does not depend on their tensor arguments' values.
_CONSTANTS = frozenset(
    {"aten.full.default", "aten.full_like.default", "aten.scalar_tensor.default"}
)
# Memory formats that keep a contiguous tensor contiguous.
_FLAT_FORMATS = (None, torch.contiguous_format, torch.preserve_format)
# Names the generated forward() uses itself, so task argument names must avoid them.
_RESERVED = frozenset(
    {"self", "torch", "nn", "triton", "tl", "out", "n_elements", "grid", _KERNEL_NAME}
)


# --------------------------------------------------------------------------------------
# Lowering table
# --------------------------------------------------------------------------------------


@dataclass
class _Call:
    """One graph node being lowered, its arguments bound to schema names.

    Attributes:
        op: The operator's name, e.g. ``"aten.mul.Tensor"``.
        expr: Argument name -> Triton expression: a kernel variable for a tensor, a
            literal for a number, ``"None"`` for an absent optional.
        raw: Argument name -> the graph's value (an ``fx.Node`` for a tensor).
    """

    op: str
    expr: dict[str, str]
    raw: dict[str, Any]

    def fmt(self, template: str, **constants: str) -> str:
        """Fill ``template``'s ``{argument}`` fields, and any extra named constants."""
        return template.format(**self.expr, **constants)


@dataclass(frozen=True)
class _Rule:
    """How one core-ATen operator becomes a Triton expression.

    Attributes:
        emit: Builds the expression from the bound call.
        keep_bool: Pass bool (``tl.int1``) operands as they are; otherwise they are
            cast to float32 first, as torch promotes bool in arithmetic.
    """

    emit: Callable[[_Call], str]
    keep_bool: bool = False


def _t(template: str, *, keep_bool: bool = False) -> _Rule:
    """A rule given as a format string over argument names, e.g. ``"{self} * {other}"``."""
    return _Rule(lambda c: c.fmt(template), keep_bool=keep_bool)


def _literal(value: float | bool) -> str:
    """A Python number as a float literal Triton reads as float32."""
    value = float(value)
    if math.isnan(value):
        return 'float("nan")'
    if math.isinf(value):
        return 'float("inf")' if value > 0 else '-float("inf")'
    return repr(value)


def _scaled(c: _Call, sign: str) -> str:
    """``self + alpha * other`` (add) or ``self - alpha * other`` (sub)."""
    if c.raw.get("alpha", 1) == 1:
        return c.fmt("{self} {sign} {other}", sign=sign)
    return c.fmt("{self} {sign} {other} * {alpha}", sign=sign)


def _pow_tensor_scalar(c: _Call) -> str:
    """``self ** exponent`` for a number exponent, exact for small integer powers."""
    x, e = c.expr["self"], float(c.raw["exponent"])
    if e == 0.0:
        return "tl.full(__TILE__, 1.0, tl.float32)"
    if e.is_integer() and abs(e) <= 4:
        product = " * ".join([x] * int(abs(e)))
        return product if e > 0 else f"1.0 / ({product})"
    if e == 0.5:
        return f"tl.sqrt_rn({x})"
    if e == -0.5:
        return f"tl.rsqrt({x})"
    if e.is_integer():
        # |x|**e with the sign of x for odd e; exp2/log2 alone would give NaN for x < 0.
        magnitude = f"tl.exp2({_literal(e)} * tl.log2(tl.abs({x})))"
        return magnitude if e % 2 == 0 else f"tl.where({x} < 0.0, -{magnitude}, {magnitude})"
    return f"tl.exp2({_literal(e)} * tl.log2({x}))"  # NaN for x < 0, as torch.pow


def _pow_scalar(c: _Call) -> str:
    """``self ** exponent`` for a number base and a tensor exponent."""
    base = float(c.raw["self"])
    if base <= 0.0:
        raise LoweringError(c.op, f"built-in coder cannot lower {c.op} with base {base} "
                            "(only positive bases are supported); use the LLM coder")
    return f"tl.exp2({c.expr['exponent']} * {_literal(math.log2(base))})"


def _clamp(c: _Call) -> str:
    """clamp/hardtanh: min first, then max, as torch orders them; NaN stays NaN.

    A NaN in a tensor bound gives NaN too, as torch's clamp with tensor bounds does.
    """
    value = c.expr["self"]
    low, high = ("min", "max") if "min" in c.expr else ("min_val", "max_val")
    for name, compare in ((low, "<"), (high, ">")):
        bound = c.raw.get(name)
        if bound is None:
            continue
        take = f"{value} {compare} {c.expr[name]}"
        if isinstance(bound, torch.fx.Node):
            take = f"({take}) | ({c.expr[name]} != {c.expr[name]})"
        value = f"tl.where({take}, {c.expr[name]}, {value})"
    return value


def _gelu(c: _Call) -> str:
    """gelu as torch computes it: erf form, or the tanh form with torch's constants."""
    if c.raw.get("approximate", "none") == "tanh":
        return c.fmt(
            "0.5 * {self} * (1.0 + _tanh({beta} * ({self} + 0.044715 * {self} * {self} * {self})))",
            beta=_literal(math.sqrt(2.0) * (2.0 / math.sqrt(math.pi)) * 0.5),
        )
    return c.fmt("0.5 * {self} * (1.0 + tl.erf({self} * {rsqrt2}))",
                 rsqrt2=_literal(math.sqrt(0.5)))


def _elu(c: _Call) -> str:
    """elu/selu: ``scale * x`` for x > 0, else ``scale * alpha * expm1(input_scale * x)``."""
    scale, alpha = float(c.raw["scale"]), float(c.raw["alpha"])
    return c.fmt(
        "tl.where({self} > 0.0, {self} * {scale}, _expm1({self} * {input_scale}) * {coef})",
        coef=_literal(alpha * scale),
    )


def _to_copy(c: _Call) -> str:
    """A dtype cast (``x.half()``, ``mask.float()``); narrowing casts round like torch."""
    if c.raw.get("memory_format") not in _FLAT_FORMATS:
        raise LoweringError(c.op, f"built-in coder cannot lower {c.op} to memory format "
                            f"{c.raw['memory_format']}; use the LLM coder")
    dtype = c.raw.get("dtype")
    if dtype in (None, torch.float32):
        return c.expr["self"]
    if dtype == torch.float16:
        return f"{c.expr['self']}.to(tl.float16).to(tl.float32)"
    if dtype == torch.bfloat16:
        return f"_round_to_bf16({c.expr['self']})"
    if dtype == torch.bool:
        return f"{c.expr['self']} != 0.0"
    raise LoweringError("dtype", f"built-in coder cannot lower {c.op} to {dtype} "
                        "(only float32, float16, bfloat16 and bool); use the LLM coder")


def _clone(c: _Call) -> str:
    if c.raw.get("memory_format") not in _FLAT_FORMATS:
        raise LoweringError(c.op, f"built-in coder cannot lower {c.op} to memory format "
                            f"{c.raw['memory_format']} (layout change); use the LLM coder")
    return c.expr["self"]


def _constant(c: _Call, dtype: torch.dtype) -> str:
    """full/full_like/scalar_tensor: a block of the fill value, rounded to its dtype."""
    value = c.raw["fill_value"] if "fill_value" in c.raw else c.raw["s"]
    if dtype == torch.bool:
        return f"tl.full(__TILE__, {int(bool(value))}, tl.int1)"
    block = f"tl.full(__TILE__, {_literal(value)}, {_TL_DTYPES[dtype]})"
    return block if dtype == torch.float32 else f"{block}.to(tl.float32)"


def _pass(c: _Call) -> str:
    return c.expr["self"]


_RULES: dict[str, _Rule] = {
    # activations kept whole by the core-ATen decomposition
    "aten.relu.default": _t("tl.where({self} < 0.0, 0.0, {self})"),
    "aten.leaky_relu.default": _t("tl.where({self} > 0.0, {self}, {self} * {negative_slope})"),
    "aten.sigmoid.default": _t("tl.sigmoid({self})"),
    "aten.tanh.default": _t("_tanh({self})"),
    "aten.gelu.default": _Rule(_gelu),
    "aten.elu.default": _Rule(_elu),
    "aten.hardtanh.default": _Rule(_clamp),
    # unary math
    "aten.abs.default": _t("tl.abs({self})"),
    "aten.neg.default": _t("-{self}"),
    # sign(NaN) is 0 in torch
    "aten.sign.default": _t("tl.where({self} > 0.0, 1.0, 0.0) - tl.where({self} < 0.0, 1.0, 0.0)"),
    "aten.exp.default": _t("tl.exp({self})"),
    "aten.exp2.default": _t("tl.exp2({self})"),
    "aten.expm1.default": _t("_expm1({self})"),
    "aten.log.default": _t("tl.log({self})"),
    "aten.log2.default": _t("tl.log2({self})"),
    "aten.log10.default": _t("tl.log({self}) * " + _literal(1.0 / math.log(10.0))),
    "aten.log1p.default": _t("_log1p({self})"),
    "aten.sqrt.default": _t("tl.sqrt_rn({self})"),
    "aten.rsqrt.default": _t("tl.rsqrt({self})"),
    "aten.reciprocal.default": _t("1.0 / {self}"),
    "aten.sin.default": _t("tl.sin({self})"),
    "aten.cos.default": _t("tl.cos({self})"),
    "aten.erf.default": _t("tl.erf({self})"),
    "aten.floor.default": _t("tl.floor({self})"),
    "aten.ceil.default": _t("tl.ceil({self})"),
    "aten.trunc.default": _t("_trunc({self})"),
    "aten.round.default": _t("_round_half_even({self})"),
    # binary arithmetic (a number operand arrives as a literal)
    "aten.add.Tensor": _Rule(lambda c: _scaled(c, "+")),
    "aten.add.Scalar": _Rule(lambda c: _scaled(c, "+")),
    "aten.sub.Tensor": _Rule(lambda c: _scaled(c, "-")),
    "aten.sub.Scalar": _Rule(lambda c: _scaled(c, "-")),
    "aten.mul.Tensor": _t("{self} * {other}"),
    "aten.mul.Scalar": _t("{self} * {other}"),
    # div.Tensor_mode (// and rounding_mode) is left out: floor(a / b) differs from
    # torch's fmod-based result where a / b rounds onto an integer.
    "aten.div.Tensor": _t("{self} / {other}"),
    "aten.div.Scalar": _t("{self} / {other}"),
    "aten.pow.Tensor_Scalar": _Rule(_pow_tensor_scalar),
    "aten.pow.Scalar": _Rule(_pow_scalar),
    # NaN in either operand gives NaN, as torch.maximum/minimum do
    "aten.maximum.default": _t("tl.where(({self} > {other}) | ({self} != {self}), {self}, {other})"),
    "aten.minimum.default": _t("tl.where(({self} < {other}) | ({self} != {self}), {self}, {other})"),
    "aten.clamp.default": _Rule(_clamp),
    "aten.clamp.Tensor": _Rule(_clamp),
    # comparisons and selection (bool values are tl.int1)
    "aten.gt.Scalar": _t("{self} > {other}"),
    "aten.gt.Tensor": _t("{self} > {other}"),
    "aten.ge.Scalar": _t("{self} >= {other}"),
    "aten.ge.Tensor": _t("{self} >= {other}"),
    "aten.lt.Scalar": _t("{self} < {other}"),
    "aten.lt.Tensor": _t("{self} < {other}"),
    "aten.le.Scalar": _t("{self} <= {other}"),
    "aten.le.Tensor": _t("{self} <= {other}"),
    "aten.eq.Scalar": _t("{self} == {other}"),
    "aten.eq.Tensor": _t("{self} == {other}"),
    "aten.ne.Scalar": _t("{self} != {other}"),
    "aten.ne.Tensor": _t("{self} != {other}"),
    "aten.isnan.default": _t("{self} != {self}"),
    "aten.isinf.default": _t('tl.abs({self}) == float("inf")'),
    "aten.where.self": _t("tl.where({condition}, {self}, {other})", keep_bool=True),
    "aten.logical_not.default": _t("{self} == 0", keep_bool=True),
    "aten.logical_and.default": _t("({self} != 0) & ({other} != 0)", keep_bool=True),
    "aten.logical_or.default": _t("({self} != 0) | ({other} != 0)", keep_bool=True),
    "aten.logical_xor.default": _t("({self} != 0) ^ ({other} != 0)", keep_bool=True),
    # bitwise ops reach here only on bool tensors (integer tensors are refused)
    "aten.bitwise_not.default": _t("{self} == 0", keep_bool=True),
    "aten.bitwise_and.Tensor": _t("{self} & {other}", keep_bool=True),
    "aten.bitwise_or.Tensor": _t("{self} | {other}", keep_bool=True),
    "aten.bitwise_xor.Tensor": _t("{self} ^ {other}", keep_bool=True),
    # casts and copies
    "aten._to_copy.default": _Rule(_to_copy),
    "aten.clone.default": _Rule(_clone, keep_bool=True),
    **{op: _Rule(_pass, keep_bool=True) for op in _RESHAPES},
}

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


# --------------------------------------------------------------------------------------
# Task loading and export
# --------------------------------------------------------------------------------------


@dataclass
class _Task:
    """A task run far enough to export: its model, example inputs and forward names.

    ``registered`` lists the Model's direct attributes in the order ``__init__``
    registered them: ``("module", name, module)`` or ``("parameter", name, tensor)``.
    """

    model: torch.nn.Module
    inputs: tuple[Any, ...]
    arg_names: list[str]
    init_inputs: list[Any]
    registered: list[tuple[str, str, Any]]
    module: types.ModuleType


def _load_task(task_desc: str, shape_overrides: dict[str, Any] | None,
               progress: Any = None) -> _Task:
    """Run the task source and build its model and example inputs.

    Inputs and model are built on the meta device first, so a KernelBench problem sized
    for an 80 GB GPU costs no memory; a task whose code refuses meta is built on CPU.
    ``progress(phase)`` is told each call into the task's code before it starts
    (``the task's Model(*get_init_inputs())`` ...), so that a lowering that hangs can
    name it.
    """
    def phase(what: str) -> None:
        if progress is not None:
            progress(f"the task's {what}")

    try:
        code = compile(task_desc, "<task>", "exec")
    except SyntaxError as exc:
        raise LoweringError("task", f"task source does not compile: {exc.msg} "
                            f"(line {exc.lineno}); fix the task") from exc
    module = types.ModuleType("aikg_task")
    phase("module code")
    try:
        exec(code, module.__dict__)
    except Exception as exc:
        raise LoweringError("task", f"task source raised {type(exc).__name__}: {exc}; "
                            "fix the task") from exc
    for name in REQUIRED_TASK_NAMES:
        if not hasattr(module, name):
            raise LoweringError("task", f"task source defines no `{name}`; a task needs "
                                "`class Model`, `get_inputs()` and `get_init_inputs()`")
    # The same rule as the verifier's reference: an override names a module-level name.
    unknown = sorted(n for n in (shape_overrides or {}) if not hasattr(module, n))
    if unknown:
        raise LoweringError("task", f"shape_overrides name {', '.join(unknown)}, which the "
                            "task does not define; use its module-level size names")
    for name, value in (shape_overrides or {}).items():
        setattr(module, name, tuple(value) if isinstance(value, list) else value)

    registered: list[tuple[str, str, Any]] = []
    top: list[torch.nn.Module] = []

    def on_module(owner, name, value):
        if owner is (top[0] if top else None):
            registered.append(("module", name, value))

    def on_parameter(owner, name, value):
        if owner is (top[0] if top else None) and value is not None:
            registered.append(("parameter", name, value))

    class _Recorder:
        """Finds the top-level Model instance as soon as Module.__init__ runs on it."""

    def build() -> tuple[torch.nn.Module, list[Any], list[Any]]:
        registered.clear()
        top.clear()
        phase("get_init_inputs()")
        init_inputs = list(module.get_init_inputs())
        original = torch.nn.Module.__init__

        def init(self, *args, **kwargs):
            if not top and isinstance(self, module.Model):
                top.append(self)
            original(self, *args, **kwargs)

        torch.nn.Module.__init__ = init
        hooks = [torch.nn.modules.module.register_module_module_registration_hook(on_module),
                 torch.nn.modules.module.register_module_parameter_registration_hook(
                     on_parameter)]
        try:
            phase("Model(*get_init_inputs())")
            model = module.Model(*init_inputs)
        finally:
            torch.nn.Module.__init__ = original
            for hook in hooks:
                hook.remove()
        phase("get_inputs()")
        return model, list(module.get_inputs()), init_inputs

    try:
        with torch.device("meta"):
            model, inputs, init_inputs = build()
    except Exception:
        try:
            model, inputs, init_inputs = build()
        except Exception as exc:
            raise LoweringError("task", f"building the task's Model or inputs raised "
                                f"{type(exc).__name__}: {exc}; fix the task") from exc
    if not isinstance(model, torch.nn.Module):
        raise LoweringError("task", "task's Model is not a torch.nn.Module")
    for position, value in enumerate(inputs):
        if not isinstance(value, torch.Tensor | bool | int | float):
            raise LoweringError("inputs", f"get_inputs() item {position} is a "
                                f"{type(value).__name__}; the built-in coder takes tensors "
                                "and numbers only; use the LLM coder")
    return _Task(model, tuple(inputs), _forward_arg_names(type(model), len(inputs)),
                 init_inputs, list(registered), module)


def _forward_arg_names(model_cls: type, count: int) -> list[str]:
    """The task forward's parameter names when they are plain, else ``in0, in1, ...``."""
    fallback = [f"in{i}" for i in range(count)]
    try:
        params = list(inspect.signature(model_cls.forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return fallback
    plain = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    names = [p.name for p in params[:count] if p.kind in plain]
    if (len(names) != count or _RESERVED.intersection(names)
            or any(n.startswith(("buf", "shape", "v_", "_")) for n in names)):
        return fallback
    return names


# Composite operators decomposed further than core ATen, into reductions and
# element-wise operators the schedules below lower (torch._decomp's own decompositions).
_EXTRA_DECOMPOSITIONS = (
    "_softmax", "_log_softmax", "native_layer_norm", "native_group_norm",
    "_native_batch_norm_legit_functional", "_native_batch_norm_legit",
    "_native_batch_norm_legit_no_training", "linalg_vector_norm", "logsumexp",
    "std", "mv", "native_dropout",
)


def _scalar_tensors(task: _Task) -> tuple[Any, ...] | None:
    """The task's inputs with each number as a 0-d tensor (float32, int64 or bool),
    or None when ``get_inputs()`` returns no number.

    torch.export bakes a Python number argument into the graph as a constant; traced as
    a 0-d tensor it stays a graph input, so the generated kernels take it as an argument
    and ModelNew follows whatever value forward is called with. A 0-d tensor promotes
    like the number it stands for (torch's type promotion treats both as "scalars":
    https://pytorch.org/docs/stable/tensor_attributes.html#type-promotion-doc).
    """
    if all(isinstance(x, torch.Tensor) for x in task.inputs):
        return None
    device = next((x.device for x in task.inputs if isinstance(x, torch.Tensor)), None)
    dtypes = {bool: torch.bool, int: torch.int64, float: torch.float32}
    return tuple(x if isinstance(x, torch.Tensor)
                 else torch.tensor(x, dtype=dtypes[type(x)], device=device)
                 for x in task.inputs)


def _export(task: _Task, inputs: tuple[Any, ...] | None = None) -> torch.export.ExportedProgram:
    """Export with every input extent dynamic (``Dim.AUTO``), else with static shapes.

    Dynamic extents make the graph's view sizes expressions over the inputs' shapes, so
    the generated forward works at other sizes (the worker checks a second one).
    ``inputs`` replaces the task's example inputs (numbers as 0-d tensors).
    """
    from torch._decomp import core_aten_decompositions, get_decompositions

    inputs = task.inputs if inputs is None else inputs
    table = core_aten_decompositions()
    aten = torch.ops.aten
    table.update(get_decompositions([getattr(aten, name) for name in _EXTRA_DECOMPOSITIONS
                                     if hasattr(aten, name)]))
    dynamic = tuple({i: torch.export.Dim.AUTO for i in range(x.dim())}
                    if isinstance(x, torch.Tensor) else None for x in inputs)
    errors = []
    for shapes in (dynamic, None):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # torch.export's internal deprecation notices
                ep = torch.export.export(task.model, inputs, dynamic_shapes=shapes)
                return ep.run_decompositions(table)
        except Exception as exc:  # noqa: BLE001 - retried with static shapes
            errors.append(exc)
    exc = errors[-1]
    # A reference that fails by itself is the task's fault, not something a coder
    # (the LLM's included) can work around: say so instead of blaming the trace.
    try:
        with torch.no_grad():
            task.model(*inputs)
    except Exception as eager:  # noqa: BLE001 - reported as the task's error
        eager_line = (str(eager).strip().splitlines() or [""])[0]
        raise LoweringError("task", f"the task's own Model fails on its get_inputs() "
                            f"({type(eager).__name__}: {eager_line}); fix the task: no "
                            "kernel can match a reference that does not run") from eager
    first_line = (str(exc).strip().splitlines() or [""])[0]
    raise LoweringError("export", f"torch.export could not trace the task's Model "
                        f"({type(exc).__name__}: {first_line}); use the LLM coder") from exc


# --------------------------------------------------------------------------------------
# Graph -> kernels
# --------------------------------------------------------------------------------------

# Ops that are views (or layout copies) in the generated forward: torch allows them
# there (the worker's op audit lists them as view/copy operators).
_VIEW_OPS = frozenset({
    "aten.view.default", "aten._unsafe_view.default", "aten.reshape.default",
    "aten.alias.default", "aten.squeeze.default", "aten.squeeze.dim", "aten.squeeze.dims",
    "aten.unsqueeze.default", "aten.permute.default", "aten.expand.default",
    "aten.slice.Tensor", "aten.select.int", "aten.t.default", "aten.transpose.int",
})
_REDUCTIONS = frozenset({
    "aten.sum.dim_IntList", "aten.sum.default", "aten.mean.dim", "aten.mean.default",
    "aten.amax.default", "aten.amin.default", "aten.max.dim", "aten.min.dim",
    "aten.max.default", "aten.min.default", "aten.argmax.default", "aten.argmin.default",
    "aten.prod.dim_int", "aten.prod.default", "aten.var.correction", "aten.var.dim",
    "aten.var_mean.correction", "aten.any.dim", "aten.any.dims", "aten.any.default",
    "aten.all.dim", "aten.all.default",
})
_MATMULS = frozenset({"aten.mm.default", "aten.bmm.default", "aten.addmm.default",
                      "aten.baddbmm.default"})
_SCANS = frozenset({"aten.cumsum.default", "aten.cumprod.default"})
_POOLS = frozenset({
    "aten.max_pool1d.default", "aten.max_pool2d.default", "aten.max_pool3d.default",
    "aten.max_pool2d_with_indices.default", "aten.max_pool3d_with_indices.default",
    "aten.avg_pool1d.default", "aten.avg_pool2d.default", "aten.avg_pool3d.default",
})
_SYM_OPS = {operator.mul: "*", operator.add: "+", operator.sub: "-",
            operator.floordiv: "//", operator.mod: "%"}
_FAMILY = {
    "conv": "convolution", "pool": "pooling", "gather": "indexing", "scatter": "indexing",
    "index": "indexing", "cat": "concatenation", "flip": "layout", "sort": "sorting",
    "topk": "sorting",
}


def _family(op: str) -> str:
    name = op.split(".")[1] if op.count(".") >= 1 else op
    return next((fam for key, fam in _FAMILY.items() if key in name), "other")


def _refuse(op: str, why: str = "") -> LoweringError:
    return LoweringError(op, f"built-in coder cannot lower {op} ({why or _family(op) + ' operators have no schedule here'}); "
                         "use the LLM coder")


@dataclass
class _Value:
    """What one graph node is in the generated code.

    kind: ``tensor`` (a forward expression: input, parameter, view or kernel output),
    ``pointwise`` (an element-wise node, computed inside the kernels that consume it),
    ``matmul`` (a matmul not launched yet: the element-wise chain consuming it may
    become its epilogue), ``sym`` (a Python int expression), ``const`` (a number),
    ``tuple`` (``items``).
    """

    kind: str
    expr: str = ""
    items: list[Any] = field(default_factory=list)


@dataclass
class _PendingMatmul:
    """A matmul whose operands exist in forward but whose kernel is not written yet.

    a, b, bias: forward expressions (bias None for mm/bmm); out_shape: a forward
    expression of the product's shape; alpha/beta: addmm's scalars.
    """

    op: str
    a: str
    b: str
    bias: str | None
    out_shape: str
    batched: bool
    alpha: float
    beta: float


@dataclass
class _Kernel:
    """One emitted ``@triton.jit`` function, its ATen ops and its launch line."""

    name: str
    source: str
    ops: list[str]


class _Lowerer:
    """Walks the core-ATen graph and writes kernels and the forward that launches them."""

    def __init__(self, ep: torch.export.ExportedProgram, task: _Task, params: dict[str, int]):
        self.ep = ep
        self.task = task
        self.p = params
        self.values: dict[torch.fx.Node, _Value] = {}
        self.forward: list[str] = []
        self.kernels: list[_Kernel] = []
        self.counter = itertools.count()
        self.shape_vars: dict[torch.fx.Node, str] = {}
        self.device = ""
        self.symbols: dict[str, str] = {}
        self.scalars: list[tuple[str, str]] = []  # (kernel parameter, forward expression)
        self.specialized: dict[int, str] = {}
        self.pending: dict[torch.fx.Node, _PendingMatmul] = {}
        self.needed: set[torch.fx.Node] = set()
        self.sizes = False  # while rendering a size list: ints may be specialized extents

    # ---- helpers -------------------------------------------------------------------

    def fresh(self, prefix: str) -> str:
        return f"{prefix}{next(self.counter)}"

    def sym(self, value: Any) -> str:
        """A Python expression for an int, SymInt or sym node argument."""
        if isinstance(value, torch.fx.Node):
            v = self.values[value]
            if v.kind not in ("sym", "const"):
                raise LoweringError("shape", f"a size argument {value.name} is a tensor")
            return v.expr
        if isinstance(value, torch.SymInt):
            return self.sympy(value.node.expr)
        if isinstance(value, bool | int):
            if self.sizes and not isinstance(value, bool) and value in self.specialized:
                return self.specialized[value]
            return str(int(value))
        if isinstance(value, list | tuple):
            return "(" + ", ".join(self.sym(v) for v in value) + ("," if len(value) == 1 else "") + ")"
        raise LoweringError("shape", f"unsupported size argument {value!r}")

    def size_list(self, sizes: Any) -> str:
        """A tuple expression for a view/expand size list, extents read at run time."""
        self.sizes = True
        try:
            return self.sym(list(sizes))
        finally:
            self.sizes = False

    def reshape_sizes(self, sizes: Any) -> str:
        """A view's size tuple read at run time; a fixed extent that no input extent or
        init argument explains (GroupNorm's channels per group, C // G, fixed because
        the weight fixes C) becomes -1, so reshape infers it at another size. The largest
        such extent is chosen; the others stay as they are."""
        sizes = list(sizes)
        init_ints = {v for v in self.task.init_inputs if type(v) is int}
        loose = [k for k, v in enumerate(sizes) if type(v) is int and v > 1
                 and v not in self.specialized and v not in init_ints]
        if not loose or any(type(v) is int and v == -1 for v in sizes):
            return self.size_list(sizes)
        pick = max(loose, key=lambda k: sizes[k])
        return self.size_list(sizes[:pick] + [-1] + sizes[pick + 1:])

    def sympy(self, expr: Any) -> str:
        import sympy

        if isinstance(expr, sympy.Integer):
            if self.sizes and int(expr) in self.specialized:
                return self.specialized[int(expr)]
            return str(int(expr))
        if isinstance(expr, sympy.Symbol):
            if expr.name not in self.symbols:
                raise LoweringError("shape", f"size symbol {expr.name} is not an input extent")
            return self.symbols[expr.name]
        if isinstance(expr, sympy.Add):
            return "(" + " + ".join(self.sympy(a) for a in expr.args) + ")"
        if isinstance(expr, sympy.Mul):
            return "(" + " * ".join(self.sympy(a) for a in expr.args) + ")"
        name = type(expr).__name__
        if name == "FloorDiv":
            return f"({self.sympy(expr.args[0])} // {self.sympy(expr.args[1])})"
        if name in ("Mod", "PythonMod"):
            return f"({self.sympy(expr.args[0])} % {self.sympy(expr.args[1])})"
        if name in ("Max", "Min"):
            return f"{name.lower()}({', '.join(self.sympy(a) for a in expr.args)})"
        raise LoweringError("shape", f"cannot express the size {expr} in Python")

    def shape_of(self, node: torch.fx.Node) -> str:
        """A forward expression for ``node``'s runtime shape (a tuple of ints)."""
        v = self.values[node]
        if v.kind == "tensor":
            return f"{v.expr}.shape"
        if v.kind == "matmul":
            return self.pending[node].out_shape
        if node in self.shape_vars:
            return self.shape_vars[node]
        leaves, shape_only = self.leaves(node)
        shapes = [f"{self.values[leaf].expr}.shape" for leaf in leaves]
        shapes += [self.size_list(s) for s in shape_only]
        var = self.fresh("shape")
        rank = len(_val(node).shape)
        self.forward.append(f"{var} = _broadcast_shape({rank}, {', '.join(shapes)})")
        self.shape_vars[node] = var
        return var

    def leaves(self, node: torch.fx.Node, keep: torch.fx.Node | None = None
               ) -> tuple[list[torch.fx.Node], list[Any]]:
        """Tensor values a pointwise chain loads, and constant-node shapes it spans.

        A matmul not launched yet is launched here (the chain reads its product from
        memory), except ``keep``: the matmul whose epilogue the chain becomes.
        """
        order: list[torch.fx.Node] = []
        shape_only: list[Any] = []
        seen: set[torch.fx.Node] = set()

        def visit(n: torch.fx.Node) -> None:
            if n in seen:
                return
            seen.add(n)
            v = self.values[n]
            if v.kind == "matmul" and n is not keep:
                self.emit_matmul(n)
                v = self.values[n]
            if v.kind in ("tensor", "matmul"):
                order.append(n)
                return
            if v.kind != "pointwise":
                return
            op = str(n.target)
            if op in _CONSTANTS:
                raw = _bind(n)
                if "size" in raw:
                    shape_only.append(raw["size"])
                elif isinstance(raw.get("self"), torch.fx.Node):
                    order_len = len(order)
                    visit(raw["self"])  # full_like: only its shape matters
                    del order_len
                return
            for arg in n.all_input_nodes:
                visit(arg)

        visit(node)
        return order, shape_only

    def kernel_chain(self, node: torch.fx.Node, load: dict[torch.fx.Node, str], tile: str,
                     body: list[str], ops: list[str], params: list[str],
                     launch: list[str]) -> str:
        """:meth:`chain` for one kernel: the scalars it needs (sizes and numbers known
        only at run time) are appended to the kernel's ``params`` and the forward's
        ``launch`` arguments; returns the variable holding ``node``."""
        self.scalars = []
        result = self.chain(node, load, tile, body, ops, {})
        params += [name for name, _ in self.scalars]
        launch += [expr for _, expr in self.scalars]
        return result

    def chain(self, node: torch.fx.Node, load: dict[torch.fx.Node, str], tile: str,
              body: list[str], ops: list[str], memo: dict[torch.fx.Node, str]) -> str:
        """Kernel lines computing ``node`` from loaded leaves; returns its variable."""
        if node in memo:
            return memo[node]
        if node in load:
            return load[node]
        if self.values[node].kind in ("sym", "const"):
            # a size or number known only at run time: a scalar kernel argument, named
            # after the forward argument it comes from when it is one (f_/i_/b_: float,
            # int, bool), else c<k>
            name = f"c{len(self.scalars)}"
            val = _val(node)
            if node.op == "placeholder" and isinstance(val, torch.Tensor):
                prefix = ("b" if val.dtype == torch.bool else
                          "f" if val.dtype.is_floating_point else "i")
                name = f"{prefix}_{self.values[node].expr}"
            self.scalars.append((name, self.values[node].expr))
            memo[node] = name
            return memo[node]
        op = str(node.target)
        val = _val(node)
        raw = _bind(node)
        exprs: dict[torch.fx.Node, str] = {}
        for arg in node.all_input_nodes:
            if op in _CONSTANTS:
                continue
            exprs[arg] = self.chain(arg, load, tile, body, ops, memo)
        if op in _CONSTANTS:
            expr = _constant(_Call(op, {}, raw), val.dtype)
        else:
            rule = _RULES[op]
            expr = rule.emit(_Call(op, _operand_exprs(raw, exprs, rule), raw))
        expr = expr.replace("__TILE__", tile)
        var = f"v_{node.name}"
        body.append(f"{var} = {expr}  # {op}")
        ops.append(op)
        memo[node] = var
        return var

    # ---- node handlers -------------------------------------------------------------

    def run(self) -> str:
        sig = self.ep.graph_signature
        if sig.user_inputs_to_mutate:
            raise LoweringError("inputs", "the task's Model mutates its input in place; the "
                                "built-in coder cannot lower that; use the LLM coder")
        kinds = {spec.arg.name: spec for spec in sig.input_specs}
        user_specs = [spec for spec in sig.input_specs
                      if spec.kind == torch.export.graph_signature.InputKind.USER_INPUT]
        user_pos = {spec.arg.name: i for i, spec in enumerate(user_specs)}
        graph = self.ep.graph
        output = next(n for n in graph.nodes if n.op == "output")
        # Buffer updates (batch norm's running statistics) are not outputs of forward;
        # ModelNew computes the user outputs only.
        user_outputs = [n for n, spec in zip(output.args[0], sig.output_specs, strict=True)
                        if spec.kind == torch.export.graph_signature.OutputKind.USER_OUTPUT]
        needed = self.needed
        for out in user_outputs:
            if isinstance(out, torch.fx.Node):
                needed |= _reachable(out) | {out}
        # symbols of input extents
        for node in graph.nodes:
            if node.op == "placeholder" and node.name in user_pos:
                val = _val(node)
                if isinstance(val, torch.Tensor):
                    name = self.task.arg_names[user_pos[node.name]]
                    if not self.device:
                        self.device = f"{name}.device"
                    for d, size in enumerate(val.shape):
                        if isinstance(size, torch.SymInt) and not size.node.expr.is_number:
                            key = str(size.node.expr)
                            self.symbols.setdefault(key, f"{name}.shape[{d}]")
                        elif int(size) > 1:
                            # An extent torch.export fixed because a parameter has it
                            # (LayerNorm's normalized_shape): read it at run time too, so
                            # the model built at another size still fits.
                            self.specialized.setdefault(int(size), f"{name}.shape[{d}]")
        for node in graph.nodes:
            if node.op == "placeholder":
                self.placeholder(node, kinds[node.name], user_pos)
            elif node.op == "output" or node not in needed:
                continue
            elif node.op == "call_function":
                self.call(node)
            else:
                raise _refuse(str(node.target), "graph node " + node.op)
        if not self.device:
            self.device = "self._device_hint"
            raise LoweringError("inputs", "the task has no tensor input; the built-in coder "
                                "needs one to place its outputs")
        results = []
        for out in user_outputs:
            if not isinstance(out, torch.fx.Node):
                raise LoweringError("outputs", "the task's Model returns a constant")
            results.append(self.materialize(out))
        spec = self.ep.call_spec.out_spec
        single = spec is None or spec.is_leaf() or (len(results) == 1 and spec.num_leaves == 1
                                                    and spec.type is None)
        if single and len(results) == 1:
            self.forward.append(f"return {results[0]}")
        else:
            if spec.type not in (tuple, list):
                raise LoweringError("outputs", "the task's Model returns a "
                                    f"{spec.type}; the built-in coder returns tensors or "
                                    "tuples of tensors; use the LLM coder")
            self.forward.append(f"return {', '.join(results)}" + ("," if len(results) == 1 else ""))
        return self.render()

    def placeholder(self, node: torch.fx.Node, spec: Any, user_pos: dict[str, int]) -> None:
        kind = spec.kind
        InputKind = torch.export.graph_signature.InputKind
        val = _val(node)
        if kind == InputKind.USER_INPUT:
            name = self.task.arg_names[user_pos[node.name]]
            if isinstance(val, torch.Tensor) and not isinstance(
                    self.task.inputs[user_pos[node.name]], torch.Tensor):
                # a number traced as a 0-d tensor: a scalar kernel argument
                self.values[node] = _Value("const", name)
            elif isinstance(val, torch.Tensor):
                _check_dtype(val.dtype, f"input `{name}`")
                self.values[node] = _Value("tensor", name)
            elif isinstance(val, torch.SymInt | torch.SymFloat):
                self.values[node] = _Value("sym", name)
            else:
                self.values[node] = _Value("const", name)
        elif kind in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
            if kind == InputKind.CONSTANT_TENSOR:
                raise LoweringError("inputs", f"the task's Model holds a constant tensor "
                                    f"({spec.target}); use the LLM coder")
            self.values[node] = _Value("tensor", "self." + spec.target)
        else:
            raise LoweringError("inputs", f"the task's Model takes a {kind.name.lower()} "
                                "input; use the LLM coder")

    def call(self, node: torch.fx.Node) -> None:
        target = node.target
        if target is operator.getitem:
            src, index = node.args
            self.values[node] = self.values[src].items[index]
            return
        if target in _SYM_OPS:
            self.sizes = True  # size arithmetic: fixed extents are read at run time too
            try:
                a, b = (self.sym(x) if not isinstance(x, torch.fx.Node) else self.values[x].expr
                        for x in node.args)
            finally:
                self.sizes = False
            self.values[node] = _Value("sym", f"({a} {_SYM_OPS[target]} {b})")
            return
        if not isinstance(target, torch._ops.OpOverload):
            raise _refuse(str(target), "not an ATen operator")
        op = str(target)
        if op == "aten.sym_size.int":
            src, dim = node.args
            self.values[node] = _Value("sym", f"{self.shape_of(src)}[{dim}]")
            return
        if op in ("aten._assert_tensor_metadata.default", "aten._assert_scalar.default",
                  "aten.sym_constrain_range_for_size.default"):
            return
        val = _val(node)
        vals = val if isinstance(val, tuple | list) else [val]
        for v in vals:
            if isinstance(v, torch.Tensor) and v.dtype not in _TL_DTYPES and v.dtype != torch.int64:
                _check_dtype(v.dtype, f"{op}'s result")
        # alias (detach) keeps the shape: a pass-through inside the chain, so a chain
        # through it stays one kernel and no output aliases an input.
        if op in _RULES and (op not in _RESHAPES or op == "aten.alias.default") or op in _CONSTANTS:
            for arg in node.all_input_nodes:
                if (self.values[arg].kind == "tensor"
                        and _val(arg).dtype not in (*_TL_DTYPES, torch.int64)):
                    _check_dtype(_val(arg).dtype, f"{op}'s operand")
            self.values[node] = _Value("pointwise")
        elif op in _VIEW_OPS or op in _RESHAPES:
            self.view(node, op)
        elif op == "aten.arange.start_step" or op == "aten.arange.default" or op == "aten.arange.start":
            raw = _bind(node)
            args = [self.sym(raw.get(k)) if isinstance(raw.get(k), torch.fx.Node) else repr(raw.get(k))
                    for k in ("start", "end", "step") if k in raw]
            var = self.fresh("buf")
            self.forward.append(f"{var} = torch.arange({', '.join(args)}, device={self.device})")
            self.values[node] = _Value("tensor", var)
        elif op in _REDUCTIONS:
            self.reduction(node, op)
        elif op in _MATMULS:
            self.matmul(node, op)
        elif op in _SCANS:
            self.scan(node, op)
        elif op in _POOLS:
            self.pool(node, op)
        elif op == "aten.flip.default":
            self.flip(node, op)
        else:
            raise _refuse(op)

    def materialize(self, node: torch.fx.Node) -> str:
        """A forward tensor holding ``node``'s value (a pointwise kernel if needed)."""
        v = self.values[node]
        if v.kind == "matmul":
            self.emit_matmul(node)
            v = self.values[node]
        if v.kind == "tensor":
            return v.expr
        if v.kind != "pointwise":
            raise LoweringError("outputs", f"{node.name} is not a tensor")
        self.pointwise(node)
        return self.values[node].expr

    def view(self, node: torch.fx.Node, op: str) -> None:
        raw = _bind(node)
        src = self.materialize(raw["self"])
        name = op.split(".")[1]
        if name in ("view", "_unsafe_view", "reshape"):
            expr = f"{src}.reshape({self.reshape_sizes(raw.get('size', raw.get('shape')))})"
        elif name == "alias":
            expr = src
        elif name == "squeeze":
            dims = raw.get("dim", raw.get("dims"))
            expr = f"{src}.squeeze()" if dims is None else (
                f"{src}.squeeze({self.sym(dims)})")
        elif name == "unsqueeze":
            expr = f"{src}.unsqueeze({raw['dim']})"
        elif name == "permute":
            expr = f"{src}.permute({self.sym(list(raw['dims']))})"
        elif name == "expand":
            expr = f"{src}.expand({self.size_list(raw['size'])})"
        elif name == "t":
            expr = f"{src}.t()"
        elif name == "transpose":
            expr = f"{src}.transpose({raw['dim0']}, {raw['dim1']})"
        elif name == "select":
            expr = f"{src}.select({raw['dim']}, {self.sym(raw['index'])})"
        elif name == "slice":
            dim = raw.get("dim", 0)
            start = raw.get("start")
            end = raw.get("end")
            step = raw.get("step", 1)
            part = (f"{'' if start is None else self.sym(start)}:"
                    f"{'' if end is None or end == sys.maxsize else self.sym(end)}:{self.sym(step)}")
            expr = f"{src}[{':, ' * dim}{part}]"
        else:
            raise _refuse(op)
        var = self.fresh("view")
        self.forward.append(f"{var} = {expr}  # {op}")
        self.values[node] = _Value("tensor", var)

    def alloc(self, shape: str, dtype: torch.dtype) -> str:
        var = self.fresh("buf")
        self.forward.append(f"{var} = torch.empty({shape}, dtype={_TORCH_DTYPE_NAME(dtype)}, "
                            f"device={self.device})")
        return var

    # ---- pointwise -----------------------------------------------------------------

    def pointwise(self, node: torch.fx.Node) -> None:
        """Schedule ``pointwise``: one program per BLOCK_SIZE output elements; each
        operand is loaded through its strides broadcast to the output's shape, or, when
        forward finds every operand dense in the output's shape (``FLAT``), at the
        output's own flat offsets.

        A chain over a matmul's product becomes that matmul's epilogue instead
        (:meth:`epilogue_of`)."""
        product = self.epilogue_of(node)
        if product is not None:
            self.emit_matmul(product, node)
            return
        val = _val(node)
        rank = len(val.shape)
        leaves, _ = self.leaves(node)
        loaded = [leaf for leaf in leaves if self._used_by_value(node, leaf)]
        shape = self.shape_of(node)
        out = self.alloc(shape, val.dtype)
        name = self.fresh("pointwise_kernel_")
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
            expr = self.values[leaf].expr
            launch += [expr, f"*_strides({expr}, {shape})"] if rank else [expr]
            offset = " + ".join(f"i{d} * s{k}_{d}" for d in range(rank)) or "offsets * 0"
            strided.append(f"v_in{k} = {_computed(leaf, f'tl.load(in{k}_ptr + {offset}, mask=mask)')}")
            flat_loads.append(f"v_in{k} = {_computed(leaf, f'tl.load(in{k}_ptr + offsets, mask=mask)')}")
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
        result = self.kernel_chain(node, load, "[BLOCK_SIZE]", body, ops, params, launch)
        store = self._cast_out(result, val.dtype, "[BLOCK_SIZE]")
        kernel_params = [*params, "out_ptr", "n_elements", *dims, "BLOCK_SIZE: tl.constexpr",
                         *(["FLAT: tl.constexpr"] if flat else [])]
        lines += [*body,
                  f"tl.store(out_ptr + offsets, ({store}).to(out_ptr.dtype.element_ty), mask=mask)"]
        doc = (f"Element-wise: {' -> '.join(dict.fromkeys(ops)) or 'copy'}.\n\n"
               "out is contiguous; input k is read through strides s{k}_* (0 along broadcast dims)"
               + (",\nor at out's offsets when FLAT." if flat else "."))
        self.add_kernel(name, kernel_params, doc, lines, ops)
        dims_launch = [f"{shape}[{d}]" for d in range(rank)]
        inputs = ", ".join(self.values[leaf].expr for leaf in loaded)
        self.launch_blocks(name, out, [*launch, out, "n", *dims_launch],
                           [f"FLAT=_flat({shape}, {inputs})"] if flat else [])
        self.values[node] = _Value("tensor", out)

    def launch_blocks(self, kname: str, out: str, args: list[str],
                      constexprs: list[str] | None = None) -> None:
        """Emit ``kname``'s launch with one program per BLOCK_SIZE elements of ``out``
        (skipped when ``out`` is empty; ``n`` is its element count); ``args`` are the
        kernel's run-time arguments, ``constexprs`` further ``NAME=expr`` ones."""
        block = self.p["block_size"]
        self.forward += [
            f"n = {out}.numel()",
            "if n > 0:",
            f"    {kname}[(triton.cdiv(n, {block}),)](",
            f"        {', '.join(args)},",
            *(f"        {c}," for c in constexprs or []),
            f"        BLOCK_SIZE={block}, num_warps={self.p['num_warps']}, "
            f"num_stages={self.p['num_stages']})",
        ]

    def _used_by_value(self, node: torch.fx.Node, leaf: torch.fx.Node) -> bool:
        """Whether the chain reads ``leaf``'s values (full_like reads only its shape)."""
        stack, seen = [node], set()
        while stack:
            n = stack.pop()
            if n in seen or self.values[n].kind in ("tensor", "matmul"):
                continue
            seen.add(n)
            if str(n.target) in _CONSTANTS:
                continue
            for arg in n.all_input_nodes:
                if arg is leaf:
                    return True
                stack.append(arg)
        return False

    @staticmethod
    def _cast_out(result: str, dtype: torch.dtype, tile: str) -> str:
        if dtype == torch.bool:
            return f"({result}) != 0"
        if dtype == torch.bfloat16:
            return f"_round_to_bf16({result})"
        return result

    def add_kernel(self, name: str, params: list[str], doc: str, lines: list[str],
                   ops: list[str]) -> None:
        docstring = '"""' + doc.replace("\n", "\n    ") + '\n    """' if "\n" in doc else f'"""{doc}"""'
        source = (f"@triton.jit\ndef {name}({', '.join(params)}):\n    {docstring}\n"
                  + textwrap.indent("\n".join(lines), "    "))
        self.kernels.append(_Kernel(name, source, ops))

    # ---- row reductions ------------------------------------------------------------

    def _row_loads(self, src: torch.fx.Node, views: list[tuple[torch.fx.Node, str]]
                   ) -> tuple[list[str], list[str], list[str], str, list[str], list[str]]:
        """Loads of the leaves ``views`` as ``[BLOCK_R, BLOCK_I]`` tiles of the
        ``(outer, R, inner)`` layout, and the element-wise chain computing ``src`` from
        them: kernel params, launch args, load lines, the chain's expression, its body
        lines and the ATen ops it covers."""
        load: dict[torch.fx.Node, str] = {}
        params, launch, loads = [], [], []
        for k, (leaf, var) in enumerate(views):
            params += [f"in{k}_ptr", f"in{k}_so", f"in{k}_sr", f"in{k}_si"]
            launch += [var, f"*{var}.stride()"]
            ld = (f"tl.load(in{k}_ptr + o * in{k}_so + r[:, None] * in{k}_sr "
                  f"+ i[None, :] * in{k}_si, mask=mask, other=0)")
            loads.append(f"v_in{k} = {_computed(leaf, ld)}")
            load[leaf] = f"v_in{k}"
        body: list[str] = []
        ops: list[str] = []
        x = self.kernel_chain(src, load, "[BLOCK_R, BLOCK_I]", body, ops, params, launch)
        return params, launch, loads, x, body, ops

    def _rows(self, node: torch.fx.Node, dims: list[int]) -> tuple[str, list[str], list[tuple[torch.fx.Node, str]]]:
        """Forward lines viewing each leaf of ``node`` as (outer, R, inner) with the reduced
        ``dims`` in the middle; returns the (outer, R, inner) sizes variable and views."""
        val = _val(node)
        rank = len(val.shape)
        dims = sorted({d % rank for d in dims}) if rank else []
        shape = self.shape_of(node)
        contiguous = dims == list(range(dims[0], dims[-1] + 1)) if dims else True
        if contiguous:
            perm = None
            a, b = (dims[0], dims[-1] + 1) if dims else (0, 0)
            outer = _prod([f"{shape}[{d}]" for d in range(a)])
            red = _prod([f"{shape}[{d}]" for d in range(a, b)])
            inner = _prod([f"{shape}[{d}]" for d in range(b, rank)])
        else:
            keep = [d for d in range(rank) if d not in dims]
            perm = keep + dims
            outer = _prod([f"{shape}[{d}]" for d in keep])
            red = _prod([f"{shape}[{d}]" for d in dims])
            inner = "1"
        sizes = self.fresh("rows")
        self.forward.append(f"{sizes} = ({outer}, {red}, {inner})")
        leaves, _ = self.leaves(node)
        views = []
        for leaf in leaves:
            if not self._used_by_value(node, leaf) and self.values[node].kind != "tensor":
                continue
            expr = f"{self.values[leaf].expr}.expand({shape})"
            if perm:
                expr += f".permute({perm})"
            var = self.fresh("rows_view")
            self.forward.append(f"{var} = {expr}.reshape({sizes})")
            views.append((leaf, var))
        return sizes, dims, views

    def reduction(self, node: torch.fx.Node, op: str) -> None:
        """Schedule ``row reduction``: the input seen as (outer, R, inner); one program
        per outer row and BLOCK_I inner columns loops over R in BLOCK_R chunks."""
        raw = _bind(node)
        src = raw["self"]
        sval = _val(src)
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
        sizes, dims, views = self._rows(src, dims)
        if self.values[src].kind == "tensor" and not views:
            views = []
        out_vals = _val(node)
        out_vals = list(out_vals) if isinstance(out_vals, tuple | list) else [out_vals]
        src_shape = self.shape_of(src)
        kept = [(f"{src_shape}[{d}]" if d not in dims else "1") for d in range(rank)
                if keepdim or d not in dims]
        out_shape = "(" + "".join(f"{k}, " for k in kept) + ")"
        outs = [self.alloc(out_shape, v.dtype) for v in out_vals]
        # leaves loaded as tiles [BLOCK_R, BLOCK_I]
        params, launch, loads, x, body, ops = self._row_loads(src, views)
        if sval.dtype == torch.bool:
            x = f"({x}).to(tl.float32)"
        loop_head = ["for r0 in range(0, R, BLOCK_R):",
                     "    r = r0 + tl.arange(0, BLOCK_R)",
                     "    mask = (r[:, None] < R) & i_mask[None, :]"]
        loop_body = [*loads, *body]
        kind = {"sum": "sum", "mean": "sum", "amax": "max", "amin": "min", "max": "max",
                "min": "min", "argmax": "argmax", "argmin": "argmin", "prod": "prod",
                "var": "var", "var_mean": "var", "any": "max", "all": "min"}[name]
        lines = ["o = tl.program_id(0).to(tl.int64)",
                 "i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)",
                 "i_mask = i < INNER"]
        ident = {"sum": "0.0", "prod": "1.0", "max": '-float("inf")', "min": 'float("inf")',
                 "argmax": '-float("inf")', "argmin": 'float("inf")', "var": "0.0"}[kind]
        results: list[str] = []
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
            if name in ("max", "min") and len(outs) == 2:
                kind = "arg" + name  # values and indices: add the index pass below
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
            if name in ("max", "min"):
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
            stores.append(f"tl.store(out{k}_ptr + o * INNER + i, "
                          f"({self._cast_out(res, v.dtype, '')}).to(out{k}_ptr.dtype.element_ty), mask=i_mask)")
        lines += stores
        kname = self.fresh("reduce_kernel_")
        kparams = [*params, *(f"out{k}_ptr" for k in range(len(outs))), "R", "INNER",
                   "BLOCK_R: tl.constexpr", "BLOCK_I: tl.constexpr"]
        doc = (f"Row reduction: {' -> '.join(dict.fromkeys([*ops, op]))}.\n\n"
               "Input k is read as [outer, R, inner] through strides in{k}_so/sr/si; "
               "out[o, i] reduces over r.")
        self.add_kernel(kname, kparams, doc, lines, [*ops, op])
        block_r, block_i = self._row_tiles(src, dims)
        self.forward += [
            f"if {sizes}[0] * {sizes}[2] > 0:",
            f"    {kname}[({sizes}[0], triton.cdiv({sizes}[2], {block_i}))](",
            f"        {', '.join([*launch, *outs, f'{sizes}[1]', f'{sizes}[2]'])},",
            f"        BLOCK_R={block_r}, BLOCK_I={block_i}, num_warps={self.p['num_warps']}, "
            f"num_stages={self.p['num_stages']})",
        ]
        if len(outs) == 1 and not isinstance(_val(node), tuple | list):
            self.values[node] = _Value("tensor", outs[0])
        else:
            self.values[node] = _Value("tuple", items=[_Value("tensor", o) for o in outs])

    def _row_tiles(self, src: torch.fx.Node, dims: list[int]) -> tuple[int, int]:
        """(BLOCK_R, BLOCK_I) from block_size: all of it along R for last-dim rows."""
        shape = [int(s) if not isinstance(s, torch.SymInt) else int(s.node.hint or 64)
                 for s in _val(src).shape]
        inner = math.prod(shape[dims[-1] + 1:]) if dims and dims == list(
            range(dims[0], dims[-1] + 1)) else 1
        block = self.p["block_size"]
        block_i = 1 if inner == 1 else min(32, triton_next_pow2(inner), block)
        return max(1, block // block_i), block_i

    # ---- matmul --------------------------------------------------------------------

    def matmul(self, node: torch.fx.Node, op: str) -> None:
        """Schedule ``matmul`` (mm, bmm, addmm, baddbmm): operands are materialized now;
        the kernel is written when the product is first read (:meth:`emit_matmul`), so
        an element-wise chain consuming it can become its epilogue."""
        raw = _bind(node)
        name = op.split(".")[1]
        a = self.materialize(raw["mat1" if name == "addmm" else ("self" if name in ("mm", "bmm") else "batch1")])
        b = self.materialize(raw["mat2" if name in ("addmm", "mm", "bmm") else "batch2"])
        batched = name in ("bmm", "baddbmm")
        if batched:
            out_shape = f"({a}.shape[0], {a}.shape[1], {b}.shape[2])"
        else:
            out_shape = f"({a}.shape[0], {b}.shape[1])"
        bias = self.materialize(raw["self"]) if name in ("addmm", "baddbmm") else None
        self.pending[node] = _PendingMatmul(op, a, b, bias, out_shape, batched,
                                            float(raw.get("alpha", 1)), float(raw.get("beta", 1)))
        self.values[node] = _Value("matmul")

    def epilogue_of(self, node: torch.fx.Node) -> torch.fx.Node | None:
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
            kind = self.values[n].kind
            if kind == "matmul":
                if n not in products:
                    products.append(n)
                continue
            if kind != "pointwise":
                continue
            chain.add(n)
            if str(n.target) not in _CONSTANTS:
                stack.extend(n.all_input_nodes)
        shape = [str(s) for s in _val(node).shape]
        for product in products:
            if [str(s) for s in _val(product).shape] != shape:
                continue
            inside = chain | {product}
            if all(user in chain or (user not in self.needed and user.op != "output")
                   for n in inside - {node} for user in n.users):
                return product
        return None

    def emit_matmul(self, node: torch.fx.Node, epilogue: torch.fx.Node | None = None) -> None:
        """Write and launch a pending matmul: BLOCK_M x BLOCK_N output tiles, tl.dot over
        BLOCK_K slices of K, float32 accumulation, then in registers: alpha, the bias
        (addmm/baddbmm) and the element-wise chain ``epilogue`` (activation, scaling,
        residual add, clamp, ...), whose other operands are loaded as tiles broadcast
        to the product's shape. With an epilogue, its value is stored, not the product.
        """
        pm = self.pending.pop(node)
        op, a, b, batched, out_shape = pm.op, pm.a, pm.b, pm.batched, pm.out_shape
        root = epilogue if epilogue is not None else node
        dtype = _val(root).dtype
        out = self.alloc(out_shape, dtype)
        av, bv, cv = (f"{t}.unsqueeze(0)" if not batched else t for t in (a, b, out))
        lines = ["pid_m = tl.program_id(0)", "pid_n = tl.program_id(1)",
                 "batch = tl.program_id(2).to(tl.int64)",
                 "rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)",
                 "rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)",
                 "acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)",
                 "for k0 in range(0, K, BLOCK_K):",
                 "    rk = k0 + tl.arange(0, BLOCK_K)",
                 "    a = tl.load(a_ptr + batch * sab + rm[:, None] * sam + rk[None, :] * sak,",
                 "                mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)",
                 "    b = tl.load(b_ptr + batch * sbb + rk[:, None] * sbk + rn[None, :] * sbn,",
                 "                mask=(rk[:, None] < K) & (rn[None, :] < N), other=0.0)",
                 f"    acc += tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=\"{self.p['precision']}\")",
                 "mask = (rm[:, None] < M) & (rn[None, :] < N)"]
        params = ["a_ptr", "b_ptr", "c_ptr", "M", "N", "K", "sab", "sam", "sak", "sbb", "sbk",
                  "sbn", "scb", "scm", "scn"]
        launch = [a, b, out, f"{out}.shape[-2]", f"{out}.shape[-1]", f"{a}.shape[-1]",
                  f"*{av}.stride()", f"*{bv}.stride()", f"*{cv}.stride()"]
        ops = [op]
        if pm.alpha != 1.0:
            lines.append(f"acc = acc * {_literal(pm.alpha)}")
        if pm.bias is not None:
            bias_view = f"{pm.bias}.expand({out_shape})" + ("" if batched else ".unsqueeze(0)")
            params += ["bias_ptr", "sxb", "sxm", "sxn"]
            launch += [pm.bias, f"*{bias_view}.stride()"]
            lines += ["bias = tl.load(bias_ptr + batch * sxb + rm[:, None] * sxm + rn[None, :] * sxn,",
                      "               mask=mask, other=0.0).to(tl.float32)",
                      f"acc = acc + bias * {_literal(pm.beta)}" if pm.beta != 1.0 else "acc = acc + bias"]
        result = "acc"
        if epilogue is not None:
            product_dtype = _val(node).dtype
            if product_dtype == torch.float16:  # the chain reads the product as torch stores it
                lines.append("acc = acc.to(tl.float16).to(tl.float32)")
            elif product_dtype == torch.bfloat16:
                lines.append("acc = _round_to_bf16(acc)")
            leaves, _ = self.leaves(epilogue, keep=node)
            load: dict[torch.fx.Node, str] = {node: "acc"}
            for k, leaf in enumerate(leaf for leaf in leaves
                                     if leaf is not node and self._used_by_value(epilogue, leaf)):
                expr = self.values[leaf].expr
                params += [f"e{k}_ptr", f"e{k}_sb", f"e{k}_sm", f"e{k}_sn"]
                launch += [expr, f"*_strides({expr}, {out_shape})" if batched
                           else f"0, *_strides({expr}, {out_shape})"]
                ld = (f"tl.load(e{k}_ptr + batch * e{k}_sb + rm[:, None] * e{k}_sm "
                      f"+ rn[None, :] * e{k}_sn, mask=mask, other=0)")
                lines.append(f"v_e{k} = {_computed(leaf, ld)}")
                load[leaf] = f"v_e{k}"
            body: list[str] = []
            result = self.kernel_chain(epilogue, load, "[BLOCK_M, BLOCK_N]", body, ops,
                                       params, launch)
            lines += body
            result = self._cast_out(result, dtype, "")
        lines.append("tl.store(c_ptr + batch * scb + rm[:, None] * scm + rn[None, :] * scn, "
                     f"({result}).to(c_ptr.dtype.element_ty), mask=mask)")
        kname = self.fresh("matmul_kernel_")
        what = "c[b, m, n] = sum_k a[b, m, k] * b[b, k, n]" + (" + bias" if pm.bias else "")
        if epilogue is not None:
            what = ("c = epilogue(sum_k a[b, m, k] * b[b, k, n]"
                    + (" + bias" if pm.bias else "") + f"), epilogue: {' -> '.join(dict.fromkeys(ops[1:]))}")
        self.add_kernel(kname, [*params, "BLOCK_M: tl.constexpr", "BLOCK_N: tl.constexpr",
                                "BLOCK_K: tl.constexpr"],
                        f"Matmul: {op}: {what}.\n\nOperands are read through "
                        "their strides, so transposed views cost nothing; masks cover the "
                        "ragged M, N and K edges.", lines, ops)
        bm, bn, bk = self.p["block_m"], self.p["block_n"], self.p["block_k"]
        batch = f"{out}.shape[0]" if batched else "1"
        self.forward += [
            f"if {out}.numel() > 0:",
            f"    {kname}[(triton.cdiv({out}.shape[-2], {bm}), triton.cdiv({out}.shape[-1], {bn}), {batch})](",
            f"        {', '.join(launch)},",
            f"        BLOCK_M={bm}, BLOCK_N={bn}, BLOCK_K={bk}, num_warps={self.p['num_warps']}, "
            f"num_stages={self.p['num_stages']})",
        ]
        self.values[root] = _Value("tensor", out)
        if epilogue is not None:
            self.values[node] = _Value("fused")  # read only by the epilogue, now stored

    # ---- scan ----------------------------------------------------------------------

    def scan(self, node: torch.fx.Node, op: str) -> None:
        """Schedule ``scan``: (outer, R, inner) rows; one program per row and BLOCK_I
        columns walks R in BLOCK_R chunks, carrying the running total."""
        raw = _bind(node)
        src = raw["self"]
        rank = len(_val(src).shape)
        dim = raw["dim"] % rank if rank else 0
        if raw.get("dtype") not in (None, _val(node).dtype):
            raise _refuse(op, "dtype argument")
        sizes, _, views = self._rows(src, [dim] if rank else [])
        out = self.alloc(self.shape_of(src), _val(node).dtype)
        params, launch, loads, x, body, ops = self._row_loads(src, views)
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
        kname = self.fresh("scan_kernel_")
        self.add_kernel(kname, [*params, "out_ptr", "R", "INNER", "BLOCK_R: tl.constexpr",
                                "BLOCK_I: tl.constexpr"],
                        f"Scan: {' -> '.join(dict.fromkeys([*ops, op]))} along R of "
                        "[outer, R, inner] rows; out is contiguous.", lines, [*ops, op])
        block_r, block_i = self._row_tiles(src, [dim] if rank else [])
        self.forward += [
            f"if {out}.numel() > 0:",
            f"    {kname}[({sizes}[0], triton.cdiv({sizes}[2], {block_i}))](",
            f"        {', '.join([*launch, out, f'{sizes}[1]', f'{sizes}[2]'])},",
            f"        BLOCK_R={block_r}, BLOCK_I={block_i}, num_warps={self.p['num_warps']}, "
            f"num_stages={self.p['num_stages']})",
        ]
        self.values[node] = _Value("tensor", out)

    # ---- flip ----------------------------------------------------------------------

    def flip(self, node: torch.fx.Node, op: str) -> None:
        """Schedule ``flip``: a copy whose loads read index ``size - 1 - i`` along the
        flipped dims (torch has no negative strides, so a flip is not a view); one
        program per BLOCK_SIZE output elements, the output contiguous."""
        raw = _bind(node)
        src = self.materialize(raw["self"])
        val = _val(node)
        rank = len(val.shape)
        dims = sorted({d % rank for d in raw["dims"]}) if rank else []
        out = self.alloc(f"{src}.shape", val.dtype)
        lines = ["pid = tl.program_id(0).to(tl.int64)  # int64: more than 2**31 elements fit",
                 "offsets = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)",
                 "mask = offsets < n_elements",
                 "rest = offsets",
                 "src = offsets * 0"]
        for d in reversed(range(rank)):
            lines.append(f"i{d} = rest % size{d}" if d else "i0 = rest")
            if d:
                lines.append(f"rest = rest // size{d}")
            index = f"(size{d} - 1 - i{d})" if d in dims else f"i{d}"
            lines.append(f"src += {index} * s{d}")
        lines.append("tl.store(out_ptr + offsets, tl.load(in_ptr + src, mask=mask), mask=mask)")
        kname = self.fresh("flip_kernel_")
        self.add_kernel(kname, ["in_ptr", *(f"s{d}" for d in range(rank)), "out_ptr",
                                "n_elements", *(f"size{d}" for d in range(rank)),
                                "BLOCK_SIZE: tl.constexpr"],
                        f"Flip: {op} along dims {dims}: out[i] = in[..., size - 1 - i, ...]; "
                        "in is read through its strides.", lines, [op])
        self.launch_blocks(kname, out, [src, f"*{src}.stride()", out, "n", f"*{src}.shape"])
        self.values[node] = _Value("tensor", out)

    # ---- pooling -------------------------------------------------------------------

    def pool(self, node: torch.fx.Node, op: str) -> None:
        """Schedule ``pooling``: max or average over a 1-D/2-D/3-D window.

        One program per BLOCK_SIZE output elements (the input seen as [B, *spatial]);
        each walks the window with a mask on every boundary. Output extents, window
        starts and the average's divisor follow ATen's ``pooling_output_shape`` and
        ``avg_pool2d`` CPU kernel (aten/src/ATen/native/Pool.h, AvgPoolKernel.cpp);
        max pooling takes NaN as the maximum, as ATen does.
        """
        match = re.fullmatch(r"aten\.(max|avg)_pool([123])d(_with_indices)?\.default", op)
        if not match:
            raise _refuse(op)
        kind, n = match.group(1), int(match.group(2))
        raw = _bind(node)
        src = raw["self"]
        sval = _val(src)
        _check_dtype(sval.dtype, f"{op}'s input")
        if sval.dtype == torch.bool:
            raise _refuse(op, "pooling over bool tensors")

        def per_dim(value: Any, default: list[int]) -> list[int]:
            values = list(value) if isinstance(value, list | tuple) else [value]
            if not values:
                values = default
            if len(values) == 1:
                values = values * n
            if len(values) != n or not all(isinstance(v, int) and not isinstance(v, bool)
                                           for v in values):
                raise _refuse(op, f"window arguments {value!r}")
            return [int(v) for v in values]

        kernel = per_dim(raw["kernel_size"], [])
        stride = per_dim(raw.get("stride", []), kernel)
        padding = per_dim(raw.get("padding", 0), [0])
        dilation = per_dim(raw.get("dilation", 1), [1]) if kind == "max" else [1] * n
        ceil_mode = bool(raw.get("ceil_mode", False))
        count_include_pad = bool(raw.get("count_include_pad", True))
        divisor = raw.get("divisor_override")
        if divisor is not None and not isinstance(divisor, int):
            raise _refuse(op, f"divisor_override {divisor!r}")
        indices_used = False
        if match.group(3):
            for user in node.users:
                if user.target is not operator.getitem or user.args[1] != 0:
                    indices_used = True
        x = self.materialize(src)
        rank = len(sval.shape)
        lengths = [f"{x}.shape[{rank - n + d}]" for d in range(n)]
        view = self.fresh("pool_in")
        self.forward.append(f"{view} = {x}.reshape(-1, {', '.join(lengths)})")
        outs = []
        for d in range(n):
            o = self.fresh("pool_len")
            span = 2 * padding[d] - dilation[d] * (kernel[d] - 1) - 1 + (stride[d] - 1 if ceil_mode else 0)
            shift = f" + {span}" if span > 0 else f" - {-span}" if span < 0 else ""
            self.forward.append(f"{o} = ({lengths[d]}{shift}) // {stride[d]} + 1")
            if ceil_mode:
                # ATen drops a last window that would start in the right padding.
                self.forward.append(f"{o} = {o} - 1 if ({o} - 1) * {stride[d]} >= "
                                    f"{lengths[d]} + {padding[d]} else {o}")
            outs.append(o)
        lead = "".join(f"{x}.shape[{d}], " for d in range(rank - n))
        out_shape = f"({lead}{', '.join(outs)})"
        out = self.alloc(out_shape, sval.dtype)
        idx_out = self.alloc(out_shape, torch.int64) if indices_used else None

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
        indent = ""
        for d in range(n):
            lines += [f"{indent}for k{d} in tl.static_range({kernel[d]}):",
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
                lines.append(f"result = acc / {_literal(divisor)}")
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
        store = self._cast_out(result, sval.dtype, "[BLOCK_SIZE]")
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
        kname = self.fresh("pool_kernel_")
        self.add_kernel(kname, params, doc, lines, [op])
        self.launch_blocks(kname, out, launch)
        if match.group(3):
            items = [_Value("tensor", out)]
            if indices_used:
                items.append(_Value("tensor", idx_out))
            self.values[node] = _Value("tuple", items=items)
        else:
            self.values[node] = _Value("tensor", out)

    # ---- rendering -----------------------------------------------------------------

    def render(self) -> str:
        code = "\n".join(k.source for k in self.kernels)
        helpers = _needed_helpers(code)
        all_ops = [op for k in self.kernels for op in k.ops]
        names = self.task.arg_names
        arg_count = len(self.task.inputs)
        shapes = ", ".join(
            f"{n}: {_dtype_name(x.dtype)}{list(x.shape)}" if isinstance(x, torch.Tensor)
            else f"{n}: {type(x).__name__}" for n, x in zip(names, self.task.inputs, strict=False))
        header = [
            "# Generated by the AIKG built-in coder (no LLM) from the task's core-ATen graph.",
            f"# Fused op chain: {' -> '.join(dict.fromkeys(all_ops)) or '(copy)'}",
            f"# Lowered at {shapes}; sizes are read from the inputs at run time.",
            f"# Kernels: {', '.join(k.name for k in self.kernels)}.",
        ]
        init = _init_lines(self.task)
        forward = (f"def forward(self, {', '.join(names[:arg_count])}):\n"
                   + textwrap.indent("\n".join(self.forward), "    "))
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
                 *(k.source for k in self.kernels),
                 model_new]
        return "\n\n\n".join(parts) + "\n"


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


def _prod(items: list[str]) -> str:
    return " * ".join(items) if items else "1"


def triton_next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _TORCH_DTYPE_NAME(dtype: torch.dtype) -> str:
    return str(dtype)


class _Args:
    """Renders a constructor argument as ``args[i]`` when it is ModelNew's i-th init
    argument, so ModelNew built with other init arguments (another size) follows them."""

    def __init__(self, init_inputs: list[Any]) -> None:
        self.init_inputs = init_inputs

    def __call__(self, value: Any) -> str:
        for i, arg in enumerate(self.init_inputs):
            if type(arg) is bool or type(value) is bool:
                continue
            if isinstance(value, int) and type(arg) is int and arg == value:
                return f"args[{i}]"
            if (isinstance(value, tuple | list) and isinstance(arg, tuple | list)
                    and tuple(arg) == tuple(value)):
                return f"tuple(args[{i}])"
        if isinstance(value, tuple | list):
            return "(" + "".join(f"{self(v)}, " for v in value) + ")"
        return repr(value)


# Known parameterised modules and how to construct them again from their attributes.
def _module_ctor(module: torch.nn.Module, a: _Args) -> str | None:
    nn = torch.nn
    if type(module) is nn.Linear:
        return (f"nn.Linear({a(module.in_features)}, {a(module.out_features)}, "
                f"bias={module.bias is not None})")
    if type(module) in (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.InstanceNorm1d,
                        nn.InstanceNorm2d, nn.InstanceNorm3d):
        return (f"nn.{type(module).__name__}({a(module.num_features)}, eps={module.eps}, "
                f"momentum={module.momentum}, affine={module.affine}, "
                f"track_running_stats={module.track_running_stats})")
    if type(module) is nn.LayerNorm:
        return (f"nn.LayerNorm({a(tuple(module.normalized_shape))}, eps={module.eps}, "
                f"elementwise_affine={module.elementwise_affine}, bias={module.bias is not None})")
    if type(module) is nn.GroupNorm:
        return (f"nn.GroupNorm({a(module.num_groups)}, {a(module.num_channels)}, "
                f"eps={module.eps}, affine={module.affine})")
    if not any(True for _ in module.parameters()) and not any(True for _ in module.buffers()):
        return None  # nothing to declare (activations, dropout, pooling)
    raise LoweringError("parameters", f"the task's Model holds a {type(module).__name__} "
                        "with parameters the built-in coder cannot declare again; use the "
                        "LLM coder")


def _init_lines(task: _Task) -> list[str]:
    """ModelNew.__init__ lines declaring the Model's parameters in the same order.

    Each direct parameter is created as the task does, with ``torch.randn`` (the usual
    KernelBench spelling), ``torch.rand``, ``torch.zeros``, ``torch.ones`` of its shape or
    its fixed values; which one is checked by building both models from the same seed.
    Sizes equal to an init argument are read from ``args``.
    """
    a = _Args(task.init_inputs)
    lines: list[str] = []
    for kind, name, value in task.registered:
        if kind == "module":
            ctor = _module_ctor(value, a)
            if ctor is not None:
                lines.append(f"self.{name} = {ctor}")
        else:
            lines.append(f"self.{name} = nn.Parameter(torch.randn({a(tuple(value.shape))}))")
    if not lines:
        return lines
    return _match_parameters(task, lines)


def _match_parameters(task: _Task, lines: list[str]) -> list[str]:
    """Pick the creating function of each direct parameter so that seeded construction
    gives the Model's values; refuse when none does."""
    try:
        torch.manual_seed(0)
        reference = task.module.Model(*task.module.get_init_inputs())
    except Exception as exc:  # noqa: BLE001 - the task does not build on CPU
        raise LoweringError("parameters", f"building the task's Model on CPU raised "
                            f"{type(exc).__name__}: {exc}") from exc
    state = reference.state_dict()
    expected = [t.detach() for t in state.values()]
    choices = ["randn", "rand", "zeros", "ones", "literal"]
    param_lines = [k for k, line in enumerate(lines) if "nn.Parameter(torch.randn" in line]
    for combo in itertools.islice(itertools.product(choices, repeat=len(param_lines)), 256):
        trial = list(lines)
        for k, fn in zip(param_lines, combo, strict=True):
            if fn == "literal":
                # a parameter the task fills with fixed values, e.g. torch.tensor(constant)
                name = trial[k].split("=")[0].strip().removeprefix("self.")
                value = state.get(name)
                if value is None or value.numel() > 64:
                    break
                trial[k] = (f"self.{name} = nn.Parameter(torch.tensor({value.tolist()!r}, "
                            f"dtype={value.dtype}))")
            else:
                trial[k] = trial[k].replace("torch.randn(", f"torch.{fn}(")
        holder = torch.nn.Module()
        scope = {"torch": torch, "nn": torch.nn, "self": holder, "args": task.init_inputs}
        torch.manual_seed(0)
        exec("\n".join(trial), scope)
        got = [t.detach() for t in holder.state_dict().values()]
        if len(got) == len(expected) and all(
                g.shape == e.shape and torch.equal(g, e) for g, e in zip(got, expected, strict=True)):
            return trial
    raise LoweringError("parameters", "the task's Model initialises its parameters in a way "
                        "the built-in coder cannot reproduce from the same seed; use the LLM "
                        "coder")


def _computed(leaf: torch.fx.Node, load: str) -> str:
    """``load`` as the kernel computes with it: float32, except booleans (masks)."""
    return load if _val(leaf).dtype == torch.bool else f"{load}.to(tl.float32)"


def _val(node: torch.fx.Node) -> Any:
    return node.meta.get("val")


def _check_dtype(dtype: torch.dtype, what: str) -> None:
    if dtype not in _TL_DTYPES:
        raise LoweringError("dtype", f"built-in coder cannot lower {what} of dtype {dtype} "
                            "(only float32, float16, bfloat16 and bool); use the LLM coder")


def _bind(node: torch.fx.Node) -> dict[str, Any]:
    """The node's arguments by schema name, defaults filled in."""
    schema = node.target._schema
    bound: dict[str, Any] = {}
    for index, argument in enumerate(schema.arguments):
        if index < len(node.args):
            bound[argument.name] = node.args[index]
        elif argument.name in node.kwargs:
            bound[argument.name] = node.kwargs[argument.name]
        elif argument.has_default_value():
            bound[argument.name] = argument.default_value
    return bound


def _reachable(output: torch.fx.Node) -> set[torch.fx.Node]:
    seen: set[torch.fx.Node] = set()
    stack = list(output.all_input_nodes)
    while stack:
        node = stack.pop()
        if node not in seen:
            seen.add(node)
            stack.extend(node.all_input_nodes)
    return seen


def _operand_exprs(raw: dict[str, Any], exprs: dict[torch.fx.Node, str],
                   rule: _Rule) -> dict[str, str]:
    out: dict[str, str] = {}
    for name, value in raw.items():
        if isinstance(value, torch.fx.Node):
            expr = exprs[value]
            tensor = _val(value)
            if isinstance(tensor, torch.Tensor) and tensor.dtype == torch.bool and not rule.keep_bool:
                expr = f"({expr}).to(tl.float32)"
            out[name] = expr
        elif isinstance(value, bool | int | float):
            out[name] = _literal(value)
        else:
            out[name] = repr(value)
    return out


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


# --------------------------------------------------------------------------------------
# Public entry point
# --------------------------------------------------------------------------------------


def lower_task(
    task_desc: str,
    shape_overrides: dict[str, Any] | None = None,
    *,
    block_size: int = 1024,
    num_warps: int = 4,
    num_stages: int = 1,
    block_m: int = 32,
    block_n: int = 32,
    block_k: int = 32,
    progress: Any = None,
) -> str:
    """Return candidate source (a Python module defining ``class ModelNew``) for a task.

    The task is run (with ``shape_overrides`` rebound as module-level names before
    ``get_init_inputs()`` / ``get_inputs()`` are called), exported to core ATen with
    dynamic input extents, and every node lowered by one of the schedules:
    ``pointwise`` (element-wise chains with broadcasting, one kernel per tensor that
    must exist in memory), ``row reduction`` (sum, mean, amax/amin, max/min, argmax/
    argmin, prod, var, any/all over any dims, with the element-wise chain producing its
    input fused in; softmax, log_softmax, layer/group/batch/instance and RMS norms and
    losses decompose into these), ``matmul`` (mm, bmm, addmm, baddbmm; ``tl.dot`` tiles,
    bias and element-wise epilogues), ``scan`` (cumsum, cumprod), ``flip`` and ``pooling`` (max_pool1d/2d/3d with
    or without indices, avg_pool1d/2d/3d). Views (permute, expand, slice, ...)
    stay views in forward, and kernels read every operand through its strides;
    pointwise kernels read operands that are contiguous in the output's shape at the
    output's flat offsets instead (``FLAT``, chosen by forward per call).
    Tensors may be float32, float16, bfloat16 or bool; kernels compute in float32.
    ``ModelNew(*init_inputs)`` declares the Model's parameters in the same order (the
    same seed gives the same values) and its ``forward`` only allocates, views and
    launches. It runs under ``TRITON_INTERPRET=1`` on CPU and on CUDA.

    Args:
        task_desc: Task source in KernelBench format.
        shape_overrides: Module-level names to rebind, e.g. ``{"batch_size": 16}``.
        block_size: Elements per program of pointwise and pooling kernels, and BLOCK_R * BLOCK_I of
            reduction and scan tiles; a power of two.
        num_warps: ``num_warps`` of every launch; a power of two from 1 to 32.
        num_stages: ``num_stages`` of every launch; at least 1.
        block_m, block_n, block_k: matmul tile sizes; powers of two, at least 16
            (``tl.dot``'s smallest tile on NVIDIA GPUs).
        progress: called with a phase (``the task's get_inputs()``, ``the task's
            Model.forward ...``) as each call into the task's code starts, for a caller
            that must name what hangs.

    Returns:
        The candidate module's source.

    Raises:
        LoweringError: The task does not run or export, or its graph holds an operator
            or shape the coder cannot lower (``.op`` names it).
        ValueError: a launch parameter is out of range.
    """
    if block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, not {block_size}")
    if num_warps not in (1, 2, 4, 8, 16, 32):
        raise ValueError(f"num_warps must be a power of two from 1 to 32, not {num_warps}")
    if num_stages < 1:
        raise ValueError(f"num_stages must be at least 1, not {num_stages}")
    for name, value in (("block_m", block_m), ("block_n", block_n), ("block_k", block_k)):
        if value < 16 or value & (value - 1):
            raise ValueError(f"{name} must be a power of two of at least 16, not {value}")
    task = _load_task(task_desc, shape_overrides, progress)
    if progress is not None:
        progress("the task's Model.forward (traced by torch.export)")
    params = {"block_size": block_size, "num_warps": num_warps, "num_stages": num_stages,
              "block_m": block_m, "block_n": block_n, "block_k": block_k,
              "precision": "ieee"}
    scalars = _scalar_tensors(task)
    if scalars is not None:
        try:
            return _Lowerer(_export(task, scalars), task, params).run()
        except LoweringError:
            # A number used as a size, a dim or in Python control flow does not trace
            # as a tensor: lower with it baked in, as torch.export specializes it.
            pass
    return _Lowerer(_export(task), task, params).run()


# A task of ours (trusted): lowered once by :func:`warm_up`.
_WARM_UP_TASK = """\
import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, x, y):
        return torch.sigmoid(x) * y + torch.sum(x, dim=1, keepdim=True)


def get_inputs():
    return [torch.randn(4, 8), torch.randn(4, 8)]


def get_init_inputs():
    return []
"""


def warm_up() -> None:
    """Lower a small task of ours once, so torch.export's lazy state (imports, caches)
    exists before the lowering sandbox's fork server forks its children.

    Trusted code only (never a user's task). Creates no thread: tensors of 32 elements
    stay below every intra-op parallel threshold, so the single-threaded fork server
    forks cleanly.
    """
    lower_task(_WARM_UP_TASK)
