"""Admission at the gateway: exact tenant limits across gateways, no cross-tenant
information, strict submissions, and jobs that cannot run failing once.

Real parts: a nats-server per test, gateways served over HTTP in this event loop (two
gateways are two apps with their own state, as two processes would be), a generator
where a job must be taken.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from pathlib import Path

import httpx
import msgspec
import nats.errors
import pytest

from schemas import decode, encode, subjects
from schemas.events import JobRecord
from services.common.bus import Bus
from services.common.runtime import cancel_and_wait, free_port
from services.common.settings import Settings
from services.gateway import limits
from services.gateway.inputs import MAX_JSON_DEPTH
from services.generator.service import Generator, run_generator
from tests.gateway.test_tenants import auth, job, tenants_file
from tests.helpers import scaled

SUBMIT = "/api/v1/jobs/submit"


async def _burst(clients: list[httpx.AsyncClient], tenant: str, n: int,
                 prefix: str) -> list[int]:
    """``n`` concurrent submissions of ``tenant``, spread over ``clients`` in turn."""
    async def one(i: int) -> int:
        r = await clients[i % len(clients)].post(SUBMIT, headers=auth(tenant),
                                                 json=job(f"{prefix}-{i}"))
        assert r.status_code in (200, 429), r.text
        return r.status_code
    return list(await asyncio.gather(*(one(i) for i in range(n))))


@contextlib.asynccontextmanager
async def _gateways(start_gateway, settings: Settings, n: int):
    async with contextlib.AsyncExitStack() as stack:
        clients = []
        for i in range(n):
            port = settings.gateway_port if i == 0 else free_port()
            url = await start_gateway(msgspec.structs.replace(settings, gateway_port=port))
            clients.append(await stack.enter_async_context(
                httpx.AsyncClient(base_url=url, timeout=scaled(30))))
        yield clients


@pytest.mark.parametrize("gateways", [1, 2])
@pytest.mark.parametrize(("limit", "value"), [("max_jobs_per_hour", 5), ("max_in_flight", 3)])
async def test_concurrent_submits_admit_exactly_the_limit(
        tmp_path: Path, settings: Settings, bus: Bus, fake_worker_heartbeat, start_gateway,
        gateways: int, limit: str, value: int) -> None:
    await fake_worker_heartbeat(bus)
    settings = msgspec.structs.replace(
        settings, tenants_file=tenants_file(tmp_path, team_b={limit: value}))
    async with _gateways(start_gateway, settings, gateways) as clients:
        codes = await _burst(clients, "team_b", 20, "b")
        assert codes.count(200) == value, codes
        # Every accepted job is queued once; a refused one left nothing behind.
        info = await bus.js.stream_info(subjects.STREAM_JOBS, subjects_filter=">")
        assert info.state.subjects == {"jobs.submit.team_b.normal": value}
        keys = await bus.jobs.keys()
        assert len(keys) == value
        entry = await bus.tenant_usage.get(limits.admission_key("team_b"))
        state = json.loads(entry.value)
        assert state["claims"] == {} and state["used"] == value
        # Another tenant is not held by team_b's count.
        r = await clients[0].post(SUBMIT, headers=auth("team_a"), json=job("a-1"))
        assert r.status_code == 200, r.text


async def test_a_claim_left_by_a_dead_gateway_is_settled(
        tmp_path: Path, settings: Settings, bus: Bus, fake_worker_heartbeat,
        start_gateway) -> None:
    """A gateway that died after its claim: the slot comes back once the claim has
    expired, unless the job's record was written (then the job keeps its place)."""
    await fake_worker_heartbeat(bus)
    settings = msgspec.structs.replace(
        settings, tenants_file=tenants_file(tmp_path, team_b={"max_jobs_per_hour": 2}))
    async with _gateways(start_gateway, settings, 1) as (client,):
        assert (await client.post(SUBMIT, headers=auth("team_b"),
                                  json=job("b-0"))).status_code == 200
        key = limits.admission_key("team_b")
        entry = await bus.tenant_usage.get(key)
        state = json.loads(entry.value)
        past = time.time() - 1
        # Two claims of gateways that died: one before its record, one after.
        state["claims"] = {"b-lost": [past, state["hour"]], "b-kept": [past, state["hour"]]}
        state["used"] += 2
        await bus.tenant_usage.update(key, json.dumps(state).encode(), last=entry.revision)
        kept = job("b-kept")
        await client.post(SUBMIT, headers=auth("team_b"), json=kept)  # idempotent: no claim
        await bus.jobs.delete("b-kept")
        record = decode((await client.get("/api/v1/jobs/b-0/status",
                                          headers=auth("team_b"))).content, JobRecord)
        record.job_id = "b-kept"
        await bus.jobs.put("b-kept", encode(record))
        # used was 3 of 2: settling gives b-lost's slot back (2 of 2), so still full.
        r = await client.post(SUBMIT, headers=auth("team_b"), json=job("b-1"))
        assert r.status_code == 429 and "submitted 2 jobs" in r.json()["detail"], r.text
        state = json.loads((await bus.tenant_usage.get(key)).value)
        assert state["claims"] == {} and state["used"] == 2


async def test_another_tenants_job_id_is_409_without_its_status(
        tmp_path: Path, settings: Settings, bus: Bus, fake_worker_heartbeat,
        start_gateway) -> None:
    await fake_worker_heartbeat(bus, worker_id="w1")
    settings = msgspec.structs.replace(settings, tenants_file=tenants_file(tmp_path))
    async with _gateways(start_gateway, settings, 1) as (client,):
        body = job("a-secret")
        assert (await client.post(SUBMIT, headers=auth("team_a"), json=body)).status_code == 200
        r = await client.post(SUBMIT, headers=auth("team_b"), json=body)
        assert r.status_code == 409, r.text
        assert "pending" not in r.text and "already submitted" not in r.text
        assert (await client.post(SUBMIT, headers=auth("team_b"),
                                  json=job("a-secret", max_rounds=2))).status_code == 409
        # The owner's resubmit is still idempotent.
        again = await client.post(SUBMIT, headers=auth("team_a"), json=body)
        assert again.status_code == 200 and again.json()["status"] == "pending"

        # A lease of team_a's job: team_b sees the worker but not the lease; team_a and
        # the operator (no tenant) see it. One lease names its tenant, one does not
        # (written before leases recorded it: the job's record says).
        await bus.leases.put("w1.0", msgspec.json.encode(
            {"worker_id": "w1", "device": "0", "job_id": "a-secret", "request_id": "req-a1"}))
        await bus.leases.put("w1.1", msgspec.json.encode(
            {"worker_id": "w1", "device": "1", "job_id": "a-other", "request_id": "req-a2",
             "tenant": "team_a"}))
        seen_b = (await client.get("/api/v1/workers", headers=auth("team_b"))).json()
        assert [w["worker_id"] for w in seen_b["workers"]] == ["w1"]
        assert seen_b["workers"][0]["leases"] == []
        assert "a-secret" not in json.dumps(seen_b) and "req-a" not in json.dumps(seen_b)
        seen_a = (await client.get("/api/v1/workers/status", headers=auth("team_a"))).json()
        assert {lease["request_id"] for lease in seen_a["workers"][0]["leases"]} == \
            {"req-a1", "req-a2"}


async def test_submissions_out_of_bounds_are_400_naming_the_field(
        settings: Settings, bus: Bus, fake_worker_heartbeat, start_gateway) -> None:
    await fake_worker_heartbeat(bus)
    async with _gateways(start_gateway, settings, 1) as (client,):
        body = json.dumps({**job("deep"), "shape_overrides": {"x": 0}})
        deep = body.replace('"x": 0', '"x": ' + "[" * 5000 + "1" + "]" * 5000)
        r = await client.post(SUBMIT, content=deep.encode(),
                              headers={"Content-Type": "application/json"})
        assert r.status_code == 400, r.text
        assert f"at most {MAX_JSON_DEPTH}" in r.json()["detail"]
        r = await client.post(SUBMIT, content=b"[" * 100_000,
                              headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and "100000 levels" in r.json()["detail"], r.text
        # Nesting hidden behind a string that ends in an escaped backslash is still
        # counted; brackets inside a string (after an escaped quote) are not.
        hidden = '{"op_name": "x\\\\", "shape_overrides": {"x": ' + "[" * 40 + "1" + "]" * 40 + "}}"
        r = await client.post(SUBMIT, content=hidden.encode(),
                              headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and "42 levels" in r.json()["detail"], r.text
        quoted = json.dumps({**job("quoted"), "op_name": '\\"' + "[" * 40})
        r = await client.post(SUBMIT, content=quoted.encode(),
                              headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and "levels deep" not in r.text, r.text

        r = await client.post(SUBMIT, json=job("big", shape_overrides={"batch_size": 10**30}))
        assert r.status_code == 400, r.text
        assert "shape_overrides.batch_size" in r.json()["detail"]
        assert r.json()["errors"][0]["key"] == "shape_overrides.batch_size"
        r = await client.post(SUBMIT, json=job("neg", shape_overrides={"dim": [4, -1]}))
        assert r.status_code == 400 and ">= 0" in r.json()["detail"], r.text
        assert "shape_overrides.dim" in r.json()["detail"]

        r = await client.post(SUBMIT, json=job("name", shape_overrides={"batch": 16}))
        assert r.status_code == 400, r.text
        detail = r.json()["detail"]
        assert "'batch'" in detail and "batch_size" in detail and "dim" in detail, detail
        assert r.json()["errors"][0]["key"] == "shape_overrides"

        ok = await client.post(SUBMIT, json=job("fine", shape_overrides={"batch_size": 8}))
        assert ok.status_code == 200, ok.text
        # Nothing refused was queued or recorded.
        assert await bus.jobs.keys() == ["fine"]
        assert (await bus.js.stream_info(subjects.STREAM_JOBS)).state.messages == 1


async def _wait_record(bus: Bus, job_id: str, timeout_s: float = 60.0) -> JobRecord:
    deadline = time.monotonic() + scaled(timeout_s)
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            record = decode((await bus.jobs.get(job_id)).value, JobRecord)
            if record.status in ("failed", "completed", "cancelled"):
                return record
        await asyncio.sleep(0.1)
    raise AssertionError(f"job {job_id} did not end within {timeout_s} s")


@pytest.mark.slow  # a whole in-process stack, several jobs
async def test_jobs_that_cannot_run_fail_once_with_the_real_reason(
        settings: Settings, bus: Bus, fake_worker_heartbeat,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Raw submissions on the bus: an unknown shape name fails at once naming the task's
    names; a job whose handling raises fails once with the exception (not "delivered 6
    times ... died each time"); a lane with a bad priority is refused by the stream, one
    with a bad tenant token goes to the DLQ with the reason."""
    await fake_worker_heartbeat(bus)

    def broken(self, run, history):
        raise ZeroDivisionError("the workflow context could not be built")

    monkeypatch.setattr(Generator, "_context", broken)
    stop = asyncio.Event()
    generator = asyncio.create_task(run_generator(settings, stop))
    try:
        await bus.js.publish(subjects.JOBS_SUBMIT, encode(msgspec.convert(
            job("raw-name", shape_overrides={"batch": 4}), dict)))
        record = await _wait_record(bus, "raw-name")
        assert record.status == "failed" and "'batch'" in record.error, record.error
        assert "batch_size" in record.error

        await bus.js.publish(subjects.JOBS_SUBMIT, json.dumps(job("raw-raise")).encode())
        record = await _wait_record(bus, "raw-raise")
        assert record.status == "failed", record
        assert "ZeroDivisionError: the workflow context could not be built" in record.error
        assert "delivered" not in record.error

        # No stream takes it: no acknowledgement (the generator's wake-up subscription
        # hears it, so the publish times out rather than finding no responders).
        with pytest.raises((nats.errors.NoRespondersError, nats.errors.TimeoutError)):
            await bus.js.publish("jobs.submit.team_a.urgent", b"{}", timeout=scaled(2))
        dlq = await bus.js.subscribe("dlq.jobs.submit.team-a.normal", durable=None)
        try:
            await bus.js.publish("jobs.submit.team-a.normal", json.dumps(job("bad")).encode())
            moved = await dlq.next_msg(timeout=scaled(30))
            assert "no tenant name" in moved.headers["Aikg-Dlq-Reason"]
            # The copy goes first, then the original is deleted from JOBS.
            for _ in range(100):
                info = await bus.js.stream_info(subjects.STREAM_JOBS, subjects_filter=">")
                if not info.state.subjects:
                    break
                await asyncio.sleep(0.1)
            assert not info.state.subjects
        finally:
            await dlq.unsubscribe()
    finally:
        stop.set()
        await asyncio.wait_for(generator, 60)
        await cancel_and_wait(generator)


def test_the_sdk_refuses_an_unknown_shape_name_before_sending() -> None:
    from services.sdk.workers import build_request
    from tests.helpers import RELU_KERNEL, RELU_TASK

    with pytest.raises(ValueError, match="'batch'.*it assigns: batch_size, dim"):
        build_request(RELU_TASK, RELU_KERNEL, "relu", backend="cpu", arch="x86_64",
                      shape_overrides={"batch": 4})
    with pytest.raises(ValueError, match="shape_overrides"):
        build_request(RELU_TASK, RELU_KERNEL, "relu", backend="cpu", arch="x86_64",
                      shape_overrides={"batch_size": 10**30})
    assert build_request(RELU_TASK, RELU_KERNEL, "relu", backend="cpu", arch="x86_64",
                         shape_overrides={"batch_size": 4}).shape_overrides == {"batch_size": 4}
