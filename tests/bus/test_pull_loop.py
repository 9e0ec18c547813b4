"""The one pull loop of the generator and the worker (services/common/pull_loop.py):
capacity-sized asks, lanes in fair order, tenants left out or deferred, the default
consumer bound again when it is deleted, redelivery of what a dead taker held,
in-progress beats past the ack wait, nak on stop, abandon and cancel, dead letters
(malformed, past max_deliver) and stopping. A real nats-server; messages are handled by
a handler of the test's own, which holds each until the test releases it.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import msgspec

from schemas import subjects
from services.common.bus import Bus, connect_bus
from services.common.lanes import LanePull
from services.common.provision import lane_config
from services.common.pull_loop import Delivery, PullLoop
from services.common.runtime import cancel_and_wait
from services.common.settings import Settings
from tests.helpers import scaled

ACK_WAIT_S = 2.0
MAX_DELIVER = 4


async def _lanes(bus: Bus, ack_wait_s: float = ACK_WAIT_S) -> LanePull:
    """Lanes of JOBS whose consumers have ``ack_wait_s`` and one delivery beyond
    :data:`MAX_DELIVER` (as the provisioner makes them)."""
    with contextlib.suppress(Exception):  # the first lanes of the test make it
        await bus.js.add_consumer(subjects.STREAM_JOBS, lane_config(
            subjects.JOBS_SUBMIT, subjects.CONSUMER_GENERATOR, ack_wait_s=ack_wait_s,
            max_deliver=MAX_DELIVER + 1))
    pull = LanePull(bus.js, bus.nc, stream=subjects.STREAM_JOBS, base=subjects.JOBS_SUBMIT,
                    consumer_of=subjects.generator_consumer,
                    config_of=lambda s, d: lane_config(s, d, ack_wait_s=ack_wait_s,
                                                       max_deliver=MAX_DELIVER + 1),
                    idle_poll_s=0.2)
    await pull.start()
    return pull


async def _publish(bus: Bus, tenant: str, priority: str, n: int) -> None:
    for i in range(n):
        await bus.js.publish(subjects.job_submit(tenant, priority), b"{}",
                             headers={"Nats-Msg-Id": f"{tenant}-{priority}-{i}"})


class _Taker:
    """Handles what it takes by holding it until released (then acks): ``slots`` at
    most."""

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self.loop: PullLoop | None = None
        self.held: list[Any] = []
        self.taken: list[str] = []
        self.dead: list[tuple[Any, str, str]] = []
        self.most = 0
        self.released: dict[int, asyncio.Event] = {}
        # Capacity looks that found no free slot, and all of them: each is a turn of
        # the loop past the point where it would have asked for more.
        self.full_looks = 0
        self.looks = 0

    def capacity(self) -> int:
        assert self.loop is not None
        free = self.slots - self.loop.in_hand
        self.looks += 1
        self.full_looks += free <= 0
        return free

    async def handle(self, msg: Any, value: dict, slot: Any) -> None:
        assert isinstance(value, dict) and slot is None
        self.held.append(msg)
        self.taken.append(msg.headers["Nats-Msg-Id"])
        self.most = max(self.most, len(self.held))
        release = self.released.setdefault(id(msg), asyncio.Event())
        try:
            await release.wait()
            await msg.ack()
        finally:
            self.held.remove(msg)

    async def dead_lettered(self, msg: Any, value: Any, reason: str, why: str) -> None:
        self.dead.append((value, reason, why))

    async def release(self, n: int = 1) -> None:
        """Let the first ``n`` held messages be acked; returns once they are."""
        done = self.held[:n]
        for msg in done:
            self.released[id(msg)].set()
        await _until(lambda: not any(m in self.held for m in done))


@contextlib.asynccontextmanager
async def _running(bus: Bus, taker: _Taker, *, ack_wait_s: float = ACK_WAIT_S,
                   abandon: asyncio.Event | None = None, **options: Any):
    """A PullLoop over fresh lanes feeding ``taker``, stopped (and its lanes) at the end;
    yields the loop and its stop event."""
    pull = await _lanes(bus, ack_wait_s)
    stop = asyncio.Event()
    options.setdefault("rebind", lambda: asyncio.sleep(0))
    loop = PullLoop(pull, Delivery(ack_wait_s, MAX_DELIVER), kind="test message",
                    decode=lambda data: msgspec.json.decode(data, type=dict),
                    handle=taker.handle, capacity=taker.capacity,
                    dead_lettered=taker.dead_lettered, idle_s=0.2, **options)
    taker.loop = loop
    task = asyncio.create_task(loop.run(stop, abandon))
    loop.task = task  # type: ignore[attr-defined]
    try:
        yield loop, stop
    finally:
        stop.set()
        if abandon is not None:
            abandon.set()
        with contextlib.suppress(BaseException):
            await asyncio.wait_for(task, 10)
        await cancel_and_wait(task)
        await pull.stop()


async def _until(check, timeout_s: float = 20.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def _publish_default(bus: Bus, msg_id: str) -> None:
    """One message on the default lane (its consumer has this test's ack wait; the
    provisioner makes tenant lanes' with the settings')."""
    await bus.js.publish(subjects.JOBS_SUBMIT, b"{}", headers={"Nats-Msg-Id": msg_id})


async def _consumer(bus: Bus):
    return await bus.js.consumer_info(subjects.STREAM_JOBS, subjects.CONSUMER_GENERATOR)


async def test_asks_only_for_free_capacity_and_in_fair_order(bus: Bus) -> None:
    await _publish(bus, "team_a", "normal", 4)
    await _publish(bus, "team_b", "normal", 2)
    await _publish(bus, "team_c", "high", 1)
    taker = _Taker(slots=2)
    async with _running(bus, taker) as (loop, _):
        await _until(lambda: len(taker.held) == 2)
        # Full: several turns of the loop later, nothing more was asked for.
        looks = taker.full_looks
        await _until(lambda: taker.full_looks >= looks + 4)
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
    left_out: list[float] = []  # when an ask left team_a's lane out

    def exclude(tenant: str) -> bool:
        if tenant in excluded:
            left_out.append(asyncio.get_running_loop().time())
        return tenant in excluded

    async with _running(bus, taker, exclude=exclude) as (loop, _):
        await _until(lambda: taker.taken == ["team_b-normal-0"])
        await taker.release()
        # team_a is left out while excluded, however free: asks with a free slot
        # skipped its lane several times, and took nothing.
        freed_at = asyncio.get_running_loop().time()
        await _until(lambda: sum(t > freed_at for t in left_out) >= 3)
        assert taker.taken == ["team_b-normal-0"]
        excluded.clear()
        loop.lanes.woken.set()
        await _until(lambda: taker.taken[-1:] == ["team_a-normal-0"])


async def test_a_deferred_tenant_is_served_after_the_other_lanes(bus: Bus) -> None:
    await _publish(bus, "team_a", "normal", 1)
    await _publish(bus, "team_c", "normal", 1)
    taker = _Taker(slots=1)
    async with _running(bus, taker, defer=lambda t: t == "team_a") as (loop, _):
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

    async with _running(bus, taker, rebind=rebind) as (loop, _):
        await bus.js.delete_consumer(subjects.STREAM_JOBS, subjects.CONSUMER_GENERATOR)
        await _until(lambda: bool(rebound), timeout_s=30)
        await bus.js.publish(subjects.JOBS_SUBMIT, b"{}", headers={"Nats-Msg-Id": "after"})
        await _until(lambda: taker.taken == ["after"], timeout_s=30)
        assert loop.rebinds >= 1


async def test_what_a_dead_taker_held_is_redelivered_to_the_next(
        bus: Bus, settings: Settings) -> None:
    """A taker whose connection dies while it holds a message (its process died: no
    nak, no more beats) leaves it to JetStream: after the ack wait it goes to the next
    loop, with deliveries counted."""
    await _publish_default(bus, "held")
    dead_bus = await connect_bus(settings, "dead-taker")
    dead = _Taker(slots=1)
    try:
        async with _running(dead_bus, dead) as (loop, _):
            await _until(lambda: dead.taken == ["held"])
            await dead_bus.nc.close()
    finally:
        with contextlib.suppress(Exception):
            await dead_bus.close()
    alive = _Taker(slots=1)
    async with _running(bus, alive):
        await _until(lambda: alive.taken == ["held"], timeout_s=ACK_WAIT_S + 20)
        assert alive.held[0].metadata.num_delivered == 2


async def test_a_message_handled_past_the_ack_wait_is_kept_by_in_progress(bus: Bus) -> None:
    """Held for three ack waits while a second loop on the same consumer has a free
    slot: the beats (a fifth of the ack wait) keep JetStream from redelivering it."""
    ack_wait = 1.0
    await _publish_default(bus, "held")
    holder, rival = _Taker(slots=1), _Taker(slots=1)
    async with _running(bus, holder, ack_wait_s=ack_wait) as (loop, _):
        assert loop.delivery.progress_every_s == ack_wait / 5
        await _until(lambda: holder.taken == ["held"])
        # The rival starts once the holder has the message (started together, either
        # could have been the first to pull it).
        async with _running(bus, rival, ack_wait_s=ack_wait):
            # Three ack waits (JetStream's clock: a missed beat would redeliver), then
            # until the rival, free all along, has asked the lanes a few more times:
            # a redelivered message would be in its hands by then.
            await asyncio.sleep(3 * ack_wait)
            asks = rival.loop.lanes.requests
            await _until(lambda: rival.loop.lanes.requests >= asks + 3)
            assert rival.taken == []
            info = await _consumer(bus)
            assert info.num_redelivered == 0 and info.num_ack_pending == 1, info
            await holder.release()
    info = await _consumer(bus)
    assert info.num_ack_pending == 0 and info.num_pending == 0, info


async def test_stopping_abandoning_or_cancelling_naks_what_is_in_hand(bus: Bus) -> None:
    """Whatever ends a loop with a message in hand (stop, a drain given up, its task
    cancelled), the message is nak'ed: the next loop has it at once, not after the
    ack wait (a minute here)."""
    ack_wait = 60.0
    await _publish_default(bus, "held")
    # Stop: the message in hand is nak'ed at once.
    first = _Taker(slots=1)
    async with _running(bus, first, ack_wait_s=ack_wait) as (loop, stop):
        await _until(lambda: first.taken == ["held"])
        stop.set()
        await asyncio.wait_for(asyncio.shield(loop.task), 10)
    # A drain: in-hand work goes on after stop, until abandon is set.
    abandon = asyncio.Event()
    second = _Taker(slots=1)
    async with _running(bus, second, ack_wait_s=ack_wait, abandon=abandon) as (loop, stop):
        await _until(lambda: second.taken == ["held"], timeout_s=10)
        assert second.held[0].metadata.num_delivered == 2
        stop.set()
        # The loop has stopped asking and is finishing what it holds; a round trip to
        # the server later the message is still in hand, not nak'ed.
        await _until(lambda: loop.finishing)
        info = await _consumer(bus)
        assert info.num_ack_pending == 1 and info.num_pending == 0, info
        assert not loop.task.done() and len(second.held) == 1
        abandon.set()
        await asyncio.wait_for(asyncio.shield(loop.task), 10)
    # The loop's own task cancelled.
    third = _Taker(slots=1)
    async with _running(bus, third, ack_wait_s=ack_wait) as (loop, _):
        await _until(lambda: third.taken == ["held"], timeout_s=10)
        await cancel_and_wait(loop.task)
    last = _Taker(slots=1)
    async with _running(bus, last, ack_wait_s=ack_wait):
        await _until(lambda: last.taken == ["held"], timeout_s=10)
        assert last.held[0].metadata.num_delivered == 4
        await last.release()


async def test_malformed_and_over_delivered_messages_are_dead_lettered(bus: Bus) -> None:
    """One that does not decode and one delivered more than max_deliver times go to
    ``dlq.<subject>`` with the reason, are acked, never reach the handler, and the
    service is told; one whose handler raised is nak'ed and handled again; the next
    message is served."""
    await bus.js.add_consumer(subjects.STREAM_JOBS, lane_config(
        subjects.JOBS_SUBMIT, subjects.CONSUMER_GENERATOR, ack_wait_s=ACK_WAIT_S,
        max_deliver=MAX_DELIVER + 1))
    await bus.js.publish(subjects.JOBS_SUBMIT, b'{"job": "poison"}',
                         headers={"Nats-Msg-Id": "poison"})
    psub = await bus.js.pull_subscribe_bind(durable=subjects.CONSUMER_GENERATOR,
                                            stream=subjects.STREAM_JOBS)
    for n in range(1, MAX_DELIVER + 1):  # each taker died before finishing it
        (msg,) = await psub.fetch(1, timeout=scaled(10))
        assert msg.metadata.num_delivered == n
        await msg.nak()
    await psub.unsubscribe()
    await bus.js.publish(subjects.JOBS_SUBMIT, b"this is {not json",
                         headers={"Nats-Msg-Id": "garbage"})
    await bus.js.publish(subjects.JOBS_SUBMIT, b'{"raises": 1}',
                         headers={"Nats-Msg-Id": "raises"})
    await bus.js.publish(subjects.JOBS_SUBMIT, b"{}", headers={"Nats-Msg-Id": "good"})

    taker = _Taker(slots=2)
    handle = taker.handle
    raised: list[int] = []

    async def flaky(msg: Any, value: dict, slot: Any) -> None:
        if value.get("raises") and not raised:
            raised.append(msg.metadata.num_delivered)
            raise RuntimeError("the bus went away")
        await handle(msg, value, slot)

    taker.handle = flaky  # type: ignore[method-assign]
    async with _running(bus, taker) as (loop, _):
        await _until(lambda: sorted(taker.taken) == ["good", "raises"], timeout_s=30)
        await taker.release(2)
        assert loop.dead_letters == 2

    assert raised == [1]
    whys = {why: (value, reason) for value, reason, why in taker.dead}
    assert whys["max_deliver"][0] == {"job": "poison"}
    assert f"delivered {MAX_DELIVER + 1} times" in whys["max_deliver"][1]
    assert whys["malformed"][0] is None
    assert whys["malformed"][1].startswith("malformed test message: ")
    dlq = subjects.dlq(subjects.JOBS_SUBMIT)
    sub = await bus.js.subscribe(dlq, ordered_consumer=True)
    moved = [await sub.next_msg(timeout=scaled(10)) for _ in range(2)]
    await sub.unsubscribe()
    by_data = {m.data: m.headers for m in moved}
    poison = by_data[b'{"job": "poison"}']
    assert poison["Aikg-Deliveries"] == str(MAX_DELIVER + 1)
    assert poison["Aikg-Dlq-Reason"] == whys["max_deliver"][1]
    assert poison["Aikg-Original-Subject"] == subjects.JOBS_SUBMIT
    garbage = by_data[b"this is {not json"]
    assert garbage["Aikg-Dlq-Reason"].startswith("malformed test message: ")
    assert "JSON" in garbage["Aikg-Dlq-Reason"]
    info = await _consumer(bus)
    assert info.num_pending == 0 and info.num_ack_pending == 0, info


async def test_stops_when_told_or_draining(bus: Bus) -> None:
    taker = _Taker(slots=1)
    draining = [False]
    async with _running(bus, taker, stopping=lambda: draining[0]) as (loop, _):
        await _until(lambda: taker.looks >= 3)  # a few turns of the loop, still running
        assert not loop.task.done()
        draining[0] = True
        await asyncio.wait_for(asyncio.shield(loop.task), 5)
        await _publish(bus, "team_a", "normal", 1)
        # The loop has ended, so nothing takes the message: it waits in the stream.
        info = await bus.js.stream_info(subjects.STREAM_JOBS,
                                        subjects_filter=subjects.job_submit("team_a", "normal"))
        assert info.state.messages == 1
        assert taker.taken == []


async def test_a_deaf_pull_gets_no_wake_ups_and_still_finds_a_new_lane_at_once(
        bus: Bus) -> None:
    """A pull with no capacity drops its wake-up subscriptions; a message published
    then, on a lane the last (reused) listing did not have, is taken by the next
    fetch_or_wait without sleeping out the idle poll."""
    pull = await _lanes(bus)
    pull.idle_poll_s = 30.0  # a sleep would fail the timing below
    taken: list[Any] = []
    try:
        await _publish(bus, "team_a", "normal", 1)
        assert await pull.fetch_or_wait(1, taken.append) == 1  # lists: team_a's lane
        await pull.deafen()
        assert pull.wakeups == []
        pull.woken.clear()
        # A probe on the wake-up subjects, on the pull's connection: once it has the
        # publish, so would the pull's wake-up subscriptions, had it any.
        probed = asyncio.Event()

        async def probe_cb(_msg: Any) -> None:
            probed.set()

        probe = await bus.nc.subscribe(f"{subjects.JOBS_SUBMIT}.*.*", cb=probe_cb)
        await _publish(bus, "team_b", "normal", 1)
        await asyncio.wait_for(probed.wait(), 10)
        await probe.unsubscribe()
        await bus.nc.flush()
        assert not pull.woken.is_set()  # nothing reached the deaf pull
        started = asyncio.get_running_loop().time()
        assert await asyncio.wait_for(pull.fetch_or_wait(1, taken.append), 10) == 1
        assert asyncio.get_running_loop().time() - started < 5
        assert [m.subject for m in taken] == [subjects.job_submit("team_a", "normal"),
                                              subjects.job_submit("team_b", "normal")]
        assert len(pull.wakeups) == 2  # listening again
    finally:
        for msg in taken:
            await msg.ack()
        await pull.stop()
