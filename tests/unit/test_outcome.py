"""The typed fields of a verdict (services/worker/procedure/outcome.py): what a
verification decides, and how it becomes a VerifyResult."""

from __future__ import annotations

import msgspec
import pytest

from schemas.events import VerifyResult
from services.worker.procedure import Outcome, Verdict

ENVELOPE = {"request_id": "r1", "job_id": "j1", "candidate_id": "c1", "worker_id": "w1",
            "device": "0"}


def test_a_misspelt_field_fails_where_the_outcome_is_made():
    with pytest.raises(TypeError, match="trails"):
        Outcome(passed=True, trails=3)
    with pytest.raises(TypeError, match="ghost_replays"):
        Verdict("audit", "outputs do not depend on the kernels", ghost_replays="matched")


def test_every_outcome_field_is_a_verify_result_field():
    result_fields = set(VerifyResult.__struct_fields__)
    assert set(Outcome.__struct_fields__) <= result_fields


def test_unset_fields_take_the_verify_result_defaults():
    result = Verdict("mismatch", "output 0 differs", trials=2, max_abs_error=0.5).outcome \
        .result(**ENVELOPE)
    defaults = VerifyResult(passed=False, **ENVELOPE)
    assert (result.passed, result.stage, result.error, result.trials, result.max_abs_error) \
        == (False, "mismatch", "output 0 differs", 2, 0.5)
    # Fields the verdict did not set are VerifyResult's defaults, not None.
    assert result.log == defaults.log == ""
    assert result.mismatch_indices == defaults.mismatch_indices == []
    assert result.notes == [] and result.sizes_checked == [] and result.unchecked == []
    assert result.shape_generic_sizes == {} and result.task_sizes_checked is None
    # The result encodes and decodes as any VerifyResult on the bus does.
    assert msgspec.json.decode(msgspec.json.encode(result), type=VerifyResult) == result


def test_set_fields_carry_over_and_the_envelope_may_not_override_them():
    outcome = Outcome(passed=True, log="ran", trials=3, atol=1e-4, rtol=1e-4,
                      sizes_checked=[{"n": 8}], notes=["inputs: trial 0: task"])
    result = outcome.result(**ENVELOPE, interpreted=True, duration_s=1.5)
    assert result.passed and result.stage is None and result.log == "ran"
    assert (result.trials, result.atol, result.sizes_checked, result.notes) == \
        (3, 1e-4, [{"n": 8}], ["inputs: trial 0: task"])
    assert result.interpreted and result.duration_s == 1.5
    assert outcome.set_fields() == {"passed": True, "log": "ran", "trials": 3, "atol": 1e-4,
                                    "rtol": 1e-4, "sizes_checked": [{"n": 8}],
                                    "notes": ["inputs: trial 0: task"]}
    with pytest.raises(TypeError):
        outcome.result(**ENVELOPE, trials=4)
