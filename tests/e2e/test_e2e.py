"""The whole path: gateway -> generator -> worker -> status, over a real nats-server.

The worker and generator run as asyncio tasks in the test's loop (their sandboxes and
lowering pools are real child processes); the gateway is served by uvicorn on a free
loopback port and driven over real HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import msgspec
import pytest

from schemas import JobRecord, subjects
from services.common.bus import Bus
from services.common.settings import Settings
from tests.helpers import (
    DECLINED_TASK,
    WRONG_RELU_KERNEL,
    job_events,
    wait_terminal,
)

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
TASKS = ROOT / "tasks"
DATA = Path(__file__).resolve().parents[1] / "data"


@pytest.fixture
async def stack(shared_services, settings: Settings, bus: Bus,
                gateway: str) -> AsyncIterator[str]:
    """Gateway + generator + one cpu worker; yields the gateway URL."""
    async with shared_services(settings, bus):
        yield gateway


def submit_body(path: Path, **extra) -> dict:
    return {"op_name": path.stem, "task_desc": path.read_text(), "backend": "cpu", **extra}


async def test_relu_job_over_http_completes_with_passed_verdict(stack: str, bus: Bus) -> None:
    async with httpx.AsyncClient(base_url=stack, timeout=10) as client:
        resp = await client.post("/api/v1/jobs/submit", json=submit_body(
            TASKS / "relu.py", job_type="single", dsl="triton_cuda", framework="torch",
            workflow="coder_only_workflow"))
        assert resp.status_code in (200, 201), resp.text
        job_id = resp.json()["job_id"]
        status = await wait_terminal(client, job_id)

    assert status["status"] == "completed", status
    assert status["job_type"] == "single" and status["op_name"] == "relu"
    assert status["error"] is None and status["submit_time"]
    result = status["result"]
    assert result["passed"] is True
    assert "@triton.jit" in result["code"] and "class ModelNew" in result["code"]
    verdict = result["verdict"]
    assert verdict["passed"] is True and verdict["stage"] is None
    assert verdict["interpreted"] is True and verdict["speedup"] is None
    assert verdict["trials"] >= 1 and verdict["atol"] is not None
    assert verdict["worker_id"] and verdict["device"] == "0"

    kinds = [e.event for e in await job_events(bus, job_id)]
    for kind in ("submitted", "started", "candidate_generated", "verify_started",
                 "verify_result", "completed"):
        assert kind in kinds, kinds
    assert kinds.index("verify_result") < kinds.index("completed")


async def test_raw_json_on_jobs_submit_runs_like_http(stack: str, bus: Bus) -> None:
    """What `nats pub jobs.submit '{...}'` sends: raw JSON bytes, no type tag."""
    job_id = "raw-pub-sigmoid"
    body = json.dumps({"op_name": "sigmoid", "task_desc": (TASKS / "sigmoid.py").read_text(),
                       "backend": "cpu", "job_id": job_id}).encode()
    await bus.nc.publish(subjects.JOBS_SUBMIT, body, headers={"Nats-Msg-Id": job_id})

    record = None
    for _ in range(600):
        with contextlib.suppress(Exception):
            entry = await bus.jobs.get(job_id)  # what `nats kv get jobs <id>` prints
            record = json.loads(entry.value)
            if record["status"] in ("completed", "failed"):
                break
        await asyncio.sleep(0.2)
    assert record is not None
    assert record["status"] == "completed", record.get("error")
    assert record["result"]["verdict"]["passed"] is True
    assert record["type"] == "job.record"
    msgspec.json.decode(entry.value, type=JobRecord)


async def test_large_task_unchanged_with_shape_overrides(stack: str) -> None:
    source = DATA / "relu_large.py"
    async with httpx.AsyncClient(base_url=stack, timeout=10) as client:
        resp = await client.post("/api/v1/jobs/submit", json=submit_body(
            source, shape_overrides={"batch_size": 16, "dim": 4096}))
        assert resp.status_code in (200, 201), resp.text
        status = await wait_terminal(client, resp.json()["job_id"])
    assert status["status"] == "completed", status["error"]
    assert status["request"]["shape_overrides"] == {"batch_size": 16, "dim": 4096}


async def test_task_the_builtin_coder_cannot_lower_fails_naming_the_op(stack: str) -> None:
    async with httpx.AsyncClient(base_url=stack, timeout=10) as client:
        body = {**submit_body(TASKS / "relu.py"), "op_name": "embedding",
                "task_desc": DECLINED_TASK}
        resp = await client.post("/api/v1/jobs/submit", json=body)
        assert resp.status_code in (200, 201), resp.text
        status = await wait_terminal(client, resp.json()["job_id"])
    assert status["status"] == "failed"
    assert "aten.embedding" in status["error"], status["error"]
    assert "cannot lower" in status["error"] and "LLM coder" in status["error"]


async def test_wrong_init_code_fails_then_builtin_candidate_passes(stack: str) -> None:
    wrong = WRONG_RELU_KERNEL
    async with httpx.AsyncClient(base_url=stack, timeout=10) as client:
        resp = await client.post("/api/v1/jobs/submit",
                                 json=submit_body(TASKS / "relu.py", init_code=wrong))
        assert resp.status_code in (200, 201), resp.text
        status = await wait_terminal(client, resp.json()["job_id"])
    assert status["status"] == "completed", status["error"]
    assert status["result"]["attempts"] == 2
    assert status["result"]["coder"] == "builtin"
    assert status["progress"]["candidates_verified"] == 2
    assert status["progress"]["candidates_passed"] == 1
