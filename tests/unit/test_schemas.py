"""Wire records: JSON round-trips, defaults a hand-written body may omit, and
rejections that name the offending field."""

from __future__ import annotations

import json

import msgspec
import pytest

from schemas import (
    JobEvent,
    JobRecord,
    JobSubmit,
    VerifyResult,
    WorkerInfo,
    decode,
    encode,
    subjects,
)
from schemas.export import JSON_DIR, schema_documents
from services.common.jobs import new_record
from services.common.verify_client import build_request

TASK = "class Model: ...\ndef get_inputs(): return []\ndef get_init_inputs(): return []\n"


def test_job_submit_minimal_body_gets_reference_defaults() -> None:
    submit = decode(b'{"op_name": "relu", "task_desc": "x"}', JobSubmit)
    assert submit.job_type == "single"
    assert submit.backend == "cpu"
    assert submit.dsl == "triton"
    assert submit.framework == "torch"
    assert submit.workflow == "coder_only_workflow"
    assert submit.type == "job.submit" and submit.schema_version == 1


def test_job_submit_accepts_reference_client_fields() -> None:
    body = {"op_name": "relu", "task_desc": TASK, "job_type": "evolve", "backend": "cuda",
            "arch": "a100", "dsl": "triton_cuda", "framework": "torch",
            "workflow": "default_workflow", "max_rounds": 2, "parallel_num": 2,
            "num_islands": 2, "migration_interval": 1, "elite_size": 3,
            "parent_selection_prob": 0.3, "shape_overrides": {"batch_size": 16, "dim": 4096}}
    submit = decode(json.dumps(body), JobSubmit)
    assert submit.dsl == "triton_cuda" and submit.max_rounds == 2
    assert submit.shape_overrides == {"batch_size": 16, "dim": 4096}
    assert decode(encode(submit), JobSubmit) == submit


@pytest.mark.parametrize(
    ("patch", "field"),
    [
        ({"max_rounds": 0}, "$.max_rounds"),
        ({"backend": "tpu"}, "$.backend"),
        ({"dsl": "cuda_c"}, "$.dsl"),
        ({"job_id": "a.b"}, "$.job_id"),
        ({"arch": "h200 >"}, "$.arch"),
        ({"parent_selection_prob": 1.5}, "$.parent_selection_prob"),
        ({"shape_overrides": {"1bad": 3}}, "$.shape_overrides"),
        ({"task_desc": ""}, "$.task_desc"),
        ({"max_rouds": 2}, "max_rouds"),
    ],
)
def test_job_submit_rejections_name_the_field(patch: dict, field: str) -> None:
    body = {"op_name": "relu", "task_desc": TASK, **patch}
    with pytest.raises(msgspec.ValidationError) as info:
        decode(json.dumps(body), JobSubmit)
    assert field in str(info.value)


def test_missing_required_field_is_named() -> None:
    with pytest.raises(msgspec.ValidationError, match="task_desc"):
        decode(b'{"op_name": "relu"}', JobSubmit)


def test_not_json_is_a_decode_error() -> None:
    with pytest.raises(msgspec.DecodeError):
        decode(b"not json", JobSubmit)


def test_records_round_trip() -> None:
    submit = JobSubmit(op_name="relu", task_desc=TASK, job_id="job-1")
    record = new_record(submit, arch="x86_64")
    request = build_request(request_id="r1", job_id="job-1", candidate_id="c1", op_name="relu",
                            task_desc=TASK, code="x", backend="cpu", arch="x86_64")
    result = VerifyResult(request_id="r1", job_id="job-1", candidate_id="c1", worker_id="w",
                          device="0", passed=False, stage="mismatch", error="differs",
                          mismatch_indices=[[0, 1]])
    event = JobEvent(job_id="job-1", event="verify_result", verdict=result)
    info = WorkerInfo(worker_id="w", backend="cpu", arch="x86_64", devices=["0"], capacity=1)
    for obj in (submit, record, request, result, event, info):
        assert decode(encode(obj), type(obj)) == obj
    raw = json.loads(encode(record))
    for name in ("job_id", "status", "job_type", "op_name", "submit_time", "result", "error"):
        assert name in raw
    assert raw["status"] == "pending" and raw["arch"] == "x86_64"
    assert isinstance(decode(encode(record), JobRecord).submit_time, type(record.submit_time))


def test_subject_builders_refuse_tokens_that_would_split_a_subject() -> None:
    assert subjects.verify("cuda", "h200") == "verify.cuda.h200"
    assert subjects.results("job-1", "w1") == "results.job-1.w1"
    assert subjects.claims("job-1", "w1") == "results.job-1.w1.claim"
    assert subjects.results_sender("results.job-1.w1") == ("w1", False)
    assert subjects.results_sender("results.job-1.w1.claim") == ("w1", True)
    for other in ("results.job-1", "results.job-1.w1.x", "jobs.job-1.w1", "results.j.w1.claim.x"):
        assert subjects.results_sender(other) is None
    assert subjects.dlq("verify.cpu.x86_64") == "dlq.verify.cpu.x86_64"
    for bad in ("a.b", "a*", ">", "a b", ""):
        with pytest.raises(ValueError):
            subjects.job_events(bad)


def test_committed_json_schemas_match_the_records() -> None:
    for name, text in schema_documents().items():
        path = JSON_DIR / name
        assert path.exists(), f"{path} missing: run `aikg schema`"
        assert path.read_text() == text, f"{path} is stale: run `aikg schema`"


def test_committed_openapi_document_matches_the_gateway() -> None:
    from services.gateway.app import openapi_document

    path = JSON_DIR / "openapi.json"
    assert path.exists(), f"{path} missing: run `aikg schema`"
    document = openapi_document()
    assert path.read_text() == document, f"{path} is stale: run `aikg schema`"
    assert document == openapi_document()  # the same bytes every time
    assert "/api/v1/jobs/submit" in json.loads(document)["paths"]
