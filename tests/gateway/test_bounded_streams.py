"""The gateway's part of bounded streams: a batch whose backend/arch loses its last
worker fails its entries within ``verify_unserved_timeout_s`` with a message naming the
lane (services/gateway/batches.py, services/common/lane_watch.py), and an out-of-range
``Last-Event-ID`` is a 400 that says so, not a 503 with the NATS error text
(services/gateway/inputs.py, ``resume_after``).
"""

from __future__ import annotations

import asyncio

import httpx
import msgspec
import pytest

from schemas import JobSubmit, subjects
from services.common.bus import Bus, JobStore
from services.common.records import new_record
from services.common.settings import Settings
from services.gateway import batch_follow
from services.gateway.inputs import MAX_EVENT_ID
from tests.conftest import fake_worker_heartbeat
from tests.gateway.test_batches import batch, queued_requests
from tests.helpers import RELU_KERNEL, RELU_TASK, WRONG_RELU_KERNEL, poll_until, scaled


async def test_a_batch_whose_lane_loses_its_worker_fails_its_entries_within_the_bound(
        settings: Settings, bus: Bus, start_gateway) -> None:
    """The only worker of the batch's pair goes away before taking a request: within
    the bound every entry (a duplicate too) fails with the lane named, the batch
    completes, and its requests are taken out of VERIFY."""
    settings = msgspec.structs.replace(settings, verify_unserved_timeout_s=2.0)
    await fake_worker_heartbeat(bus, "cpu", "x86_64", worker_id="leaving")
    url = await start_gateway(settings)
    codes = [RELU_KERNEL, WRONG_RELU_KERNEL, RELU_KERNEL + "\n# the same\n"]
    loop = asyncio.get_running_loop()
    async with httpx.AsyncClient(base_url=url, timeout=scaled(15)) as client:
        r = await client.post("/api/v1/verify/batch", json=batch(codes, batch_id="b-gone"))
        assert r.status_code == 200, r.text
        assert len(await queued_requests(bus, subjects.verify("cpu", "x86_64"))) == 2
        await bus.workers.delete("leaving")
        gone = loop.time()

        async def ended():
            record = (await client.get("/api/v1/verify/batch/b-gone")).json()
            return record if record["status"] != "running" else None

        record = await poll_until(ended, 30, "the batch's end")
        waited = loop.time() - gone
    assert 2.0 <= waited < 2.0 + scaled(8), waited
    assert record["status"] == "completed"
    verdicts = sorted(record["verdicts"], key=lambda v: v["index"])
    assert [(v["index"], v["passed"], v["stage"]) for v in verdicts] == [
        (0, False, "infrastructure"), (1, False, "infrastructure"), (2, False, "infrastructure")]
    assert verdicts[2]["duplicate_of"] == 0
    for v in verdicts:
        assert v["error"].startswith("no worker serves verify.cpu.x86_64: none has sent a "
                                     "heartbeat in the last 2 s"), v["error"]
        assert "live: none" in v["error"]
    assert await queued_requests(bus, subjects.verify("cpu", "x86_64")) == []


async def test_a_batch_keeps_waiting_while_its_lane_is_served(
        settings: Settings, bus: Bus, fake_worker_heartbeat, start_gateway,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A live worker of the pair (busy elsewhere) keeps the batch's requests queued
    past the bound: being served is not being fast."""
    settings = msgspec.structs.replace(settings, verify_unserved_timeout_s=1.0)
    checks: list[float] = []  # when the batch's lane watch looked (its clock)

    class CountedWatch(batch_follow.LaneWatch):
        async def check(self) -> str | None:
            checks.append(self.clock())
            return await super().check()

    monkeypatch.setattr(batch_follow, "LaneWatch", CountedWatch)
    await fake_worker_heartbeat(bus, "cpu", "x86_64")
    url = await start_gateway(settings)
    async with httpx.AsyncClient(base_url=url, timeout=scaled(15)) as client:
        r = await client.post("/api/v1/verify/batch", json=batch([RELU_KERNEL],
                                                                 batch_id="b-served"))
        assert r.status_code == 200, r.text

        async def past_the_bound() -> bool:
            # Checks well past the bound (and a read of the workers bucket after it),
            # each of which would have failed the batch had the lane been unserved.
            return bool(checks) and sum(
                t >= checks[0] + 2 * settings.verify_unserved_timeout_s for t in checks) >= 3

        await poll_until(past_the_bound, 30, "the lane watch's checks past the bound")
        record = (await client.get("/api/v1/verify/batch/b-served")).json()
    assert record["status"] == "running" and record["verdicts"] == []
    assert len(await queued_requests(bus, subjects.verify("cpu", "x86_64"))) == 1


async def test_an_out_of_range_last_event_id_is_a_400(
        settings: Settings, bus: Bus, start_gateway) -> None:
    """10**30, 2**64, a negative id and ids that are not ASCII digits are refused with
    a 400 naming the fault; the largest id is accepted (the stream opens)."""
    await JobStore(bus.jobs).create(new_record(
        JobSubmit(op_name="relu", task_desc=RELU_TASK, backend="cpu"), job_id="job-ev",
        arch="x86_64"))
    url = await start_gateway(settings)
    async with httpx.AsyncClient(base_url=url, timeout=scaled(15)) as client:
        for route in ("/api/v1/jobs/job-ev/events", "/api/v1/verify/batch/b-none/events"):
            for bad, said in ((str(10**30), "out of range"), (str(2**64), "out of range"),
                              (str(MAX_EVENT_ID + 1), "out of range"),
                              ("-1", "must not be negative"), ("1_000", "an integer"),
                              ("\u0663".encode(), "an integer"), ("+5", "an integer"),
                              ("1e3", "an integer")):
                r = await client.get(route, headers={"Last-Event-ID": bad})
                assert r.status_code == 400, (route, bad, r.status_code, r.text)
                assert "Last-Event-ID" in r.json()["detail"] and said in r.json()["detail"], \
                    (bad, r.text)
        async with client.stream("GET", "/api/v1/jobs/job-ev/events",
                                 headers={"Last-Event-ID": str(MAX_EVENT_ID)}) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
