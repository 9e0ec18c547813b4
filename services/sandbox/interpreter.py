"""Triton's CPU interpreter (``TRITON_INTERPRET=1``) made to compute as a GPU does.

Triton 3.9's interpreter runs a kernel's ``tl`` operations with numpy, and numpy's
numerics differ from an NVIDIA GPU's (sm_80 and later) in ways a kernel can observe
with ``tl`` code alone: a kernel could compute right only where ``tl.dot`` is exact,
or where float-to-int casts wrap. :func:`install` replaces the interpreter builder's
methods with ones that give the GPU's answer (the rules, with their sources, are in
:mod:`services.sandbox.numerics`):

* ``tl.dot`` rounds fp32 operands for its ``input_precision``: TF32 (the default for
  fp32), ``tf32x3``, ``bf16x3``, ``bf16x6`` (accepted here as by the NVIDIA backend),
  or ``ieee`` (exact operands);
* float-to-integer casts saturate (NaN to 0), narrowing float casts round to nearest
  even (or toward zero for ``fp_downcast_rounding="rtz"``), bf16 conversions included;
* bfloat16 arithmetic, comparisons and reductions work on the values, computed in fp32
  and rounded to nearest even (the interpreter worked on the raw ``uint16`` bits);
* ``triton.language.extra.libdevice`` functions run through numpy equivalents (the
  interpreter called the stubs, which return None);
* fp32 ``tl.exp``, ``/`` and ``tl.sqrt``, approximate instructions on a GPU, are not
  correctly rounded in every lane (their precise twins ``libdevice.exp``,
  ``tl.div_rn``, ``tl.sqrt_rn`` are): :func:`services.sandbox.numerics.approximate`.

Speed: every fp32 ``tl.dot`` runs through BLAS (``np.matmul`` without ``dtype``); the
interpreter's own ``np.matmul(a, b, dtype=acc.dtype)`` takes numpy's generic loop
instead (3.7 ms against 0.03 ms for a 128 x 64 by 64 x 128 fp32 tile; triton-lang/triton
pull request 3566 added the ``dtype`` for int8). fp16 and bf16 operands are widened to
fp32 first (their products are exact there) and take BLAS too. Element-wise methods
check for bfloat16 with one dtype test before doing what the interpreter did.

The sandbox's fork server installs it on the cpu backend before any child forks
(:mod:`services.sandbox.forkserver`), so every reference, candidate and lowering child
runs with it; a candidate's own code cannot undo it for the reference or the replay,
which run in other processes (and a kernel body may not reach the interpreter's
internals: :mod:`services.worker.kernel_source`).
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any

from services.sandbox import numerics

_INSTALLED = "_aikg_gpu_numerics"


def install() -> bool:
    """Install the GPU numerics into ``triton.runtime.interpreter``; idempotent.

    Returns:
        True when they are in place, False when this Triton has no interpreter builder
        with a ``create_dot`` (another version: left as it is).
    """
    from triton.runtime import interpreter

    builder = getattr(interpreter, "InterpreterBuilder", None)
    if getattr(builder, "create_dot", None) is None:
        return False
    if getattr(builder, _INSTALLED, False):
        return True
    _install_dot(interpreter)
    _install_casts(interpreter)
    _install_bf16(interpreter)
    _install_libdevice(interpreter)
    _install_approximations(interpreter)
    setattr(builder, _INSTALLED, True)
    return True


# ------------------------------------------------------------------ helpers


def _is_bf16(handle: Any) -> bool:
    """A TensorHandle holding bfloat16 (stored as ``uint16`` bits)."""
    data = getattr(handle, "data", None)
    return data is not None and data.dtype.char == "H" and handle.dtype.scalar.name == "bf16"


def _precision_names() -> dict[Any, str]:
    from triton._C.libtriton import ir

    return {getattr(ir.INPUT_PRECISION, name): name.lower()
            for name in ir.INPUT_PRECISION.__members__}


# ------------------------------------------------------------------ tl.dot


def _install_dot(interpreter: Any) -> None:
    import numpy as np

    builder = interpreter.InterpreterBuilder
    original = builder.create_dot
    handle = interpreter.TensorHandle
    names = _precision_names()
    f32 = np.dtype(np.float32)

    # The NVIDIA backend also accepts bf16x3 and bf16x6 (its allowed_dot_input_precisions).
    options = interpreter.interpreter_builder.options
    extra = tuple(p for p in ("bf16x3", "bf16x6")
                  if p not in options.allowed_dot_input_precisions)
    if extra:
        interpreter.interpreter_builder.options = dataclasses.replace(
            options, allowed_dot_input_precisions=options.allowed_dot_input_precisions + extra)

    def create_dot(self: Any, a: Any, b: Any, d: Any, input_precision: Any,
                   max_num_imprecise_acc: Any) -> Any:
        acc = d.data
        x, y = a.data, b.data
        if acc.dtype == f32:
            if x.dtype == f32 and y.dtype == f32:
                precision = names.get(input_precision) or str(input_precision).lower()
                return handle(numerics.dot_f32(x, y, acc, precision), d.dtype.scalar)
            if _is_bf16(a) and _is_bf16(b):
                return handle(np.matmul(numerics.bf16_to_f32(x), numerics.bf16_to_f32(y)) + acc,
                              d.dtype.scalar)
            if x.dtype.char == "e" and y.dtype.char == "e":  # float16: exact in fp32
                return handle(np.matmul(x.astype(f32), y.astype(f32)) + acc, d.dtype.scalar)
        elif acc.dtype == x.dtype == y.dtype and acc.dtype.kind == "f" and acc.dtype != \
                np.float16:
            return handle(np.matmul(x, y) + acc, d.dtype.scalar)
        return original(self, a, b, d, input_precision, max_num_imprecise_acc)

    create_dot.__doc__ = f"tl.dot as a GPU computes it ({__name__})"
    builder.create_dot = create_dot


# ------------------------------------------------------------------ casts


def _install_casts(interpreter: Any) -> None:
    import numpy as np
    from triton._C.libtriton import ir

    builder = interpreter.InterpreterBuilder
    handle = interpreter.TensorHandle
    np_dtype = interpreter._get_np_dtype
    original_cast = builder.cast_impl
    original_fp_to_fp = builder.create_fp_to_fp
    rtz = ir.ROUNDING_MODE.RTZ

    def widened(src: Any) -> Any:
        return numerics.bf16_to_f32(src.data) if _is_bf16(src) else src.data

    def cast_impl(self: Any, src: Any, dst_type: Any) -> Any:
        source, target = src.dtype.scalar, dst_type.scalar
        if source.is_fp8() or target.is_fp8() or target.is_ptr() or source.is_ptr():
            return original_cast(self, src, dst_type)
        data = widened(src)
        dst = np_dtype(target)
        if target.is_floating():
            out = numerics.narrow(data, dst, target.name == "bf16")
        elif data.dtype.kind == "f":
            out = numerics.float_to_int(data, dst) if dst != np.bool_ else data != 0
        else:
            out = data.astype(dst)
        return handle(out, target)

    def create_fp_to_fp(self: Any, src: Any, dst_type: Any, rounding_mode: Any) -> Any:
        source, target = src.dtype.scalar, dst_type.scalar
        if source.is_fp8() or target.is_fp8():
            return original_fp_to_fp(self, src, dst_type, rounding_mode)
        out = numerics.narrow(widened(src), np_dtype(target), target.name == "bf16",
                              toward_zero=rounding_mode == rtz)
        return handle(out, target)

    builder.cast_impl = cast_impl
    builder.create_fp_to_fp = create_fp_to_fp


# ------------------------------------------------------------------ bfloat16


def _install_bf16(interpreter: Any) -> None:
    import numpy as np
    import triton.language as tl

    builder = interpreter.InterpreterBuilder
    handle = interpreter.TensorHandle
    f32 = np.dtype(np.float32)

    def to_f32(h: Any) -> Any:
        return handle(numerics.bf16_to_f32(h.data), tl.float32) if _is_bf16(h) else h

    def back(out: Any, like: Any) -> Any:
        """A result computed in fp32 for bf16 operands, as bf16 (RNE); a non-float
        result (a comparison) keeps the interpreter's own tagging."""
        if out.data.dtype == f32:
            return handle(numerics.f32_to_bf16(out.data), tl.bfloat16)
        return handle(out.data, like.dtype.scalar)

    original_binary = builder.binary_op

    def binary_op(self: Any, lhs: Any, rhs: Any, op: Any) -> Any:
        if lhs.data.dtype.char != "H" and rhs.data.dtype.char != "H":
            return original_binary(self, lhs, rhs, op)
        if not (_is_bf16(lhs) or _is_bf16(rhs)):
            return original_binary(self, lhs, rhs, op)
        return back(original_binary(self, to_f32(lhs), to_f32(rhs), op), lhs)

    original_unary = builder.unary_op

    def unary_op(self: Any, arg: Any, op: Any) -> Any:
        if arg.data.dtype.char != "H" or not _is_bf16(arg):
            return original_unary(self, arg, op)
        return back(original_unary(self, to_f32(arg), op), arg)

    builder.binary_op = binary_op
    builder.unary_op = unary_op

    def widening(name: str) -> None:
        original = getattr(builder, name)

        @functools.wraps(original)
        def method(self: Any, *args: Any) -> Any:
            if not any(_is_bf16(a) for a in args):
                return original(self, *args)
            first = next(a for a in args if _is_bf16(a))
            return back(original(self, *(to_f32(a) for a in args)), first)

        setattr(builder, name, method)

    for name in ("create_erf", "create_rsqrt", "create_fma", "create_clampf"):
        if hasattr(builder, name):
            widening(name)

    # Reductions and scans with numpy fast paths (sum, min/max, cumsum, cumprod) run
    # in fp32 on bf16 data and round the result once.
    def as_dtype(t: Any, data: Any, dtype: Any) -> Any:
        ty = t.type.with_element_ty(dtype) if t.type.is_block() else dtype
        return tl.core.tensor(handle(data, dtype), ty)

    def reducing(cls: Any, name: str) -> None:
        original = getattr(cls, name)

        @functools.wraps(original)
        def method(self: Any, input: Any, *args: Any, **kwargs: Any) -> Any:
            t = input[0] if isinstance(input, tuple) else input
            if not isinstance(t, tl.core.tensor) or not _is_bf16(t.handle):
                return original(self, input, *args, **kwargs)
            wide = as_dtype(t, numerics.bf16_to_f32(t.handle.data), tl.float32)
            out = original(self, wide, *args, **kwargs)

            def narrowed(r: Any) -> Any:
                if isinstance(r, tl.core.tensor) and r.handle.data.dtype == f32:
                    return as_dtype(r, numerics.f32_to_bf16(r.handle.data), tl.bfloat16)
                return r

            if isinstance(out, (tuple, list)):
                return type(out)(narrowed(r) for r in out)
            return narrowed(out)

        setattr(cls, name, method)

    reducing(interpreter.ReduceOps, "sum")
    reducing(interpreter.ReduceOps, "min_max")
    reducing(interpreter.ScanOps, "cumsum")
    reducing(interpreter.ScanOps, "cumprod")


# ------------------------------------------------------------------ approximations


def _install_approximations(interpreter: Any) -> None:
    """fp32 ``tl.exp`` (``create_exp``), ``/`` (``create_fdiv``) and ``tl.sqrt``
    (``create_sqrt``) through :func:`numerics.approximate`; ``create_precise_divf`` and
    ``create_precise_sqrt`` (``tl.div_rn``, ``tl.sqrt_rn``) stay correctly rounded."""
    builder = interpreter.InterpreterBuilder
    handle = interpreter.TensorHandle
    exp, fdiv, sqrt = builder.create_exp, builder.create_fdiv, builder.create_sqrt

    def create_exp(self: Any, arg: Any) -> Any:
        out = exp(self, arg)
        return handle(numerics.approximate(out.data, out.data == 1.0), out.dtype.scalar)

    def create_fdiv(self: Any, lhs: Any, rhs: Any) -> Any:
        out = fdiv(self, lhs, rhs)
        if out.data.dtype.char != "f":
            return out
        exact = numerics.exact_quotient(lhs.data, rhs.data, out.data)
        return handle(numerics.approximate(out.data, exact), out.dtype.scalar)

    def create_sqrt(self: Any, arg: Any) -> Any:
        out = sqrt(self, arg)
        if out.data.dtype.char != "f":
            return out
        exact = numerics.exact_root(arg.data, out.data)
        return handle(numerics.approximate(out.data, exact), out.dtype.scalar)

    builder.create_exp, builder.create_fdiv, builder.create_sqrt = \
        create_exp, create_fdiv, create_sqrt


# ------------------------------------------------------------------ libdevice


def _install_libdevice(interpreter: Any) -> None:
    """``create_extern_elementwise`` through :data:`numerics.LIBDEVICE`, and the
    functions of ``triton.language.extra.libdevice`` (stubs the GPU compiler replaces
    by those of ``triton.language.extra.cuda.libdevice``) and of the CUDA module
    callable from an interpreted kernel body."""
    import triton.language.extra.libdevice as stubs
    from triton.language.extra.cuda import libdevice as cuda

    builder = interpreter.InterpreterBuilder
    handle = interpreter.TensorHandle
    np_dtype = interpreter._get_np_dtype
    symbols = numerics.libdevice_symbols(Path(cuda.__file__).read_text())
    semantic = interpreter.interpreter_semantic

    def create_extern_elementwise(self: Any, lib_name: Any, lib_path: Any, symbol: str,
                                  args: list[Any], ret_type: Any, is_pure: Any) -> Any:
        name = symbols.get(symbol, symbol)
        arrays = [numerics.bf16_to_f32(a.data) if _is_bf16(a) else a.data for a in args]
        target = ret_type.scalar
        return handle(numerics.libdevice_call(name, arrays, np_dtype(target)), target)

    builder.create_extern_elementwise = create_extern_elementwise

    # CUDA's functions are builtins: the compiler passes _semantic, the interpreter
    # does not (it patches only triton.language's own builtins per kernel).
    for name, fn in list(vars(cuda).items()):
        if not callable(fn) or not getattr(fn, "__triton_builtin__", False) or \
                getattr(fn, "__module__", "") != cuda.__name__:
            continue

        def defaulted(*args: Any, _semantic: Any = None, _fn: Any = fn, **kwargs: Any) -> Any:
            return _fn(*args, _semantic=semantic if _semantic is None else _semantic,
                       **kwargs)

        functools.update_wrapper(defaulted, fn)
        setattr(cuda, name, defaulted)

    # The generic stubs: the compiler maps them by module and name to CUDA's, so each
    # keeps its __module__ and __name__; in the interpreter they call CUDA's.
    for name, stub in list(vars(stubs).items()):
        target = getattr(cuda, name, None)
        if not callable(stub) or getattr(stub, "__module__", "") != stubs.__name__ or \
                target is None:
            continue

        def call(*args: Any, _target: Any = target, **kwargs: Any) -> Any:
            kwargs.pop("_semantic", None)
            return _target(*args, _semantic=semantic, **kwargs)

        call.__module__ = stubs.__name__
        call.__name__ = call.__qualname__ = name
        call.__doc__ = stub.__doc__
        setattr(stubs, name, call)
