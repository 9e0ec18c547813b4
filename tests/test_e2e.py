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

from schemas import JobEvent, JobRecord, decode, subjects
from services.common.bus import Bus
from services.common.settings import Settings
from services.generator.service import run_generator
from services.worker.service import run_worker

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
TASKS = ROOT / "tasks"
DATA = Path(__file__).resolve().parent / "data"


@contextlib.asynccontextmanager
async def services_running(settings: Settings, bus: Bus) -> AsyncIterator[None]:
    """A worker and a generator until the block ends; waits for the worker's heartbeat."""
    stop = asyncio.Event()
    tasks = [
        asyncio.create_task(run_worker(settings, stop), name="worker"),
        asyncio.create_task(run_generator(settings, stop), name="generator"),
    ]
    try:
        for _ in range(600):
            for t in tasks:
                if t.done():
                    t.result()
            with contextlib.suppress(Exception):
                if await bus.workers.keys():
                    break
            await asyncio.sleep(0.05)
        else:
            raise TimeoutError("worker never sent a heartbeat")
        yield
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 60)


@pytest.fixture
async def stack(settings: Settings, bus: Bus, gateway: str) -> AsyncIterator[str]:
    """Gateway + generator + one cpu worker; yields the gateway URL."""
    async with services_running(settings, bus):
        yield gateway


async def wait_terminal(client: httpx.AsyncClient, job_id: str, timeout_s: float = 120) -> dict:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while loop.time() < deadline:
        resp = await client.get(f"/api/v1/jobs/{job_id}/status")
        if resp.status_code == 200 and resp.json()["status"] in ("completed", "failed", "cancelled"):
            return resp.json()
        await asyncio.sleep(0.2)
    raise TimeoutError(f"job {job_id} did not finish in {timeout_s}s")


async def job_events(bus: Bus, job_id: str) -> list[JobEvent]:
    """Every event of the job so far, read from the JOB_EVENTS stream."""
    sub = await bus.js.subscribe(subjects.job_events(job_id), ordered_consumer=True)
    events = []
    try:
        while True:
            msg = await sub.next_msg(timeout=0.5)
            events.append(decode(msg.data, JobEvent))
    except Exception:  # noqa: BLE001 - timeout: no more history
        pass
    finally:
        await sub.unsubscribe()
    return events


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


async def test_kernelbench_file_unchanged_with_shape_overrides(stack: str) -> None:
    source = DATA / "kernelbench_19_ReLU.py"
    async with httpx.AsyncClient(base_url=stack, timeout=10) as client:
        resp = await client.post("/api/v1/jobs/submit", json=submit_body(
            source, shape_overrides={"batch_size": 16, "dim": 4096}))
        assert resp.status_code in (200, 201), resp.text
        status = await wait_terminal(client, resp.json()["job_id"])
    assert status["status"] == "completed", status["error"]
    assert status["request"]["shape_overrides"] == {"batch_size": 16, "dim": 4096}


async def test_task_the_builtin_coder_cannot_lower_fails_naming_the_op(stack: str) -> None:
    async with httpx.AsyncClient(base_url=stack, timeout=10) as client:
        resp = await client.post("/api/v1/jobs/submit", json=submit_body(TASKS / "matmul.py"))
        assert resp.status_code in (200, 201), resp.text
        status = await wait_terminal(client, resp.json()["job_id"])
    assert status["status"] == "failed"
    assert "aten.mm" in status["error"] or "aten.matmul" in status["error"], status["error"]
    assert "cannot lower" in status["error"]


async def test_wrong_init_code_fails_then_builtin_candidate_passes(stack: str) -> None:
    wrong = '''
import torch
import torch.nn as nn
import triton
import triton.language as tl


@triton.jit
def relu_kernel(x_ptr, out_ptr, n, BLOCK_SIZE: tl.constexpr):
    offs = tl.program_id(0) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    m = offs < n
    x = tl.load(x_ptr + offs, mask=m)
    tl.store(out_ptr + offs, tl.maximum(x, 0.5), mask=m)


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        x = x.contiguous()
        out = torch.empty_like(x)
        n = x.numel()
        relu_kernel[(triton.cdiv(n, 1024),)](x, out, n, BLOCK_SIZE=1024)
        return out
'''
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
