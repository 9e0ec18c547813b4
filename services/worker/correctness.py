"""The numerical comparison of candidate outputs with reference outputs, and its float64
recheck.

Pure functions on CPU tensors; they run in the worker (the parent), on tensors the
sandboxed children sent, so a candidate cannot influence the verdict except through
the values it computed.

Tolerances (``|got - expected| <= atol + rtol * |expected|``) are per dtype and
backend, scale-aware: the table and where each value comes from is
:mod:`services.worker.tolerances`.

NaN must be NaN where the reference is NaN (and only there); +-Inf must match exactly.

Element-wise tolerances alone can be met by a constant when every expected value is
below ``atol`` (a wide softmax, a tiny-scale norm: KernelBench issue #165), so two
scale-aware checks follow for floating-point outputs, over elements finite in both:

* relative L2 error ``||got - expected||_2 / ||expected||_2`` at most ``5 * rtol``
  (float32 5e-4 on cpu, 2.5e-2 on GPUs; float16 5e-2; bfloat16 1e-1; float64 5e-7).
  Honest kernels that sum in another order stay orders of magnitude below (float32
  ~1e-6); a zero output scores 1.0. Skipped where ``||expected||`` is 0.
* a constant output (every element equal) fails when the expected output is not
  constant: its spread ``max - min`` exceeds ``rtol * max|expected|``, so rounding
  noise in a reference that should be constant does not count.

An output with no elements compares nothing; the verifier refuses to pass a trial
that compared no elements (:func:`compared_elements`).

Float64 recheck (:func:`recheck`). The reference is the task's ``Model`` in float32,
and at some inputs its float32 output is itself noise: a mean of group-normalized
values (mathematically 0) comes out as rounding noise near 1e-8, a training-mode
BatchNorm over two values per channel is ill-conditioned. An honest candidate's own
noise then fails the checks above. So when a trial fails on floating outputs (the
element-wise or a scale check; never a count, shape or dtype difference, nor NaN/Inf
where the reference has none or the reverse; float32, float16 and bfloat16 outputs),
the verifier has the reference child run the task's own ``Model`` again in float64
(built afresh as for the trial, which must first reproduce the trial's float32
outputs bit for bit; then ``.double()``, floating inputs in float64) on the trial's
inputs: the *truth*. Per failing output:

* the float32 reference is judged against the truth with the normal tolerance; when
  it passes, the reference is accurate and the original failure stands (the candidate
  is wrong);
* otherwise the reference is noise at these inputs, and the candidate is judged
  against the truth with ``atol`` widened by ``NOISE_FACTOR`` x the reference's own
  max abs error and the relative L2 bound raised to ``NOISE_FACTOR`` x the
  reference's own relative L2 (when that is larger). A pass is noted in the verdict.

Anything that keeps the recheck from running (the Model cannot run in float64, a
child error, a timeout) leaves the original verdict. The recheck runs only the task's
code; the candidate's part in it is the outputs it already returned.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from services.worker.tolerances import (
    REL_L2_FACTOR,
    Tolerance,
    Widening,
    format_tolerance,
    ran_tf32,
    scaled,
    tolerance_for,
)

# The tolerances are services/worker/tolerances.py's; the verifier and the tests read
# them, with the comparison, from here.
__all__ = ["NOISE_FACTOR", "REL_L2_FACTOR", "Comparison", "OutputComparison", "Recheck",
           "Tolerance", "Widening", "check_meta", "compare_output", "compare_outputs",
           "compared_elements", "format_tolerance", "ran_tf32", "recheck", "recheckable",
           "scaled", "tolerance_for"]

NOISE_FACTOR = 10.0
"""How far beyond the float32 reference's own error a candidate may be from the float64
truth when that reference is noise at a trial's inputs (:func:`recheck`).

The reference's error against the truth measures how much float32 rounding this
computation amplifies at these inputs (its conditioning times the unit roundoff). An
honest float32 kernel that rounds in another order makes an error of the same order
with another sign pattern: rounding errors add like a random walk, and another
summation order (blocked, sequential) may amplify them a few times more. Ten leaves an
order of magnitude for that; a candidate further from the truth is wrong beyond what
float32 rounding explains. It never widens anything against an accurate reference:
the widening applies only where the reference itself fails the normal tolerance
against the truth."""
# Output dtypes a float64 recheck may apply to (a float64 reference is the truth).
_RECHECKED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_MAX_INDICES = 5
# Elements scanned per step when looking for the first mismatching indices.
_SCAN_CHUNK = 1 << 20


def _format_shape(shape: tuple[int, ...] | list[int]) -> str:
    return str(tuple(shape))


def _format_value(value: float | complex | bool) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


@dataclass
class OutputComparison:
    """How one output compares with its reference.

    ``mismatch_indices`` are the first (row-major) mismatching indices, at most 5.
    ``max_abs_error`` / ``max_rel_error`` are over elements finite in both (None if
    there are none); the relative error is over elements whose expected value is
    non-zero. ``rel_l2_error`` is ``||got - expected|| / ||expected||`` over elements
    finite in both (None for integer outputs or a zero reference).
    """

    index: int
    tolerance: Tolerance
    passed: bool
    message: str = ""
    max_abs_error: float | None = None
    max_rel_error: float | None = None
    mismatch_count: int = 0
    mismatch_indices: list[list[int]] = field(default_factory=list)
    rel_l2_error: float | None = None


def check_meta(index: int, expected_shape: list[int] | tuple[int, ...],
               expected_dtype: torch.dtype, shape: list[int] | tuple[int, ...],
               dtype: torch.dtype) -> str | None:
    """A message when output ``index``'s shape or dtype differ from the reference, else None.

    Example: ``output 0 has shape (16, 4096) and dtype float32; expected (16, 4096)
    and float64``.
    """
    if list(expected_shape) == list(shape) and expected_dtype == dtype:
        return None
    name = str(dtype).removeprefix("torch.")
    expected_name = str(expected_dtype).removeprefix("torch.")
    return (f"output {index} has shape {_format_shape(shape)} and dtype {name}; "
            f"expected {_format_shape(expected_shape)} and {expected_name}")


def _first_indices(bad: torch.Tensor, shape: tuple[int, ...], limit: int) -> list[list[int]]:
    flat = bad.reshape(-1)
    found: list[int] = []
    for start in range(0, flat.numel(), _SCAN_CHUNK):
        hits = flat[start:start + _SCAN_CHUNK].nonzero().flatten()[: limit - len(found)]
        found.extend(int(h) + start for h in hits)
        if len(found) >= limit:
            break
    return [_unravel(i, shape) for i in found]


def _unravel(flat_index: int, shape: tuple[int, ...]) -> list[int]:
    index = []
    for dim in reversed(shape):
        index.append(flat_index % dim)
        flat_index //= dim
    return index[::-1]


def _as_real(t: torch.Tensor) -> torch.Tensor:
    """float64 view for comparison; complex tensors gain a trailing (real, imag) dim."""
    if t.dtype.is_complex:
        return torch.view_as_real(t.to(torch.complex128))
    return t.to(torch.float64)


def compare_output(index: int, expected: torch.Tensor, got: torch.Tensor,
                   backend: str = "cpu", *, detail: bool = True,
                   shortcut: bool = True, tolerance: Tolerance | None = None,
                   widening: Widening | None = None, tf32: bool = False) -> OutputComparison:
    """Compare output ``index`` of the candidate with the reference's.

    Args:
        index: position of the output in the forward result (for messages).
        expected: reference output (CPU).
        got: candidate output (CPU).
        backend: selects the float32 tolerance (see the module doc).
        detail: False returns a mismatch as soon as one is certain, with ``message``
            ``output 0: 1234 of 65536 elements differ`` and no error figures or indices
            (for a check that only needs to know whether the outputs match, such as
            the ghost replay, whose outputs are NaN-filled): NaN where the reference
            has none, or the reverse, fails before the float64 pass, and
            ``mismatch_count`` then counts only those. Whether the output passes is
            the same either way.
        shortcut: outputs equal element for element (``torch.equal``: same values,
            NaN never equal) pass with every error 0 without the float64 pass; the
            same result as the full comparison, a few times cheaper. False always
            runs the full comparison (tests compare the two).
        tolerance: instead of ``expected``'s dtype's (the float64 recheck compares a
            float32 output with float64 values at float32's tolerance).
        widening: a float64 recheck's allowance (:class:`Widening`); None: none.
        tf32: the call ran a TF32 ``tl.dot`` (:func:`ran_tf32`): float32 at the GPU's
            tolerance.

    Returns:
        The comparison; on failure ``message`` reads e.g. ``output 0: 1234 of 65536
        elements differ beyond atol=1e-4 rtol=1e-4; max abs error 0.53 at [3, 17]
        (expected 0.12, got 0.65)``.
    """
    tol = tolerance or tolerance_for(expected.dtype, backend, tf32=tf32)
    meta = check_meta(index, expected.shape, expected.dtype, got.shape, got.dtype)
    if meta is not None:
        return OutputComparison(index=index, tolerance=tol, passed=False, message=meta)
    shape = tuple(expected.shape)
    total = expected.numel()
    if total == 0:
        return OutputComparison(index=index, tolerance=tol, passed=True)

    exact = not (expected.dtype.is_floating_point or expected.dtype.is_complex)
    if shortcut and not expected.dtype.is_complex and torch.equal(got, expected):
        if not exact:
            tol = scaled(tol, expected.to(torch.float64))
            if widening is not None:
                tol = Tolerance(tol.atol + widening.atol, tol.rtol)
        return _identical(index, expected, tol, exact)
    if not detail and expected.dtype.is_floating_point:
        # isclose(equal_nan=True) never matches NaN with a number.
        nan_count = int((torch.isnan(got) != torch.isnan(expected)).sum())
        if nan_count:
            return OutputComparison(index=index, tolerance=tol, passed=False,
                                    mismatch_count=nan_count,
                                    message=f"output {index}: {nan_count} of {total} "
                                            "elements differ")
    if exact:
        bad = got != expected
        e = expected.to(torch.float64) if expected.dtype != torch.bool else expected.double()
        g = got.to(torch.float64) if got.dtype != torch.bool else got.double()
    else:
        e, g = _as_real(expected), _as_real(got)
        tol = scaled(tol, e)
        if widening is not None:
            tol = Tolerance(tol.atol + widening.atol, tol.rtol)
        close = torch.isclose(g, e, rtol=tol.rtol, atol=tol.atol, equal_nan=True)
        if expected.dtype.is_complex:
            close = close.all(dim=-1)
        bad = ~close
    if expected.dtype.is_complex:
        # Errors per complex element: the larger of the two parts.
        finite = torch.isfinite(e).all(dim=-1) & torch.isfinite(g).all(dim=-1)
        diff = (g - e).abs().amax(dim=-1)
        magnitude = e.abs().amax(dim=-1)
    else:
        finite = torch.isfinite(e) & torch.isfinite(g)
        diff = (g - e).abs()
        magnitude = e.abs()
    diff = torch.where(finite, diff, torch.zeros((), dtype=diff.dtype))
    nonzero = finite & (magnitude > 0)
    rel = torch.where(nonzero, diff / torch.where(nonzero, magnitude, torch.ones(())),
                      torch.zeros((), dtype=diff.dtype))
    max_abs = float(diff.max()) if bool(finite.any()) else None
    max_rel = float(rel.max()) if bool(nonzero.any()) else None
    count = int(bad.sum())
    if count and not detail:
        return OutputComparison(index=index, tolerance=tol, passed=False, mismatch_count=count,
                                message=f"output {index}: {count} of {total} elements differ")
    result = OutputComparison(index=index, tolerance=tol, passed=count == 0,
                              max_abs_error=max_abs, max_rel_error=max_rel,
                              mismatch_count=count)
    if not exact:
        result.rel_l2_error = _rel_l2(e, g, finite if not expected.dtype.is_complex
                                      else finite.unsqueeze(-1).expand_as(e))
    if count == 0:
        if not exact:
            result.message = _scale_problem(index, e, g, tol, result.rel_l2_error, widening)
            result.passed = not result.message
        return result

    result.mismatch_indices = _first_indices(bad, shape, _MAX_INDICES)
    # Point at the worst mismatch: the largest finite error among the mismatching
    # elements, or else the first non-finite disagreement.
    bad_finite = bad & finite
    if bool(bad_finite.any()):
        flat = int(torch.where(bad_finite, diff, torch.full((), -1.0, dtype=diff.dtype))
                   .reshape(-1).argmax())
        worst = f"max abs error {_format_value(float(diff.reshape(-1)[flat]))}"
    else:
        flat = int(bad.reshape(-1).to(torch.uint8).argmax())
        worst = "NaN/Inf positions differ"
    at = _unravel(flat, shape)
    want = expected.reshape(-1)[flat].item()
    have = got.reshape(-1)[flat].item()
    rule = ("exactly" if exact else
            f"beyond atol={format_tolerance(tol.atol)} rtol={format_tolerance(tol.rtol)}")
    result.message = (f"output {index}: {count} of {total} elements differ {rule}; "
                      f"{worst} at {at} (expected {_format_value(want)}, "
                      f"got {_format_value(have)})")
    return result


def _identical(index: int, expected: torch.Tensor, tol: Tolerance,
               exact: bool) -> OutputComparison:
    """The full comparison's result for an output equal to ``expected`` element for
    element (real dtypes): errors 0 where the full pass measures them, None where it
    has nothing to measure (no finite element; no non-zero one; a zero reference's
    relative L2). A constant output then has a constant reference, so the scale
    checks cannot fail."""
    if exact:
        finite = torch.ones((), dtype=torch.bool).expand(expected.shape)
    else:
        finite = torch.isfinite(expected)
    any_finite = bool(finite.any())
    nonzero = bool((finite & (expected != 0)).any())
    result = OutputComparison(index=index, tolerance=tol, passed=True,
                              max_abs_error=0.0 if any_finite else None,
                              max_rel_error=0.0 if nonzero else None)
    if not exact and nonzero:
        e = torch.where(finite, expected.to(torch.float64), torch.zeros((), dtype=torch.float64))
        norm = float(torch.linalg.vector_norm(e))
        result.rel_l2_error = 0.0 if math.isfinite(norm) and norm != 0 else None
    return result


def _rel_l2(e: torch.Tensor, g: torch.Tensor, finite: torch.Tensor) -> float | None:
    zero = torch.zeros((), dtype=e.dtype)
    e = torch.where(finite, e, zero)
    g = torch.where(finite, g, zero)
    norm = float(torch.linalg.vector_norm(e))
    if norm == 0 or not math.isfinite(norm):
        return None
    return float(torch.linalg.vector_norm(g - e)) / norm


def _scale_problem(index: int, e: torch.Tensor, g: torch.Tensor, tol: Tolerance,
                   rel_l2: float | None, widening: Widening | None = None) -> str:
    """Why outputs within the element-wise tolerance still fail (module doc), or ''."""
    bound = REL_L2_FACTOR * tol.rtol
    why = "5 x rtol"
    if widening is not None and widening.rel_l2 > bound:
        bound, why = widening.rel_l2, f"{NOISE_FACTOR:g} x the float32 reference's own"
    noise = widening.atol if widening is not None else 0.0
    finite = torch.isfinite(e) & torch.isfinite(g)
    if bool(finite.any()):
        ef, gf = e[finite], g[finite]
        spread = float(ef.max() - ef.min())
        if float(gf.max()) == float(gf.min()) and \
                spread > tol.rtol * float(ef.abs().max()) + noise:
            return (f"output {index} is constant (every element {_format_value(float(gf[0]))}) "
                    f"but the expected output is not (it spans {_format_value(spread)}); the "
                    "values are within atol only because they are small")
    if rel_l2 is not None and rel_l2 > bound:
        return (f"output {index}: relative L2 error {rel_l2:.3g} exceeds {bound:.3g} "
                f"({why}) although every element is within atol={format_tolerance(tol.atol)} "
                f"rtol={format_tolerance(tol.rtol)}; the output does not follow the "
                "expected values' scale")
    return ""


def compared_elements(expected: list[torch.Tensor]) -> tuple[int, str]:
    """Elements a trial compares, and ``output 0 has shape (0, 1024)`` for the first empty one."""
    total = sum(t.numel() for t in expected)
    empty = next((f"output {i} has shape {_format_shape(tuple(t.shape))}"
                  for i, t in enumerate(expected) if t.numel() == 0), "")
    return total, empty


@dataclass
class Comparison:
    """All outputs of one trial compared; ``message`` is the first failing output's."""

    passed: bool
    outputs: list[OutputComparison]
    message: str = ""

    @property
    def first_failure(self) -> OutputComparison | None:
        return next((o for o in self.outputs if not o.passed), None)

    @property
    def max_abs_error(self) -> float | None:
        return _max(o.max_abs_error for o in self.outputs)

    @property
    def max_rel_error(self) -> float | None:
        return _max(o.max_rel_error for o in self.outputs)

    @property
    def rel_l2_error(self) -> float | None:
        return _max(o.rel_l2_error for o in self.outputs)


def _max(values) -> float | None:
    present = [v for v in values if v is not None and not math.isnan(v)]
    return max(present) if present else None


def compare_outputs(expected: list[torch.Tensor], got: list[torch.Tensor],
                    backend: str = "cpu", *, detail: bool = True, tf32: bool = False
                    ) -> Comparison:
    """Compare every output of one trial (see :func:`compare_output`; ``detail`` and
    ``tf32`` as there).

    A different number of outputs fails with ``ModelNew.forward returned 2 outputs;
    expected 1``.
    """
    if len(expected) != len(got):
        return Comparison(passed=False, outputs=[],
                          message=f"ModelNew.forward returned {len(got)} output"
                                  f"{'s' if len(got) != 1 else ''}; expected {len(expected)}")
    outputs = [compare_output(i, e, g, backend, detail=detail, tf32=tf32)
               for i, (e, g) in enumerate(zip(expected, got, strict=True))]
    failed = next((o for o in outputs if not o.passed), None)
    return Comparison(passed=failed is None, outputs=outputs,
                      message=failed.message if failed else "")


# ---------------------------------------------------------------- float64 recheck


def _nonfinite_differ(expected: torch.Tensor, got: torch.Tensor) -> bool:
    """Whether NaN or +-Inf sit at other positions (or Inf with another sign)."""
    odd = ~torch.isfinite(expected) | ~torch.isfinite(got)
    return not bool(torch.isclose(got[odd], expected[odd], rtol=0, atol=0,
                                  equal_nan=True).all())


def recheckable(comparison: Comparison, expected: list[torch.Tensor],
                got: list[torch.Tensor]) -> bool:
    """Whether a failed trial may be rechecked against the task's Model in float64
    (:func:`recheck`): as many outputs as the reference's, and each failing one a
    float32, float16 or bfloat16 output with the reference's shape and dtype and its
    NaN and Inf where the reference has them. Cheap: the verifier asks before it has
    the reference child compute anything."""
    if comparison.passed or len(expected) != len(got) or \
            len(comparison.outputs) != len(expected):
        return False
    for o in comparison.outputs:
        e, g = expected[o.index], got[o.index]
        if not o.passed and (e.dtype not in _RECHECKED_DTYPES or check_meta(
                o.index, e.shape, e.dtype, g.shape, g.dtype) or _nonfinite_differ(e, g)):
            return False
    return True


@dataclass
class Recheck:
    """A failed trial judged against the float64 truth (:func:`recheck`).

    ``passed``: every failing output passed against the truth, the reference being
    noise there; ``comparison`` is then the trial's comparison with each of those
    outputs compared against the truth (widened), the others as they were, and
    ``notes`` says for each what the reference's own error and the widened tolerance
    were. Otherwise ``reason`` says why the original failure stands.
    """

    passed: bool
    comparison: Comparison | None = None
    notes: list[str] = field(default_factory=list)
    reason: str = ""


def recheck(comparison: Comparison, expected: list[torch.Tensor], truth: list[torch.Tensor],
            got: list[torch.Tensor], backend: str = "cpu", *, tf32: bool = False
            ) -> Recheck:
    """Judge a failed trial's failing outputs against the task's Model run in float64.

    Args:
        comparison: the trial's failed :func:`compare_outputs` of ``got`` with ``expected``.
        expected: the reference's outputs (the task's Model as the task made it,
            float32 for the outputs this applies to).
        truth: the same Model's outputs in float64 on the same inputs, same shapes.
        got: the candidate's outputs.
        backend: selects the float32 tolerance (with ``tf32``, as in
            :func:`compare_output`).

    Returns:
        A pass only where, for every failing output, the float32 reference fails the
        normal tolerance against the truth (it is noise at these inputs) and the
        candidate passes against the truth at ``atol`` + ``NOISE_FACTOR`` x the
        reference's max abs error and a relative L2 bound of at least
        ``NOISE_FACTOR`` x the reference's relative L2 (module doc). Anything else
        (:func:`recheckable` false, a truth of another shape or not float64, an
        accurate reference, a candidate beyond the widened tolerance) is a failure
        with its ``reason``.
    """
    if not recheckable(comparison, expected, got):
        return Recheck(False, reason="not a floating-point mismatch that a float64 "
                                     "recheck can decide")
    if len(truth) != len(expected):
        return Recheck(False, reason=f"the float64 Model returned {len(truth)} outputs; "
                                     f"the reference {len(expected)}")
    outputs = list(comparison.outputs)
    notes = []
    for failed in comparison.outputs:
        if failed.passed:
            continue
        i = failed.index
        e, t = expected[i], truth[i]
        if t.dtype != torch.float64 or t.shape != e.shape:
            return Recheck(False, reason=f"output {i} of the float64 Model has shape "
                                         f"{_format_shape(tuple(t.shape))} and dtype "
                                         f"{str(t.dtype).removeprefix('torch.')}")
        tol = tolerance_for(e.dtype, backend, tf32=tf32)
        own = compare_output(i, t, e.to(torch.float64), tolerance=tol)
        if own.passed or own.max_abs_error is None:
            return Recheck(False, reason=f"output {i}: the float32 reference is accurate at "
                                         "these inputs (it passes against the float64 Model)")
        widening = Widening(NOISE_FACTOR * own.max_abs_error,
                            NOISE_FACTOR * (own.rel_l2_error or 0.0))
        judged = compare_output(i, t, got[i].to(torch.float64), tolerance=tol,
                                widening=widening)
        if not judged.passed:
            return Recheck(False, reason=f"against the float64 Model, {judged.message}")
        outputs[i] = judged
        own_l2 = "n/a" if own.rel_l2_error is None else f"{own.rel_l2_error:.3g}"
        bound = max(REL_L2_FACTOR * tol.rtol, widening.rel_l2)
        notes.append(f"output {i}: the float32 reference is noise at these inputs (its own "
                     f"max abs error {own.max_abs_error:.3g}, relative L2 {own_l2} against "
                     f"the task's Model in float64); the candidate matched the float64 "
                     f"outputs within atol={format_tolerance(judged.tolerance.atol)} "
                     f"rtol={format_tolerance(tol.rtol)} and relative L2 {bound:.3g}")
    return Recheck(True, comparison=Comparison(passed=True, outputs=outputs), notes=notes)
