"""The worker service: pulls verify requests for its backend/arch and runs them.

One durable pull consumer per ``verify.<backend>.<arch>`` is shared by every worker
of that pair (docs/architecture.md, "The life of a verify request"). A worker fetches
only as many requests as it has free devices, leases the device in the ``leases``
bucket, claims the request (:class:`VerifyClaim`), runs the candidate in the sandbox
(:class:`services.worker.verifier.Verifier`), publishes the :class:`VerifyResult` on
``results.<job_id>.<worker_id>``, acks, and releases the lease
(:class:`services.worker.requests.Requests`).

Delivery rules (services/common/pull_loop.py, the generator's too): while it holds a
request the worker sends ``in_progress()`` every fifth of the consumer's ack wait
(``verify_ack_wait_s``, 5 s), so a long run is not handed to another worker; a worker
that dies stops doing so, and JetStream redelivers its request after the ack wait, a
few seconds after the death. The consumer allows ``verify_max_deliver + 1``
deliveries: the last one only dead-letters the request (``dlq.verify.<backend>.<arch>``),
and the worker publishes a failed ``infrastructure`` result and an ``error`` job
event. A message that is not a VerifyRequest is dead-lettered at once; requests of
cancelled jobs are acked unrun; a request of a tenant the tenants file does not name
(when one is configured) gets a failed ``infrastructure`` verdict, unrun. On stop
(SIGTERM, or the ``drain`` endpoint, :mod:`services.worker.control`) in-flight runs
finish first; a second signal gives them back to the queue (nak).

This module holds the :class:`Worker` (its devices, heartbeat, pull loop, shared
baselines and lifetime); the handling of each request is
:mod:`services.worker.requests`, the fleet's devices and leases as this worker sees
them :mod:`services.worker.fleet`, its control endpoints :mod:`services.worker.control`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import socket
import time

import structlog
from nats.aio.msg import Msg
from prometheus_client import Gauge

import services
from schemas import VerifyRequest, WorkerInfo, decode, encode, subjects, utcnow
from services.common.bus import Bus, connect_bus
from services.common.metrics import start_metrics_server
from services.common.pull_loop import PullLoop, open_pull_loop
from services.common.runtime import cancel_and_wait, install_signal_handlers
from services.common.settings import Settings, memory_limit_for
from services.common.shares import share_slots
from services.common.tenants import load_tenants, warn_without_tenants_file
from services.sandbox.limits import child_limits_from
from services.worker.cache import SharedCache
from services.worker.control import control_service
from services.worker.fleet import DeviceShares
from services.worker.requests import Requests, VerifyRunner

log = structlog.get_logger("aikg.worker")

DEVICES = Gauge("aikg_worker_devices", "Devices (cpu: slots) this worker offers.",
                ["backend", "arch"])


def default_worker_id() -> str:
    """``<host>-<pid>`` with characters a NATS subject/KV key cannot hold replaced."""
    host = re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname())[:40]
    return f"{host}-{os.getpid()}"


# How long one pull request waits on the server for requests, seconds; a stop or
# drain takes effect within this.
PULL_EXPIRES_S = 1.0
# Seconds between attempts at a heartbeat put that failed (NATS away or failing over).
HEARTBEAT_RETRY_S = 0.5


def _check_worker_user(settings: Settings, worker_id: str) -> None:
    """Refuse a worker id its NATS user may not write the keys of.

    A worker's user ``worker-<id>`` may write only the heartbeat and leases of worker
    ``<id>`` (services/common/nats_auth.py); any other id would beat into refusals.

    Raises:
        ValueError: the user is ``worker-<other id>``; the message names both.
    """
    from services.common.nats_auth import worker_user

    user = settings.nats_worker_user or settings.nats_user
    if user.startswith("worker-") and user != worker_user(worker_id):
        raise ValueError(
            f"worker id {worker_id!r} does not match its NATS user {user!r}, which may write "
            f"only the heartbeat and leases of worker {user.removeprefix('worker-')!r}: set "
            f"AIKG_WORKER_ID={user.removeprefix('worker-')} (or connect as "
            f"{worker_user(worker_id)})")


# Device names become lease keys (`<worker_id>.<device>`) and env values: one subject
# token of at most this many characters.
_DEVICE_NAME_CHARS = 32


class Worker:
    """A verify consumer bound to one backend/arch and a list of devices.

    Args:
        bus: connected NATS bus.
        settings: backend, arch, devices, timings.
        verifier: the sandboxed verifier (started by :meth:`run` if not yet, closed
            when :meth:`run` returns); None: a :class:`~services.worker.verifier.Verifier`
            built from ``settings``.

    Raises:
        ValueError: a device name is not usable as a lease key, or is listed twice; or
            the worker id is not one NATS subject token.
    """

    def __init__(self, bus: Bus, settings: Settings,
                 verifier: VerifyRunner | None = None) -> None:
        self.bus = bus
        self.settings = settings
        self.backend = settings.worker_backend
        self.arch = settings.arch
        self.devices = settings.devices or ["0"]
        bad = [d for d in self.devices if not subjects.is_token(d, _DEVICE_NAME_CHARS)]
        if bad or len(set(self.devices)) != len(self.devices):
            raise ValueError(
                f"devices {settings.worker_devices!r}: each must be a distinct name of "
                "letters, digits, '_' or '-' (GPU ordinals, or slot numbers on cpu), e.g. "
                "--devices 0,1")
        self.worker_id = settings.worker_id or default_worker_id()
        # It names the control subjects and lease keys: fail before the slow start.
        subjects.worker_service(self.worker_id)
        _check_worker_user(settings, self.worker_id)
        self.started_at = utcnow()
        self.free: asyncio.Queue[str] = asyncio.Queue()
        for d in self.devices:
            self.free.put_nowait(d)
        # Set when a device comes back: the fetch loop waits on it rather than polling.
        self.freed = asyncio.Event()
        # The request intake (bound in run()); its messages in hand each hold (or
        # wait for) one device.
        self.loop: PullLoop | None = None
        self.draining = False
        memory = memory_limit_for(self.backend, settings.memory_limit_bytes)
        if verifier is None:
            from services.worker.verifier import Verifier  # torch and the sandbox: slow

            verifier = Verifier(
                self.backend, worker_id=self.worker_id, memory_limit_bytes=memory,
                sandbox_require=settings.sandbox_require_list,
                sandbox_env_allow=settings.sandbox_env_allow_list,
                aot_target=settings.worker_aot_target,
                compile_extra_targets=settings.worker_compile_extra_targets,
                compile_extra_required=settings.worker_compile_extra_required,
                scratch_bytes=settings.sandbox_scratch_bytes or None,
                task_timeout_s=settings.task_timeout_s,
                child_limits=child_limits_from(settings),
                compile_timeout_s=settings.profile_compile_timeout_s,
                check_bytes=settings.worker_check_bytes or None,
            )
        self.verifier: VerifyRunner = verifier
        # Fair shares of this backend/arch's devices (services/common/shares.py).
        self.tenants = load_tenants(settings)
        warn_without_tenants_file(settings, "worker", log)
        self.fleet = DeviceShares(self.worker_id, self.backend, self.arch, len(self.devices),
                                  settings.worker_heartbeat_s)
        self.labels = {"backend": self.backend, "arch": self.arch}
        self.log = log.bind(worker_id=self.worker_id, backend=self.backend, arch=self.arch)
        self.requests = Requests(bus, settings, verifier, worker_id=self.worker_id,
                                 backend=self.backend, arch=self.arch, tenants=self.tenants,
                                 free=self.free, freed=self.freed, logger=self.log)

    @property
    def in_flight(self) -> int:
        return len(self.devices) - self.free.qsize()

    @property
    def stopping(self) -> bool:
        """Drained, or stopped and finishing the requests in hand."""
        return self.draining or (self.loop is not None and self.loop.finishing)

    def info(self) -> WorkerInfo:
        return WorkerInfo(
            worker_id=self.worker_id,
            backend=self.backend,
            arch=self.arch,
            devices=list(self.devices),
            capacity=len(self.devices),
            in_flight=self.in_flight,
            host=socket.gethostname(),
            version=services.__version__,
            started_at=self.started_at,
            status="draining" if self.stopping else "running",
            sandbox=self.verifier.sandbox.isolation.summary() if self.verifier.sandbox.started else [],
            sandbox_notes=list(self.verifier.sandbox_notes),
        )

    async def heartbeat(self) -> None:
        """Put WorkerInfo into the ``workers`` bucket every ``worker_heartbeat_s``.

        Each put may take at most one period; a failed one (NATS reconnecting, a
        bucket leader failing over) is retried every ``HEARTBEAT_RETRY_S`` rather than a
        period later, so the key (TTL: three periods) outlives a short outage and is
        back as soon as NATS answers again.
        """
        period = self.settings.worker_heartbeat_s
        while True:
            try:
                await asyncio.wait_for(
                    self.bus.workers.put(self.worker_id, encode(self.info())), period)
                delay = period
            except Exception as exc:  # noqa: BLE001 - keep beating through reconnects
                self.log.warning("heartbeat_failed", error=str(exc) or type(exc).__name__)
                delay = min(HEARTBEAT_RETRY_S, period)
            await asyncio.sleep(delay)

    async def run(self, stop: asyncio.Event, abandon: asyncio.Event | None = None) -> None:
        """Serve until ``stop`` is set or a drain is requested; then clean up.

        In-flight verifications finish (results published, messages acked) before
        this returns, unless ``abandon`` is set meanwhile: then their sandboxed
        children are killed and their messages nak'ed, so another worker takes them
        at once instead of after ack_wait. Whatever happens, the heartbeat key is
        deleted and the fork server stopped (its children with it).

        Args:
            stop: set to stop taking requests.
            abandon: set to give up the in-flight verifications while stopping.

        Raises:
            services.sandbox.pool.PoolBroken: the sandbox could not start.
        """
        abandon = abandon if abandon is not None else asyncio.Event()
        loop = beat = service = None
        try:
            await asyncio.to_thread(self.verifier.start)
            await self._open_shared_cache()
            DEVICES.labels(**self.labels).set(len(self.devices))
            subject = subjects.verify(self.backend, self.arch)
            # Requests wait in one lane per tenant and priority, taken in fair order
            # as devices come free (services/common/pull_loop.py); the lanes of a tenant
            # at its share of this backend/arch's devices are not asked, even with a
            # device free (with share_borrow_idle: asked after every other lane came
            # up empty), so that device is there for another tenant's next request.
            borrow = self.settings.share_borrow_idle
            loop = self.loop = self.requests.loop = await open_pull_loop(
                self.bus.js, self.bus.nc, self.settings, stream=subjects.STREAM_VERIFY,
                base=subject, idle_s=PULL_EXPIRES_S, kind="verify request",
                decode=lambda data: decode(data, VerifyRequest), handle=self.requests.handle,
                capacity=self.free.qsize, claim=self._claim,
                dead_lettered=self.requests.dead_lettered, freed=self.freed,
                exclude=None if borrow else self.at_share,
                defer=self.at_share if borrow else None, stopping=lambda: self.draining)
            await self.fleet.start(self.bus)
            # The control service answers before the first heartbeat says the worker is
            # there (whoever sees the heartbeat may ask its status at once).
            service = await control_service(self.bus.nc, self.bus.js, self, self.log)
            beat = asyncio.create_task(self.heartbeat())
            self.log.info("worker_started", subject=subject, devices=self.devices,
                          ack_wait_s=loop.delivery.ack_wait_s,
                          max_deliver=loop.delivery.max_deliver)
            await loop.run(stop, abandon)
        finally:
            self.draining = True
            if loop is not None:
                await loop.finish(abandon)
            if service is not None:
                with contextlib.suppress(Exception):
                    await service.stop()
            if beat is not None:
                await cancel_and_wait(beat)
                with contextlib.suppress(Exception):
                    await self.bus.workers.delete(self.worker_id)
            await self.fleet.stop()
            if loop is not None:
                await loop.lanes.stop()
            self.verifier.shared_cache = None
            await asyncio.to_thread(self.verifier.close)
            DEVICES.labels(**self.labels).set(0)
            self.log.info("worker_stopped")

    async def _open_shared_cache(self) -> None:
        """Give the verifier the baselines every worker shares
        (:mod:`services.worker.cache`); without them (turned off, or JetStream refused)
        it keeps to its own process's cache."""
        try:
            cache = await SharedCache.open(self.bus.js, self.settings, worker_id=self.worker_id)
        except Exception as exc:  # noqa: BLE001 - verifying works without the shared tier
            self.log.warning("shared_cache_unavailable", error=str(exc) or type(exc).__name__,
                             hint="baselines stay in this worker")
            return
        self.verifier.shared_cache = cache
        self.log.info("shared_cache", enabled=cache is not None)

    def _claim(self, msg: Msg) -> tuple[str | None, float]:
        """A free device for a message just taken (before the next fetch counts the
        free ones), or None to wait for one, and when it arrived (monotonic)."""
        device = None if self.free.empty() else self.free.get_nowait()
        return device, time.monotonic()

    def at_share(self, tenant: str) -> bool:
        """Whether ``tenant`` holds its ``max_device_share`` of this backend/arch's
        devices: this worker's runs of it, plus the other workers' leases of it (as
        last read, at most one heartbeat period old). Its lanes are then not asked
        (asked last with ``share_borrow_idle``)."""
        cap = share_slots(self.tenants.get(tenant).max_device_share, self.fleet.devices())
        held = self.loop.held[tenant] if self.loop is not None else 0
        return held + self.fleet.held_elsewhere(tenant) >= cap


async def run_worker(settings: Settings, stop: asyncio.Event | None = None, *,
                     verifier: VerifyRunner | None = None) -> None:
    """Connect, serve verify requests until ``stop`` is set (or a signal), then exit;
    ``verifier`` as :class:`Worker`'s.

    Without ``stop`` (a worker process), the first SIGINT/SIGTERM stops taking
    requests and lets the in-flight verifications finish (each within its request's
    ``timeout_s``); a second one gives them up: their children are killed and their
    messages nak'ed, so another worker takes them at once rather than after ack_wait.

    Raises:
        ConnectionError: NATS is unreachable at start.
        ValueError: the device list is not usable (see :class:`Worker`).
        services.sandbox.errors.PoolBroken: the sandbox could not start.
    """
    abandon = asyncio.Event()
    restore = lambda: None  # noqa: E731
    if stop is None:
        stop = asyncio.Event()
        restore = install_signal_handlers(
            stop, abandon, logger=log, hint="in-flight verifications finish first; signal "
            "again to give them to other workers now")
    try:
        start_metrics_server(settings.metrics_port)
        bus = await connect_bus(settings,
                                f"aikg-worker-{settings.worker_id or default_worker_id()}",
                                role="worker")
        try:
            await Worker(bus, settings, verifier).run(stop, abandon)
        finally:
            await bus.close()
    finally:
        restore()
