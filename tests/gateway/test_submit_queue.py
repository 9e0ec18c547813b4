"""A job's submit message on a real NATS server whose JOBS stream is taken away or
answers nothing: tries repeat with one ``Nats-Msg-Id``; a record is withdrawn (503)
only when its message is known not to be stored, and otherwise stays, queued by the
gateway in the background or failed when the stream's duplicate window runs out.

What the stream stands in for: a JetStream node failing over, whose acknowledgement
of a stored submit message can be lost (tests/bus/test_cluster.py met it: the job was
withdrawn while a generator ran it, and the client's retry was then dropped as a
duplicate)."""

from __future__ import annotations

import asyncio
import json

import httpx
import nats.errors
import pytest
from nats.aio.msg import Msg

from schemas import JobSubmit, subjects
from services.common.bus import DUPLICATE_WINDOW_S, Bus, JobNotFound, JobStore
from services.gateway import queuing
from services.gateway.queuing import Unqueued, queue_job
from tests import support_gateway
from tests.helpers import scaled

client, cpu_worker, job = support_gateway.client, support_gateway.cpu_worker, support_gateway.job

# Where a submission of the default tenant and priority is queued.
DEFAULT_LANE = subjects.job_submit(subjects.DEFAULT_TENANT, subjects.DEFAULT_PRIORITY)


@pytest.fixture
def quick(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tries that give up within about a second, so a test need not wait out NATS's
    real timeouts."""
    monkeypatch.setattr(queuing, "QUEUE_RETRY_S", scaled(1.0))
    monkeypatch.setattr(queuing, "QUEUE_ACK_TIMEOUT_S", scaled(0.25))


class Listener:
    """A plain subscriber that takes every message on ``subject`` and never answers: a
    stream that stored the message but whose acknowledgement was lost."""

    def __init__(self) -> None:
        self.taken: list[Msg] = []

    async def take(self, msg: Msg) -> None:
        self.taken.append(msg)

    def ids(self) -> set[str]:
        return {(m.headers or {}).get("Nats-Msg-Id", "") for m in self.taken}


async def without_jobs_stream(bus: Bus) -> dict:
    """Delete the JOBS stream; returns its config, for :func:`restore_jobs_stream`."""
    config = (await bus.js.stream_info(subjects.STREAM_JOBS)).config
    await bus.js.delete_stream(subjects.STREAM_JOBS)
    return config


async def jobs_stored(bus: Bus) -> int:
    return (await bus.js.stream_info(subjects.STREAM_JOBS)).state.messages


def relu_submit(relu_task: str) -> JobSubmit:
    return JobSubmit(op_name="relu", task_desc=relu_task, backend="cpu")


async def test_unanswered_tries_carry_one_id_and_may_have_landed(bus: Bus, relu_task: str,
                                                                 quick: None) -> None:
    listener = Listener()
    sub = await bus.nc.subscribe("aikg.test.queue", cb=listener.take)
    try:
        with pytest.raises(Unqueued) as info:
            await queue_job(bus, "aikg.test.queue", relu_submit(relu_task), "job-1")
    finally:
        await sub.unsubscribe()
    assert info.value.maybe_stored
    assert isinstance(info.value.cause, nats.errors.TimeoutError)
    # Tried again, each try with the job id: the stream would store one of them.
    assert len(listener.taken) >= 2
    assert listener.ids() == {"job-1"}


async def test_tries_nobody_takes_are_known_not_stored(bus: Bus, relu_task: str,
                                                       quick: None) -> None:
    with pytest.raises(Unqueued) as info:
        await queue_job(bus, "aikg.test.nobody", relu_submit(relu_task), "job-2")
    assert not info.value.maybe_stored, info.value
    assert "NoResponders" in str(info.value) or "NoStreamResponse" in str(info.value)


async def test_a_job_queued_twice_is_stored_once(bus: Bus, relu_task: str) -> None:
    await queue_job(bus, DEFAULT_LANE, relu_submit(relu_task), "job-3")
    await queue_job(bus, DEFAULT_LANE, relu_submit(relu_task), "job-3")
    assert await jobs_stored(bus) == 1


async def test_a_submission_no_stream_takes_is_withdrawn(
        bus: Bus, client: httpx.AsyncClient, cpu_worker: None, job, quick: None) -> None:
    config = await without_jobs_stream(bus)
    r = await client.post("/api/v1/jobs/submit", json=job(job_id="nobody-1"))
    assert r.status_code == 503, r.text
    assert "could not queue the job" in r.json()["detail"]
    with pytest.raises(JobNotFound):
        await JobStore(bus.jobs).get("nobody-1")
    # The job id is free again: once the stream is back the same submission is queued.
    await bus.js.add_stream(config)
    r = await client.post("/api/v1/jobs/submit", json=job(job_id="nobody-1"))
    assert r.status_code == 200, r.text
    assert await jobs_stored(bus) == 1


async def test_a_submission_whose_message_may_have_landed_keeps_its_record(
        bus: Bus, client: httpx.AsyncClient, cpu_worker: None, job, quick: None) -> None:
    config = await without_jobs_stream(bus)
    listener = Listener()
    sub = await bus.nc.subscribe(DEFAULT_LANE, cb=listener.take)
    r = await client.post("/api/v1/jobs/submit", json=job(job_id="maybe-1"))
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "pending"
    assert "not yet acknowledged" in r.json()["message"], r.json()
    record, _ = await JobStore(bus.jobs).get("maybe-1")
    assert record.status == "pending"
    assert listener.taken and listener.ids() == {"maybe-1"}

    # The stream is back: the gateway's background tries store the job, once.
    await sub.unsubscribe()
    await bus.js.add_stream(config)
    deadline = asyncio.get_running_loop().time() + scaled(15)
    while await jobs_stored(bus) < 1:
        assert asyncio.get_running_loop().time() < deadline, "never queued in the background"
        await asyncio.sleep(0.1)
    # The client's retry of the same job is idempotent, and the stream keeps one copy.
    r = await client.post("/api/v1/jobs/submit", json=job(job_id="maybe-1"))
    assert r.status_code == 200, r.text
    assert r.json()["message"] == "job already submitted"
    assert await jobs_stored(bus) == 1
    assert (await JobStore(bus.jobs).get("maybe-1"))[0].status == "pending"


async def test_a_job_never_acknowledged_fails_before_the_duplicate_window_ends(
        bus: Bus, client: httpx.AsyncClient, cpu_worker: None, job, quick: None,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Background tries stop about two seconds after the submission.
    monkeypatch.setattr(queuing, "REQUEUE_MARGIN_S", DUPLICATE_WINDOW_S - scaled(2.0))
    await without_jobs_stream(bus)
    listener = Listener()
    sub = await bus.nc.subscribe(DEFAULT_LANE, cb=listener.take)
    events = await bus.nc.subscribe(subjects.job_events("late-1"))
    try:
        r = await client.post("/api/v1/jobs/submit", json=job(job_id="late-1"))
        assert r.status_code == 200, r.text
        deadline = asyncio.get_running_loop().time() + scaled(15)
        while (record := (await JobStore(bus.jobs).get("late-1"))[0]).status == "pending":
            assert asyncio.get_running_loop().time() < deadline, "still pending"
            await asyncio.sleep(0.1)
        assert record.status == "failed"
        assert "could not queue the job" in (record.error or ""), record.error
        assert "submit it again" in (record.error or "")
        seen = [json.loads((await events.next_msg(timeout=scaled(5))).data)["event"]
                for _ in range(2)]
        assert seen == ["submitted", "failed"]
        assert listener.ids() == {"late-1"}
    finally:
        await sub.unsubscribe()
        await events.unsubscribe()
