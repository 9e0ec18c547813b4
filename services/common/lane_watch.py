"""Whether a verify lane has a live worker, and failing a wait on one that has none.

A verify request goes to ``verify.<backend>.<arch>`` (or a tenant lane of it) and waits
in the VERIFY stream until a worker of that pair takes it. With no such worker it would
wait until its requester's result timeout (``verify_result_timeout_s``, an hour by
default). Every requester (the generator's jobs and evolve runs, the gateway's batches,
``RemoteWorker.verify`` / ``verify_many``) instead watches the lane with a
:class:`LaneWatch`: once no live worker of the pair has been seen for
``verify_unserved_timeout_s`` seconds in a row, the wait ends with a message naming the
lane, and the job (batch entry, call) fails with it.

"Live" is a heartbeat in the ``workers`` bucket (a worker puts its ``WorkerInfo`` every
``worker_heartbeat_s``; the bucket drops a key three periods after its last put). The
bucket is read without a JetStream consumer: the stream's info filtered on the keys'
subjects lists the keys, and a message get of each key's last message gives its value
(:func:`live_heartbeats`). A read that fails (NATS away, failing over) ends the count:
an outage of the bus never fails a job as unserved.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import nats.errors
import nats.js.errors
import structlog
from nats.js import JetStreamContext
from prometheus_client import Counter

from schemas import WorkerInfo, subjects
from services.common.jobs import heartbeats
from services.common.runtime import cancel_and_wait

log = structlog.get_logger("aikg.lanes")

_T = TypeVar("_T")

# Shortest and longest pause between two reads of the bucket by one watch, seconds; in
# between it is a fifth of the bound, so a lane is declared unserved at most a fifth
# of the bound late.
_MIN_READ_S = 0.2
_MAX_READ_S = 5.0
# NATS trouble a read may meet; it ends the count rather than failing anything.
_READ_ERRORS = (nats.errors.Error, nats.js.errors.Error, TimeoutError, OSError)

UNSERVED_LANES = Counter(
    "aikg_unserved_lane_failures_total",
    "Waits for verdicts ended because no live worker served the request's "
    "backend/arch for verify_unserved_timeout_s, by who waited (generator, gateway "
    "batch, sdk).", ["backend", "arch", "waiter"],
)


class UnservedLane(RuntimeError):
    """No live worker has served the lane for the bound; ``str()`` is the message."""


async def live_heartbeats(js: JetStreamContext) -> list[WorkerInfo]:
    """The heartbeats in the ``workers`` bucket now (:func:`services.common.jobs.heartbeats`:
    stream info filtered on the keys, then a message get per key; no consumer).

    Raises:
        nats.errors.Error: NATS trouble (timeouts, no permission); a missing bucket
            reads as no worker.
    """
    return await heartbeats(js)


def unserved_message(backend: str, arch: str, waited_s: float,
                     live: list[WorkerInfo]) -> str:
    """What a request on ``verify.<backend>.<arch>`` fails with when no worker of the
    pair has been live for ``waited_s`` seconds; ``live``: the workers there are."""
    pairs = sorted({f"{w.backend}/{w.arch}" for w in live})
    return (f"no worker serves {subjects.verify(backend, arch)}: none has sent a heartbeat "
            f"in the last {waited_s:.0f} s (AIKG_VERIFY_UNSERVED_TIMEOUT_S); start one "
            f"(`aikg worker --backend {backend} --arch {arch}`) or pick a served arch "
            f"(live: {', '.join(pairs) or 'none'})")


class LaneWatch:
    """Watches one backend/arch for a live worker while requests on it wait.

    :meth:`check` reads the ``workers`` bucket (at most every ``read_every_s``) and says
    whether the pair has had no live worker for ``bound_s`` seconds in a row, counted
    from the first read that found none; a read that finds one, or fails, starts the
    count again.

    Args:
        js: a JetStream context whose user may read the ``KV_workers`` stream (stream
            info and message gets).
        backend / arch: the lane's pair.
        bound_s: ``verify_unserved_timeout_s``; 0 or less: never unserved (the wait
            falls back to its result timeout).
        waiter: who waits, the metric's label (``generator``, ``batch``, ``sdk``).
        clock: monotonic seconds (tests may pass their own).
    """

    def __init__(self, js: JetStreamContext, backend: str, arch: str, bound_s: float, *,
                 waiter: str = "", clock: Callable[[], float] = time.monotonic) -> None:
        self.js = js
        self.backend = backend
        self.arch = arch
        self.bound_s = bound_s
        self.waiter = waiter
        self.clock = clock
        self.read_every_s = min(_MAX_READ_S, max(_MIN_READ_S, bound_s / 5))
        self.live: list[WorkerInfo] = []
        self._unserved_since: float | None = None
        self._last_read: float | None = None
        self._told_error = False

    @property
    def active(self) -> bool:
        """Whether the watch can ever say unserved (a bound above 0)."""
        return self.bound_s > 0

    async def check(self) -> str | None:
        """The failure message when the lane has been unserved for the bound, else None."""
        if not self.active:
            return None
        now = self.clock()
        if self._last_read is None or now - self._last_read >= self.read_every_s:
            self._last_read = now
            await self._read(now)
        if self._unserved_since is None or now - self._unserved_since < self.bound_s:
            return None
        return unserved_message(self.backend, self.arch, now - self._unserved_since, self.live)

    async def _read(self, now: float) -> None:
        try:
            self.live = await live_heartbeats(self.js)
        except _READ_ERRORS as exc:
            self._unserved_since = None
            if not self._told_error:
                self._told_error = True
                log.warning("lane_watch_read_failed", backend=self.backend, arch=self.arch,
                            error=repr(exc))
            return
        if any(w.backend == self.backend and w.arch == self.arch for w in self.live):
            self._unserved_since = None
        elif self._unserved_since is None:
            self._unserved_since = now

    async def wait(self) -> str:
        """Return the failure message once the lane has been unserved for the bound
        (never returns while the bound is 0 or less, or a worker is live)."""
        if not self.active:
            await asyncio.Event().wait()
        while True:
            message = await self.check()
            if message is not None:
                UNSERVED_LANES.labels(backend=self.backend, arch=self.arch,
                                      waiter=self.waiter or "other").inc()
                log.warning("lane_unserved", backend=self.backend, arch=self.arch,
                            waiter=self.waiter, message=message)
                return message
            await asyncio.sleep(self.read_every_s)


async def while_served(work: Awaitable[_T], watch: LaneWatch) -> _T:
    """Await ``work`` (a verdict) unless ``watch``'s lane goes unserved first.

    ``work`` wins a tie. Both are cancelled if the caller is.

    Raises:
        UnservedLane: the lane had no live worker for ``watch.bound_s`` seconds; the
            message names the lane (:func:`unserved_message`).
        whatever ``work`` raises (a result timeout).
    """
    main = asyncio.ensure_future(work)
    if not watch.active:
        return await main
    guard = asyncio.create_task(watch.wait(), name=f"lane-watch-{watch.backend}-{watch.arch}")
    try:
        done, _ = await asyncio.wait({main, guard}, return_when=asyncio.FIRST_COMPLETED)
        if main in done:
            return main.result()
        raise UnservedLane(guard.result())
    finally:
        await cancel_and_wait(main, guard)
