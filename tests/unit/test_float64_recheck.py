"""The float64 recheck of a failed trial: :func:`services.worker.correctness.recheck`
(the judgement against the task's Model in float64) and the reference child's part,
:func:`services.worker._reference._float64_outputs`, on real tensors and a real task
module. End to end through the Verifier: tests/corpus (``honest/centered_mean.py``,
``hostile/softmax_zeros_plus_noise.py``)."""

from __future__ import annotations

import types

import pytest
import torch

from services.sandbox import values
from services.sandbox.child import JobFailure
from services.worker import correctness, wire
from services.worker._reference import _float64_outputs, _Task, digest
from services.worker.correctness import NOISE_FACTOR, compare_outputs, recheck, recheckable


def _judge(expected: torch.Tensor, truth: torch.Tensor, got: torch.Tensor):
    comparison = compare_outputs([expected], [got])
    assert not comparison.passed, "the case must fail before the recheck"
    return recheck(comparison, [expected], [truth], [got])


def _centered_mean(x: torch.Tensor) -> torch.Tensor:
    return (x - x.mean(dim=-1, keepdim=True)).mean(dim=-1)


def _noise_case(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A mathematically zero output: (float32 reference, float64 truth)."""
    x = torch.randn(64, 1000, generator=torch.Generator().manual_seed(seed)) * 100 + 1000
    return _centered_mean(x), _centered_mean(x.double())


def test_a_reference_that_is_noise_is_rechecked_with_a_widened_tolerance():
    expected, truth = _noise_case()
    # The same computation in another order: other noise of the same size.
    x = torch.randn(64, 1000, generator=torch.Generator().manual_seed(0)) * 100 + 1000
    got = (x - x.sum(dim=-1, keepdim=True) / 1000).flip(-1).sum(dim=-1) / 1000
    assert "relative L2 error" in compare_outputs([expected], [got]).message
    result = _judge(expected, truth, got)
    assert result.passed, result.reason
    (out,) = result.comparison.outputs
    own = float((expected.double() - truth).abs().max())
    assert out.tolerance.atol == pytest.approx(1e-4 + NOISE_FACTOR * own)
    assert out.max_abs_error == pytest.approx(float((got.double() - truth).abs().max()))
    (note,) = result.notes
    assert note.startswith("output 0: the float32 reference is noise") and \
        f"max abs error {own:.3g}" in note, note


def test_exact_zeros_pass_against_a_truth_that_is_zero_up_to_float64_noise():
    expected, truth = _noise_case(1)
    assert _judge(expected, truth, torch.zeros_like(expected)).passed


def test_an_ill_conditioned_reference_widens_by_its_own_error_only():
    # Training-mode BatchNorm over two values per channel: outputs +-1 that float32
    # gets wrong by up to 5e-4 (beyond atol + rtol = 2e-4).
    gen = torch.Generator().manual_seed(2)
    truth = torch.sign(torch.randn(256, dtype=torch.float64, generator=gen))
    expected = (truth + 5e-4 * torch.rand(256, dtype=torch.float64, generator=gen)).float()
    allowed = 1e-4 + NOISE_FACTOR * float((expected.double() - truth).abs().max())
    honest = (truth + 1.9e-3).float()
    assert _judge(expected, truth, honest).passed
    wrong = truth.clone()
    wrong[7] += 1.2 * allowed
    result = _judge(expected, truth, wrong.float())
    assert not result.passed and "against the float64 Model" in result.reason, result.reason


def test_an_accurate_reference_keeps_a_wrong_candidate_failing():
    truth = torch.randn(32, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    expected = truth.float()
    result = _judge(expected, truth, expected * 1.01)
    assert not result.passed and "accurate" in result.reason, result.reason


def test_zeros_plus_noise_for_a_wide_softmax_still_fail():
    # KernelBench issue #165: every probability below atol; the reference is accurate.
    x = 0.1 * torch.randn(4, 16384, dtype=torch.float64,
                          generator=torch.Generator().manual_seed(4))
    truth = torch.softmax(x, dim=1)
    expected = torch.softmax(x.float(), dim=1)
    got = (1e-7 * x).float()
    assert "relative L2 error" in compare_outputs([expected], [got]).message
    result = _judge(expected, truth, got)
    assert not result.passed and "accurate" in result.reason, result.reason


def test_nan_where_the_reference_has_none_is_never_rechecked():
    expected, truth = _noise_case(5)
    got = expected.clone()
    got[3] = float("nan")
    comparison = compare_outputs([expected], [got])
    assert not recheckable(comparison, [expected], [got])
    assert not recheck(comparison, [expected], [truth], [got]).passed
    # Nor the reverse, nor Inf of another sign.
    nan_ref = expected.clone()
    nan_ref[3] = float("inf")
    other = expected.clone()
    other[3] = float("-inf")
    comparison = compare_outputs([nan_ref], [other])
    assert not recheck(comparison, [nan_ref], [truth], [other]).passed


def test_shape_dtype_count_and_integer_mismatches_are_unaffected():
    expected, truth = _noise_case(6)
    cases = [([expected], [expected[:-1]]), ([expected], [expected.double()]),
             ([expected], [expected, expected]),
             ([torch.arange(4)], [torch.arange(4) + 1])]
    for want, got in cases:
        comparison = compare_outputs(want, got)
        assert not comparison.passed
        assert not recheckable(comparison, want, got)
        assert not recheck(comparison, want, [truth] * len(want), got).passed


def test_a_truth_that_is_not_float64_decides_nothing():
    expected, truth = _noise_case(7)
    got = torch.zeros_like(expected)
    for bad in (truth.float(), truth[:-1]):
        result = recheck(compare_outputs([expected], [got]), [expected], [bad], [got])
        assert not result.passed and "of the float64 Model" in result.reason


def test_passing_outputs_keep_their_comparison():
    expected, truth = _noise_case(8)
    fine = torch.randn(8, generator=torch.Generator().manual_seed(8))
    comparison = compare_outputs([fine, expected], [fine, torch.zeros_like(expected)])
    result = recheck(comparison, [fine, expected], [fine.double(), truth],
                     [fine, torch.zeros_like(expected)])
    assert result.passed, result.reason
    assert result.comparison.outputs[0] is comparison.outputs[0]
    assert len(result.notes) == 1 and result.notes[0].startswith("output 1:")


def test_the_widened_l2_bound_is_named():
    tol = correctness.Tolerance(1e-4, 1e-4)
    e = torch.full((4,), 1.0, dtype=torch.float64)
    got = e + torch.tensor([0.0, 0.0, 0.0, 0.0009], dtype=torch.float64)
    plain = correctness.compare_output(0, e, got, tolerance=tol)
    wide = correctness.compare_output(0, e, got, tolerance=tol,
                                      widening=correctness.Widening(1e-3, 2e-3))
    assert not plain.passed and wide.passed, (plain.message, wide.message)


# ---------------------------------------------------------------- the reference's part

_TASK = """
import torch
import torch.nn as nn

class Model(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(dim))

    def forward(self, x):
        return (x * self.scale - (x * self.scale).mean(dim=-1, keepdim=True)).mean(dim=-1)

rows = 4
dim = 32

def get_inputs():
    return [torch.randn(rows, dim) + 100]

def get_init_inputs():
    return [dim]
"""


def _task(source: str) -> _Task:
    module = types.ModuleType("aikg_task")
    exec(compile(source, "task.py", "exec"), module.__dict__)  # noqa: S102 - a test's own task
    return _Task(module, torch.device("cpu"))


def _command(task: _Task, outputs: list[torch.Tensor], made: list, **overrides):
    encoded, raws = values.encode_raw(made)
    command = wire.RefRecheck(key="main", index=0, overrides=overrides, inputs=encoded,
                              digests=[digest(o) for o in outputs], max_output_bytes=1 << 20)
    return command, [bytearray(t.numpy().tobytes())
                     for t in raws]


def _trial(task: _Task, runs: int = 1) -> tuple[list, list[torch.Tensor]]:
    """A trial as the reference makes it: inputs, then its Model's outputs (the Model
    having run ``runs`` times)."""
    model = task.model(task.init())
    made = task.inputs(123, None)
    for _ in range(runs):
        outputs, _ = task.forward(model, made)
    return made, outputs


def test_the_reference_recomputes_a_trial_in_float64():
    task = _task(_TASK)
    made, outputs = _trial(task)
    command, raws = _command(task, outputs, made)
    truth = _float64_outputs(task, command, raws)
    assert [t.dtype for t in truth] == [torch.float64] and truth[0].shape == (4,)
    model = task.model(task.init()).double()
    assert torch.equal(truth[0], model(made[0].double()))
    # At other sizes: the overrides are rebound first, as for the trial.
    task.rebind({"rows": 6})
    made, outputs = _trial(task)
    command, raws = _command(task, outputs, made, rows=6)
    assert _float64_outputs(task, command, raws)[0].shape == (6,)


def test_a_model_that_keeps_state_is_not_rechecked():
    task = _task(_TASK.replace("    def forward(self, x):\n", "    def forward(self, x):\n"
                               "        self.scale.data += 1\n"))
    made, outputs = _trial(task, runs=2)
    command, raws = _command(task, outputs, made)
    with pytest.raises(JobFailure, match="does not reproduce"):
        _float64_outputs(task, command, raws)


def test_a_model_that_cannot_run_in_float64_is_an_error():
    task = _task(_TASK.replace("return (x * self.scale",
                               "x = x @ torch.eye(x.shape[-1])\n        return (x * self.scale"))
    made, outputs = _trial(task)
    command, raws = _command(task, outputs, made)
    with pytest.raises(JobFailure, match="Model.forward"):
        _float64_outputs(task, command, raws)
