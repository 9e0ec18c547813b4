"""Queue positions and estimated start times of waiting jobs, read from the JOBS stream.

A job waits in its lane (``jobs.submit`` or ``jobs.submit.<tenant>.<priority>``,
services/common/lanes.py) until a generator takes it. A lane's waiting jobs are the
messages after its consumer's last delivered stream sequence, in stream order; they
are read with ``STREAM.MSG.GET`` (``next_by_subj``), which returns each message's
``Nats-Msg-Id`` (the job id) without consuming it.

Position (1: the next job to start) follows the generators' order: every waiting job
of a higher priority first, then, within the job's priority, round-robin over
tenants. For the job at index ``k`` (0-based) of its tenant's lane, with ``n_u``
jobs waiting in tenant ``u``'s lane of the same priority::

    position = (jobs waiting at higher priorities) + k + 1 + sum over u != own of min(n_u, k + 1)

which counts the turn of every other tenant before the job's own in each round (the
generators' round-robin pointer is their own state, so the worst case is told). It
never grows while no job of a higher priority, or of a tenant with fewer waiting
jobs than ``k + 1``, arrives.

Estimated start: ``now + position / rate``, where ``rate`` is how many jobs the
generators took per second over the last :data:`RATE_WINDOW_S` seconds (the growth
of the JOBS consumers' delivered counts, sampled every :data:`SAMPLE_S` seconds and on
each read); None while no job was taken in the window.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import time
from collections import deque
from dataclasses import dataclass, field

import nats.js.errors
import structlog

from schemas import subjects, utcnow
from services.common.bus import Bus

log = structlog.get_logger("aikg.gateway.queue")

# A snapshot is reused for this long, seconds (status polls and event streams of many
# waiting jobs share one read of the stream).
SNAPSHOT_TTL_S = 1.0
# Waiting jobs read per lane at most; jobs further back get no position.
MAX_SCAN = 2000
# Throughput window and sampling period, seconds.
RATE_WINDOW_S = 600.0
SAMPLE_S = 5.0


@dataclass
class QueueSnapshot:
    """One read of the JOBS lanes: each waiting job's position, and the rate then."""

    positions: dict[str, int] = field(default_factory=dict)
    rate: float | None = None
    taken_at: float = 0.0
    at: dt.datetime = field(default_factory=utcnow)

    def estimate(self, job_id: str) -> tuple[int | None, dt.datetime | None]:
        """``(queue_position, estimated_start_time)`` of ``job_id``; ``(None, None)``
        when it is not waiting in a lane (started, or beyond :data:`MAX_SCAN`)."""
        position = self.positions.get(job_id)
        if position is None:
            return None, None
        if not self.rate:
            return position, None
        return position, self.at + dt.timedelta(seconds=position / self.rate)


def fair_positions(lanes: dict[tuple[str, str], list[str]]) -> dict[str, int]:
    """Positions of waiting jobs (module docstring's formula).

    Args:
        lanes: ``(tenant, priority) -> job ids in stream order``.

    Returns:
        ``job id -> position`` (1-based).
    """
    out: dict[str, int] = {}
    ahead = 0
    for priority in subjects.PRIORITIES:
        group = {t: ids for (t, p), ids in lanes.items() if p == priority and ids}
        for tenant, ids in group.items():
            others = [len(v) for u, v in group.items() if u != tenant]
            for k, job_id in enumerate(ids):
                out[job_id] = ahead + k + 1 + sum(min(n, k + 1) for n in others)
        ahead += sum(len(ids) for ids in group.values())
    return out


class QueueView:
    """Reads and caches :class:`QueueSnapshot` for the gateway (one per app)."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.snap = QueueSnapshot()
        self.lock = asyncio.Lock()
        # (monotonic time, deliveries of all JOBS consumers so far)
        self.samples: deque[tuple[float, int]] = deque()

    async def estimate(self, job_id: str) -> tuple[int | None, dt.datetime | None]:
        """:meth:`QueueSnapshot.estimate` on a snapshot at most :data:`SNAPSHOT_TTL_S` old."""
        return (await self.snapshot()).estimate(job_id)

    async def snapshot(self) -> QueueSnapshot:
        async with self.lock:
            if time.monotonic() - self.snap.taken_at >= SNAPSHOT_TTL_S:
                self.snap = await self._read()
            return self.snap

    async def sample(self) -> None:
        """Record the JOBS consumers' delivered counts (the throughput's source)."""
        await self._consumers()

    async def run_sampler(self) -> None:
        """:meth:`sample` every :data:`SAMPLE_S` seconds until cancelled."""
        while True:
            try:
                await self.sample()
            except Exception as exc:  # noqa: BLE001 - a missed sample only blurs the rate
                log.debug("queue_sample_failed", error=f"{type(exc).__name__}: {exc}")
            await asyncio.sleep(SAMPLE_S)

    async def _consumers(self) -> dict[str, tuple[int, int]]:
        """``consumer -> (last delivered stream sequence, undelivered count)`` of every
        JOBS consumer, recording a throughput sample on the way."""
        infos = await self.bus.js.consumers_info(subjects.STREAM_JOBS)
        now = time.monotonic()
        delivered = 0
        out: dict[str, tuple[int, int]] = {}
        for info in infos:
            out[info.name] = (info.delivered.stream_seq or 0 if info.delivered else 0,
                              info.num_pending or 0)
            if info.delivered and info.delivered.consumer_seq:
                delivered += info.delivered.consumer_seq
        self.samples.append((now, delivered))
        while self.samples and now - self.samples[0][0] > RATE_WINDOW_S:
            self.samples.popleft()
        return out

    def rate(self) -> float | None:
        """Jobs taken per second over the window; None without growth in it."""
        if len(self.samples) < 2:
            return None
        (t0, d0), (t1, d1) = self.samples[0], self.samples[-1]
        if t1 - t0 < 1.0 or d1 <= d0:
            return None
        return (d1 - d0) / (t1 - t0)

    async def _read(self) -> QueueSnapshot:
        js = self.bus.js
        consumers = await self._consumers()
        info = await js.stream_info(subjects.STREAM_JOBS, subjects_filter=">")
        lanes: dict[tuple[str, str], list[str]] = {}
        for subject, count in (info.state.subjects or {}).items():
            lane = subjects.parse_lane(subjects.JOBS_SUBMIT, subject)
            if lane is None or not count:
                continue
            last, pending = consumers.get(subjects.generator_consumer(*lane), (0, count))
            ids: list[str] = []
            seq = last + 1
            for _ in range(min(pending, MAX_SCAN)):
                try:
                    msg = await js.get_msg(subjects.STREAM_JOBS, seq=seq, subject=subject,
                                           next=True)
                except nats.js.errors.NotFoundError:
                    break
                ids.append((msg.headers or {}).get("Nats-Msg-Id") or f"#{msg.seq}")
                seq = (msg.seq or seq) + 1
            lanes[lane] = ids
        return QueueSnapshot(positions=fair_positions(lanes), rate=self.rate(),
                             taken_at=time.monotonic(), at=utcnow())
