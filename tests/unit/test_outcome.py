"""The typed fields of a verdict (services/worker/procedure/outcome.py): what a
verification decides, and how it becomes a VerifyResult."""

from __future__ import annotations

import msgspec
import pytest

from schemas.events import VerifyResult
from services.worker.procedure import Outcome, Timings, Verdict
from services.worker.procedure.outcome import DECIDED
from services.worker.procedure.outcome import ENVELOPE as WORKER_FIELDS

ENVELOPE = {"request_id": "r1", "job_id": "j1", "candidate_id": "c1", "worker_id": "w1",
            "device": "0"}


def test_a_misspelt_field_fails_where_the_outcome_is_made():
    with pytest.raises(TypeError, match="trails"):
        Outcome(passed=True, trails=3)
    with pytest.raises(TypeError, match="ghost_replays"):
        Verdict("audit", "outputs do not depend on the kernels", ghost_replays="matched")


def test_the_schema_is_the_one_list_of_fields():
    # Every VerifyResult field is either decided by a verification or set by the
    # worker around it, never both: a field added to the schema is an Outcome field.
    result_fields = set(VerifyResult.__struct_fields__)
    assert WORKER_FIELDS <= result_fields
    assert DECIDED == result_fields - WORKER_FIELDS
    assert {"passed", "stage", "error", "trials", "traffic", "compile_facts",
            "baseline_source"} <= DECIDED
    with pytest.raises(TypeError, match="worker_id"):
        Outcome(passed=True, worker_id="w1")
    # Reads are the schema's fields: an unset one reads as its default.
    outcome = Outcome(trials=2)
    assert outcome.fields.trials == 2 and outcome.fields.notes == []
    assert outcome.decided == {"passed", "trials"}


def test_none_leaves_a_field_unset_and_fill_keeps_what_is_set():
    outcome = Outcome(passed=False, stage="mismatch", max_abs_error=None, trials=1)
    assert "max_abs_error" not in outcome.decided
    outcome.fill(trials=5, notes=["seen"], log="")
    assert (outcome.fields.trials, outcome.fields.notes) == (1, ["seen"])
    assert outcome.set_fields() == {"passed": False, "stage": "mismatch", "log": "",
                                    "trials": 1, "notes": ["seen"]}


def test_timings_set_the_times_and_the_flag_becomes_the_error():
    timings = Timings(base_time_us=100.0, gen_time_us=1.0, speedup=100.0,
                      flag="flagged: speedup 100.0", baseline_source="shared_cache",
                      baseline_age_s=3.0)
    timed = Outcome(passed=True, trials=3).timed(timings).fields
    assert (timed.passed, timed.error, timed.speedup, timed.speedup_eager) == \
        (True, "flagged: speedup 100.0", 100.0, 100.0)
    assert (timed.baseline_source, timed.baseline_age_s) == ("shared_cache", 3.0)
    unflagged = Outcome(passed=True).timed(msgspec.structs.replace(timings, flag=None))
    assert "error" not in unflagged.decided


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
