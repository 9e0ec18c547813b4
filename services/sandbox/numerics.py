"""GPU (NVIDIA, sm_80 and later) numerics as numpy functions, for Triton's interpreter.

Triton 3.9's interpreter (``TRITON_INTERPRET=1``) computes with numpy, which differs
from what a GPU runs in ways a kernel can observe with ``tl`` code alone. The functions
here give the GPU's answer; :mod:`services.sandbox.interpreter` installs them into the
interpreter's builder. Sources of each rule:

* **TF32** (``tl.dot``'s default ``input_precision`` for fp32 operands): each operand
  is rounded to 10 explicit mantissa bits by ``cvt.rna.tf32.f32`` (PTX ISA, "cvt":
  ``.rna`` rounds to nearest, ties away from zero) and the products are summed in
  fp32 (:func:`round_tf32`). ``tf32x3`` splits each operand into a TF32 ``big`` part
  and a TF32 rounding of the rest (``small``) and sums ``big*small + small*big +
  big*big`` (Triton's ``F32DotTC`` pass); ``bf16x3`` / ``bf16x6`` split into two or
  three bfloat16 parts the same way (3 and 6 products).
* **Float-to-integer casts** saturate: ``cvt.rzi.sat`` truncates toward zero, clamps to
  the destination's range, and NaN gives 0 (PTX ISA, "cvt", float-to-integer
  conversions) (:func:`float_to_int`). numpy's ``astype`` wraps instead.
* **Narrowing float casts** (fp64 to fp32, fp16 or bf16; fp32 to fp16 or bf16) round
  to nearest even (``cvt.rn``), or toward zero for ``fp_downcast_rounding="rtz"``
  (``cvt.rz``: an overflow gives the largest finite value, never infinity)
  (:func:`narrow`). The interpreter truncates fp32 to bf16.
* **bfloat16** is stored by the interpreter as the raw ``uint16`` bits; arithmetic on
  it computes in fp32 and rounds the result to nearest even, which is what a GPU's
  native bf16 instructions (``add.rn.bf16``, ``fma.rn.bf16``) give for one operation:
  fp32's 24-bit significand is at least twice bf16's 8 plus 2, so the two roundings
  equal one (Figueroa, "When is double rounding innocuous?", SIGNUM 1995). numpy's
  float16 arithmetic already computes in fp32 and rounds once.
* **libdevice** (``triton.language.extra.libdevice``): CUDA's libdevice functions
  (``__nv_tanhf`` ...) as numpy equivalents (:data:`LIBDEVICE`), correctly rounded or
  within a few ulp where libdevice is; its fast-math approximations (``fast_expf``,
  ``fast_tanhf`` ...) are computed exactly here, so they differ from a GPU by their
  approximation error (up to ~2**-21 relative, CUDA Math API, "Intrinsic functions").
* **Approximate fp32 instructions.** Triton's NVIDIA backend lowers fp32 ``tl.exp`` to
  ``ex2.approx.f32`` (of ``x * log2(e)``), ``/`` to ``div.full.f32`` and ``tl.sqrt`` to
  ``sqrt.approx.f32`` (PTX ISA: at most 2 ulp from the correctly rounded result), while
  ``libdevice.exp``, ``tl.div_rn`` and ``tl.sqrt_rn`` are accurate; numpy computes
  both of each pair alike, so a kernel comparing them could tell the interpreter from
  a GPU. :func:`approximate` moves a keyed half of the results one ulp away from zero
  (the key drawn once per process, the lanes a function of the result's bits, so every
  run of a launch gives the same values); results a GPU's approximation also gives
  exactly (``exp`` of 0, exact quotients and square roots) are left as they are.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Callable
from typing import Any

import numpy as np

_U16 = np.dtype(np.uint16)
_U32 = np.dtype(np.uint32)
_F32 = np.dtype(np.float32)
_F64 = np.dtype(np.float64)


# ------------------------------------------------------------------ approximations

# Which results :func:`approximate` moves: drawn once per process (the sandbox's fork
# server installs the numerics before any child forks, so every child of one server
# shares it); kernels never see it, and candidate host code never runs in the replay.
_APPROX_KEY = np.uint32(secrets.randbits(32))
_GOLDEN = np.uint32(0x9E3779B1)  # Knuth's multiplicative hash constant (2**32 / phi)


def approximate(out: np.ndarray, exact: np.ndarray | None = None) -> np.ndarray:
    """``out`` (the correctly rounded fp32 results of an approximate GPU instruction)
    with a keyed half of its finite, nonzero lanes one ulp further from zero, as the
    instruction's own error may leave them; lanes where ``exact`` is true stay.

    Args:
        out: results, any shape; only float32 arrays are changed (others returned).
        exact: bool array broadcastable to ``out``: results the GPU gives exactly.
    Returns:
        a new float32 array (or ``out`` itself when it is not float32).
    """
    if not isinstance(out, np.ndarray) or out.dtype != _F32:
        return out
    bits = np.ascontiguousarray(out).view(_U32)
    with np.errstate(over="ignore"):
        pick = ((bits ^ _APPROX_KEY) * _GOLDEN) >> np.uint32(31) == 1
    pick &= np.isfinite(out) & (out != 0)
    if exact is not None:
        pick &= ~np.broadcast_to(exact, out.shape)
    if not pick.any():
        return out
    moved = bits.copy()
    moved[pick] += np.uint32(1)
    return moved.view(_F32).reshape(out.shape)


def exact_quotient(a: np.ndarray, b: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Where the fp32 quotient ``q`` of ``a / b`` is exact (``q * b == a`` in fp64)."""
    with np.errstate(all="ignore"):
        return np.asarray(q, _F64) * np.asarray(b, _F64) == np.asarray(a, _F64)


def exact_root(x: np.ndarray, r: np.ndarray) -> np.ndarray:
    """Where the fp32 square root ``r`` of ``x`` is exact (``r * r == x`` in fp64)."""
    with np.errstate(all="ignore"):
        return np.asarray(r, _F64) * np.asarray(r, _F64) == np.asarray(x, _F64)


# ------------------------------------------------------------------ bfloat16


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 values stored as ``uint16`` bits -> float32 (exact: bf16 is fp32's top
    half). Any shape."""
    return (np.asarray(bits, _U16).astype(_U32) << np.uint32(16)).view(_F32)


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits (``uint16``), rounded to nearest even as
    ``cvt.rn.bf16.f32`` does; an overflow gives infinity, NaN stays a (quiet) NaN of
    the same sign. Any shape."""
    x = np.asarray(x, _F32)
    bits = x.view(_U32)
    with np.errstate(over="ignore"):
        rounded = ((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))
                   >> np.uint32(16)).astype(_U16)
    nan = np.isnan(x)
    if nan.any():
        quiet = ((bits >> np.uint32(16)) | np.uint32(0x0040)).astype(_U16)
        rounded = np.where(nan, quiet, rounded)
    return rounded


def _f64_to_f32_odd(x: np.ndarray) -> np.ndarray:
    """float64 -> float32 rounded to odd (truncate, then set the last bit when inexact):
    rounding that once more to a format at least 2 bits narrower equals rounding ``x``
    directly (Boldo and Melquiond, "Emulation of FMA and correctly rounded sums: proved
    algorithms using rounding to odd", IEEE TC 2008)."""
    with np.errstate(over="ignore", invalid="ignore"):
        t = x.astype(_F32)
        back = t.astype(_F64)
        inexact = (back != x) & ~np.isnan(x)
        t = np.where(inexact & (np.abs(back) > np.abs(x)), np.nextafter(t, _F32.type(0)), t)
    return (t.view(_U32) | inexact.astype(_U32)).view(_F32)


def to_bf16(x: np.ndarray) -> np.ndarray:
    """Any real array (float32, float64, integers, bool) -> bfloat16 bits, rounded to
    nearest even once (float64 and integers through float32 rounded to odd)."""
    x = np.asarray(x)
    if x.dtype == _F32:
        return f32_to_bf16(x)
    return f32_to_bf16(_f64_to_f32_odd(x.astype(_F64)))


def _bf16_toward_zero(x: np.ndarray) -> np.ndarray:
    """float32 or float64 -> bfloat16 bits, rounded toward zero (``cvt.rz.bf16``)."""
    if x.dtype != _F32:
        x = _toward_zero(x.astype(_F64), _F32)
    bits = np.asarray(x, _F32).view(_U32)
    out = (bits >> np.uint32(16)).astype(_U16)
    nan = np.isnan(x)
    return np.where(nan, out | np.uint16(0x0040), out) if nan.any() else out


def _toward_zero(x: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """``x`` (float) converted to the narrower float ``dtype`` rounding toward zero: the
    nearest-even result stepped one ulp toward zero where it is larger in magnitude
    (an infinity from a finite ``x`` becomes the largest finite value)."""
    with np.errstate(over="ignore", invalid="ignore"):
        t = x.astype(dtype)
        over = np.abs(t.astype(x.dtype)) > np.abs(x)
    return np.where(over, np.nextafter(t, dtype.type(0)), t) if over.any() else t


# ------------------------------------------------------------------ casts


def narrow(x: np.ndarray, dst: np.dtype, bf16: bool, toward_zero: bool = False) -> np.ndarray:
    """A floating-point (or integer) array converted to ``dst`` as a GPU converts it.

    Args:
        x: the source values (float16/32/64, integers or bool; bfloat16 already
            widened with :func:`bf16_to_f32`).
        dst: the numpy dtype the interpreter stores the destination in (``uint16`` for
            bfloat16, with ``bf16`` true).
        bf16: the destination is bfloat16.
        toward_zero: round toward zero (``fp_downcast_rounding="rtz"``) instead of to
            nearest even.

    Returns:
        An array of ``dst``, same shape.
    """
    if bf16:
        if toward_zero and x.dtype.kind == "f":
            return _bf16_toward_zero(x)
        return to_bf16(x)
    if toward_zero and x.dtype.kind == "f" and dst.itemsize < x.dtype.itemsize:
        return _toward_zero(x, dst)
    with np.errstate(over="ignore", invalid="ignore"):
        return x.astype(dst)


def float_to_int(x: np.ndarray, dst: np.dtype) -> np.ndarray:
    """Floats -> integers of ``dst`` as ``cvt.rzi.sat`` converts them: truncated toward
    zero, clamped to ``dst``'s range (+-inf to its ends), NaN -> 0. Any shape."""
    info = np.iinfo(dst)
    with np.errstate(invalid="ignore", over="ignore"):
        t = np.trunc(x.astype(_F64))
        high = t >= math.ldexp(1.0, info.bits - (1 if info.min < 0 else 0))
        low = t < float(info.min)
        bad = high | low | np.isnan(t)
        out = np.where(bad, 0.0, t).astype(dst)
    if high.any():
        out[high] = info.max
    if low.any():
        out[low] = info.min
    return out


# ------------------------------------------------------------------ tl.dot


def round_tf32(x: np.ndarray) -> np.ndarray:
    """float32 -> float32 holding a TF32 value: 10 explicit mantissa bits, rounded to
    nearest with ties away from zero (``cvt.rna.tf32.f32``); inf and NaN unchanged."""
    x = np.ascontiguousarray(x, _F32)
    # +-inf keep their bits (their low 13 bits are 0); only a NaN could carry into
    # another value, so NaNs are put back (one cheap test on a NaN-free tile).
    rounded = ((x.view(_U32) + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).view(_F32)
    nan = np.isnan(x)
    return np.where(nan, x, rounded) if nan.any() else rounded


def _round_bf16_value(x: np.ndarray) -> np.ndarray:
    return bf16_to_f32(f32_to_bf16(x))


def _split(x: np.ndarray, parts: int, rounder: Callable[[np.ndarray], np.ndarray]
           ) -> list[np.ndarray]:
    out = []
    rest = x
    for _ in range(parts):
        part = rounder(rest)
        out.append(part)
        with np.errstate(invalid="ignore"):
            rest = rest - part
    return out


def dot_f32(a: np.ndarray, b: np.ndarray, acc: np.ndarray, precision: str) -> np.ndarray:
    """``a @ b + acc`` for float32 operands as ``tl.dot`` computes it on a GPU for
    ``precision`` (``tf32``, ``tf32x3``, ``ieee``, ``bf16x3``, ``bf16x6``; see the
    module doc). Shapes ``[..., M, K] @ [..., K, N] + [..., M, N]``; float32."""
    if precision == "ieee":
        return np.matmul(a, b) + acc
    if precision == "tf32":
        return np.matmul(round_tf32(a), round_tf32(b)) + acc
    if precision == "tf32x3":
        a_big, a_small = _split(a, 2, round_tf32)
        b_big, b_small = _split(b, 2, round_tf32)
        return (np.matmul(a_big, b_small) + np.matmul(a_small, b_big)) + \
            np.matmul(a_big, b_big) + acc
    if precision in ("bf16x3", "bf16x6"):
        a_hi, a_mid, a_lo = _split(a, 3, _round_bf16_value)
        b_hi, b_mid, b_lo = _split(b, 3, _round_bf16_value)
        terms = [(a_hi, b_mid), (a_mid, b_hi)]
        if precision == "bf16x6":
            terms = [(a_mid, b_mid), (a_hi, b_lo), (a_lo, b_hi)] + terms
        out = np.zeros_like(acc)
        for x, y in terms:
            out = out + np.matmul(x, y)
        return out + np.matmul(a_hi, b_hi) + acc
    raise ValueError(f"unknown tl.dot input_precision {precision!r}")


# ------------------------------------------------------------------ libdevice


def _vectorized(fn: Callable[[float], float], pole: float = math.nan
                ) -> Callable[[np.ndarray], np.ndarray]:
    """A scalar ``math`` function over an array, in float64; ``pole`` where it raises
    (a domain error or an overflow)."""

    def safe(v: float) -> float:
        try:
            return fn(v)
        except (ValueError, OverflowError):
            return math.nan if math.isnan(v) else pole

    ufunc = np.frompyfunc(safe, 1, 1)

    def apply(x: np.ndarray) -> np.ndarray:
        return ufunc(x.astype(_F64)).astype(_F64)

    return apply


def _tgamma(x: np.ndarray) -> np.ndarray:
    x = x.astype(_F64)
    with np.errstate(over="ignore", invalid="ignore"):
        out = _vectorized(math.gamma)(x)
        # math.gamma raises on overflow; the GPU returns inf there (poles: NaN or inf)
        big = (x > 171.7) & np.isfinite(x)
        out = np.where(big, np.inf, out)
        pole = (x <= 0) & (x == np.floor(x))
        out = np.where(pole & (x == 0), np.copysign(np.inf, x), np.where(pole, np.nan, out))
    return out


def _round_half_away(x: np.ndarray) -> np.ndarray:
    t = np.trunc(x)
    return np.where(np.abs(x - t) >= 0.5, t + np.sign(x), t)


def _erfinv(y: np.ndarray) -> np.ndarray:
    """Inverse error function: Giles' single-precision approximation ("Approximating
    the erfinv function", GPU Computing Gems, 2011) refined by two Newton steps in
    float64 (erf from ``math.erf``)."""
    y = y.astype(_F64)
    with np.errstate(divide="ignore", invalid="ignore"):
        w = -np.log((1.0 - y) * (1.0 + y))
        small = w < 5.0
        ws = w - 2.5
        ps = 2.81022636e-08
        for c in (3.43273939e-07, -3.5233877e-06, -4.39150654e-06, 0.00021858087,
                  -0.00125372503, -0.00417768164, 0.246640727, 1.50140941):
            ps = c + ps * ws
        wl = np.sqrt(w) - 3.0
        pl = -0.000200214257
        for c in (0.000100950558, 0.00134934322, -0.00367342844, 0.00573950773,
                  -0.0076224613, 0.00943887047, 1.00167406, 2.83297682):
            pl = c + pl * wl
        x = np.where(small, ps, pl) * y
        erf = _vectorized(math.erf)
        for _ in range(2):
            x = x - (erf(x) - y) / (2.0 / math.sqrt(math.pi) * np.exp(-x * x))
        x = np.where(np.abs(y) == 1.0, np.copysign(np.inf, y), x)
        x = np.where(np.abs(y) > 1.0, np.nan, x)
    return x


def _ilogb(x: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        _, e = np.frexp(x)
    out = (e - 1).astype(np.int64)
    out = np.where(x == 0, -2147483648, out)
    out = np.where(np.isnan(x), -2147483648, out)
    return np.where(np.isinf(x), 2147483647, out)


def _remainder(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    return np.frompyfunc(lambda a, b: math.remainder(a, b) if b != 0 and not math.isinf(a)
                         else math.nan, 2, 1)(x.astype(_F64), y.astype(_F64)).astype(_F64)


def _fma(x: np.ndarray, y: np.ndarray, z: np.ndarray) -> np.ndarray:
    """``x * y + z`` rounded once (Triton's own fp32 and fp64 FMA of its interpreter)."""
    from triton._C.libtriton import interpreter as native

    x, y, z = np.broadcast_arrays(x, y, z)
    if z.dtype == _F32:
        return native.fma_fp32(x.astype(_F32), y.astype(_F32), z)
    return native.fma_fp64(x.astype(_F64), y.astype(_F64), z.astype(_F64))


def _norm(*xs: np.ndarray) -> np.ndarray:
    wide = [x.astype(_F64) for x in xs]
    return np.sqrt(sum(w * w for w in wide))


def _float_to_int_rounded(rounder: Callable[[np.ndarray], np.ndarray], dst: Any
                          ) -> Callable[[np.ndarray], np.ndarray]:
    return lambda x: float_to_int(rounder(x.astype(_F64)), np.dtype(dst))


_ERF = _vectorized(math.erf)
_ERFC = _vectorized(math.erfc)
_RN = np.rint
_RZ = np.trunc
_RD = np.floor
_RU = np.ceil

LIBDEVICE: dict[str, Callable[..., np.ndarray]] = {
    # rounding and magnitude
    "abs": np.abs, "fabs": np.abs, "floor": np.floor, "ceil": np.ceil, "trunc": np.trunc,
    "rint": np.rint, "nearbyint": np.rint, "round": _round_half_away,
    "saturatef": lambda x: np.where(np.isnan(x), 0, np.clip(x, 0, 1)),
    "copysign": np.copysign, "fdim": lambda x, y: np.where(x > y, x - y, np.where(
        np.isnan(x) | np.isnan(y), np.nan, 0)),
    "fmod": np.fmod, "remainder": _remainder, "nextafter": np.nextafter,
    "ldexp": lambda x, e: np.ldexp(x, e.astype(np.int32)),
    "scalbn": lambda x, e: np.ldexp(x, e.astype(np.int32)),
    "ilogb": _ilogb, "logb": lambda x: np.where(x == 0, -np.inf, np.where(
        np.isinf(x), np.inf, _ilogb(x))),
    # classification (int32 0/1)
    "isnan": np.isnan, "isinf": np.isinf, "finitef": np.isfinite, "isfinited": np.isfinite,
    "signbit": np.signbit,
    # arithmetic, correctly rounded (the _rz/_rd/_ru variants round to nearest here)
    "add_rn": np.add, "add_rz": np.add, "add_rd": np.add, "add_ru": np.add,
    "sub_rn": np.subtract, "sub_rz": np.subtract, "sub_rd": np.subtract,
    "sub_ru": np.subtract,
    "mul_rn": np.multiply, "mul_rz": np.multiply, "mul_rd": np.multiply,
    "mul_ru": np.multiply,
    "div_rn": np.divide, "div_rz": np.divide, "div_rd": np.divide, "div_ru": np.divide,
    "fast_dividef": np.divide,
    "rcp_rn": np.reciprocal, "rcp_rz": np.reciprocal, "rcp_rd": np.reciprocal,
    "rcp_ru": np.reciprocal,
    "sqrt": np.sqrt, "sqrt_rn": np.sqrt, "sqrt_rz": np.sqrt, "sqrt_rd": np.sqrt,
    "sqrt_ru": np.sqrt,
    "rsqrt": lambda x: 1 / np.sqrt(x), "rsqrt_rn": lambda x: 1 / np.sqrt(x),
    "cbrt": np.cbrt, "rcbrt": lambda x: 1 / np.cbrt(x),
    "hypot": np.hypot, "rhypot": lambda x, y: 1 / np.hypot(x, y),
    "norm3d": _norm, "norm4d": _norm,
    "rnorm3d": lambda *xs: 1 / _norm(*xs), "rnorm4d": lambda *xs: 1 / _norm(*xs),
    # exponentials and logarithms
    "exp": np.exp, "exp2": np.exp2, "exp10": lambda x: np.power(x.dtype.type(10), x),
    "expm1": np.expm1, "log": np.log, "log2": np.log2, "log10": np.log10,
    "log1p": np.log1p, "pow": lambda x, y: np.power(x, y.astype(x.dtype)),
    "fast_expf": np.exp, "fast_exp10f": lambda x: np.power(np.float32(10), x),
    "fast_logf": np.log, "fast_log2f": np.log2, "fast_log10f": np.log10,
    "fast_powf": np.power,
    # trigonometric and hyperbolic
    "sin": np.sin, "cos": np.cos, "tan": np.tan, "fast_sinf": np.sin,
    "fast_cosf": np.cos, "fast_tanf": np.tan,
    "sinpi": lambda x: np.sin(np.pi * x.astype(_F64)),
    "cospi": lambda x: np.cos(np.pi * x.astype(_F64)),
    "asin": np.arcsin, "acos": np.arccos, "atan": np.arctan, "atan2": np.arctan2,
    "sinh": np.sinh, "cosh": np.cosh, "tanh": np.tanh, "fast_tanhf": np.tanh,
    "asinh": np.arcsinh, "acosh": np.arccosh, "atanh": np.arctanh,
    # special functions
    "erf": _ERF, "erfc": _ERFC,
    "erfcx": lambda x: np.where(x < 25, np.exp(np.minimum(x.astype(_F64), 25) ** 2) * _ERFC(x),
                                1 / (math.sqrt(math.pi) * x.astype(_F64))),
    "erfinv": _erfinv, "erfcinv": lambda y: _erfinv(1 - y.astype(_F64)),
    "normcdf": lambda x: 0.5 * _ERFC(-x.astype(_F64) / math.sqrt(2)),
    "normcdfinv": lambda p: math.sqrt(2) * _erfinv(2 * p.astype(_F64) - 1),
    "lgamma": _vectorized(math.lgamma, pole=math.inf), "tgamma": _tgamma,
    "cyl_bessel_i0": np.i0,
    # fused multiply-add: one rounding
    "fma": lambda x, y, z: _fma(x, y, z), "fma_rn": lambda x, y, z: _fma(x, y, z),
    # conversions (float-to-integer saturate as cvt does)
    "float2int_rn": _float_to_int_rounded(_RN, np.int32),
    "float2int_rz": _float_to_int_rounded(_RZ, np.int32),
    "float2int_rd": _float_to_int_rounded(_RD, np.int32),
    "float2int_ru": _float_to_int_rounded(_RU, np.int32),
    "float2uint_rn": _float_to_int_rounded(_RN, np.uint32),
    "float2uint_rz": _float_to_int_rounded(_RZ, np.uint32),
    "float2ll_rn": _float_to_int_rounded(_RN, np.int64),
    "float2ll_rz": _float_to_int_rounded(_RZ, np.int64),
    "double2int_rn": _float_to_int_rounded(_RN, np.int32),
    "double2int_rz": _float_to_int_rounded(_RZ, np.int32),
    "double2ll_rn": _float_to_int_rounded(_RN, np.int64),
    "double2ll_rz": _float_to_int_rounded(_RZ, np.int64),
    "llrint": _float_to_int_rounded(_RN, np.int64),
    "llround": _float_to_int_rounded(_round_half_away, np.int64),
    "double2float_rn": lambda x: x.astype(_F32),
    "double2float_rz": lambda x: _toward_zero(x.astype(_F64), _F32),
    "int2float_rn": lambda x: x.astype(_F32), "uint2float_rn": lambda x: x.astype(_F32),
    "ll2float_rn": lambda x: x.astype(_F32), "int2double_rn": lambda x: x.astype(_F64),
    "float_as_int": lambda x: np.ascontiguousarray(x, _F32).view(np.int32),
    "int_as_float": lambda x: np.ascontiguousarray(x, np.int32).view(_F32),
    "float_as_uint": lambda x: np.ascontiguousarray(x, _F32).view(np.uint32),
    "uint_as_float": lambda x: np.ascontiguousarray(x, np.uint32).view(_F32),
    "double_as_longlong": lambda x: np.ascontiguousarray(x, _F64).view(np.int64),
    "longlong_as_double": lambda x: np.ascontiguousarray(x, np.int64).view(_F64),
    # integer functions
    "popc": lambda x: np.bitwise_count(x.view(np.uint32 if x.itemsize == 4 else np.uint64)),
    "hadd": lambda x, y: (x.astype(np.int64) + y) >> 1,
    "rhadd": lambda x, y: (x.astype(np.int64) + y + 1) >> 1,
    "mul24": lambda x, y: ((x.astype(np.int64) << 40 >> 40) * (y.astype(np.int64) << 40 >> 40)),
    "mulhi": lambda x, y: (x.astype(np.int64) * y.astype(np.int64)) >> 32,
}
"""Each libdevice function of ``triton.language.extra.libdevice`` by its name there ->
a numpy function of its arguments' arrays. The result is converted to the libdevice
symbol's return type; integer results of classifications are 0/1."""


def libdevice_symbols(source: str) -> dict[str, str]:
    """The libdevice symbol (``__nv_tanhf``) -> function name (``tanh``) table of
    Triton's CUDA libdevice module, read from its source (``source``: the module's
    text; each function's dispatch table names its symbols)."""
    import ast

    table: dict[str, str] = {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.FunctionDef):
            continue
        for sub in ast.walk(node):
            if isinstance(sub, ast.Constant) and isinstance(sub.value, str) and \
                    sub.value.startswith("__nv_"):
                table[sub.value] = node.name
    return table


def libdevice_call(name: str, args: list[np.ndarray], out: np.dtype) -> np.ndarray:
    """Run libdevice function ``name`` on ``args`` (numpy arrays, broadcast together),
    giving an array of ``out``.

    Raises:
        NotImplementedError: no numpy equivalent of ``name`` here (the message names it).
    """
    fn = LIBDEVICE.get(name)
    if fn is None:
        raise NotImplementedError(
            f"libdevice.{name} has no implementation in the verifier's Triton interpreter; "
            "use a triton.language function or another libdevice function")
    with np.errstate(all="ignore"):
        result = np.asarray(fn(*args))
        if out.kind in "iu" and result.dtype.kind == "f":
            return float_to_int(result, out)
        return result.astype(out)
