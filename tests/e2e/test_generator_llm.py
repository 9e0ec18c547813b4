"""The generator with an LLM, end to end: gateway (HTTP), generator and a real cpu worker
over a real nats-server, and the scripted OpenAI-compatible server called by the real
openai client.

The scripted model writes a broken softmax first and the correct one only when its
prompt contains the verifier's error, so a completed job proves the repair loop
carried the verdict back to the coder.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path

import httpx
import msgspec
import pytest

from schemas import JobRecord, VerifyResult, decode, subjects
from services.common.bus import Bus
from services.common.jobs import cancel_job
from services.common.settings import Settings
from tests import fake_llm
from tests.fake_llm import SOFTMAX_BROKEN, SOFTMAX_FIXED, FakeLLM, Reply, fenced
from tests.helpers import (
    LLM_ONLY_SOFTMAX_TASK,
    job_events,
    scaled,
    stream_messages,
)

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
KEY = "sk-test-generator-SECRET-42"
def llm_settings(settings: Settings, fake: FakeLLM, **extra) -> Settings:
    return msgspec.structs.replace(settings, llm_base_url=fake.url, llm_model="fake-coder",
                                   llm_api_key=KEY, llm_timeout_s=60.0, **extra)


async def verdicts(bus: Bus, job_id: str) -> list[VerifyResult]:
    return [decode(m, VerifyResult) for m in await stream_messages(bus, subjects.job_verdicts(job_id))]


async def test_softmax_job_completes_after_one_repair_round(
        shared_services, settings: Settings, bus: Bus, gateway: str, capfd: pytest.CaptureFixture[str],
        tmp_path: Path) -> None:
    softmax = tmp_path / "softmax.py"
    softmax.write_text(LLM_ONLY_SOFTMAX_TASK)
    with FakeLLM(fake_llm.repair_script) as fake:
        async with shared_services(llm_settings(settings, fake), bus):
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "services.cli", "submit", str(softmax), "--coder", "llm",
                "--wait", "--json", "--timeout", "240",
                env={**os.environ, "AIKG_GATEWAY_URL": gateway},
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=ROOT)
            out, err = await asyncio.wait_for(proc.communicate(), 300)
        coder_prompts = [r.prompt for r in fake.chat_requests("You are the coder")]
        auth = {r.headers.get("authorization") for r in fake.requests}

    assert proc.returncode == 0, (out.decode()[-2000:], err.decode()[-2000:])
    record = msgspec.json.decode(out, type=JobRecord)
    assert record.status == "completed" and record.error is None
    result = record.result
    assert result is not None and result.passed and result.coder == "llm"
    assert result.model == fake.model
    assert result.attempts == 2 and result.code == SOFTMAX_FIXED

    first, second = record.progress.candidates
    assert (first.coder, first.passed, first.stage) == ("llm", False, "mismatch")
    assert (second.coder, second.passed) == ("llm", True)
    assert first.code is None and second.code == SOFTMAX_FIXED
    assert first.request_id == f"{record.job_id}-a1" and second.request_id == f"{record.job_id}-a2"

    # The repair prompt carried the first verdict's own words back to the coder.
    results = await verdicts(bus, record.job_id)
    assert [v.passed for v in results] == [False, True]
    assert results[0].error and results[0].error == first.error
    assert len(coder_prompts) == 2
    assert results[0].error not in coder_prompts[0]
    assert results[0].error in coder_prompts[1] and SOFTMAX_BROKEN.strip() in coder_prompts[1]

    usage = record.progress.llm_usage
    assert usage.requests == 2 and usage.prompt_tokens > 0 and usage.completion_tokens > 0
    assert record.progress.candidates_verified == 2 and record.progress.candidates_passed == 1

    events = await job_events(bus, record.job_id)
    kinds = [e.event for e in events]
    for kind in ("submitted", "started", "candidate_generated", "verify_started",
                 "verify_result", "completed"):
        assert kind in kinds, kinds
    assert kinds.count("candidate_generated") == 2 and kinds.count("completed") == 1
    times = [e.time for e in events]
    assert times == sorted(times)

    # The key went to the endpoint and nowhere else.
    assert auth == {f"Bearer {KEY}"}
    captured = capfd.readouterr()
    for text in (out.decode(), err.decode(), captured.out, captured.err,
                 json.dumps([msgspec.to_builtins(e) for e in events])):
        assert KEY not in text


async def test_default_workflow_uses_designer_and_conductor(
        shared_services, settings: Settings, bus: Bus, gateway: str) -> None:
    with FakeLLM(fake_llm.repair_script) as fake:
        async with shared_services(llm_settings(settings, fake), bus):
            async with httpx.AsyncClient(base_url=gateway, timeout=scaled(10)) as client:
                resp = await client.post("/api/v1/jobs/submit", json={
                    "op_name": "softmax", "task_desc": LLM_ONLY_SOFTMAX_TASK, "backend": "cpu",
                    "workflow": "default_workflow", "init_code": SOFTMAX_BROKEN})
                assert resp.status_code in (200, 201), resp.text
                job_id = resp.json()["job_id"]
                record = await wait_status(client, job_id, ("completed", "failed"))
        roles = [r.agent_role.split()[3] for r in fake.requests]  # "You are the <agent> ..."

    assert record["status"] == "completed", record["error"]
    assert record["result"]["attempts"] == 2
    assert [c["coder"] for c in record["progress"]["candidates"]] == ["init_code", "llm"]
    assert record["progress"]["plan"].startswith("1. One program per row")
    assert record["progress"]["candidates"][1]["guidance"] == "Divide num by den before storing."
    assert roles == ["designer", "conductor", "coder"]


async def wait_status(client: httpx.AsyncClient, job_id: str, statuses: tuple[str, ...],
                      timeout_s: float = 180) -> dict:
    deadline = time.monotonic() + scaled(timeout_s)
    while time.monotonic() < deadline:
        resp = await client.get(f"/api/v1/jobs/{job_id}/status")
        if resp.status_code == 200 and resp.json()["status"] in statuses:
            return resp.json()
        await asyncio.sleep(0.1)
    raise TimeoutError(f"job {job_id} not in {statuses} after {timeout_s} s")


async def test_cancel_during_generation_stops_the_llm_call_and_verification(
        shared_services, settings: Settings, bus: Bus, gateway: str) -> None:
    # The broken init_code is verified first; the LLM's repair then never comes.
    script = [Reply(content=fenced(SOFTMAX_FIXED), delay_s=30)]
    with FakeLLM(script) as fake:
        async with shared_services(llm_settings(settings, fake), bus):
            async with httpx.AsyncClient(base_url=gateway, timeout=scaled(10)) as client:
                resp = await client.post("/api/v1/jobs/submit", json={
                    "op_name": "softmax", "task_desc": LLM_ONLY_SOFTMAX_TASK, "backend": "cpu",
                    "coder": "llm", "init_code": SOFTMAX_BROKEN, "max_attempts": 5})
                assert resp.status_code in (200, 201), resp.text
                job_id = resp.json()["job_id"]
                await fake.wait_requests(1, timeout_s=120)
                cancelled_at = time.monotonic()
                resp = await client.post(f"/api/v1/jobs/{job_id}/cancel")
                if resp.status_code in (404, 405):  # a gateway without the route: what it calls
                    await cancel_job(bus, job_id)
                else:
                    assert resp.status_code == 200 and resp.json()["status"] == "cancelled"

                # The generator aborts the held LLM call and acks the job within 5 s.
                while not fake.disconnects:
                    assert time.monotonic() - cancelled_at < 5, "LLM call still open"
                    await asyncio.sleep(0.05)
                while True:
                    info = await bus.js.consumer_info(subjects.STREAM_JOBS,
                                                      subjects.CONSUMER_GENERATOR)
                    if info.num_ack_pending == 0 and info.num_pending == 0:
                        break
                    assert time.monotonic() - cancelled_at < 5, "job still held by the generator"
                    await asyncio.sleep(0.05)
                await asyncio.sleep(1.5)  # anything still going would show by now
                status = (await client.get(f"/api/v1/jobs/{job_id}/status")).json()
                events = await job_events(bus, job_id)
                results = await verdicts(bus, job_id)
                verify_info = await bus.js.stream_info(subjects.STREAM_VERIFY)

    assert status["status"] == "cancelled"
    assert len(status["progress"]["candidates"]) == 1
    assert len(fake.requests) == 1  # no retry of the aborted call
    assert len(results) == 1 and verify_info.state.last_seq == 1  # only the init_code ran
    kinds = [e.event for e in events]
    assert kinds.count("cancelled") == 1 and "completed" not in kinds and "failed" not in kinds
    assert kinds.index("cancelled") > kinds.index("verify_result")


async def test_llm_job_without_an_llm_fails_saying_what_to_set(
        shared_services, settings: Settings, bus: Bus, gateway: str) -> None:
    async with shared_services(settings, bus):
        async with httpx.AsyncClient(base_url=gateway, timeout=scaled(10)) as client:
            resp = await client.post("/api/v1/jobs/submit", json={
                "op_name": "softmax", "task_desc": LLM_ONLY_SOFTMAX_TASK, "backend": "cpu",
                "coder": "llm"})
            assert resp.status_code in (200, 201), resp.text
            record = await wait_status(client, resp.json()["job_id"], ("completed", "failed"))
    assert record["status"] == "failed"
    assert "AIKG_LLM_BASE_URL" in record["error"] and "coder 'builtin'" in record["error"]


async def test_an_llm_that_never_answers_fails_the_job_clearly(
        shared_services, settings: Settings, bus: Bus, gateway: str) -> None:
    script = [Reply(status=429, headers={"Retry-After": "0.2"}, error=f"busy, key {KEY}"),
              Reply(content="never", delay_s=30)]
    with FakeLLM(script) as fake:
        slow = llm_settings(settings, fake, llm_max_retries=1)
        slow = msgspec.structs.replace(slow, llm_timeout_s=1.0)
        async with shared_services(slow, bus):
            async with httpx.AsyncClient(base_url=gateway, timeout=scaled(10)) as client:
                resp = await client.post("/api/v1/jobs/submit", json={
                    "op_name": "softmax", "task_desc": LLM_ONLY_SOFTMAX_TASK, "backend": "cpu",
                    "coder": "llm", "init_code": SOFTMAX_BROKEN})
                assert resp.status_code in (200, 201), resp.text
                record = await wait_status(client, resp.json()["job_id"], ("completed", "failed"))
                raw = (await client.get(f"/api/v1/jobs/{record['job_id']}/status")).text
    assert record["status"] == "failed"
    assert "did not answer the coder within 1 s (2 calls)" in record["error"], record["error"]
    assert "AIKG_LLM_TIMEOUT_S" in record["error"] and "mismatch" in record["error"]
    assert record["result"]["attempts"] == 1  # the init_code's verdict is kept
    assert len(fake.requests) == 2 and KEY not in raw
