"""Tolerances of the numerical comparison of candidate outputs with reference outputs
(:mod:`services.worker.correctness`), per dtype of the expected output and backend.

Tolerances (``|got - expected| <= atol + rtol * |expected|``, the rule of
``torch.isclose`` / ``torch.testing.assert_close``), per dtype of the expected output:

===============  ============  ============  ============================================
dtype            atol          rtol          why
===============  ============  ============  ============================================
float64          1e-7          1e-7          torch.testing's defaults (rtol 1e-7,
                                             atol 1e-7).
float32          1e-4          1e-4          torch.testing's rtol 1.3e-6 / atol 1e-5
                                             fails honest kernels that sum in another
                                             order; KernelBench's 1e-2 passes kernels
                                             that drop a small term. 1e-4 is ~840 ulp of 1.0.
float32 (GPU)    5e-3          5e-3          Triton's ``tl.dot`` on fp32 inputs uses TF32
                                             (10-bit mantissa) unless the kernel asks for
                                             ``input_precision="ieee"``; PyTorch's tests
                                             check TF32 matmuls at 5e-3
                                             (``@tf32_on_and_off(0.005)``, torch/testing/
                                             _internal/common_cuda.py). cuda and ascend,
                                             and cpu for a call whose replay ran a TF32
                                             ``tl.dot`` (the interpreter rounds its
                                             operands as a GPU does: :func:`ran_tf32`).
float16          1e-2          1e-2          10-bit mantissa (unit roundoff 4.9e-4) and
                                             accumulation in another order;
                                             torch.testing: rtol 1e-3, atol 1e-5.
bfloat16         2e-2          2e-2          7-bit mantissa (unit roundoff 3.9e-3);
                                             torch.testing: rtol 1.6e-2, atol 1e-5.
float8_e4m3*     1.25e-1       1.25e-1       3-bit mantissa (unit roundoff 6.25e-2).
float8_e5m2*     2.5e-1        2.5e-1        2-bit mantissa (unit roundoff 1.25e-1).
complex          as its real dtype, on the real and imaginary parts.
integer, bool    0             0             exact.
===============  ============  ============  ============================================

``atol`` is scale-aware: it is multiplied by the root-mean-square of the expected
output's finite values when that is above 1. Trials draw inputs at magnitudes up to
100 (:mod:`services.worker.inputs`); a float32 matmul of such inputs has outputs near
1e5 whose rounding errors on elements that cancel reach 1e-2, which a fixed
``1e-4 + 1e-4 * |expected|`` would count against an honest kernel. Below a
root-mean-square of 1 the table's ``atol`` holds (the relative L2 bound of
:mod:`services.worker.correctness` keeps small outputs honest).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

_FLOAT_TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-7, 1e-7),
    torch.float32: (1e-4, 1e-4),
    torch.float16: (1e-2, 1e-2),
    torch.bfloat16: (2e-2, 2e-2),
}
_GPU_FLOAT32 = (5e-3, 5e-3)
# Relative L2 error bound as a multiple of the dtype's rtol (services/worker/correctness.py).
REL_L2_FACTOR = 5.0


@dataclass(frozen=True)
class Tolerance:
    """Absolute and relative tolerance (unitless, in the output's values)."""

    atol: float
    rtol: float


@dataclass(frozen=True)
class Widening:
    """The allowance of a float64 recheck (:func:`services.worker.correctness.recheck`):
    ``atol`` (the output's units) is added to the scaled atol and lets a constant output
    pass against a truth whose spread is within it; the relative L2 bound is at least
    ``rel_l2`` (unitless)."""

    atol: float
    rel_l2: float


def ran_tf32(traffic: Iterable[Any]) -> bool:
    """Whether a replayed call ran a TF32 ``tl.dot``: its counted launches
    (``LaunchTraffic``, :mod:`services.worker.traffic`) hold ``tf32`` dot FLOPs. Such a
    call's float32 outputs are judged at the GPU's float32 tolerance on every backend."""
    return any((getattr(launch, "dot_flops", None) or {}).get("tf32") for launch in traffic)


def tolerance_for(dtype: torch.dtype, backend: str = "cpu", *, tf32: bool = False
                  ) -> Tolerance:
    """The tolerance for an expected output of ``dtype`` on ``backend`` (table in the
    module doc); ``tf32``: the call ran a TF32 ``tl.dot`` (:func:`ran_tf32`)."""
    if dtype.is_complex:
        dtype = {torch.complex128: torch.float64, torch.complex64: torch.float32,
                 torch.complex32: torch.float16}.get(dtype, torch.float32)
    if dtype == torch.float32 and (backend != "cpu" or tf32):
        return Tolerance(*_GPU_FLOAT32)
    if dtype in _FLOAT_TOLERANCES:
        return Tolerance(*_FLOAT_TOLERANCES[dtype])
    if dtype.is_floating_point:
        name = str(dtype)
        if "e4m3" in name:
            return Tolerance(0.125, 0.125)
        if "e5m2" in name:
            return Tolerance(0.25, 0.25)
        return Tolerance(*_FLOAT_TOLERANCES[torch.float32])
    return Tolerance(0.0, 0.0)


def scaled(tol: Tolerance, expected: torch.Tensor) -> Tolerance:
    """``tol`` with its atol multiplied by the root-mean-square of ``expected``'s finite
    values when that is above 1 (see the module doc); ``expected`` is float64."""
    finite = expected[torch.isfinite(expected)]
    if tol.atol == 0 or finite.numel() == 0:
        return tol
    top = float(finite.abs().max())
    if top <= 1.0:
        return tol
    rms = top * float(torch.sqrt(torch.mean((finite / top) ** 2)))
    return Tolerance(tol.atol * rms, tol.rtol) if rms > 1.0 else tol


def format_tolerance(value: float) -> str:
    """``1e-4``, ``2e-2``, ``1.25e-1``, ``0``: short, exact for the table's values."""
    if value == 0:
        return "0"
    mantissa, exponent = f"{value:.3e}".split("e")
    mantissa = mantissa.rstrip("0").rstrip(".")
    return f"{mantissa}e{int(exponent)}"
