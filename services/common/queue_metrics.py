"""Queue depth and fleet size as Prometheus gauges, read from JetStream.

nats-server has no Prometheus ``/metrics`` (its monitoring endpoints, ``/varz``, ``/jsz``
..., answer JSON: https://docs.nats.io/running-a-nats-service/nats_admin/monitoring):
queue depth comes from consumer info. :func:`run_queue_metrics` polls, every ``interval_s`` seconds, the info of each
``verify-<backend>-<arch>[...]`` durable on VERIFY and of each ``generator[...]`` durable
on JOBS (one per tenant lane, services/common/lanes.py), and the ``workers`` bucket; a custom collector serves the latest snapshot:

====================================  ===================================================
metric                                meaning
====================================  ===================================================
``aikg_queue_pending``                messages not yet delivered to the consumer
``aikg_queue_ack_pending``            delivered, not yet acked (running or lost in flight)
``aikg_queue_redelivered``            delivered more than once and not yet acked
``aikg_tenant_queue_pending``         the same, per tenant lane (``stream``, ``tenant``,
                                      ``priority``), VERIFY lanes summed over backend/arch
``aikg_tenant_queue_ack_pending``     delivered and not yet acked, per tenant lane
``aikg_workers_live``                 workers whose heartbeat is in the ``workers`` bucket
``aikg_worker_devices_live``          devices (cpu: slots) those workers offer
====================================  ===================================================

Queue gauges carry ``stream``, ``consumer``, ``backend`` and ``arch`` labels
(``backend``/``arch`` are empty on JOBS); fleet gauges carry ``backend`` and ``arch``.
Consumer names are per backend/arch and tenant lane, never ids; a tenant name goes
through :func:`services.common.tenants.tenant_label` (bounded cardinality). A poll that fails drops that part of
the snapshot, and the gauges empty when the poller stops, so trouble shows in
Grafana as a gap rather than as stale numbers.

Every process that runs the poller exports the same numbers: aggregate them with
``max by (...)`` in PromQL, not ``sum``.
"""

from __future__ import annotations

import asyncio
import weakref
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import structlog
from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from schemas import subjects
from services.common.bus import Bus
from services.common.jobs import live_workers
from services.common.tenants import tenant_label

log = structlog.get_logger("aikg.queue_metrics")

QUEUE_LABELS = ("stream", "consumer", "backend", "arch")
FLEET_LABELS = ("backend", "arch")
TENANT_LABELS = ("stream", "tenant", "priority")
# JetStream lists at most this many consumers per CONSUMER.LIST page.
_CONSUMER_PAGE = 256


@dataclass(frozen=True)
class ConsumerDepth:
    """One durable consumer's backlog, from its consumer info (message counts)."""

    stream: str
    consumer: str
    backend: str
    arch: str
    pending: int
    ack_pending: int
    redelivered: int
    tenant: str = subjects.DEFAULT_TENANT
    priority: str = subjects.DEFAULT_PRIORITY


@dataclass(frozen=True)
class Snapshot:
    """What one poll saw; either part is None when its read failed."""

    consumers: list[ConsumerDepth] | None = None
    workers: dict[tuple[str, str], int] | None = None
    devices: dict[tuple[str, str], int] | None = None


class QueueCollector(Collector):
    """Serves the latest :class:`Snapshot` as gauge families (thread-safe: the
    snapshot is replaced whole, never mutated)."""

    def __init__(self) -> None:
        self.snapshot = Snapshot()

    def describe(self) -> Iterable[GaugeMetricFamily]:
        return list(self._families(Snapshot()))

    def collect(self) -> Iterable[GaugeMetricFamily]:
        return list(self._families(self.snapshot))

    @staticmethod
    def _families(snap: Snapshot) -> Iterator[GaugeMetricFamily]:
        pending = GaugeMetricFamily(
            "aikg_queue_pending", "Messages on the stream not yet delivered to the consumer.",
            labels=QUEUE_LABELS)
        ack_pending = GaugeMetricFamily(
            "aikg_queue_ack_pending", "Messages delivered to the consumer and not yet acked.",
            labels=QUEUE_LABELS)
        redelivered = GaugeMetricFamily(
            "aikg_queue_redelivered",
            "Messages delivered more than once and not yet acked.", labels=QUEUE_LABELS)
        for c in snap.consumers or []:
            labels = [c.stream, c.consumer, c.backend, c.arch]
            pending.add_metric(labels, c.pending)
            ack_pending.add_metric(labels, c.ack_pending)
            redelivered.add_metric(labels, c.redelivered)
        workers = GaugeMetricFamily(
            "aikg_workers_live", "Workers with a live heartbeat in the workers bucket.",
            labels=FLEET_LABELS)
        for (backend, arch), n in sorted((snap.workers or {}).items()):
            workers.add_metric([backend, arch], n)
        devices = GaugeMetricFamily(
            "aikg_worker_devices_live",
            "Devices (cpu: slots) offered by workers with a live heartbeat.", labels=FLEET_LABELS)
        for (backend, arch), n in sorted((snap.devices or {}).items()):
            devices.add_metric([backend, arch], n)
        lane_pending = GaugeMetricFamily(
            "aikg_tenant_queue_pending",
            "Messages waiting in a tenant's lane, not yet delivered (VERIFY: all "
            "backend/arch summed).", labels=TENANT_LABELS)
        lane_ack = GaugeMetricFamily(
            "aikg_tenant_queue_ack_pending",
            "Messages of a tenant's lane delivered and not yet acked (running).",
            labels=TENANT_LABELS)
        sums: dict[tuple[str, str, str], list[int]] = {}
        for c in snap.consumers or []:
            key = (c.stream, tenant_label(c.tenant), c.priority)
            total = sums.setdefault(key, [0, 0])
            total[0] += c.pending
            total[1] += c.ack_pending
        for key, (waiting, running) in sorted(sums.items()):
            lane_pending.add_metric(list(key), waiting)
            lane_ack.add_metric(list(key), running)
        yield from (pending, ack_pending, redelivered, lane_pending, lane_ack, workers, devices)


COLLECTOR = QueueCollector()
_registered: weakref.WeakSet[CollectorRegistry] = weakref.WeakSet()
_pollers = 0


def _lane(base: str, filter_subject: str | None) -> tuple[str, str]:
    """``(tenant, priority)`` of a lane consumer's filter subject under ``base``."""
    return (subjects.parse_lane(base, filter_subject or "")
            or (subjects.DEFAULT_TENANT, subjects.DEFAULT_PRIORITY))


def _backend_arch(filter_subject: str | None, name: str) -> tuple[str, str]:
    """``verify.cuda.h200`` (or a lane under it) -> ``("cuda", "h200")``; falls back to
    the consumer name ``verify-cuda-h200`` (arch names may hold '-', so the subject is
    preferred)."""
    parts = (filter_subject or "").split(".")
    if len(parts) in (3, 5) and parts[0] == subjects.VERIFY_PREFIX:
        return parts[1], parts[2]
    _, _, rest = name.partition("-")
    backend, _, arch = rest.partition("-")
    return backend, arch


async def _consumers(bus: Bus) -> list[ConsumerDepth]:
    out: list[ConsumerDepth] = []
    offset = 0
    while True:
        page = await bus.js.consumers_info(subjects.STREAM_VERIFY, offset=offset or None)
        for info in page:
            if not info.name.startswith("verify-"):
                continue
            backend, arch = _backend_arch(info.config.filter_subject, info.name)
            tenant, priority = _lane(subjects.verify(backend, arch), info.config.filter_subject)
            out.append(ConsumerDepth(
                stream=subjects.STREAM_VERIFY, consumer=info.name, backend=backend, arch=arch,
                pending=info.num_pending or 0, ack_pending=info.num_ack_pending or 0,
                redelivered=info.num_redelivered or 0, tenant=tenant, priority=priority))
        if len(page) < _CONSUMER_PAGE:
            break
        offset += len(page)
    offset = 0
    while True:
        # ``generator`` and its lanes' ``generator-<tenant>-<priority>``; none until a
        # generator has started once.
        page = await bus.js.consumers_info(subjects.STREAM_JOBS, offset=offset or None)
        for info in page:
            if not info.name.startswith(subjects.CONSUMER_GENERATOR):
                continue
            tenant, priority = _lane(subjects.JOBS_SUBMIT, info.config.filter_subject)
            out.append(ConsumerDepth(
                stream=subjects.STREAM_JOBS, consumer=info.name, backend="", arch="",
                pending=info.num_pending or 0, ack_pending=info.num_ack_pending or 0,
                redelivered=info.num_redelivered or 0, tenant=tenant, priority=priority))
        if len(page) < _CONSUMER_PAGE:
            break
        offset += len(page)
    return sorted(out, key=lambda c: (c.stream, c.consumer))


async def poll(bus: Bus) -> Snapshot:
    """Read consumer info and the ``workers`` bucket once.

    A part whose read fails (NATS down, a stream missing) is None in the snapshot and
    is logged as ``queue_metrics_failed``.
    """
    consumers = workers = devices = None
    try:
        consumers = await _consumers(bus)
    except Exception as exc:  # noqa: BLE001 - a metrics poll must never raise
        log.warning("queue_metrics_failed", part="consumers", error=f"{type(exc).__name__}: {exc}")
    try:
        live = await live_workers(bus)
    except Exception as exc:  # noqa: BLE001
        log.warning("queue_metrics_failed", part="workers", error=f"{type(exc).__name__}: {exc}")
    else:
        workers = dict(Counter((w.backend, w.arch) for w in live))
        devices = {}
        for w in live:
            devices[(w.backend, w.arch)] = devices.get((w.backend, w.arch), 0) + w.capacity
    return Snapshot(consumers=consumers, workers=workers, devices=devices)


def register(registry: CollectorRegistry = REGISTRY) -> QueueCollector:
    """Add the queue collector to ``registry`` once (later calls do nothing)."""
    if registry not in _registered:
        registry.register(COLLECTOR)
        _registered.add(registry)
    return COLLECTOR


async def run_queue_metrics(bus: Bus, interval_s: float = 5.0,
                            registry: CollectorRegistry = REGISTRY) -> None:
    """Poll queue depth and fleet size every ``interval_s`` seconds until cancelled.

    Run it as a task beside a service that serves ``/metrics`` (the gateway does):
    ``task = asyncio.create_task(run_queue_metrics(bus))``; cancel it before closing
    the bus. When the last poller of the process stops, the gauges are emptied.

    Args:
        bus: a connected bus.
        interval_s: seconds between polls (Prometheus' scrape interval is a good value).
        registry: where the collector is registered (the default registry by default).
    """
    global _pollers
    collector = register(registry)
    _pollers += 1
    try:
        while True:
            collector.snapshot = await poll(bus)
            await asyncio.sleep(interval_s)
    finally:
        _pollers -= 1
        if _pollers == 0:
            collector.snapshot = Snapshot()
