"""Fair pulls across tenant lanes: one durable consumer per (tenant, priority) subject.

JetStream hands out a durable consumer's messages in stream order, so one consumer
per queue is a FIFO: a burst of 100 jobs from one tenant holds up everyone behind it.
Here each tenant and priority waits on its own subject (a *lane*,
:func:`schemas.subjects.job_submit`, :func:`schemas.subjects.verify_lane`) with its own
durable pull consumer, and :class:`LanePull` asks the lanes for one message at a time:
the highest priority that has a waiting message first, and within a priority the
tenants in turn (round-robin, starting after the tenant served last).

Nothing is queued in memory: every message stays in its work-queue stream until it
is acked, so a generator or worker that dies leaves its unacked messages to
JetStream's redelivery, as before. The lanes are found in the stream itself (the
per-subject message counts of ``STREAM.INFO`` with a subject filter), so a new
tenant needs no restart; the default lane (the subject without a lane suffix, which
raw ``nats pub`` users and older clients publish to) is always asked.

Each ask is a ``$JS.API.CONSUMER.MSG.NEXT`` pull request with ``batch: 1`` and
``no_wait: true``: the server answers at once with the message or a 404 status, so
a caller never holds more messages than it asked for (the reason the worker pulled
this way before; see :class:`services.worker.service.Worker`). While every lane is
empty, :meth:`LanePull.wait` sleeps until a message is published on one of the
lanes' subjects (a core NATS subscription used only as a wake-up) or
``idle_poll_s`` passes (redeliveries after ack_wait publish nothing). A service with
no free capacity unsubscribes those wake-ups (:meth:`LanePull.deafen`), and the
listing of lanes is reused for :data:`LANE_LIST_S`: with n workers of a backend/arch,
each request otherwise cost n wake-ups and every dispatch a ``STREAM.INFO`` round trip
(bench/fleet.py measures both).

nats-server 2.11+ also has consumer priority groups, but they order *consumers*
of one subject (overflow, pinning), not tenants' messages, and nats-py 2.16's
``ConsumerConfig`` has no field for them; per-tenant subjects and consumers are what
both the installed server and client support.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import nats.js.errors
import structlog
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig

from schemas import subjects
from services.common.provision import ensure_consumer

log = structlog.get_logger("aikg.lanes")

# How long one no_wait pull may take to be answered before the ask counts as empty,
# seconds (the server answers at once; this covers a lost reply).
ANSWER_TIMEOUT_S = 2.0
# After a wake-up finds nothing (the stream stores a message a moment after core
# subscribers see it), the next asks come after these pauses, seconds.
WAKE_RETRY_S = (0.005, 0.02, 0.1)
# How long one listing of the lanes holding messages (a STREAM.INFO) is used again,
# seconds: a busy service fetching after each message asks for it at most this often.
# A lane's first message published while a service is deaf (no free capacity) is
# seen by it at most this much later; a listening one sees it at once (the wake-up
# names the lane). Measured by bench/fleet.py: one STREAM.INFO per verification was
# a sequential round trip before every dispatch.
LANE_LIST_S = 0.25


@dataclass(frozen=True)
class Lane:
    """One tenant's queue at one priority: its subject and durable consumer."""

    tenant: str
    priority: str
    subject: str
    consumer: str


class LanePull:
    """Take messages one at a time from the lanes under ``base``, fairly.

    Args:
        js / nc: the JetStream context and connection.
        stream: the work-queue stream (``JOBS``, ``VERIFY``).
        base: the default lane's subject (``jobs.submit``, ``verify.<backend>.<arch>``);
            lanes are ``<base>.<tenant>.<priority>``.
        consumer_of: ``(tenant, priority) -> durable consumer name`` of a lane.
        config_of: ``(subject, durable) -> ConsumerConfig`` for a lane consumer that
            does not exist yet, used only where no provisioner answers (a server
            without permissions; the caller binds the default lane's own).
        idle_poll_s: longest sleep of :meth:`wait`, seconds.
        sweep_strays: move messages on subjects that name no lane to the DLQ
            (:meth:`sweep_strays`; needs the rights to read and delete single messages
            of ``stream``, which only the generator has, for JOBS).
    """

    def __init__(self, js: JetStreamContext, nc: Any, *, stream: str, base: str,
                 consumer_of: Callable[[str, str], str],
                 config_of: Callable[[str, str], ConsumerConfig],
                 idle_poll_s: float = 1.0, sweep_strays: bool = False) -> None:
        self.js = js
        self.nc = nc
        self.stream = stream
        self.base = base
        self.consumer_of = consumer_of
        self.config_of = config_of
        self.idle_poll_s = idle_poll_s
        self.inbox = nc.new_inbox()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.woken = asyncio.Event()
        self.subs: list[Any] = []
        # The wake-up subscriptions (none while deafened).
        self.wakeups: list[Any] = []
        # The last listing of lanes holding messages (tenant, priority) and when it was
        # taken (monotonic); lanes named by wake-ups since it was asked for.
        self.listed: set[tuple[str, str]] = set()
        self.listed_at = float("-inf")
        self.seen: set[tuple[str, str]] = set()
        self.requests = 0
        # Consumers known to exist (the default lane's is bound by the caller).
        self.known: set[str] = {consumer_of(subjects.DEFAULT_TENANT, subjects.DEFAULT_PRIORITY)}
        # Per priority: the tenant served last, so the next ask starts after it.
        self.last_served: dict[str, str] = {}
        # Set when the default lane's consumer answered an error status (409, 503): the
        # caller binds it again.
        self.default_failed = False
        # Subjects under ``base`` holding messages that name no lane (a tenant token
        # that is no tenant name): moved to the DLQ by :meth:`sweep_strays`.
        self.strays: set[str] = set()
        self.swept = 0
        self.sweep = sweep_strays

    async def start(self) -> None:
        """Subscribe the reply inbox and the wake-up subjects."""
        async def on_reply(msg) -> None:
            self.queue.put_nowait(msg)

        self.subs.append(await self.nc.subscribe(f"{self.inbox}.*", cb=on_reply))
        await self.listen()

    async def listen(self) -> None:
        """Subscribe the wake-up subjects (again, after :meth:`deafen`)."""
        # Verify requests wake workers through the VERIFY stream's headers-only
        # republish (subjects.verify_wake): a worker never sees a request's body (and
        # its claim nonce) unless JetStream delivers the request to it.
        wake = f"{subjects.WAKE_PREFIX}." if self.stream == subjects.STREAM_VERIFY else ""

        async def on_publish(msg) -> None:
            lane = subjects.parse_lane(self.base, (msg.subject or "").removeprefix(wake))
            if lane is not None:
                self.seen.add(lane)
            self.woken.set()

        if self.wakeups:
            return
        for subject in (self.base, f"{self.base}.*.*"):
            self.wakeups.append(await self.nc.subscribe(wake + subject, cb=on_publish))

    async def deafen(self) -> None:
        """Unsubscribe the wake-up subjects while the caller has no capacity to take
        anything: each publish on a lane reaches every subscriber, busy or not (n
        workers of a backend/arch: n messages per request, most of them to workers
        that cannot take it). :meth:`fetch_or_wait` listens again before it waits."""
        wakeups, self.wakeups = self.wakeups, []
        for sub in wakeups:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def stop(self) -> None:
        await self.deafen()
        for sub in self.subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        self.subs.clear()

    def lane(self, tenant: str, priority: str) -> Lane:
        """The lane of ``tenant`` at ``priority``."""
        subject = self.base if subjects.is_default_lane(tenant, priority) \
            else f"{self.base}.{tenant}.{priority}"
        return Lane(tenant, priority, subject, self.consumer_of(tenant, priority))

    async def lanes(self) -> list[Lane]:
        """Lanes holding messages (from the stream's per-subject counts, listed at most
        every :data:`LANE_LIST_S`, plus the lanes wake-ups named since), and the
        default lane; a subject under ``base`` that names no lane is left out."""
        loop = asyncio.get_running_loop()
        if loop.time() - self.listed_at >= LANE_LIST_S:
            asked_at, self.seen = loop.time(), set()
            try:
                info = await self.js.stream_info(self.stream,
                                                 subjects_filter=f"{self.base}.*.*")
            except Exception as exc:  # noqa: BLE001 - the default lane still works
                log.warning("lane_listing_failed", stream=self.stream,
                            error=f"{type(exc).__name__}: {exc}")
            else:
                listed = set()
                for subject, count in (info.state.subjects or {}).items():
                    parsed = subjects.parse_lane(self.base, subject)
                    if parsed is not None and count:
                        listed.add(parsed)
                    elif parsed is None and count:
                        self.strays.add(subject)
                self.listed, self.listed_at = listed, asked_at
        found = self.listed | self.seen | {(subjects.DEFAULT_TENANT, subjects.DEFAULT_PRIORITY)}
        return [self.lane(t, p) for t, p in sorted(found)]

    def _emptied(self, lane: Lane) -> None:
        """``lane`` had nothing to hand out: not asked again until a listing or a
        wake-up names it (a lane a wake-up named stays asked until the next listing:
        the wake-up can precede the message's store)."""
        self.listed.discard((lane.tenant, lane.priority))

    def order(self, lanes: list[Lane]) -> list[list[Lane]]:
        """Lanes grouped by priority (high first), each group's tenants starting after
        the one served last at that priority."""
        groups = []
        for priority in subjects.PRIORITIES:
            group = sorted((ln for ln in lanes if ln.priority == priority),
                           key=lambda ln: ln.tenant)
            last = self.last_served.get(priority)
            if last is not None and group:
                after = [ln for ln in group if ln.tenant > last]
                group = after + [ln for ln in group if ln.tenant <= last]
            groups.append(group)
        return groups

    async def fetch(self, want: int, take: Callable[[Any], None], *,
                    exclude: Callable[[str], bool] | None = None,
                    defer: Callable[[str], bool] | None = None) -> int:
        """Take up to ``want`` messages in fair order, passing each to ``take``.

        Args:
            exclude: tenant -> True while its lanes must not be asked at all (a tenant
                at its share of the caller's slots, services/common/shares.py).
            defer: tenant -> True while its lanes are asked only after every other
                lane came up empty (a tenant at its share of the devices). Both are
                asked again before each message.

        Returns:
            How many were taken (0 when every lane is empty or all its messages are
            being worked on).
        """
        got = 0
        for msg in self._late():
            take(msg)
            got += 1
        if got >= want:
            return got
        lanes = await self.lanes()
        if self.strays and self.sweep:
            await self.sweep_strays()
        passes = [True, False] if defer is not None else [False]
        for deferring in passes:
            for group in self.order(lanes):
                active = list(group)
                while active and got < want:
                    for lane in list(active):
                        if got >= want:
                            break
                        if (exclude is not None and exclude(lane.tenant)) or (
                                deferring and defer(lane.tenant)):
                            active.remove(lane)
                            continue
                        msg = await self._next(lane)
                        if msg is None:
                            active.remove(lane)
                            lanes = [ln for ln in lanes if ln != lane]
                            self._emptied(lane)
                            continue
                        self.last_served[lane.priority] = lane.tenant
                        take(msg)
                        got += 1
                if got >= want:
                    return got
        return got

    async def sweep_strays(self) -> int:
        """Move the messages of :attr:`strays` to ``dlq.<subject>``, each with the
        reason in ``Aikg-Dlq-Reason``, and delete them from the stream: no consumer
        would ever take them (the stream's subjects fix the priority token; NATS
        subjects cannot say which characters a tenant token may hold).

        Each message is copied first (``Nats-Msg-Id`` ``dlq-<stream>-<seq>``, so a
        retry is not stored twice), then deleted by sequence; a failure leaves it for
        the next sweep. Returns how many were moved.
        """
        moved = 0
        for subject in sorted(self.strays):
            self.strays.discard(subject)
            token = subject[len(self.base) + 1:].split(".")[0]
            reason = (f"{subject} names no lane: {token!r} is no tenant name (1 to 32 "
                      "letters, digits or _); publish on "
                      f"{self.base} or {self.base}.<tenant>.<priority>")
            for _ in range(1000):
                try:
                    msg = await self.js.get_msg(self.stream, seq=1, subject=subject,
                                                next=True)
                except nats.js.errors.NotFoundError:
                    break
                except Exception as exc:  # noqa: BLE001 - swept again on a later fetch
                    log.warning("stray_sweep_failed", subject=subject,
                                error=f"{type(exc).__name__}: {exc}")
                    break
                try:
                    await self.js.publish(subjects.dlq(subject), msg.data or b"", headers={
                        "Aikg-Dlq-Reason": reason, "Aikg-Original-Subject": subject,
                        "Aikg-Deliveries": "0", "Nats-Msg-Id": f"dlq-{self.stream}-{msg.seq}"})
                    await self.js.delete_msg(self.stream, msg.seq)
                except Exception as exc:  # noqa: BLE001 - swept again on a later fetch
                    log.warning("stray_sweep_failed", subject=subject,
                                error=f"{type(exc).__name__}: {exc}")
                    break
                moved += 1
                log.warning("stray_message_dead_lettered", subject=subject, seq=msg.seq,
                            reason=reason)
        self.swept += moved
        return moved

    async def wait(self) -> None:
        """Sleep until a message is published on a lane, or ``idle_poll_s`` passes."""
        self.woken.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.woken.wait(), self.idle_poll_s)
        if self.woken.is_set():
            await asyncio.sleep(WAKE_RETRY_S[0])

    async def fetch_or_wait(self, want: int, take: Callable[[Any], None],
                            **choose: Callable[[str], bool] | None) -> int:
        """:meth:`fetch` (``choose``: its ``exclude`` / ``defer``); when it takes
        nothing, :meth:`wait` and ask again a few times (a wake-up can precede the
        message's store by a moment). Before it waits, a deafened pull listens again,
        and the lanes are listed afresh and asked once more: a message published while
        it was deaf, or since a reused listing, is in the stream by then."""
        relisted = asyncio.get_running_loop().time() - self.listed_at >= LANE_LIST_S
        got = await self.fetch(want, take, **choose)
        if got:
            return got
        if not relisted or not self.wakeups:
            # Lanes filled while deaf, or after a listing reused, are in no listing
            # yet: listen, list again and ask once more before sleeping.
            await self.listen()
            self.listed_at = float("-inf")
            got = await self.fetch(want, take, **choose)
            if got:
                return got
        await self.wait()
        if not self.woken.is_set():
            return await self.fetch(want, take, **choose)
        for pause in WAKE_RETRY_S:
            got = await self.fetch(want, take, **choose)
            if got:
                return got
            await asyncio.sleep(pause)
        return 0

    async def _ensure(self, lane: Lane) -> bool:
        """Have the lane's consumer made when it does not exist, by the admin-side
        provisioner (:func:`services.common.provision.ensure_consumer`; an existing one
        keeps its configuration, as a bound durable does). False when it cannot be had."""
        if lane.consumer in self.known:
            return True
        try:
            await ensure_consumer(self.js, self.nc, self.stream, lane.subject,
                                  self.config_of(lane.subject, lane.consumer))
        except Exception as exc:  # noqa: BLE001 - try again on the next fetch
            log.warning("lane_consumer_failed", consumer=lane.consumer, error=str(exc))
            return False
        self.known.add(lane.consumer)
        log.info("lane_consumer_bound", stream=self.stream, consumer=lane.consumer,
                 subject=lane.subject)
        return True

    async def _next(self, lane: Lane) -> Any | None:
        """One message of ``lane``, or None when it has none to hand out now."""
        if not await self._ensure(lane):
            return None
        self.requests += 1
        reply = f"{self.inbox}.{self.requests}"
        api = f"$JS.API.CONSUMER.MSG.NEXT.{self.stream}.{lane.consumer}"
        await self.nc.publish(api, json.dumps({"batch": 1, "no_wait": True}).encode(),
                              reply=reply)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + ANSWER_TIMEOUT_S
        while True:
            try:
                msg = await asyncio.wait_for(self.queue.get(), max(0.0, deadline - loop.time()))
            except TimeoutError:
                return None
            status = _status(msg)
            if status is None:
                return msg
            if msg.subject != reply:
                continue  # the end of an earlier ask, answered late
            if status not in ("404", "408"):
                # 409 (consumer deleted, too many pending) or 503: look it up again next time.
                log.warning("lane_pull_failed", consumer=lane.consumer, status=status)
                if lane.consumer != self.consumer_of(subjects.DEFAULT_TENANT,
                                                     subjects.DEFAULT_PRIORITY):
                    self.known.discard(lane.consumer)
                else:
                    self.default_failed = True
            return None

    def _late(self) -> list:
        """Messages (not statuses) already queued: deliveries of an ask that timed out."""
        out = []
        while not self.queue.empty():
            msg = self.queue.get_nowait()
            if _status(msg) is None:
                out.append(msg)
        return out


def _status(msg) -> str | None:
    """The status code of a JetStream status message (``"404"`` ...), None for a message.

    Delivered messages carry an ack subject as reply; status messages carry none.
    """
    if msg.reply:
        return None
    return (msg.headers or {}).get("Status", "")
