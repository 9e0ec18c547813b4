"""Rules on PyTorch compute in ``ModelNew.forward`` and the helpers it calls (S007,
S018), and the vocabulary of torch calls the other rules share.

In ``forward`` and its helpers a candidate must not compute with PyTorch:
``torch.<op>(...)``, ``F.<op>(...)``, tensor compute methods (:data:`COMPUTE_METHODS`),
the ``@`` operator or a ``torch.nn`` submodule's call are S007; the same functions
reached through an alias, an attribute, a table or a literal ``getattr`` are S018.
Allocation, layout and timing calls (:data:`ALLOWED_TORCH_CALLS`) are fine.
Which helpers are walked is :func:`services.worker.static_check.model.check_model`'s.
"""

from __future__ import annotations

import ast
from typing import TYPE_CHECKING

from services.worker.static_check.syntax import literal_getattr
from services.worker.static_check.system import STREAM_CALLS

if TYPE_CHECKING:
    from services.worker.static_check.checker import Checker

# torch calls that allocate, describe or lay out tensors: allowed in forward.
ALLOWED_TORCH_CALLS = frozenset({
    "empty", "empty_like", "empty_strided", "zeros", "zeros_like", "ones", "ones_like",
    "full", "full_like", "arange", "tensor", "as_tensor", "as_strided", "is_tensor",
    "is_floating_point", "is_complex", "numel", "device", "dtype", "Size", "finfo", "iinfo",
    "get_default_dtype", "promote_types", "result_type", "broadcast_shapes", "no_grad",
    "inference_mode", "is_grad_enabled", "cuda.synchronize", "cuda.current_device",
    "cuda.device_count", "cuda.get_device_properties", "cuda.get_device_capability",
    "cuda.is_available", "cuda.current_stream", "cuda.device", "npu.synchronize",
    "npu.current_device", "npu.current_stream",
    # Timing and profiler markers: they measure, they do not compute.
    "cuda.Event", "npu.Event", "cuda.nvtx.range_push", "cuda.nvtx.range_pop",
    "cuda.nvtx.range",
    # Generator state: the trial inputs do not depend on it (they come from elsewhere).
    "manual_seed", "initial_seed", "seed", "cuda.manual_seed", "cuda.manual_seed_all",
})
# Tensor methods that compute (in-place variants with a trailing underscore too).
COMPUTE_METHODS = frozenset({
    "abs", "absolute", "acos", "acosh", "add", "addbmm", "addcdiv", "addcmul", "addmm",
    "addmv", "addr", "all", "amax", "amin", "aminmax", "any", "argmax", "argmin", "argsort",
    "asin", "asinh", "atan", "atan2", "atanh", "baddbmm", "bitwise_and", "bitwise_not",
    "bitwise_or", "bitwise_xor", "bmm", "ceil", "clamp", "clamp_max", "clamp_min", "clip",
    "cos", "cosh", "count_nonzero", "cross", "cummax", "cummin", "cumprod", "cumsum", "diag",
    "diff", "digamma", "dist", "div", "divide", "dot", "eq", "erf", "erfc", "erfinv", "exp",
    "exp2", "expm1", "floor", "floor_divide", "fmax", "fmin", "fmod", "frac", "gather",
    "ge", "gelu", "greater", "gt", "hardtanh", "heaviside", "histc", "hypot", "index_add",
    "index_fill", "index_put", "index_reduce", "index_select", "inner", "isclose", "kron",
    "kthvalue", "le", "lerp", "less", "lgamma", "log", "log10", "log1p", "log2",
    "log_softmax", "logaddexp", "logcumsumexp", "logical_and", "logical_not", "logical_or",
    "logical_xor", "logit", "logsumexp", "lt", "masked_fill", "masked_scatter",
    "masked_select", "matmul", "max", "maximum", "mean", "median", "min", "minimum", "mm",
    "mode", "mul", "multiply", "mv", "nan_to_num", "nanmean", "nansum", "ne", "neg",
    "negative", "norm", "outer", "pow", "prod", "quantile", "reciprocal", "relu",
    "remainder", "renorm", "round", "rsqrt", "scatter", "scatter_add", "scatter_reduce",
    "sgn", "sigmoid", "sign", "silu", "sin", "sinh", "softmax", "softplus", "sort", "sqrt",
    "square", "std", "sub", "subtract", "sum", "tan", "tanh", "tensordot", "topk", "trace",
    "tril", "triu", "true_divide", "trunc", "var", "where", "xlogy", "__matmul__",
    "__add__", "__mul__", "__sub__", "__truediv__", "einsum", "conv1d", "conv2d", "conv3d",
    "linear", "layer_norm", "group_norm", "batch_norm", "dropout", "mish", "hardswish",
    "hardsigmoid", "elu", "selu", "celu", "leaky_relu", "prelu", "rrelu", "glu",
    "softmin", "normalize", "cosine_similarity", "pairwise_distance", "cdist",
})
NN_CONTAINERS = frozenset({"Parameter", "ParameterList", "ParameterDict", "ModuleList",
                           "ModuleDict", "Identity", "Buffer"})
# torch namespaces whose lower-case members are all functions (for S017/S018).
TORCH_FUNCTION_SPACES = ("torch.nn.functional.", "torch.ops.", "torch.special.",
                         "torch.linalg.", "torch.fft.", "torch._C._nn.")


def torch_function(name: str) -> bool:
    """Whether dotted ``name`` is a torch function that computes (``torch.relu``,
    ``torch.nn.functional.gelu``, ``torch.ops.aten.mm.default``); dtypes, devices and
    the allocation/layout calls of :data:`ALLOWED_TORCH_CALLS` are not."""
    if not name.startswith("torch.") or name[len("torch."):] in ALLOWED_TORCH_CALLS:
        return False
    last = name.rsplit(".", 1)[-1]
    if last.rstrip("_") in COMPUTE_METHODS or last in COMPUTE_METHODS:
        return True
    return name.startswith(TORCH_FUNCTION_SPACES) and last[:1].islower()


def submodules(ctx: Checker, init: ast.AST | None) -> dict[str, str]:
    """``self.x = nn.Linear(...)`` in __init__: attribute -> torch.nn class."""
    found: dict[str, str] = {}
    if init is None:
        return found
    for node in ast.walk(init):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            cls = ctx.qual(node.value.func)
            if (cls and cls.startswith("torch.nn.") and cls.split(".")[-1][:1].isupper()
                    and cls.split(".")[-1] not in NN_CONTAINERS):
                for t in node.targets:
                    if (isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                            and t.value.id == "self"):
                        found[t.attr] = cls
    return found


def check_compute(ctx: Checker, node: ast.Call, where: str, submodules: dict[str, str]) -> None:
    """A call in ``where`` (forward or a helper it calls) that computes with PyTorch:
    S007 named directly, S018 through an alias, an attribute or a literal getattr.
    ``submodules``: the ``torch.nn`` submodules of the owning class (:func:`submodules`)."""
    func = node.func
    name = ctx.qual(func)
    why = "torch compute ops are not allowed; do the work in a Triton kernel"
    if isinstance(func, ast.Name) and func.id in ctx.value_aliases:
        ctx.add(node.lineno, f"{func.id} (an alias of {ctx.value_aliases[func.id]}) "
                f"called in {where} ({why})", "S018")
        return
    if (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name)
            and func.value.id == "self" and func.attr in ctx.attr_aliases):
        ctx.add(node.lineno, f"self.{func.attr} ({ctx.attr_aliases[func.attr]}) called "
                f"in {where} ({why})", "S018")
        return
    literal = literal_getattr(func)
    if literal is not None:
        if name and name.startswith("torch."):
            if name[len("torch."):] not in ALLOWED_TORCH_CALLS:
                ctx.add(node.lineno, f"getattr(..., {literal[1]!r}) reaches {name}, "
                        f"called in {where} ({why})", "S018")
        elif literal[1].rstrip("_") in COMPUTE_METHODS:
            ctx.add(node.lineno, f"getattr(..., {literal[1]!r}) reaches the tensor "
                    f"method .{literal[1]}(), called in {where} ({why})", "S018")
        return
    if name and name.startswith("torch."):
        short = name[len("torch."):]
        if short not in ALLOWED_TORCH_CALLS and name not in STREAM_CALLS:
            ctx.add(node.lineno, f"{name} called in {where} ({why})", "S007")
        return
    if not isinstance(func, ast.Attribute):
        return
    base = func.value
    if (isinstance(base, ast.Name) and base.id == "self" and func.attr in submodules):
        ctx.add(node.lineno, f"self.{func.attr} ({submodules[func.attr]}) called in {where} "
                "(torch modules compute in PyTorch; keep its parameters but do the work "
                "in a Triton kernel)", "S007")
        return
    base_name = ctx.qual(base)
    if base_name and base_name.split(".")[0] in ctx.aliases:
        return  # a module function (math.exp, triton.cdiv), not a tensor method
    method = func.attr
    if method.endswith("_") and not method.endswith("__"):
        method = method[:-1]
    if method in COMPUTE_METHODS:
        ctx.add(node.lineno, f".{func.attr}() called in {where} ({why})", "S007")
