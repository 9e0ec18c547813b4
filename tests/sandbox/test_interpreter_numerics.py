"""The interpreter computes as a GPU does (services.sandbox.interpreter, .numerics): real
kernels run in Triton's interpreter in this process, each rule against its GPU answer."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice
from triton.language.extra.cuda import libdevice as cuda_libdevice

from schemas.events import LaunchTraffic
from services.sandbox import interpreter as gpu_numerics
from services.sandbox import numerics
from services.worker.correctness import compare_outputs, ran_tf32


def _dot_kernel(a_ptr, b_ptr, c_ptr, PRECISION: tl.constexpr):
    r = tl.arange(0, 16)
    offs = r[:, None] * 16 + r[None, :]
    a = tl.load(a_ptr + offs)
    b = tl.load(b_ptr + offs)
    if PRECISION == "default":
        c = tl.dot(a, b)
    else:
        c = tl.dot(a, b, input_precision=PRECISION)
    tl.store(c_ptr + offs, c)


def _cast_kernel(x_ptr, i32_ptr, i8_ptr, u8_ptr, i64_ptr, bf_ptr, h_ptr, bfz_ptr, hz_ptr,
                 n, BLOCK: tl.constexpr):
    o = tl.arange(0, BLOCK)
    m = o < n
    x = tl.load(x_ptr + o, mask=m)
    tl.store(i32_ptr + o, x.to(tl.int32), mask=m)
    tl.store(i8_ptr + o, x.to(tl.int8), mask=m)
    tl.store(u8_ptr + o, x.to(tl.uint8), mask=m)
    tl.store(i64_ptr + o, x.to(tl.int64), mask=m)
    tl.store(bf_ptr + o, x.to(tl.bfloat16), mask=m)
    tl.store(h_ptr + o, x.to(tl.float16), mask=m)
    tl.store(bfz_ptr + o, x.to(tl.bfloat16, fp_downcast_rounding="rtz"), mask=m)
    tl.store(hz_ptr + o, x.to(tl.float16, fp_downcast_rounding="rtz"), mask=m)


def _narrow64_kernel(x_ptr, f_ptr, n, BLOCK: tl.constexpr):
    o = tl.arange(0, BLOCK)
    m = o < n
    tl.store(f_ptr + o, tl.load(x_ptr + o, mask=m).to(tl.float32), mask=m)


def _half_kernel(x_ptr, y_ptr, fma_ptr, neg_ptr, less_ptr, sum_ptr, max_ptr, n,
                 BLOCK: tl.constexpr):
    o = tl.arange(0, BLOCK)
    m = o < n
    x = tl.load(x_ptr + o, mask=m, other=0.0)
    y = tl.load(y_ptr + o, mask=m, other=0.0)
    tl.store(fma_ptr + o, x * y + x, mask=m)
    tl.store(neg_ptr + o, -x, mask=m)
    tl.store(less_ptr + o, x < y, mask=m)
    # tl.sum and tl.max as the interpreter runs them (their @jit wrappers need triton
    # imported with TRITON_INTERPRET=1, as in the sandbox, not in this process)
    tl.store(sum_ptr, tl.reduce(x, 0, tl.standard._sum_combine))
    lowest = tl.full((BLOCK,), -60000.0, tl.float32).to(x.dtype)
    tl.store(max_ptr, tl.reduce(tl.where(m, x, lowest), 0, tl.standard._elementwise_max))


def _libdevice_kernel(x_ptr, y_ptr, out_ptr, n, FN: tl.constexpr,
                      BLOCK: tl.constexpr):
    o = tl.arange(0, BLOCK)
    m = o < n
    x = tl.load(x_ptr + o, mask=m, other=1.0)
    y = tl.load(y_ptr + o, mask=m, other=1.0)
    if FN == "tanh":
        r = libdevice.tanh(x)
    elif FN == "exp":
        r = libdevice.exp(x)
    elif FN == "exp2":
        r = libdevice.exp2(x)
    elif FN == "log":
        r = libdevice.log(y)
    elif FN == "log1p":
        r = libdevice.log1p(y)
    elif FN == "expm1":
        r = libdevice.expm1(x)
    elif FN == "sqrt":
        r = libdevice.sqrt(y)
    elif FN == "rsqrt":
        r = libdevice.rsqrt(y)
    elif FN == "erf":
        r = libdevice.erf(x)
    elif FN == "pow":
        r = libdevice.pow(y, x)
    elif FN == "fast_expf":
        r = libdevice.fast_expf(x)
    elif FN == "floor":
        r = libdevice.floor(x)
    elif FN == "ceil":
        r = libdevice.ceil(x)
    elif FN == "round":
        r = libdevice.round(x)
    elif FN == "trunc":
        r = libdevice.trunc(x)
    elif FN == "sin":
        r = libdevice.sin(x)
    elif FN == "cos":
        r = libdevice.cos(x)
    elif FN == "atan":
        r = libdevice.atan(x)
    elif FN == "sinh":
        r = libdevice.sinh(x)
    elif FN == "cosh":
        r = libdevice.cosh(x)
    elif FN == "asin":
        r = libdevice.asin(x * 0.1)
    elif FN == "acos":
        r = libdevice.acos(x * 0.1)
    elif FN == "div_rn":
        r = libdevice.div_rn(x, y)
    elif FN == "isnan":
        r = tl.where(libdevice.isnan(x / (x - x)), 1.0, 0.0)
    elif FN == "isinf":
        r = tl.where(libdevice.isinf(x / (x - x)), 1.0, 0.0)
    else:
        r = cuda_libdevice.tanh(x) + cuda_libdevice.erf(x)
    tl.store(out_ptr + o, r, mask=m)


def _approx_kernel(x_ptr, y_ptr, exp_ptr, libexp_ptr, div_ptr, div_rn_ptr, sqrt_ptr,
                   sqrt_rn_ptr, n, BLOCK: tl.constexpr):
    o = tl.arange(0, BLOCK)
    m = o < n
    x = tl.load(x_ptr + o, mask=m, other=1.0)
    y = tl.load(y_ptr + o, mask=m, other=1.0)
    tl.store(exp_ptr + o, tl.exp(x), mask=m)
    tl.store(libexp_ptr + o, libdevice.exp(x), mask=m)
    tl.store(div_ptr + o, x / y, mask=m)
    tl.store(div_rn_ptr + o, tl.div_rn(x, y), mask=m)
    tl.store(sqrt_ptr + o, tl.sqrt(tl.abs(x)), mask=m)
    tl.store(sqrt_rn_ptr + o, tl.sqrt_rn(tl.abs(x)), mask=m)


@pytest.fixture(scope="module")
def kernels():
    """The module's kernels, run by Triton's interpreter with the GPU numerics in place
    (as the cpu fork server installs them before any child forks)."""
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"  # read by triton.jit when it wraps a function
    assert gpu_numerics.install()
    yield {fn.__name__.strip("_").removesuffix("_kernel"): triton.jit(fn)
           for fn in (_dot_kernel, _cast_kernel, _narrow64_kernel, _half_kernel,
                      _libdevice_kernel, _approx_kernel)}
    if saved is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = saved


# ------------------------------------------------------------------ tl.dot


def _dot(kernels, a: torch.Tensor, b: torch.Tensor, precision: str) -> torch.Tensor:
    c = torch.empty(16, 16)
    kernels["dot"][(1,)](a, b, c, PRECISION=precision)
    return c


def test_fp32_dot_rounds_operands_to_tf32_by_default(kernels) -> None:
    # 1 + 2**-20 has no TF32 representation: a GPU's product with 1 is 1, IEEE's is exact.
    a = torch.full((16, 16), 1.0 + 2.0 ** -20)
    eye = torch.eye(16)
    assert _dot(kernels, a, eye, "ieee")[0, 0].item() == 1.0 + 2.0 ** -20
    assert _dot(kernels, a, eye, "tf32")[0, 0].item() == 1.0
    assert _dot(kernels, a, eye, "default")[0, 0].item() == 1.0
    # tf32x3 (big + small parts), bf16x3 and bf16x6 recover it.
    for precision in ("tf32x3", "bf16x3", "bf16x6"):
        assert _dot(kernels, a, eye, precision)[0, 0].item() == 1.0 + 2.0 ** -20, precision


def test_tf32_rounding_is_to_nearest_ties_away_from_zero(kernels) -> None:
    # 1 + 2**-11 is halfway between TF32 neighbours 1 and 1 + 2**-10: cvt.rna rounds away.
    a = torch.zeros(16, 16)
    a[0, 0], a[1, 0], a[2, 0] = 1.0 + 2.0 ** -11, -(1.0 + 2.0 ** -11), 1.0 + 2.0 ** -12
    got = _dot(kernels, a, torch.eye(16), "tf32")
    assert got[0, 0].item() == 1.0 + 2.0 ** -10
    assert got[1, 0].item() == -(1.0 + 2.0 ** -10)
    assert got[2, 0].item() == 1.0


def test_tf32_dot_is_the_product_of_rounded_operands(kernels) -> None:
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(16, 16, generator=g), torch.randn(16, 16, generator=g)
    got = _dot(kernels, a, b, "tf32").double()
    rounded = [torch.from_numpy(numerics.round_tf32(t.numpy())).double() for t in (a, b)]
    torch.testing.assert_close(got, rounded[0] @ rounded[1], rtol=1e-6, atol=1e-6)
    exact = a.double() @ b.double()
    assert (got - exact).abs().max().item() > 1e-4  # TF32's error, not IEEE's
    ieee = _dot(kernels, a, b, "ieee").double()
    torch.testing.assert_close(ieee, exact, rtol=1e-5, atol=1e-5)


def test_round_tf32_keeps_inf_and_nan() -> None:
    x = np.array([np.inf, -np.inf, np.nan, 3.4028235e38], np.float32)
    out = numerics.round_tf32(x)
    assert np.isposinf(out[0]) and np.isneginf(out[1]) and np.isnan(out[2])
    assert np.isposinf(out[3])  # the largest float32 rounds up past TF32's largest


# ------------------------------------------------------------------ casts

_CAST_INPUTS = [math.nan, math.inf, -math.inf, 3e9, -3e9, 1e20, -1.7, 2.9, 300.0, -200.0,
                1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8, 1.0 + 2.0 ** -8 + 2.0 ** -20,
                1.0 + 2.0 ** -11, 1.0 + 3 * 2.0 ** -11, 70000.0, -70000.0, 65519.0, 65520.0]


def _casts(kernels) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    x = torch.tensor(_CAST_INPUTS, dtype=torch.float32)
    n = x.numel()
    outs = {"i32": torch.empty(n, dtype=torch.int32), "i8": torch.empty(n, dtype=torch.int8),
            "u8": torch.empty(n, dtype=torch.uint8), "i64": torch.empty(n, dtype=torch.int64),
            "bf": torch.empty(n, dtype=torch.bfloat16), "h": torch.empty(n, dtype=torch.float16),
            "bfz": torch.empty(n, dtype=torch.bfloat16),
            "hz": torch.empty(n, dtype=torch.float16)}
    kernels["cast"][(1,)](x, *outs.values(), n, BLOCK=32)
    return x, outs


def _saturated(value: float, lo: int, hi: int) -> int:
    if math.isnan(value):
        return 0
    if math.isinf(value):
        return hi if value > 0 else lo
    return max(lo, min(hi, math.trunc(value)))


def test_float_to_int_casts_saturate_and_nan_gives_zero(kernels) -> None:
    x, outs = _casts(kernels)
    for key, dtype in (("i32", torch.int32), ("i8", torch.int8), ("u8", torch.uint8),
                       ("i64", torch.int64)):
        info = torch.iinfo(dtype)
        want = [_saturated(v, info.min, info.max) for v in x.tolist()]
        assert outs[key].tolist() == want, key
    assert outs["i32"][:3].tolist() == [0, 2 ** 31 - 1, -2 ** 31]


def test_narrowing_casts_round_to_nearest_even(kernels) -> None:
    x, outs = _casts(kernels)
    # torch's conversions round to nearest even, as cvt.rn does on a GPU
    assert torch.equal(outs["bf"].float().nan_to_num(7.0), x.bfloat16().float().nan_to_num(7.0))
    assert torch.equal(outs["h"].float().nan_to_num(7.0), x.half().float().nan_to_num(7.0))
    bf = outs["bf"].float().tolist()
    assert bf[10] == 1.0  # a tie between 1 and 1 + 2**-7 goes to the even 1
    assert bf[11] == 1.0 + 2.0 ** -6  # a tie between 1 + 2**-7 and 1 + 2**-6: even is up
    assert bf[12] == 1.0 + 2.0 ** -7  # just above a tie: up (truncation gave 1)
    h = outs["h"].float().tolist()
    assert h[13] == 1.0 and h[14] == 1.0 + 2.0 ** -9
    assert h[17] == 65504.0 and math.isinf(h[18])  # 65520 is halfway to 2**16: inf


def test_rtz_rounding_truncates_and_never_overflows(kernels) -> None:
    x, outs = _casts(kernels)
    bfz, hz = outs["bfz"].float().tolist(), outs["hz"].float().tolist()
    assert math.isnan(bfz[0]) and bfz[1] == math.inf and bfz[2] == -math.inf
    assert bfz[12] == 1.0 and bfz[11] == 1.0 + 2.0 ** -7
    assert hz[15] == 65504.0 and hz[16] == -65504.0  # cvt.rz: the largest finite value
    assert hz[14] == 1.0 + 2.0 ** -10 and hz[1] == math.inf


def test_fp64_to_fp32_rounds_to_nearest_even(kernels) -> None:
    x = torch.tensor([1.0 + 2.0 ** -24, 1.0 + 3 * 2.0 ** -24, 1.0 + 2.0 ** -24 + 2.0 ** -50,
                      1e39, -1e39, math.nan], dtype=torch.float64)
    out = torch.empty(x.numel())
    kernels["narrow64"][(1,)](x, out, x.numel(), BLOCK=8)
    assert torch.equal(out.nan_to_num(7.0), x.float().nan_to_num(7.0))


def test_fp64_and_integers_round_once_to_bf16() -> None:
    # Through float32 by nearest even, 1 + 2**-8 + 2**-40 would become the tie 1 + 2**-8
    # and then 1; rounding once gives 1 + 2**-7 (rounding to odd first keeps it).
    x = np.array([1.0 + 2.0 ** -8 + 2.0 ** -40, -(1.0 + 2.0 ** -8 + 2.0 ** -40), 1e300])
    got = numerics.bf16_to_f32(numerics.to_bf16(x))
    assert got.tolist() == [1.0 + 2.0 ** -7, -(1.0 + 2.0 ** -7), math.inf]
    ints = np.array([257, 259, 2 ** 24 + 1], np.int64)  # ties at 8 bits: even
    assert numerics.bf16_to_f32(numerics.to_bf16(ints)).tolist() == [256.0, 260.0, 2.0 ** 24]


# ------------------------------------------------------------------ bf16 and fp16


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_arithmetic_rounds_each_operation(kernels, dtype) -> None:
    g = torch.Generator().manual_seed(1)
    n = 200
    x = (torch.randn(n, generator=g) * 3).to(dtype)
    y = (torch.randn(n, generator=g) * 3).to(dtype)
    out = {k: torch.empty(n, dtype=dtype) for k in ("fma", "neg")}
    less = torch.empty(n, dtype=torch.bool)
    total, top = torch.empty(1, dtype=dtype), torch.empty(1, dtype=dtype)
    kernels["half"][(1,)](x, y, out["fma"], out["neg"], less, total, top, n, BLOCK=256)
    # eager PyTorch rounds each bf16/fp16 operation to nearest even, as a GPU does
    assert torch.equal(out["fma"], x * y + x)
    assert torch.equal(out["neg"], -x)
    assert torch.equal(less, x < y)  # negative values compare by value, not by bits
    assert top.item() == x.max().item()
    # the sum: in fp32, rounded once (a GPU rounds each partial sum: within a few ulp)
    assert total.item() == x.float().sum().to(dtype).item()


def test_bf16_dot_operands_are_values(kernels) -> None:
    g = torch.Generator().manual_seed(2)
    a = torch.randn(16, 16, generator=g).bfloat16()
    b = torch.randn(16, 16, generator=g).bfloat16()
    c = torch.empty(16, 16)
    kernels["dot"][(1,)](a, b, c, PRECISION="default")
    torch.testing.assert_close(c, a.float() @ b.float(), rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ libdevice

_LIBDEVICE = {
    "tanh": lambda x, y: torch.tanh(x), "exp": lambda x, y: torch.exp(x),
    "exp2": lambda x, y: torch.exp2(x), "log": lambda x, y: torch.log(y),
    "log1p": lambda x, y: torch.log1p(y), "expm1": lambda x, y: torch.expm1(x),
    "sqrt": lambda x, y: torch.sqrt(y), "rsqrt": lambda x, y: torch.rsqrt(y),
    "erf": lambda x, y: torch.erf(x), "pow": lambda x, y: torch.pow(y, x),
    "fast_expf": lambda x, y: torch.exp(x), "floor": lambda x, y: torch.floor(x),
    "ceil": lambda x, y: torch.ceil(x),
    "round": lambda x, y: torch.sign(x) * torch.floor(x.abs() + 0.5),
    "trunc": lambda x, y: torch.trunc(x), "sin": lambda x, y: torch.sin(x),
    "cos": lambda x, y: torch.cos(x), "atan": lambda x, y: torch.atan(x),
    "sinh": lambda x, y: torch.sinh(x), "cosh": lambda x, y: torch.cosh(x),
    "asin": lambda x, y: torch.asin(x * 0.1), "acos": lambda x, y: torch.acos(x * 0.1),
    "div_rn": lambda x, y: x / y,
    "isnan": lambda x, y: torch.isnan(x / (x - x)).float(),
    "isinf": lambda x, y: torch.isinf(x / (x - x)).float(),
    "cuda_module": lambda x, y: torch.tanh(x) + torch.erf(x),
}


@pytest.mark.parametrize("name", sorted(_LIBDEVICE))
def test_libdevice_functions_run_in_the_interpreter(kernels, name) -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(300, generator=g) * 2
    x[:4] = torch.tensor([0.5, -0.5, 2.5, 0.0])  # round's ties go away from zero
    y = torch.rand(300, generator=g) * 4 + 0.01
    out = torch.full((300,), math.nan)
    kernels["libdevice"][(1,)](x, y, out, 300, FN=name, BLOCK=512)
    want = _LIBDEVICE[name](x.double(), y.double()).float()
    torch.testing.assert_close(out, want, rtol=2e-6, atol=2e-6, equal_nan=True)


def test_a_libdevice_function_without_an_equivalent_names_itself() -> None:
    with pytest.raises(NotImplementedError, match=r"libdevice\.j0 has no implementation"):
        numerics.libdevice_call("j0", [np.zeros(2, np.float32)], np.dtype(np.float32))


def test_libdevice_symbols_cover_the_cuda_table() -> None:
    from pathlib import Path

    from triton.language.extra.cuda import libdevice as cuda

    symbols = numerics.libdevice_symbols(Path(cuda.__file__).read_text())
    assert symbols["__nv_tanhf"] == symbols["__nv_tanh"] == "tanh"
    assert symbols["__nv_fast_expf"] == "fast_expf" and symbols["__nv_powif"] == "pow"
    # every math function of the list the interpreter is asked to cover has a numpy twin
    for name in ("tanh", "exp", "exp2", "log", "log1p", "expm1", "sqrt", "rsqrt", "erf",
                 "pow", "fast_expf", "isnan", "isinf", "floor", "ceil", "round", "trunc",
                 "sin", "cos", "atan", "sinh", "cosh", "asin", "acos", "div_rn"):
        assert name in numerics.LIBDEVICE, name


# ------------------------------------------------------------------ install and verdict


def test_install_is_idempotent(kernels) -> None:
    from triton.runtime import interpreter

    methods = {name: getattr(interpreter.InterpreterBuilder, name)
               for name in ("create_dot", "cast_impl", "binary_op", "unary_op",
                            "create_extern_elementwise")}
    assert gpu_numerics.install()
    assert all(getattr(interpreter.InterpreterBuilder, n) is m for n, m in methods.items())


def test_a_tf32_dot_is_judged_at_the_gpu_float32_tolerance() -> None:
    expected = [torch.ones(64)]
    got = [torch.ones(64) + 2e-3]  # a TF32-sized error: beyond cpu's 1e-4, within 5e-3
    assert not compare_outputs(expected, got, "cpu").passed
    assert compare_outputs(expected, got, "cpu", tf32=True).passed
    assert not compare_outputs(expected, [torch.ones(64) + 2e-2], "cpu", tf32=True).passed
    assert ran_tf32([LaunchTraffic(kernel="k", dot_flops={"tf32": 8})])
    assert not ran_tf32([LaunchTraffic(kernel="k", dot_flops={"fp32": 8}),
                         LaunchTraffic(kernel="k")])


# ------------------------------------------------------------------ approximations


def _approx(kernels, x: torch.Tensor, y: torch.Tensor) -> dict[str, np.ndarray]:
    names = ("exp", "libexp", "div", "div_rn", "sqrt", "sqrt_rn")
    out = {name: torch.empty_like(x) for name in names}
    kernels["approx"][(1,)](x, y, *out.values(), x.numel(), BLOCK=x.numel())
    return {name: t.numpy() for name, t in out.items()}


def _ulps(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.abs(a.view(np.int32).astype(np.int64) - b.view(np.int32).astype(np.int64))


def test_approximate_instructions_are_not_their_precise_twins(kernels) -> None:
    # On a GPU fp32 tl.exp, / and tl.sqrt are ex2.approx, div.full and sqrt.approx: a
    # kernel comparing them with libdevice.exp, tl.div_rn and tl.sqrt_rn finds lanes
    # that differ, here too; the precise ones stay correctly rounded.
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(1024, generator=g), torch.randn(1024, generator=g) + 3.0
    got = _approx(kernels, x, y)
    xs, ys = x.numpy(), y.numpy()
    assert np.array_equal(got["libexp"], np.exp(xs))
    assert np.array_equal(got["div_rn"], xs / ys)
    assert np.array_equal(got["sqrt_rn"], np.sqrt(np.abs(xs)))
    for fast, precise in (("exp", "libexp"), ("div", "div_rn"), ("sqrt", "sqrt_rn")):
        ulps = _ulps(got[fast], got[precise])
        assert 200 < int((ulps == 1).sum()) < 824 and int(ulps.max()) == 1, fast
    # the same inputs give the same lanes (every order of a launch agrees), and results
    # a GPU's approximation gives exactly stay exact
    again = _approx(kernels, x, y)
    assert all(np.array_equal(got[k], again[k]) for k in got)
    exact = _approx(kernels, torch.tensor([0.0, 6.0, 4.0, 9.0]),
                    torch.tensor([1.0, 3.0, 2.0, 3.0]))
    assert exact["exp"][0] == 1.0 and list(exact["div"][1:]) == [2.0, 2.0, 3.0]
    assert list(exact["sqrt"][2:]) == [2.0, 3.0]
