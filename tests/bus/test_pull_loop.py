"""The one pull loop of the generator and the worker (services/common/pull_loop.py):
capacity-sized asks, lanes in fair order, tenants left out or deferred, the default
consumer bound again when it is deleted, redelivery of what a dead taker held, and
stopping. A real nats-server; messages are taken by a handler of the test's own.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from schemas import subjects
from services.common.bus import Bus
from services.common.lanes import LanePull, lane_config
from services.common.pull_loop import PullLoop
from services.common.runtime import cancel_and_wait

ACK_WAIT_S = 2.0


async def _lanes(bus: Bus) -> LanePull:
    await bus.js.add_consumer(subjects.STREAM_JOBS, lane_config(
        subjects.JOBS_SUBMIT, subjects.CONSUMER_GENERATOR, ack_wait_s=ACK_WAIT_S,
        max_deliver=5))
    pull = LanePull(bus.js, bus.nc, stream=subjects.STREAM_JOBS, base=subjects.JOBS_SUBMIT,
                    consumer_of=subjects.generator_consumer,
                    config_of=lambda s, d: lane_config(s, d, ack_wait_s=ACK_WAIT_S,
                                                       max_deliver=5),
                    idle_poll_s=0.2)
    await pull.start()
    return pull


async def _publish(bus: Bus, tenant: str, priority: str, n: int) -> None:
    for i in range(n):
        await bus.js.publish(subjects.job_submit(tenant, priority), b"{}",
                             headers={"Nats-Msg-Id": f"{tenant}-{priority}-{i}"})


class _Taker:
    """Holds what it takes until released: ``capacity`` slots, at most."""

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self.held: list[Any] = []
        self.taken: list[str] = []
        self.most = 0
        self.freed = asyncio.Event()

    def capacity(self) -> int:
        return self.slots - len(self.held)

    def take(self, msg: Any) -> None:
        self.held.append(msg)
        self.taken.append(msg.headers["Nats-Msg-Id"])
        self.most = max(self.most, len(self.held))

    async def release(self, n: int = 1) -> None:
        for msg in self.held[:n]:
            await msg.ack()
        del self.held[:n]
        self.freed.set()


@contextlib.asynccontextmanager
async def _running(bus: Bus, taker: _Taker, **options: Any):
    """A PullLoop over fresh lanes feeding ``taker``, stopped (and its lanes) at the end;
    yields the loop."""
    pull = await _lanes(bus)
    stop = asyncio.Event()
    options.setdefault("rebind", lambda: asyncio.sleep(0))
    loop = PullLoop(pull, capacity=taker.capacity, take=taker.take, freed=taker.freed,
                    idle_s=0.2, **options)
    task = asyncio.create_task(loop.run(stop))
    try:
        yield loop
    finally:
        stop.set()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, 10)
        await cancel_and_wait(task)
        await pull.stop()


async def _until(check, timeout_s: float = 20.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def test_asks_only_for_free_capacity_and_in_fair_order(bus: Bus) -> None:
    await _publish(bus, "team_a", "normal", 4)
    await _publish(bus, "team_b", "normal", 2)
    await _publish(bus, "team_c", "high", 1)
    taker = _Taker(slots=2)
    async with _running(bus, taker):
        await _until(lambda: len(taker.held) == 2)
        await asyncio.sleep(0.5)  # full: nothing more is asked for
        assert len(taker.taken) == 2
        while len(taker.taken) < 7:
            before = len(taker.taken)
            await taker.release()
            await _until(lambda n=before: len(taker.taken) > n)
        assert taker.most == 2
        # high first; then the tenants in turn; team_a's rest last.
        assert taker.taken[0] == "team_c-high-0"
        assert set(taker.taken[1:3]) == {"team_a-normal-0", "team_b-normal-0"}, taker.taken
        assert taker.taken[-2:] == ["team_a-normal-2", "team_a-normal-3"], taker.taken


async def test_left_out_and_deferred_tenants(bus: Bus) -> None:
    await _publish(bus, "team_a", "normal", 2)
    await _publish(bus, "team_b", "normal", 1)
    taker = _Taker(slots=1)
    excluded = {"team_a"}
    async with _running(bus, taker, exclude=lambda t: t in excluded) as loop:
        await _until(lambda: taker.taken == ["team_b-normal-0"])
        await taker.release()
        await asyncio.sleep(0.6)  # team_a is left out while excluded, however free
        assert taker.taken == ["team_b-normal-0"]
        excluded.clear()
        loop.lanes.woken.set()
        await _until(lambda: taker.taken[-1:] == ["team_a-normal-0"])


async def test_a_deferred_tenant_is_served_after_the_other_lanes(bus: Bus) -> None:
    await _publish(bus, "team_a", "normal", 1)
    await _publish(bus, "team_c", "normal", 1)
    taker = _Taker(slots=1)
    async with _running(bus, taker, defer=lambda t: t == "team_a"):
        await _until(lambda: taker.taken == ["team_c-normal-0"])
        await taker.release()
        await _until(lambda: taker.taken[-1:] == ["team_a-normal-0"])


async def test_a_deleted_consumer_is_bound_again_and_work_goes_on(bus: Bus) -> None:
    taker = _Taker(slots=1)
    rebound: list[int] = []

    async def rebind() -> None:
        rebound.append(1)
        await bus.js.add_consumer(subjects.STREAM_JOBS, lane_config(
            subjects.JOBS_SUBMIT, subjects.CONSUMER_GENERATOR, ack_wait_s=ACK_WAIT_S,
            max_deliver=5))

    async with _running(bus, taker, rebind=rebind) as loop:
        await bus.js.delete_consumer(subjects.STREAM_JOBS, subjects.CONSUMER_GENERATOR)
        await _until(lambda: bool(rebound), timeout_s=30)
        await bus.js.publish(subjects.JOBS_SUBMIT, b"{}", headers={"Nats-Msg-Id": "after"})
        await _until(lambda: taker.taken == ["after"], timeout_s=30)
        assert loop.rebinds >= 1


async def test_what_a_dead_taker_held_is_redelivered_to_the_next(bus: Bus) -> None:
    """A taker that stops without acking (its process died) leaves its messages to
    JetStream: after the ack wait they go to the next loop, with deliveries counted."""
    await _publish(bus, "team_a", "normal", 1)
    dead = _Taker(slots=1)
    async with _running(bus, dead):
        await _until(lambda: dead.taken == ["team_a-normal-0"])
    alive = _Taker(slots=1)
    async with _running(bus, alive):
        await _until(lambda: alive.taken == ["team_a-normal-0"], timeout_s=ACK_WAIT_S + 20)
        assert alive.held[0].metadata.num_delivered == 2


async def test_stops_when_told_or_draining(bus: Bus) -> None:
    pull = await _lanes(bus)
    taker = _Taker(slots=1)
    draining = [False]
    loop = PullLoop(pull, capacity=taker.capacity, take=taker.take, freed=taker.freed,
                    rebind=lambda: asyncio.sleep(0), stopping=lambda: draining[0],
                    idle_s=0.2)
    task = asyncio.create_task(loop.run(asyncio.Event()))
    await asyncio.sleep(0.3)
    assert not task.done()
    draining[0] = True
    await asyncio.wait_for(task, 5)
    await _publish(bus, "team_a", "normal", 1)
    await asyncio.sleep(0.3)
    assert taker.taken == []
    await pull.stop()
