"""Bounded streams (services/common/lane_watch.py, services/common/bus.py): a verify
request on a backend/arch no live worker serves fails within
``verify_unserved_timeout_s`` with a message naming the lane, one whose lane gains a
worker in time runs, and JOBS and VERIFY carry limits that drop nothing queued.
"""

from __future__ import annotations

import asyncio

import msgspec
import nats.js.errors
import pytest
from nats.js.api import DiscardPolicy

from schemas import JobSubmit, encode, subjects
from services.common.bus import Bus, connect_bus, ensure_streams, stream_configs
from services.common.lane_watch import LaneWatch, live_heartbeats
from services.common.settings import Settings
from services.sdk import remote_worker
from services.sdk.workers import NoWorkerError, RemoteWorker
from tests.conftest import as_role, fake_worker_heartbeat
from tests.helpers import RELU_KERNEL, RELU_TASK, cpu_request, job_events, poll_until, scaled

UNSERVED = "noarch"  # an arch no test worker offers


def remote(settings: Settings, arch: str, bound_s: float) -> RemoteWorker:
    """A RemoteWorker with the generator's rights that sends even with no live worker."""
    return RemoteWorker(settings.nats_url, backend="cpu", arch=arch, require_live_worker=False,
                        unserved_timeout_s=bound_s, settings=as_role(settings, "generator"))


async def test_work_queues_have_limits_and_a_full_one_refuses_new_keeps_old(
        settings: Settings, bus: Bus) -> None:
    """JOBS and VERIFY are created with a max age and a message count with discard
    new; a full stream refuses the next publish and keeps every queued message."""
    for name in (subjects.STREAM_JOBS, subjects.STREAM_VERIFY):
        config = (await bus.js.stream_info(name)).config
        assert config.max_age == settings.queue_max_age_s > 0, name
        assert config.max_msgs == settings.queue_max_msgs > 0, name
        assert config.discard == DiscardPolicy.NEW, name
    assert {c.name: c.max_age for c in stream_configs(settings)}[subjects.STREAM_VERIFY] \
        == 7 * 24 * 3600.0
    # A stream of two messages: the third publish is refused, the two stay.
    small = msgspec.structs.replace(settings, queue_max_msgs=2)
    await bus.js.delete_stream(subjects.STREAM_VERIFY)
    await ensure_streams(bus.js, small)
    subject = subjects.verify("cpu", UNSERVED)
    for i in range(2):
        await bus.js.publish(subject, encode(cpu_request(RELU_KERNEL, RELU_TASK)),
                             headers={"Nats-Msg-Id": f"full-{i}"})
    with pytest.raises(nats.js.errors.Error, match="maximum messages"):
        await bus.js.publish(subject, b"{}", headers={"Nats-Msg-Id": "full-2"})
    assert (await bus.js.stream_info(subjects.STREAM_VERIFY)).state.messages == 2


async def test_a_service_creates_limited_streams_and_starts_at_once_against_them(
        settings: Settings, bus: Bus) -> None:
    """The gateway's user, connecting to streams made with the same settings, finds
    them as it would make them (no refused update, no wait)."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    gateway = await connect_bus(as_role(settings, "gateway"), "test-gateway")
    try:
        assert loop.time() - started < 3.0  # STREAM_UPDATE_TIMEOUT_S: no update tried
        config = (await gateway.js.stream_info(subjects.STREAM_JOBS)).config
        assert config.max_age == settings.queue_max_age_s
    finally:
        await gateway.close()


async def test_heartbeats_are_read_without_a_consumer(settings: Settings, bus: Bus) -> None:
    """live_heartbeats, as the generator's user, lists live workers and leaves out a
    deleted key, creating no consumer on the bucket's stream."""
    await fake_worker_heartbeat(bus, "cpu", "a1", worker_id="w-a1")
    await fake_worker_heartbeat(bus, "cuda", "h100", worker_id="w-h100")
    await bus.workers.delete("w-h100")
    generator = await connect_bus(as_role(settings, "generator"), "test-generator")
    try:
        live = await live_heartbeats(generator.js)
        assert [(w.worker_id, w.backend, w.arch) for w in live] == [("w-a1", "cpu", "a1")]
        info = await bus.js.stream_info(f"KV_{subjects.BUCKET_WORKERS}")
        assert info.state.consumer_count == 0
    finally:
        await generator.close()


async def test_lane_watch_counts_only_unbroken_unserved_time(settings: Settings,
                                                             bus: Bus) -> None:
    """A lane is unserved only after the bound with no live worker in a row; a
    heartbeat of its pair starts the count again, another pair's does not count."""
    now = [0.0]
    watch = LaneWatch(bus.js, "cpu", "a2", 10.0, clock=lambda: now[0])
    await fake_worker_heartbeat(bus, "cpu", "other", worker_id="w-other")
    assert await watch.check() is None  # the count starts
    now[0] = 9.0
    assert await watch.check() is None
    await fake_worker_heartbeat(bus, "cpu", "a2", worker_id="w-a2")
    now[0] = 12.0
    assert await watch.check() is None  # served: the count is gone
    await bus.workers.delete("w-a2")
    now[0] = 14.0  # a read (one every fifth of the bound) finds none: the count starts
    assert await watch.check() is None
    now[0] = 23.5
    assert await watch.check() is None
    now[0] = 24.5
    message = await watch.check()
    assert message is not None and message.startswith(
        "no worker serves verify.cpu.a2: none has sent a heartbeat in the last 10 s")
    assert "live: cpu/other" in message
    assert await LaneWatch(bus.js, "cpu", "a2", 0.0).check() is None  # 0: off


async def test_remote_verify_on_an_unserved_lane_fails_within_the_bound(
        settings: Settings, bus: Bus) -> None:
    """RemoteWorker.verify and verify_many on a lane nobody serves end with
    NoWorkerError naming the lane after the bound, not at the result timeout."""
    bound = 2.0
    worker = remote(settings, UNSERVED, bound)
    loop = asyncio.get_running_loop()
    try:
        started = loop.time()
        with pytest.raises(NoWorkerError, match=f"no worker serves verify.cpu.{UNSERVED}: none "
                           "has sent a heartbeat in the last 2 s"):
            await worker.verify(RELU_TASK, RELU_KERNEL, "relu", trials=1)
        assert bound <= loop.time() - started < bound + scaled(5)
        started = loop.time()
        with pytest.raises(NoWorkerError, match=f"2 of 2 requests .* no worker serves "
                           f"verify.cpu.{UNSERVED}"):
            await worker.verify_many(RELU_TASK, [RELU_KERNEL, RELU_KERNEL + "x = 1\n"], "relu",
                                     trials=1)
        assert bound <= loop.time() - started < bound + scaled(5)
    finally:
        await worker.close()


@pytest.mark.slow
async def test_a_request_whose_lane_gains_a_worker_in_time_runs(
        shared_services, settings: Settings, bus: Bus, monkeypatch: pytest.MonkeyPatch) -> None:
    """Queued on a lane with no worker until the lane watch has found none (the count
    toward the bound has started), then a worker starts before the bound: the request
    is verified and its verdict returned."""
    found_none: list[float] = []  # when a check of the request's lane watch found no worker

    class CountedWatch(LaneWatch):
        async def check(self) -> str | None:
            message = await super().check()
            if not any(w.backend == self.backend and w.arch == self.arch for w in self.live):
                found_none.append(self.clock())
            return message

    monkeypatch.setattr(remote_worker, "LaneWatch", CountedWatch)
    worker = remote(settings, settings.arch, scaled(30))
    try:
        call = asyncio.create_task(worker.verify(RELU_TASK, RELU_KERNEL, "relu", trials=1))

        async def counting() -> bool:
            return bool(found_none)

        await poll_until(counting, 30, "the lane watch's first read without a worker")
        assert not call.done()
        async with shared_services(settings, bus, generator=False):
            result = await asyncio.wait_for(call, scaled(120))
        assert result.passed, result.error
    finally:
        await worker.close()


@pytest.mark.slow
async def test_a_job_whose_lane_nobody_serves_fails_with_the_lane_named(
        shared_services, settings: Settings, bus: Bus) -> None:
    """A job sent on the bus (``nats pub``) for an arch no worker offers: the generator
    sends its verify request, and the job fails within the bound saying no worker
    serves that lane, and which pairs are live."""
    settings = msgspec.structs.replace(settings, verify_unserved_timeout_s=2.0)
    submit = JobSubmit(op_name="relu", task_desc=RELU_TASK, backend="cpu", arch=UNSERVED,
                       job_id="job-unserved", coder="builtin")
    async with shared_services(settings, bus):
        await bus.js.publish(subjects.JOBS_SUBMIT, encode(submit),
                             headers={"Nats-Msg-Id": "job-unserved"})

        async def ended():
            try:
                record = msgspec.json.decode((await bus.jobs.get("job-unserved")).value)
            except nats.js.errors.KeyNotFoundError:
                return None
            return record if record["status"] in ("completed", "failed", "cancelled") else None

        record = await poll_until(ended, 120, "the job's end")
    assert record["status"] == "failed"
    error = record["error"]
    assert f"no worker serves verify.cpu.{UNSERVED}: none has sent a heartbeat in the last 2 s" \
        in error, error
    assert f"live: cpu/{settings.arch}" in error
    # It failed within the bound of its request going out, not at the result timeout.
    candidate = record["progress"]["candidates"][0]
    assert candidate["verify_seq"] and candidate["passed"] is None
    events = {e.event: e.time for e in await job_events(bus, "job-unserved")}
    waited = (events["failed"] - events["verify_started"]).total_seconds()
    assert 2.0 <= waited < 2.0 + scaled(10), waited


def test_the_bound_defaults_to_tens_of_seconds() -> None:
    """The default bound outlasts a worker's restart and is far below the result timeout."""
    defaults = Settings()
    assert 10 <= defaults.verify_unserved_timeout_s < defaults.verify_result_timeout_s / 10
