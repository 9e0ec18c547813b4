"""What the lowering knows of each core-ATen operator: the element-wise rules, the
operator set of each schedule, the dtypes a kernel may load, and the refusal of the rest.

:data:`RULES` maps an element-wise operator to the :class:`Rule` that writes it as one
Triton expression over its operands (``"aten.mul.Tensor"`` -> ``{self} * {other}``);
those nodes are fused into the kernel that consumes them. The other sets
(:data:`REDUCTIONS`, :data:`MATMULS`, ...) are the operators of one schedule each; the
registry (:mod:`services.generator.lowering.registry`) pairs each set with the function
that lowers it. An operator in none is refused with :func:`refuse`, which names its
family (``indexing``, ``sorting``, ...) so the caller can hand the task to the LLM coder.
This module imports no schedule, so every schedule may read it.

Numerics follow torch's: NaN propagation in maximum/minimum/clamp, sign(NaN) = 0, gelu's
constants, round half to even (torch.round's documented rule).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from services.generator.lowering.emit import literal
from services.generator.lowering.errors import LoweringError
from services.generator.lowering.ir import meta_val

# Tensor dtypes a candidate may load or store. float64 and integer tensors are refused:
# the kernel computes in float32, which would not match them.
TL_DTYPES: dict[torch.dtype, str] = {
    torch.float32: "tl.float32",
    torch.float16: "tl.float16",
    torch.bfloat16: "tl.bfloat16",
    torch.bool: "tl.int1",
}

# Ops that reshape without moving elements: on contiguous tensors the flat order is
# unchanged, so the kernel passes the value through.
RESHAPES = frozenset(
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
CONSTANTS = frozenset(
    {"aten.full.default", "aten.full_like.default", "aten.scalar_tensor.default"}
)
# Memory formats that keep a contiguous tensor contiguous.
_FLAT_FORMATS = (None, torch.contiguous_format, torch.preserve_format)


@dataclass
class Call:
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
class Rule:
    """How one core-ATen operator becomes a Triton expression.

    Attributes:
        emit: Builds the expression from the bound call.
        keep_bool: Pass bool (``tl.int1``) operands as they are; otherwise they are
            cast to float32 first, as torch promotes bool in arithmetic.
    """

    emit: Callable[[Call], str]
    keep_bool: bool = False


def _t(template: str, *, keep_bool: bool = False) -> Rule:
    """A rule given as a format string over argument names, e.g. ``"{self} * {other}"``."""
    return Rule(lambda c: c.fmt(template), keep_bool=keep_bool)


def _scaled(c: Call, sign: str) -> str:
    """``self + alpha * other`` (add) or ``self - alpha * other`` (sub)."""
    if c.raw.get("alpha", 1) == 1:
        return c.fmt("{self} {sign} {other}", sign=sign)
    return c.fmt("{self} {sign} {other} * {alpha}", sign=sign)


def _pow_tensor_scalar(c: Call) -> str:
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
        magnitude = f"tl.exp2({literal(e)} * tl.log2(tl.abs({x})))"
        return magnitude if e % 2 == 0 else f"tl.where({x} < 0.0, -{magnitude}, {magnitude})"
    return f"tl.exp2({literal(e)} * tl.log2({x}))"  # NaN for x < 0, as torch.pow


def _pow_scalar(c: Call) -> str:
    """``self ** exponent`` for a number base and a tensor exponent."""
    base = float(c.raw["self"])
    if base <= 0.0:
        raise LoweringError(c.op, f"built-in coder cannot lower {c.op} with base {base} "
                            "(only positive bases are supported); use the LLM coder")
    return f"tl.exp2({c.expr['exponent']} * {literal(math.log2(base))})"


def _clamp(c: Call) -> str:
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


def _gelu(c: Call) -> str:
    """gelu as torch computes it: erf form, or the tanh form with torch's constants."""
    if c.raw.get("approximate", "none") == "tanh":
        return c.fmt(
            "0.5 * {self} * (1.0 + _tanh({beta} * ({self} + 0.044715 * {self} * {self} * {self})))",
            beta=literal(math.sqrt(2.0) * (2.0 / math.sqrt(math.pi)) * 0.5),
        )
    return c.fmt("0.5 * {self} * (1.0 + tl.erf({self} * {rsqrt2}))",
                 rsqrt2=literal(math.sqrt(0.5)))


def _elu(c: Call) -> str:
    """elu/selu: ``scale * x`` for x > 0, else ``scale * alpha * expm1(input_scale * x)``."""
    scale, alpha = float(c.raw["scale"]), float(c.raw["alpha"])
    return c.fmt(
        "tl.where({self} > 0.0, {self} * {scale}, _expm1({self} * {input_scale}) * {coef})",
        coef=literal(alpha * scale),
    )


def _to_copy(c: Call) -> str:
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


def _clone(c: Call) -> str:
    if c.raw.get("memory_format") not in _FLAT_FORMATS:
        raise LoweringError(c.op, f"built-in coder cannot lower {c.op} to memory format "
                            f"{c.raw['memory_format']} (layout change); use the LLM coder")
    return c.expr["self"]


def constant_expr(c: Call, dtype: torch.dtype) -> str:
    """full/full_like/scalar_tensor: a block of the fill value, rounded to its dtype."""
    value = c.raw["fill_value"] if "fill_value" in c.raw else c.raw["s"]
    if dtype == torch.bool:
        return f"tl.full(__TILE__, {int(bool(value))}, tl.int1)"
    block = f"tl.full(__TILE__, {literal(value)}, {TL_DTYPES[dtype]})"
    return block if dtype == torch.float32 else f"{block}.to(tl.float32)"


def _pass(c: Call) -> str:
    return c.expr["self"]


RULES: dict[str, Rule] = {
    # activations kept whole by the core-ATen decomposition
    "aten.relu.default": _t("tl.where({self} < 0.0, 0.0, {self})"),
    "aten.leaky_relu.default": _t("tl.where({self} > 0.0, {self}, {self} * {negative_slope})"),
    "aten.sigmoid.default": _t("tl.sigmoid({self})"),
    "aten.tanh.default": _t("_tanh({self})"),
    "aten.gelu.default": Rule(_gelu),
    "aten.elu.default": Rule(_elu),
    "aten.hardtanh.default": Rule(_clamp),
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
    "aten.log10.default": _t("tl.log({self}) * " + literal(1.0 / math.log(10.0))),
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
    "aten.add.Tensor": Rule(lambda c: _scaled(c, "+")),
    "aten.add.Scalar": Rule(lambda c: _scaled(c, "+")),
    "aten.sub.Tensor": Rule(lambda c: _scaled(c, "-")),
    "aten.sub.Scalar": Rule(lambda c: _scaled(c, "-")),
    "aten.mul.Tensor": _t("{self} * {other}"),
    "aten.mul.Scalar": _t("{self} * {other}"),
    # div.Tensor_mode (// and rounding_mode) is left out: floor(a / b) differs from
    # torch's fmod-based result where a / b rounds onto an integer.
    "aten.div.Tensor": _t("{self} / {other}"),
    "aten.div.Scalar": _t("{self} / {other}"),
    "aten.pow.Tensor_Scalar": Rule(_pow_tensor_scalar),
    "aten.pow.Scalar": Rule(_pow_scalar),
    # NaN in either operand gives NaN, as torch.maximum/minimum do
    "aten.maximum.default": _t("tl.where(({self} > {other}) | ({self} != {self}), {self}, {other})"),
    "aten.minimum.default": _t("tl.where(({self} < {other}) | ({self} != {self}), {self}, {other})"),
    "aten.clamp.default": Rule(_clamp),
    "aten.clamp.Tensor": Rule(_clamp),
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
    "aten._to_copy.default": Rule(_to_copy),
    "aten.clone.default": Rule(_clone, keep_bool=True),
    **{op: Rule(_pass, keep_bool=True) for op in RESHAPES},
}


# Ops that are views (or layout copies) in the generated forward: torch allows them
# there (the worker's op audit lists them as view/copy operators).
VIEW_OPS = frozenset({
    "aten.view.default", "aten._unsafe_view.default", "aten.reshape.default",
    "aten.alias.default", "aten.squeeze.default", "aten.squeeze.dim", "aten.squeeze.dims",
    "aten.unsqueeze.default", "aten.permute.default", "aten.expand.default",
    "aten.slice.Tensor", "aten.select.int", "aten.t.default", "aten.transpose.int",
})
REDUCTIONS = frozenset({
    "aten.sum.dim_IntList", "aten.sum.default", "aten.mean.dim", "aten.mean.default",
    "aten.amax.default", "aten.amin.default", "aten.max.dim", "aten.min.dim",
    "aten.max.default", "aten.min.default", "aten.argmax.default", "aten.argmin.default",
    "aten.prod.dim_int", "aten.prod.default", "aten.var.correction", "aten.var.dim",
    "aten.var_mean.correction", "aten.any.dim", "aten.any.dims", "aten.any.default",
    "aten.all.dim", "aten.all.default",
})
MATMULS = frozenset({"aten.mm.default", "aten.bmm.default", "aten.addmm.default",
                     "aten.baddbmm.default"})
SCANS = frozenset({"aten.cumsum.default", "aten.cumprod.default"})
POOLS = frozenset({
    "aten.max_pool1d.default", "aten.max_pool2d.default", "aten.max_pool3d.default",
    "aten.max_pool2d_with_indices.default", "aten.max_pool3d_with_indices.default",
    "aten.avg_pool1d.default", "aten.avg_pool2d.default", "aten.avg_pool3d.default",
})
ARANGES = frozenset({"aten.arange.start_step", "aten.arange.default", "aten.arange.start"})
FLIPS = frozenset({"aten.flip.default"})
CONVOLUTIONS = frozenset({"aten.convolution.default"})
CONCATS = frozenset({"aten.cat.default"})
# ``t.copy_(src)`` made functional: src's values (an attribute overwritten by an input).
COPIES = frozenset({"aten.copy.default"})
# nn.LSTM / nn.GRU / nn.RNN, kept whole by the export (task.export_program).
RECURRENT = frozenset({"aten.lstm.input", "aten.gru.input", "aten.rnn_tanh.input",
                       "aten.rnn_relu.input"})
SPLITS = frozenset({"aten.split_with_sizes.default", "aten.split.Tensor", "aten.chunk.default",
                    "aten.unbind.int"})
# Size arithmetic on SymInts, written as Python in the generated forward.
SYM_OPS = {operator.mul: "*", operator.add: "+", operator.sub: "-",
           operator.floordiv: "//", operator.mod: "%"}
_FAMILY = {
    "conv": "convolution", "pool": "pooling", "gather": "indexing", "scatter": "indexing",
    "index": "indexing", "cat": "concatenation", "flip": "layout", "sort": "sorting",
    "topk": "sorting", "rand": "random", "normal": "random", "bernoulli": "random",
}


def _family(op: str) -> str:
    name = op.split(".")[1] if op.count(".") >= 1 else op
    return next((fam for key, fam in _FAMILY.items() if key in name), "other")


def refuse(op: str, why: str = "") -> LoweringError:
    return LoweringError(op, f"built-in coder cannot lower {op} ({why or _family(op) + ' operators have no schedule here'}); "
                         "use the LLM coder")


def check_dtype(dtype: torch.dtype, what: str) -> None:
    if dtype not in TL_DTYPES:
        raise LoweringError("dtype", f"built-in coder cannot lower {what} of dtype {dtype} "
                            "(only float32, float16, bfloat16 and bool); use the LLM coder")


def operand_exprs(raw: dict[str, Any], exprs: dict[torch.fx.Node, str],
                  rule: Rule) -> dict[str, str]:
    out: dict[str, str] = {}
    for name, value in raw.items():
        if isinstance(value, torch.fx.Node):
            expr = exprs[value]
            tensor = meta_val(value)
            if isinstance(tensor, torch.Tensor) and tensor.dtype == torch.bool and not rule.keep_bool:
                expr = f"({expr}).to(tl.float32)"
            out[name] = expr
        elif isinstance(value, bool | int | float):
            out[name] = literal(value)
        else:
            out[name] = repr(value)
    return out


# Element-wise nodes, computed inside the kernels that read them. alias (detach) keeps
# the shape: a pass-through inside the chain, so a chain through it stays one kernel and
# no output aliases an input; the other reshapes are views in forward.
POINTWISE_OPS = frozenset(
    {op for op in RULES if op not in RESHAPES or op == "aten.alias.default"} | CONSTANTS)
# The reshapes and views that are one line of forward (schedule ``view``); alias is
# element-wise (a pass-through in a chain), so it is not here.
FORWARD_VIEWS = (VIEW_OPS | RESHAPES) - POINTWISE_OPS
