"""The fleet's devices of one backend/arch as one worker sees them: every worker's
capacity and every lease, read from the ``workers`` and ``leases`` buckets, so that a
worker can tell whether a tenant holds its share of the fleet's devices
(:mod:`services.common.shares`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import msgspec
import structlog

from schemas import subjects
from services.common.bus import Bus, bucket_entries
from services.common.runtime import cancel_and_wait

log = structlog.get_logger("aikg.worker")

# A lease or heartbeat not renewed for this many periods no longer counts toward a
# tenant's device share (leases are renewed every period, heartbeats too).
SHARE_STALE_PERIODS = 3
# How long a starting worker waits for the current leases and heartbeats, seconds.
SHARE_WATCH_START_S = 5.0


class DeviceShares:
    """The fleet's devices of one backend/arch and who holds them, as every worker sees
    them: a read of the ``leases`` bucket (each lease names its tenant, backend and
    arch) and of the ``workers`` bucket (each worker's capacity) every heartbeat period,
    with message gets (:func:`services.common.bus.bucket_entries`: a worker may create
    no consumer, so it may not watch).

    The leases are read, not watched: every verification puts and deletes a lease, so
    a watch would deliver two messages per verification to every worker of the fleet
    (n workers: 2n per verification, the first thing that bent the dispatch curve of
    ``bench/fleet.py``); a read costs one pass over the held leases per period,
    whatever the rate. Other workers' leases and capacities are thus up to one period
    old; a key the bucket expired is gone from the next read, and an entry not read
    again for :data:`SHARE_STALE_PERIODS` heartbeat periods (reads failing) counts as
    gone. Until the first read answers, only this worker's own devices and runs are
    known.

    Args:
        worker_id / backend / arch: this worker (its own leases are counted by the
            caller, from its runs, not from the watch).
        own_devices: this worker's device count.
        period_s: the heartbeat period, seconds.
    """

    def __init__(self, worker_id: str, backend: str, arch: str, own_devices: int,
                 period_s: float = 3.0) -> None:
        self.worker_id = worker_id
        self.backend = backend
        self.arch = arch
        self.own_devices = own_devices
        self.period_s = period_s
        # key -> (tenant, seen at) / worker id -> (capacity, seen at)
        self.leases: dict[str, tuple[str, float]] = {}
        self.capacity: dict[str, tuple[int, float]] = {}
        self.watches: list[asyncio.Task] = []

    def _fresh(self, seen: float) -> bool:
        return time.monotonic() - seen < SHARE_STALE_PERIODS * self.period_s

    def devices(self) -> int:
        """Devices of this backend/arch on every live worker (this one's included)."""
        others = sum(c for w, (c, seen) in self.capacity.items()
                     if w != self.worker_id and self._fresh(seen))
        return self.own_devices + others

    def held_elsewhere(self, tenant: str) -> int:
        """Leases of ``tenant`` on this backend/arch held by other workers."""
        return sum(1 for key, (t, seen) in self.leases.items()
                   if t == tenant and self._fresh(seen)
                   and not key.startswith(f"{self.worker_id}."))

    async def start(self, bus: Bus) -> None:
        """Start reading the ``leases`` and ``workers`` buckets every period, and wait
        (at most :data:`SHARE_WATCH_START_S`) for the first reads; a failure leaves this
        worker's own view."""
        loaded = asyncio.Event()
        self.watches.append(asyncio.create_task(self._read_fleet(bus, loaded)))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(loaded.wait(), SHARE_WATCH_START_S)

    async def _read_fleet(self, bus: Bus, ready: asyncio.Event) -> None:
        """Every ``period_s``: the ``workers`` bucket's capacities and the ``leases``
        bucket's entries of this backend/arch replace :attr:`capacity` and
        :attr:`leases` (a failed read keeps the last, which goes stale)."""
        while True:
            try:
                workers = await bucket_entries(bus.js, subjects.BUCKET_WORKERS)
            except Exception as exc:  # noqa: BLE001 - tried again next period
                log.warning("share_watch_failed", error=str(exc) or type(exc).__name__)
            else:
                capacity: dict[str, tuple[int, float]] = {}
                for key, entry in workers.items():
                    with contextlib.suppress(Exception):
                        self._on_worker(capacity, key, entry.value)
                self.capacity = capacity
            try:
                entries = await bucket_entries(bus.js, subjects.BUCKET_LEASES)
            except Exception as exc:  # noqa: BLE001 - tried again next period
                log.warning("lease_read_failed", error=str(exc) or type(exc).__name__)
            else:
                now = time.monotonic()
                held = {}
                for key, entry in entries.items():
                    with contextlib.suppress(Exception):
                        tenant = self._lease_tenant(entry.value, key)
                        if tenant is not None:
                            held[key] = (tenant, now)
                self.leases = held
            ready.set()
            await asyncio.sleep(self.period_s)

    async def stop(self) -> None:
        await cancel_and_wait(*self.watches)
        self.watches.clear()

    def _lease_tenant(self, raw: bytes | None, key: str) -> str | None:
        """The tenant of a lease value of this backend/arch under ``key``
        (``<worker_id>.<device>``), else None. A value that does not name the key's
        worker is no lease: a queued verify request (it has a tenant, backend and arch)
        a puller had the server deliver onto a lease key."""
        if not raw:
            return None
        value = msgspec.json.decode(raw)
        if value.get("worker_id") != key.split(".", 1)[0]:
            return None
        if value.get("backend") == self.backend and value.get("arch") == self.arch:
            return str(value.get("tenant") or subjects.DEFAULT_TENANT)
        return None

    def _on_worker(self, capacity: dict[str, tuple[int, float]], key: str,
                   raw: bytes | None) -> None:
        """Add worker ``key``'s capacity to ``capacity`` when its heartbeat ``raw`` is of
        this backend/arch (raises on a value that is no JSON object)."""
        if not raw:
            return
        value = msgspec.json.decode(raw)
        if value.get("worker_id") != key:
            return  # not this worker's heartbeat (a relayed copy of something else)
        if value.get("backend") == self.backend and value.get("arch") == self.arch:
            capacity[key] = (int(value.get("capacity") or 0), time.monotonic())
