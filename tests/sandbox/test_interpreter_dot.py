"""The interpreter's tl.dot through BLAS (services.sandbox.interpreter): same products, every
dtype (the GPU rounding of each input_precision: test_interpreter_numerics.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import triton.language as tl
from triton.runtime import interpreter

from services.sandbox import interpreter as fast_dot
from tests.helpers import ROOT, scaled


@pytest.fixture(scope="module")
def builder():
    assert fast_dot.install()
    return interpreter.InterpreterBuilder


def _dot(builder, a, a_ty, b, b_ty, acc, acc_ty):
    handle = interpreter.TensorHandle
    out = builder.create_dot(None, handle(a, a_ty), handle(b, b_ty), handle(acc, acc_ty),
                             "ieee", 0)
    return out.data


def test_float32_products_match_numpys_own(builder) -> None:
    rng = np.random.default_rng(0)
    a = rng.standard_normal((37, 64), dtype=np.float32)
    b = rng.standard_normal((64, 45), dtype=np.float32)
    acc = rng.standard_normal((37, 45), dtype=np.float32)
    out = _dot(builder, a, tl.float32, b, tl.float32, acc, tl.float32)
    assert out.dtype == np.float32 and out.shape == (37, 45)
    expected = a.astype(np.float64) @ b.astype(np.float64) + acc
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-4)


def test_int8_operands_still_accumulate_in_int32(builder) -> None:
    # the case the interpreter's dtype= is for: 10*10 + 20*20 wraps around in int8
    a = np.array([[10, 20]], np.int8)
    acc = np.zeros((1, 1), np.int32)
    out = _dot(builder, a, tl.int8, a.T.copy(), tl.int8, acc, tl.int32)
    assert out.dtype == np.int32 and out[0, 0] == 500


def test_float16_operands_accumulate_in_float32(builder) -> None:
    a = np.full((16, 16), 0.1, np.float16)
    acc = np.zeros((16, 16), np.float32)
    out = _dot(builder, a, tl.float16, a, tl.float16, acc, tl.float32)
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, np.float32(16 * np.float16(0.1) ** 2), rtol=1e-3)


def test_install_is_idempotent(builder) -> None:
    patched = builder.create_dot
    assert fast_dot.install()
    assert builder.create_dot is patched


@pytest.mark.slow  # a fork server of its own
def test_the_cpu_fork_server_installs_it_before_children_fork() -> None:
    # the GPU numerics (services.sandbox.interpreter.install), tl.dot among them
    probe = ("from services.sandbox import forkserver\n"
             "from triton.runtime import interpreter\n"
             "forkserver._preload([])\n"
             "print(getattr(interpreter.InterpreterBuilder, '_aikg_gpu_numerics', False))\n")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=scaled(120))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "True"
