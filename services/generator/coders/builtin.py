"""Built-in coder: lowers an element-wise task to one fused Triton kernel, without an LLM.

The task (KernelBench format: ``class Model``, ``get_inputs()``, ``get_init_inputs()``)
is run, exported with ``torch.export.export(...).run_decompositions()`` and its core-ATen
graph is walked node by node. Every node must be an element-wise operator from
``_RULES`` (or a free reshape); each becomes one line of a single ``@triton.jit`` kernel
that loads every tensor input once, computes in float32, casts to the output dtype and
stores. Anything else (matmul, reductions, softmax, convolutions, broadcasting between
inputs, layout changes, several outputs, parameters) raises :class:`LoweringError`
naming the operator or the reason, so the caller can hand the task to the LLM coder.

The coder runs the task's code in this process: call it where task code is trusted, or
from a subprocess.
"""

from __future__ import annotations

import inspect
import math
import re
import textwrap
import types
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx

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


class LoweringError(Exception):
    """The task cannot be lowered by the built-in coder.

    Attributes:
        op: The core-ATen operator that has no lowering (e.g. ``"aten.mm.default"``),
            or a short reason tag: ``"task"`` (the source does not run or lacks
            ``Model``/``get_inputs``/``get_init_inputs``), ``"export"`` (torch.export
            failed), ``"inputs"``, ``"outputs"``, ``"dtype"``, ``"shape"``.
    """

    def __init__(self, op: str, message: str) -> None:
        super().__init__(message)
        self.op = op


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
        return "tl.full([BLOCK_SIZE], 1.0, tl.float32)"
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
        return f"tl.full([BLOCK_SIZE], {int(bool(value))}, tl.int1)"
    block = f"tl.full([BLOCK_SIZE], {_literal(value)}, {_TL_DTYPES[dtype]})"
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
_HELPER_CALL = re.compile(r"\b(" + "|".join(_HELPERS) + r")\(")


# --------------------------------------------------------------------------------------
# Task loading and export
# --------------------------------------------------------------------------------------


@dataclass
class _Task:
    """A task run far enough to export: its model, example inputs and forward names."""

    model: torch.nn.Module
    inputs: tuple[Any, ...]
    arg_names: list[str]


def _load_task(task_desc: str, shape_overrides: dict[str, Any] | None) -> _Task:
    """Run the task source and build its model and example inputs.

    Inputs and model are built on the meta device first, so a KernelBench problem sized
    for an 80 GB GPU costs no memory; a task whose code refuses meta is built on CPU.
    """
    try:
        code = compile(task_desc, "<task>", "exec")
    except SyntaxError as exc:
        raise LoweringError("task", f"task source does not compile: {exc.msg} "
                            f"(line {exc.lineno}); fix the task") from exc
    module = types.ModuleType("aikg_task")
    try:
        exec(code, module.__dict__)
    except Exception as exc:
        raise LoweringError("task", f"task source raised {type(exc).__name__}: {exc}; "
                            "fix the task") from exc
    for name in ("Model", "get_inputs", "get_init_inputs"):
        if not hasattr(module, name):
            raise LoweringError("task", f"task source defines no `{name}`; a task needs "
                                "`class Model`, `get_inputs()` and `get_init_inputs()`")
    for name, value in (shape_overrides or {}).items():
        setattr(module, name, value)

    def build() -> tuple[torch.nn.Module, list[Any]]:
        init_inputs = module.get_init_inputs()
        return module.Model(*init_inputs), list(module.get_inputs())

    try:
        with torch.device("meta"):
            model, inputs = build()
    except Exception:
        try:
            model, inputs = build()
        except Exception as exc:
            raise LoweringError("task", f"building the task's Model or inputs raised "
                                f"{type(exc).__name__}: {exc}; fix the task") from exc
    if not isinstance(model, torch.nn.Module):
        raise LoweringError("task", "task's Model is not a torch.nn.Module")
    for position, value in enumerate(inputs):
        if not isinstance(value, torch.Tensor):
            raise LoweringError("inputs", f"get_inputs() item {position} is a "
                                f"{type(value).__name__}; the built-in coder takes tensor "
                                "inputs only; use the LLM coder")
    return _Task(model, tuple(inputs), _forward_arg_names(type(model), len(inputs)))


def _forward_arg_names(model_cls: type, count: int) -> list[str]:
    """The task forward's parameter names when they are plain, else ``in0, in1, ...``."""
    fallback = [f"in{i}" for i in range(count)]
    try:
        params = list(inspect.signature(model_cls.forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return fallback
    plain = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    names = [p.name for p in params[:count] if p.kind in plain]
    if len(names) != count or _RESERVED.intersection(names):
        return fallback
    return names


def _export(task: _Task) -> torch.export.ExportedProgram:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch.export's internal deprecation notices
            return torch.export.export(task.model, task.inputs).run_decompositions()
    except Exception as exc:
        first_line = (str(exc).strip().splitlines() or [""])[0]
        raise LoweringError("export", f"torch.export could not trace the task's Model "
                            f"({type(exc).__name__}: {first_line}); use the LLM coder") from exc


# --------------------------------------------------------------------------------------
# Graph -> kernel plan
# --------------------------------------------------------------------------------------


@dataclass
class _Input:
    """A forward argument the kernel reads (or allocates the output like)."""

    position: int
    name: str  # the forward argument's name
    var: str  # the kernel variable holding its value
    dtype: torch.dtype
    shape: tuple[int, ...]
    loaded: bool = False


@dataclass
class _Plan:
    """Everything the candidate source is rendered from."""

    inputs: dict[int, _Input] = field(default_factory=dict)
    body: list[str] = field(default_factory=list)
    chain: list[str] = field(default_factory=list)
    result: str = ""
    out_shape: tuple[int, ...] = ()
    out_dtype: torch.dtype = torch.float32


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


def _plan(ep: torch.export.ExportedProgram, arg_names: list[str]) -> _Plan:
    """Walk the core-ATen graph and turn each node into one kernel line.

    Raises:
        LoweringError: for any node without a lowering, broadcasting between varying
            values, unsupported dtypes, parameters/buffers/constants, input mutation, or
            an output that is not one tensor shaped like an input.
    """
    signature = ep.graph_signature
    for spec in signature.input_specs:
        if spec.kind != torch.export.graph_signature.InputKind.USER_INPUT:
            raise LoweringError("inputs", f"the task's Model uses a {spec.kind.name.lower()} "
                                f"({spec.arg.name}); the built-in coder lowers stateless "
                                "element-wise models only; use the LLM coder")
    if signature.user_inputs_to_mutate or signature.buffers_to_mutate:
        raise LoweringError("inputs", "the task's Model mutates its input in place; the "
                            "built-in coder cannot lower that; use the LLM coder")
    out_spec = ep.call_spec.out_spec
    if len(signature.user_outputs) != 1 or out_spec is None or not out_spec.is_leaf():
        raise LoweringError("outputs", "the task's Model must return exactly one tensor "
                            "for the built-in coder; use the LLM coder")

    positions = {name: i for i, name in enumerate(signature.user_inputs)}
    graph = ep.graph
    output = next(n for n in graph.nodes if n.op == "output")
    result_node = output.args[0][0]
    if not isinstance(result_node, torch.fx.Node):
        raise LoweringError("outputs", "the task's Model returns a constant, not a tensor")
    needed = _reachable(output)

    plan = _Plan()
    exprs: dict[torch.fx.Node, str] = {}
    varying: set[torch.fx.Node] = set()  # nodes whose value depends on an input's values
    for node in graph.nodes:
        if node not in needed:
            continue  # e.g. aten._assert_tensor_metadata, which has no users
        if node.op == "placeholder":
            val = _val(node)
            _check_dtype(val.dtype, f"input `{node.name}`")
            position = positions[node.name]
            exprs[node] = f"v_{node.name}"
            plan.inputs[position] = _Input(position, arg_names[position], exprs[node],
                                           val.dtype, tuple(val.shape))
            varying.add(node)
            continue
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            raise LoweringError(str(node.target), f"built-in coder cannot lower graph node "
                                f"{node.format_node()}; use the LLM coder")
        op = str(node.target)
        val = _val(node)
        if not isinstance(val, torch.Tensor):
            raise LoweringError(op, f"built-in coder cannot lower {op} (it does not return "
                                "one tensor); use the LLM coder")
        _check_dtype(val.dtype, f"{op}'s result")
        raw = _bind(node)
        tensor_args = [a for a in raw.values() if isinstance(a, torch.fx.Node)]
        for arg in tensor_args:
            _check_dtype(_val(arg).dtype, f"{op}'s operand")
        if op not in _CONSTANTS and any(a in varying for a in tensor_args):
            varying.add(node)
        if op in _CONSTANTS:
            expr = _constant(_Call(op, {}, raw), val.dtype)
        else:
            rule = _RULES.get(op)
            if rule is None:
                raise LoweringError(op, f"built-in coder cannot lower {op} (only element-wise "
                                    "operators are supported); use the LLM coder")
            _check_shapes(op, node, tensor_args, varying)
            expr = rule.emit(_Call(op, _operand_exprs(raw, exprs, rule), raw))
        if op in _RESHAPES or expr in exprs.values():
            exprs[node] = expr  # pass-through: no new kernel variable
        else:
            exprs[node] = f"v_{node.name}"
            plan.body.append(f"v_{node.name} = {expr}  # {op}")
        plan.chain.append(op)

    if not plan.inputs:
        raise LoweringError("inputs", "the task's output depends on no tensor input; "
                            "the built-in coder needs one to size the output")
    for node in needed:
        if node.op == "placeholder" and any(
            (u in needed or u is output) and str(u.target) not in _CONSTANTS
            for u in node.users
        ):
            plan.inputs[positions[node.name]].loaded = True
    result = _val(result_node)
    plan.out_shape, plan.out_dtype = tuple(result.shape), result.dtype
    plan.result = exprs[result_node]
    if not any(i.shape == plan.out_shape for i in plan.inputs.values()):
        raise LoweringError("shape", f"the output shape {list(plan.out_shape)} differs from "
                            "every input's shape; the built-in coder allocates the output "
                            "like an input; use the LLM coder")
    return plan


def _check_shapes(op: str, node: torch.fx.Node, tensor_args: list[torch.fx.Node],
                  varying: set[torch.fx.Node]) -> None:
    """Refuse broadcasting between varying values; constants broadcast freely."""
    shape = tuple(_val(node).shape)
    for arg in tensor_args:
        arg_shape = tuple(_val(arg).shape)
        if op in _RESHAPES:
            if _val(arg).numel() != _val(node).numel():
                raise LoweringError(op, f"built-in coder cannot lower {op} from "
                                    f"{list(arg_shape)} to {list(shape)}; use the LLM coder")
        elif arg in varying and arg_shape != shape:
            raise LoweringError(op, f"built-in coder cannot lower {op} with an operand of "
                                f"shape {list(arg_shape)} and result of shape {list(shape)} "
                                "(broadcasting is not supported); use the LLM coder")


def _operand_exprs(raw: dict[str, Any], exprs: dict[torch.fx.Node, str],
                   rule: _Rule) -> dict[str, str]:
    out: dict[str, str] = {}
    for name, value in raw.items():
        if isinstance(value, torch.fx.Node):
            expr = exprs[value]
            if _val(value).dtype == torch.bool and not rule.keep_bool:
                expr = f"({expr}).to(tl.float32)"
            out[name] = expr
        elif isinstance(value, bool | int | float):
            out[name] = _literal(value)
        else:
            out[name] = repr(value)
    return out


# --------------------------------------------------------------------------------------
# Rendering
# --------------------------------------------------------------------------------------


def _render(plan: _Plan, arg_count: int, arg_names: list[str], block_size: int,
            num_warps: int, num_stages: int) -> str:
    loaded = [plan.inputs[p] for p in sorted(plan.inputs) if plan.inputs[p].loaded]
    like = next(plan.inputs[p] for p in sorted(plan.inputs)
                if plan.inputs[p].shape == plan.out_shape)

    kernel_params = [f"{i.name}_ptr" for i in loaded] + ["out_ptr", "n_elements",
                                                         "BLOCK_SIZE: tl.constexpr"]
    loads = [
        f"{i.var} = tl.load({i.name}_ptr + offsets, mask=mask)"
        + ("" if i.dtype == torch.bool else ".to(tl.float32)")
        for i in loaded
    ]
    store_value = plan.result
    if plan.out_dtype == torch.bool:
        store_value = f"({store_value}) != 0"
    elif plan.out_dtype == torch.bfloat16:
        store_value = f"_round_to_bf16({store_value})"
    kernel_lines = [
        "pid = tl.program_id(0).to(tl.int64)  # int64: more than 2**31 elements fit",
        "offsets = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)",
        "mask = offsets < n_elements",
        *loads,
        *plan.body,
        f"tl.store(out_ptr + offsets, ({store_value}).to(out_ptr.dtype.element_ty), mask=mask)",
    ]
    kernel = (
        "@triton.jit\n"
        f"def {_KERNEL_NAME}({', '.join(kernel_params)}):\n"
        + textwrap.indent("\n".join(kernel_lines), "    ")
    )

    helpers = _needed_helpers("\n".join(kernel_lines))
    contiguous = loaded if like in loaded else [*loaded, like]
    if like.dtype == plan.out_dtype:
        alloc = f"out = torch.empty_like({like.name})"
    else:
        alloc = (f"out = torch.empty({like.name}.shape, "
                 f"dtype={_TORCH_DTYPE_NAMES[plan.out_dtype]}, device={like.name}.device)")
    launch_args = [i.name for i in loaded] + ["out", "n_elements"]
    forward_lines = [
        *(f"{i.name} = {i.name}.contiguous()" for i in contiguous),
        alloc,
        "n_elements = out.numel()",
        "if n_elements > 0:",
        f"    grid = (triton.cdiv(n_elements, {block_size}),)",
        f"    {_KERNEL_NAME}[grid](",
        f"        {', '.join(launch_args)},",
        f"        BLOCK_SIZE={block_size}, num_warps={num_warps}, num_stages={num_stages},",
        "    )",
        "return out",
    ]
    forward = (
        f"def forward(self, {', '.join(arg_names[:arg_count])}):\n"
        + textwrap.indent("\n".join(forward_lines), "    ")
    )

    shapes = ", ".join(f"{i.name}: {_dtype_name(i.dtype)}{list(i.shape)}"
                       for i in plan.inputs.values())
    chain = " -> ".join(dict.fromkeys(plan.chain)) or "(copy)"
    header = [
        "# Generated by the AIKG built-in coder (no LLM) from the task's core-ATen graph.",
        f"# Fused op chain: {chain}",
        f"# Lowered at {shapes} -> {_dtype_name(plan.out_dtype)}{list(plan.out_shape)};",
        "# the kernel runs over flattened contiguous tensors, so other shapes work too.",
        "# Scalars and init arguments of the task are baked into the kernel as constants.",
    ]
    model_new = (
        "class ModelNew(nn.Module):\n"
        '    """Runs the task\'s element-wise chain as one fused Triton kernel."""\n\n'
        "    def __init__(self, *args, **kwargs):\n"
        "        super().__init__()\n\n"
        + textwrap.indent(forward, "    ")
    )
    parts = [
        "\n".join(header)
        + "\nimport torch\nimport torch.nn as nn\nimport triton\nimport triton.language as tl",
        *(_HELPERS[h].strip() for h in helpers),
        kernel,
        model_new,
    ]
    return "\n\n\n".join(parts) + "\n"


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
) -> str:
    """Return candidate source (a Python module defining ``class ModelNew``) for a task.

    The task is run (with ``shape_overrides`` rebound as module-level names before
    ``get_init_inputs()`` / ``get_inputs()`` are called), exported to core ATen, and its
    whole element-wise chain fused into one ``@triton.jit`` kernel. Tensor inputs and the
    output may be float32, float16, bfloat16 or bool, of any shape (all of one shape);
    the kernel loads each input once, computes in float32 and stores in the output
    dtype. ``ModelNew(*init_inputs)`` accepts the task's init arguments (their values are
    baked in as constants) and its ``forward`` takes the task's positional inputs and
    only allocates, launches and returns. It runs under ``TRITON_INTERPRET=1`` on CPU and
    on CUDA.

    Args:
        task_desc: Task source in KernelBench format.
        shape_overrides: Module-level names to rebind, e.g. ``{"batch_size": 16}``.
        block_size: Elements per program; a power of two.
        num_warps: ``num_warps`` of the launch; a power of two from 1 to 32.
        num_stages: ``num_stages`` of the launch; at least 1.

    Returns:
        The candidate module's source.

    Raises:
        LoweringError: The task does not run or export, or its graph holds an operator
            or shape the coder cannot lower (``.op`` names it).
        ValueError: ``block_size``, ``num_warps`` or ``num_stages`` is out of range.
    """
    if block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, not {block_size}")
    if num_warps not in (1, 2, 4, 8, 16, 32):
        raise ValueError(f"num_warps must be a power of two from 1 to 32, not {num_warps}")
    if num_stages < 1:
        raise ValueError(f"num_stages must be at least 1, not {num_stages}")
    task = _load_task(task_desc, shape_overrides)
    ep = _export(task)
    plan = _plan(ep, task.arg_names)
    return _render(plan, len(task.inputs), task.arg_names, block_size, num_warps, num_stages)
