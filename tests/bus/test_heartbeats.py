"""Reading a whole bucket (bus.bucket_entries) and the heartbeats read with it: the last
value of each live key only (deleted, purged, undecodable and expired ones left out),
in batches, under concurrent readers, with no consumer left behind; each service role
may read the heartbeats."""

from __future__ import annotations

import asyncio

import nats.js.errors
import pytest

from schemas import WorkerInfo, encode, subjects
from services.common.bus import Bus, bucket_entries, connect_bus
from services.common.jobs import heartbeats, live_workers
from services.common.settings import Settings
from tests.conftest import as_role
from tests.helpers import scaled


def info(worker_id: str) -> WorkerInfo:
    return WorkerInfo(worker_id=worker_id, backend="cpu", arch="x86_64", devices=["0"],
                      capacity=1, host="test", version="test")


async def test_live_deleted_garbage_and_expired_heartbeats(bus: Bus, settings: Settings) -> None:
    assert await live_workers(bus) == []
    for worker_id in ("w-1", "w-2", "w-gone"):
        await bus.workers.put(worker_id, encode(info(worker_id)))
    await bus.workers.put("w-garbage", b"\x00 not a heartbeat")
    await bus.workers.delete("w-gone")
    assert sorted(w.worker_id for w in await heartbeats(bus.js)) == ["w-1", "w-2"]

    # The bucket's TTL is three heartbeats: keys nobody renews expire and are gone.
    ttl_s = 3 * settings.worker_heartbeat_s
    deadline = asyncio.get_running_loop().time() + scaled(ttl_s + 5)
    await bus.workers.put("w-2", encode(info("w-2")))
    while asyncio.get_running_loop().time() < deadline:
        await bus.workers.put("w-2", encode(info("w-2")))
        if [w.worker_id for w in await live_workers(bus)] == ["w-2"]:
            break
        await asyncio.sleep(0.25)
    assert [w.worker_id for w in await live_workers(bus)] == ["w-2"]


async def test_every_service_role_may_read_the_heartbeats(bus: Bus, settings: Settings) -> None:
    await bus.workers.put("w-1", encode(info("w-1")))
    for role in ("gateway", "generator", "worker"):
        role_bus = await connect_bus(as_role(settings, role), f"test-{role}", role=role)
        try:
            assert [w.worker_id for w in await live_workers(role_bus)] == ["w-1"], role
        finally:
            await role_bus.close()


async def test_bucket_entries_are_the_last_value_of_each_live_key(bus: Bus) -> None:
    assert await bucket_entries(bus.js, subjects.BUCKET_JOBS) == {}
    await bus.jobs.put("gone", b"x")
    await bus.jobs.delete("gone")
    await bus.jobs.put("purged", b"x")
    await bus.jobs.purge("purged")
    assert await bucket_entries(bus.js, subjects.BUCKET_JOBS) == {}  # markers only

    await bus.jobs.put("a", b"first")
    latest = await bus.jobs.put("a", b"second")
    await bus.jobs.put("b", b"only")
    entries = await bucket_entries(bus.js, subjects.BUCKET_JOBS)
    assert {k: e.value for k, e in entries.items()} == {"a": b"second", "b": b"only"}
    assert entries["a"].revision == latest and entries["a"].created is not None


async def test_bucket_entries_read_past_one_batch_and_leave_no_consumer(bus: Bus) -> None:
    keys = [f"job-{i:04d}" for i in range(600)]  # more than two fetch batches
    await asyncio.gather(*(bus.jobs.put(k, k.encode()) for k in keys))
    entries = await bucket_entries(bus.js, subjects.BUCKET_JOBS)
    assert sorted(entries) == keys and all(e.value == k.encode() for k, e in entries.items())
    info = await bus.js.stream_info(f"KV_{subjects.BUCKET_JOBS}")
    assert info.state.consumer_count == 0


async def test_concurrent_bucket_reads_all_see_every_key(bus: Bus) -> None:
    # The race that emptied KeyValue.watch-based listings: many readers at once, each
    # starting while the server is busy delivering to the others.
    for i in range(6):
        await bus.jobs.put(f"job-{i}", b"record")
    reads = await asyncio.gather(*(bucket_entries(bus.js, subjects.BUCKET_JOBS)
                                   for _ in range(40)))
    assert [len(r) for r in reads] == [6] * 40


async def test_a_missing_bucket_is_an_error_and_no_heartbeat(bus: Bus) -> None:
    with pytest.raises(nats.js.errors.NotFoundError):
        await bucket_entries(bus.js, "no_such_bucket")
    await bus.js.delete_key_value(subjects.BUCKET_WORKERS)
    assert await heartbeats(bus.js) == []
