"""jobs.heartbeats lists the workers bucket from its stream's subjects: live keys only,
deleted and undecodable ones left out, expired ones gone; each service role may read it."""

from __future__ import annotations

import asyncio

from schemas import WorkerInfo, encode
from services.common.bus import Bus, connect_bus
from services.common.jobs import heartbeats, live_workers
from services.common.settings import Settings
from tests.conftest import as_role


def info(worker_id: str) -> WorkerInfo:
    return WorkerInfo(worker_id=worker_id, backend="cpu", arch="x86_64", devices=["0"],
                      capacity=1, host="test", version="test")


async def test_live_deleted_garbage_and_expired_heartbeats(bus: Bus, settings: Settings) -> None:
    assert await live_workers(bus) == []
    for worker_id in ("w-1", "w-2", "w-gone"):
        await bus.workers.put(worker_id, encode(info(worker_id)))
    await bus.workers.put("w-garbage", b"\x00 not a heartbeat")
    await bus.workers.delete("w-gone")
    assert sorted(w.worker_id for w in await heartbeats(bus.js, bus.workers)) == ["w-1", "w-2"]

    # The bucket's TTL is three heartbeats: keys nobody renews expire and are gone.
    ttl_s = 3 * settings.worker_heartbeat_s
    deadline = asyncio.get_running_loop().time() + ttl_s + 5
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
