"""The worker service over a real nats-server: delivery, devices, leases, control.

Each test runs a worker as an asyncio task in the test's loop: the first the real
:func:`run_worker` with its own fork server, the others a :class:`Worker` with the
session's started verifier lent to it (``shared_verifier``; its fork server and
sandboxed children are real processes), and talks to it the way other
services and ``nats`` CLI users do: raw JSON on ``verify.cpu.<arch>``, results on
``results.<job_id>``, the ``leases`` / ``workers`` / ``jobs`` buckets, the DLQ stream
and the ``aikg.worker.<worker_id>.{status,drain}`` endpoints.

Candidates are the built-in coder's output for ``tasks/relu.py`` at 16 x 1024; a
"slow" candidate sleeps in a Python loop in ``forward`` before launching its kernel.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import functools
import json
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import nats.js.errors
import pytest

from schemas import JobEvent, JobRecord, JobSubmit, VerifyResult, decode, subjects, utcnow
from services.common.bus import Bus, JobStore, connect_bus
from services.common.provision import create_consumer, lane_config
from services.common.settings import Settings
from services.generator.lowering import lower_task
from services.worker.service import Worker, run_worker
from services.worker.verifier import Verifier
from tests.conftest import lend_verifier
from tests.helpers import BUNDLED_RELU_TASK, poll_until, scaled

ROOT = Path(__file__).resolve().parents[2]
RELU_TASK = BUNDLED_RELU_TASK
SHAPES = {"batch_size": 16, "dim": 1024}
# Generous: two shared cores, and each worker imports torch + triton in its fork server.
START_TIMEOUT_S = 120.0
RESULT_TIMEOUT_S = 120.0


@functools.cache
def relu_candidate() -> str:
    """The built-in coder's (correct) candidate for tasks/relu.py at 16 x 1024."""
    return lower_task(RELU_TASK, SHAPES)


def slow_candidate(sleep_s: float) -> str:
    """The relu candidate, sleeping ``sleep_s`` seconds in ``forward`` (0.1 s steps)
    before it launches its kernel."""
    code = relu_candidate()
    code = code.replace("import torch\n", "import time\nimport torch\n", 1)
    steps = max(1, round(sleep_s / 0.1))
    code = code.replace(
        "    def forward(self, x):\n",
        f"    def forward(self, x):\n        for _ in range({steps}):\n"
        "            time.sleep(0.1)\n", 1)
    assert "time.sleep" in code
    return code


def request_body(settings: Settings, job_id: str, code: str | None = None,
                 **fields: Any) -> dict[str, Any]:
    """A VerifyRequest as raw JSON fields (what ``nats pub`` would send)."""
    body = {
        "request_id": f"req-{uuid.uuid4().hex[:12]}",
        "job_id": job_id,
        "candidate_id": "cand-1",
        "op_name": "relu",
        "task_desc": RELU_TASK,
        "code": code if code is not None else relu_candidate(),
        "backend": "cpu",
        "arch": settings.arch,
        "shape_overrides": SHAPES,
        "timeout_s": 120.0,
    }
    body.update(fields)
    return body


async def publish_request(bus: Bus, settings: Settings, body: dict[str, Any] | bytes,
                          msg_id: str | None = None) -> None:
    """Publish raw bytes on ``verify.cpu.<arch>`` (stored once the PubAck arrives)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    if msg_id is None and isinstance(body, dict):
        msg_id = body["request_id"]
    headers = {"Nats-Msg-Id": msg_id} if msg_id else None
    await bus.js.publish(subjects.verify("cpu", settings.arch), data, headers=headers)


class Results:
    """Every VerifyResult published on ``results.>`` while the test runs, by job id."""

    def __init__(self) -> None:
        self.by_job: dict[str, list[VerifyResult]] = {}

    async def start(self, bus: Bus) -> None:
        async def on_msg(msg) -> None:
            result = decode(msg.data, VerifyResult)
            self.by_job.setdefault(result.job_id, []).append(result)

        await bus.nc.subscribe(f"{subjects.RESULTS_PREFIX}.*.*", cb=on_msg)
        await bus.nc.flush()

    async def wait(self, job_id: str, count: int = 1,
                   timeout_s: float = RESULT_TIMEOUT_S) -> list[VerifyResult]:
        async def enough() -> list[VerifyResult] | None:
            got = self.by_job.get(job_id, [])
            return got if len(got) >= count else None

        return await poll_until(enough, timeout_s, f"{count} result(s) for {job_id}")


@pytest.fixture
async def results(bus: Bus) -> Results:
    collector = Results()
    await collector.start(bus)
    return collector


async def serve_with(settings: Settings, stop: asyncio.Event, verifier: Verifier) -> None:
    """What :func:`run_worker` does, with the session's started verifier lent to the
    worker instead of a fork server of its own."""
    worker_bus = await connect_bus(settings, f"aikg-worker-{settings.worker_id}", role="worker")
    try:
        await Worker(worker_bus, settings,
                     verifier=lend_verifier(verifier, settings.worker_id)).run(stop)
    finally:
        await worker_bus.close()


@contextlib.asynccontextmanager
async def running_worker(settings: Settings, bus: Bus, *, verifier: Verifier | None = None,
                         **overrides: Any) -> AsyncIterator[tuple[Settings, asyncio.Task]]:
    """A worker as a task until the block ends; waits for its first heartbeat.

    Without ``verifier`` it is the real :func:`run_worker` (its own fork server, a few
    seconds to start); with one (the session's ``shared_verifier``) it is
    :func:`serve_with`. ``overrides`` replace settings fields (``worker_devices``,
    ``verify_ack_wait_s`` ...). The verify consumer is first made (or updated) as the
    admin with the worker's settings, as ``aikg nats-setup --verify cpu/<arch>`` would:
    a worker's user may not create or change it.
    """
    overrides.setdefault("verify_ack_wait_s", 3.0)
    worker_settings = msgspec.structs.replace(settings, **overrides)
    await create_consumer(bus.js, subjects.STREAM_VERIFY,
                          subjects.verify(worker_settings.worker_backend, worker_settings.arch),
                          worker_settings, update=True)
    stop = asyncio.Event()
    serving = (run_worker(worker_settings, stop) if verifier is None
               else serve_with(worker_settings, stop, verifier))
    task = asyncio.create_task(serving, name="worker")

    async def beating() -> bool:
        if task.done():
            task.result()
            raise RuntimeError("the worker stopped before its first heartbeat")
        with contextlib.suppress(nats.js.errors.KeyNotFoundError):
            return (await bus.workers.get(worker_settings.worker_id)).value is not None
        return False

    try:
        await poll_until(beating, START_TIMEOUT_S, "worker heartbeat")
        yield worker_settings, task
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), 120)


async def worker_status(bus: Bus, worker_id: str) -> dict[str, Any]:
    reply = await bus.nc.request(f"{subjects.worker_service(worker_id)}.status", b"", timeout=scaled(10))
    return json.loads(reply.data)


async def consumer_info(bus: Bus, settings: Settings):
    return await bus.js.consumer_info(subjects.STREAM_VERIFY,
                                      subjects.verify_consumer("cpu", settings.arch))


async def lease_keys(bus: Bus, worker_id: str) -> set[str]:
    try:
        keys = await bus.leases.keys()
    except nats.js.errors.NoKeysError:
        return set()
    return {k for k in keys if k.startswith(f"{worker_id}.")}


async def stream_messages(bus: Bus, subject: str, expect: int,
                          timeout_s: float = 10.0) -> list[Any]:
    """The first ``expect`` messages stored on ``subject`` (an ordered consumer)."""
    sub = await bus.js.subscribe(subject, ordered_consumer=True)
    out = []
    try:
        deadline = time.monotonic() + timeout_s
        while len(out) < expect and time.monotonic() < deadline:
            with contextlib.suppress(nats.errors.TimeoutError, asyncio.TimeoutError):
                out.append(await sub.next_msg(timeout=scaled(0.5)))
    finally:
        await sub.unsubscribe()
    return out


async def job_events(bus: Bus, job_id: str, expect: int = 1) -> list[JobEvent]:
    msgs = await stream_messages(bus, subjects.job_events(job_id), expect)
    return [decode(m.data, JobEvent) for m in msgs]


async def queue_drained(bus: Bus, settings: Settings) -> bool:
    info = await consumer_info(bus, settings)
    return info.num_pending == 0 and info.num_ack_pending == 0


# --------------------------------------------------------------------------- tests


@pytest.mark.slow  # run_worker itself: a fork server of its own (the others borrow one)
async def test_raw_request_gets_passed_result_and_status_answers(
        settings: Settings, bus: Bus, results: Results) -> None:
    async with running_worker(settings, bus) as (ws, _):
        idle = await worker_status(bus, ws.worker_id)
        assert idle["worker_id"] == ws.worker_id
        assert idle["devices"] == ["0"] and idle["capacity"] == 1
        assert idle["in_flight"] == 0 and idle["leases"] == []
        assert idle["backend"] == "cpu" and idle["arch"] == settings.arch
        assert idle["status"] == "running"

        body = request_body(settings, "job-relu")
        await publish_request(bus, settings, body)
        (result,) = await results.wait("job-relu")

        assert result.passed is True, (result.stage, result.error, result.log)
        assert result.stage is None and result.error is None
        assert result.request_id == body["request_id"]
        assert result.candidate_id == "cand-1"
        assert result.worker_id == ws.worker_id and result.device == "0"
        assert result.interpreted is True and result.speedup is None
        assert result.trials == 3 and result.duration_s > 0
        await poll_until(lambda: queue_drained(bus, settings), 10, "request acked")
        assert await lease_keys(bus, ws.worker_id) == set()

        # A hand-written created_at without a UTC offset decodes as a naive datetime;
        # it must not break the queue-wait metric, and so the request.
        naive = request_body(settings, "job-naive", created_at="2030-01-01T00:00:00")
        await publish_request(bus, settings, naive)
        (result,) = await results.wait("job-naive")
        assert result.passed, (result.stage, result.error)
        info = await consumer_info(bus, settings)
        assert info.num_redelivered == 0 and info.num_pending == 0, info


@pytest.mark.slow
async def test_two_devices_run_two_requests_at_once_and_a_third_waits(
        settings: Settings, bus: Bus, results: Results,
        shared_verifier: Verifier) -> None:
    async with running_worker(settings, bus, verifier=shared_verifier,
                              worker_devices="0,1") as (ws, _):
        bodies = [request_body(settings, f"job-cap-{i}", slow_candidate(4.0), trials=1)
                  for i in range(3)]
        for body in bodies:
            await publish_request(bus, settings, body)

        async def both_busy() -> dict | None:
            status = await worker_status(bus, ws.worker_id)
            return status if status["in_flight"] == 2 and len(status["leases"]) == 2 else None

        status = await poll_until(both_busy, 60, "two verifications in flight")
        assert {lease["device"] for lease in status["leases"]} == {"0", "1"}
        assert {lease["request_id"] for lease in status["leases"]} <= \
            {b["request_id"] for b in bodies}
        # The bucket's key listing (a KV watch) can lag the worker's own view under load.
        held = {f"{ws.worker_id}.0", f"{ws.worker_id}.1"}

        async def both_leased() -> bool:
            return await lease_keys(bus, ws.worker_id) == held

        await poll_until(both_leased, 10, "both leases in the leases bucket")
        entry = await bus.leases.get(f"{ws.worker_id}.0")
        lease = json.loads(entry.value)
        assert lease["worker_id"] == ws.worker_id and lease["job_id"].startswith("job-cap-")
        # The third request stays in the stream: the worker asks only for free devices.
        info = await consumer_info(bus, settings)
        assert info.num_ack_pending == 2 and info.num_pending == 1, info

        done = [(await results.wait(b["job_id"]))[0] for b in bodies]
        assert all(r.passed for r in done), [(r.stage, r.error) for r in done]
        assert {r.device for r in done} <= {"0", "1"}
        first_two = sorted(done, key=lambda r: r.finished_at)[:2]
        last = max(done, key=lambda r: r.finished_at)
        # The third one started only after one of the first two had finished.
        assert last.finished_at - min(r.finished_at for r in first_two) >= \
            dt.timedelta(seconds=3)
        assert await lease_keys(bus, ws.worker_id) == set()
        idle = await worker_status(bus, ws.worker_id)
        assert idle["in_flight"] == 0 and idle["leases"] == []


@pytest.mark.slow  # a worker drained mid-verification
async def test_drain_finishes_in_flight_work_then_leaves_workers_bucket(
        settings: Settings, bus: Bus, results: Results,
        shared_verifier: Verifier) -> None:
    async with running_worker(settings, bus, verifier=shared_verifier) as (ws, task):
        busy = request_body(settings, "job-drain", slow_candidate(3.0), trials=1)
        await publish_request(bus, settings, busy)
        await poll_until(lambda: lease_keys(bus, ws.worker_id), 60, "lease while running")

        reply = await bus.nc.request(f"{subjects.worker_service(ws.worker_id)}.drain", b"",
                                     timeout=scaled(10))
        answer = json.loads(reply.data)
        assert answer == {"worker_id": ws.worker_id, "status": "draining", "in_flight": 1}
        later = request_body(settings, "job-after-drain")
        await publish_request(bus, settings, later)
        assert not task.done()

        await asyncio.wait_for(asyncio.shield(task), 120)
        task.result()
        (result,) = await results.wait("job-drain", timeout_s=5)
        assert result.passed, (result.stage, result.error)
        with pytest.raises((nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError)):
            await bus.workers.get(ws.worker_id)
        assert await lease_keys(bus, ws.worker_id) == set()
        # The request published after the drain was left for other workers.
        assert "job-after-drain" not in results.by_job
        info = await consumer_info(bus, settings)
        assert info.num_pending == 1 and info.num_ack_pending == 0, info


async def test_dead_lettered_requests_tell_their_jobs_and_the_next_is_served(
        settings: Settings, bus: Bus, results: Results,
        shared_verifier: Verifier) -> None:
    """The worker's side of the pull loop's dead letters (the mechanics are
    tests/test_pull_loop.py's): a request past max_deliver gets a failed
    ``infrastructure`` result and an ``error`` event, a malformed one an ``error``
    event on the job it names; the next request is served."""
    max_deliver = 2
    subject = subjects.verify("cpu", settings.arch)
    # The consumer as the provisioner makes it for these settings, then max_deliver
    # deliveries that each end without a verdict, as if the worker holding the request
    # died each time.
    durable = subjects.verify_consumer("cpu", settings.arch)
    await bus.js.add_consumer(subjects.STREAM_VERIFY, lane_config(
        subject, durable, ack_wait_s=3.0, max_deliver=max_deliver + 1))
    psub = await bus.js.pull_subscribe_bind(durable=durable, stream=subjects.STREAM_VERIFY)
    body = request_body(settings, "job-poison")
    await publish_request(bus, settings, body)
    for n in range(1, max_deliver + 1):
        (msg,) = await psub.fetch(1, timeout=scaled(10))
        assert msg.metadata.num_delivered == n
        await msg.nak()
    await psub.unsubscribe()
    wrong = {"job_id": "job-malformed", "request_id": 42, "code": "x"}
    await publish_request(bus, settings, json.dumps(wrong).encode(), msg_id="bad-1")
    good = request_body(settings, "job-good")
    await publish_request(bus, settings, good)

    async with running_worker(settings, bus, verifier=shared_verifier,
                              verify_max_deliver=max_deliver):
        (result,) = await results.wait("job-poison")
        (served,) = await results.wait("job-good")
        await poll_until(lambda: queue_drained(bus, settings), 10, "all three acked")

    assert served.passed, (served.stage, served.error)
    assert result.passed is False and result.stage == "infrastructure"
    assert f"delivered {max_deliver + 1} times" in result.error
    assert f"moved to {subjects.dlq(subject)}" in result.error
    assert result.request_id == body["request_id"]
    dead = await stream_messages(bus, subjects.dlq(subject), 2)
    assert sorted(m.headers["Aikg-Deliveries"] for m in dead) == ["1", str(max_deliver + 1)]
    events = await job_events(bus, "job-poison")
    assert [e.event for e in events] == ["error"]
    assert events[0].request_id == body["request_id"]
    events = await job_events(bus, "job-malformed")
    assert [e.event for e in events] == ["error"]
    assert events[0].message.startswith("malformed verify request: ")
    assert f"moved to {subjects.dlq(subject)}" in events[0].message
    assert "job-malformed" not in results.by_job


async def test_request_of_cancelled_job_is_acked_without_running(
        settings: Settings, bus: Bus, results: Results,
        shared_verifier: Verifier) -> None:
    submit = JobSubmit(op_name="relu", task_desc=RELU_TASK, job_id="job-cancelled")
    record = JobRecord(job_id="job-cancelled", status="cancelled", job_type="single",
                       op_name="relu", submit_time=utcnow(), backend="cpu",
                       arch=settings.arch, request=submit, error="cancelled by user")
    assert await JobStore(bus.jobs).create(record)
    async with running_worker(settings, bus, verifier=shared_verifier) as (ws, _):
        # If it ran, it would hold the only device (and a lease) for 30 s.
        await publish_request(bus, settings,
                              request_body(settings, "job-cancelled", slow_candidate(30.0)))
        await publish_request(bus, settings, request_body(settings, "job-live"))
        started = time.monotonic()
        (result,) = await results.wait("job-live")
        assert result.passed, (result.stage, result.error)
        assert time.monotonic() - started < 30
        await poll_until(lambda: queue_drained(bus, settings), 10, "both acked")
        assert "job-cancelled" not in results.by_job
        with pytest.raises(nats.js.errors.NotFoundError):
            await bus.js.get_last_msg(subjects.STREAM_RESULTS,
                                      subjects.job_results("job-cancelled"))
        assert await lease_keys(bus, ws.worker_id) == set()


async def test_consumer_deleted_under_a_running_worker_is_recreated(
        settings: Settings, bus: Bus, results: Results,
        shared_verifier: Verifier) -> None:
    async with running_worker(settings, bus, verifier=shared_verifier):
        await bus.js.delete_consumer(subjects.STREAM_VERIFY,
                                     subjects.verify_consumer("cpu", settings.arch))
        body = request_body(settings, "job-after-delete")
        await publish_request(bus, settings, body)
        (result,) = await results.wait("job-after-delete", timeout_s=60)
        assert result.passed, (result.stage, result.error)
        # Made again by the provisioner, with its configuration (not the worker's 3 s:
        # a worker chooses nothing about a shared consumer).
        info = await consumer_info(bus, settings)
        assert info.config.ack_wait == pytest.approx(settings.verify_ack_wait_s)


async def test_heartbeat_is_back_promptly_after_nats_restarts(
        shared_verifier: Verifier, nats_server, settings: Settings, bus: Bus) -> None:
    """A NATS outage longer than the heartbeat period: the worker keeps running and its
    heartbeat key is renewed soon after the server is back (failed puts are retried
    every HEARTBEAT_RETRY_S, not a period later)."""
    async with running_worker(settings, bus, verifier=shared_verifier,
                              worker_heartbeat_s=2.0) as (worker, task):
        before = (await bus.workers.get(worker.worker_id)).revision
        nats_server.kill()
        await asyncio.sleep(3.0)  # puts fail meanwhile
        nats_server.start()  # same port, same JetStream store
        restarted = time.monotonic()

        async def renewed() -> bool:
            with contextlib.suppress(Exception):
                entry = await bus.workers.get(worker.worker_id)
                return entry.value is not None and entry.revision > before
            return False

        await poll_until(renewed, 15.0, "a heartbeat after the restart")
        elapsed = time.monotonic() - restarted
        print(f"heartbeat renewed {elapsed:.2f} s after NATS came back")
        assert elapsed < 3.0
        assert not task.done()
