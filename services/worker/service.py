"""The worker service: pulls verify requests for its backend/arch and runs them.

One durable pull consumer per ``verify.<backend>.<arch>`` is shared by every worker
of that pair (docs/architecture.md, "The life of a verify request"). A worker fetches
only as many requests as it has free devices, leases the device in the ``leases``
bucket, claims the request (:class:`VerifyClaim`), runs the candidate in the sandbox
(:class:`services.worker.verifier.Verifier`), publishes the :class:`VerifyResult` on
``results.<job_id>.<worker_id>``, acks, and releases the lease.

Delivery rules (services/common/pull_loop.py, the generator's too): while it holds a
request the worker sends ``in_progress()`` every fifth of the consumer's ack wait
(``verify_ack_wait_s``, 5 s), so a long run is not handed to another worker; a worker
that dies stops doing so, and JetStream redelivers its request after the ack wait, a
few seconds after the death. The consumer allows ``verify_max_deliver + 1``
deliveries: the last one only dead-letters the request (``dlq.verify.<backend>.<arch>``),
and this module publishes a failed ``infrastructure`` result and an ``error`` job
event. A message that is not a VerifyRequest is dead-lettered at once; requests of
cancelled jobs are acked unrun; a request of a tenant the tenants file does not name
(when one is configured) gets a failed ``infrastructure`` verdict, unrun. On stop
(SIGTERM, or the ``drain`` endpoint) in-flight runs finish first; a second signal
gives them back to the queue (nak).

Why one module: the request handler, device leases, heartbeat and the final publishes
(result, dead letter, events) are one delivery protocol; its crash-safety (ack only
after the verdict is stored, leases renewed while a run lasts) is checked by reading
them together.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import os
import re
import socket
import time
from collections.abc import Callable

import msgspec
import structlog
from nats import micro
from prometheus_client import Counter, Gauge, Histogram

import services
from schemas import (
    JobEvent,
    VerifyClaim,
    VerifyRequest,
    VerifyResult,
    WorkerInfo,
    decode,
    encode,
    subjects,
    utcnow,
)
from schemas.events import phase_label
from services.common.bus import Bus, JobNotFound, JobStore, bucket_entries, connect_bus
from services.common.jobs import publish_event
from services.common.metrics import start_metrics_server
from services.common.pull_loop import PullLoop, deliveries, open_pull_loop
from services.common.runtime import cancel_and_wait, install_signal_handlers, retry_async
from services.common.settings import Settings, memory_limit_for
from services.common.shares import share_slots
from services.common.tenants import load_tenants, tenant_label, warn_without_tenants_file
from services.common.verdicts import proof
from services.sandbox.limits import child_limits_from

log = structlog.get_logger("aikg.worker")

VERIFICATIONS = Counter(
    "aikg_worker_verifications_total",
    "Verifications finished, by outcome (passed/failed) and failing stage ('none' when passed).",
    ["backend", "arch", "outcome", "stage"],
)
VERIFY_SECONDS = Histogram(
    "aikg_worker_verification_duration_seconds",
    "Wall time of one verification on the worker, seconds.",
    ["backend", "arch"],
    buckets=(0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600),
)
QUEUE_WAIT = Histogram(
    "aikg_worker_queue_wait_seconds",
    "Time from a verify request's creation to the start of its run, seconds, by tenant.",
    ["backend", "arch", "tenant"],
    buckets=(0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 300),
)
IN_FLIGHT = Gauge("aikg_worker_in_flight", "Verifications running now.", ["backend", "arch"])
DEVICES = Gauge("aikg_worker_devices", "Devices (cpu: slots) this worker offers.",
                ["backend", "arch"])
LEASES = Gauge("aikg_worker_leases_held", "Device leases held now.", ["backend", "arch"])
SANDBOX_KILLS = Counter(
    "aikg_worker_sandbox_kills_total",
    "Candidate runs the sandbox ended, by reason: timeout (ran past timeout_s and was "
    "killed) or crash (died by a signal or exited without a result).",
    ["backend", "arch", "reason"],
)
VERIFY_PHASE_SECONDS = Histogram(
    "aikg_verify_phase_seconds",
    "Time one verification spent in each phase, seconds (phase names: "
    "schemas.events.VERIFY_PHASES; trial_1, trial_2 ... are all 'trial').",
    ["backend", "arch", "phase"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 120),
)
DEAD_LETTERED = Counter("aikg_worker_dead_lettered_total",
                        "Verify requests moved to the DLQ, by reason.", ["backend", "arch", "reason"])
RELAYED_CONTROL = Counter(
    "aikg_worker_relayed_control_requests_total",
    "Messages on this worker's control endpoints ignored because the server relayed them "
    "(a JetStream delivery: its reply subject a $JS. ack subject, or relay headers), by "
    "endpoint: a pull or direct get whose asker named the endpoint as its reply subject.",
    ["endpoint"],
)


def relayed_by_server(reply: str | None, headers: dict[str, str] | None) -> bool:
    """Whether a message arrived as the server's relay of a stream message rather than as
    a client's request: its reply subject is a JetStream subject (``$JS.ACK...`` of a
    pulled message) or its headers carry a direct get's ``Nats-Stream``/``Nats-Subject``.
    nats-server delivers those to any reply subject a puller names, unchecked."""
    return (reply or "").startswith("$JS.") or \
        any(h in (headers or {}) for h in ("Nats-Stream", "Nats-Subject"))


def default_worker_id() -> str:
    """``<host>-<pid>`` with characters a NATS subject/KV key cannot hold replaced."""
    host = re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname())[:40]
    return f"{host}-{os.getpid()}"


# How long one pull request waits on the server for requests, seconds; a stop or
# drain takes effect within this.
PULL_EXPIRES_S = 1.0
# Seconds between attempts at a heartbeat put that failed (NATS away or failing over).
HEARTBEAT_RETRY_S = 0.5
# Attempts at each publish that ends a request (its result, its DLQ copy) before the
# handler gives up and leaves the message to JetStream's redelivery.
FINAL_PUBLISH_ATTEMPTS = 3
# A lease or heartbeat not renewed for this many periods no longer counts toward a
# tenant's device share (leases are renewed every period, heartbeats too).
SHARE_STALE_PERIODS = 3
# How long a starting worker waits for the current leases and heartbeats, seconds.
SHARE_WATCH_START_S = 5.0


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


class Worker:
    """A verify consumer bound to one backend/arch and a list of devices.

    Args:
        bus: connected NATS bus.
        settings: backend, arch, devices, timings.
        verifier: the sandboxed verifier (started by :meth:`run` if not yet, closed
            when :meth:`run` returns).

    Raises:
        ValueError: a device name is not usable as a lease key, or is listed twice; or
            the worker id is not one NATS subject token.
    """

    def __init__(self, bus: Bus, settings: Settings, verifier=None) -> None:
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
        self.verifier = verifier
        # Fair shares of this backend/arch's devices (services/common/shares.py).
        self.tenants = load_tenants(settings)
        warn_without_tenants_file(settings, "worker", log)
        self.fleet = DeviceShares(self.worker_id, self.backend, self.arch, len(self.devices),
                                  settings.worker_heartbeat_s)
        self.jobs = JobStore(bus.jobs)
        self.labels = {"backend": self.backend, "arch": self.arch}
        self.log = log.bind(worker_id=self.worker_id, backend=self.backend, arch=self.arch)

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
            loop = self.loop = await open_pull_loop(
                self.bus.js, self.bus.nc, self.settings, stream=subjects.STREAM_VERIFY,
                base=subject, idle_s=PULL_EXPIRES_S, kind="verify request",
                decode=lambda data: decode(data, VerifyRequest), handle=self.handle,
                capacity=self.free.qsize, claim=self._claim,
                dead_lettered=self._dead_lettered, freed=self.freed,
                exclude=None if borrow else self.at_share,
                defer=self.at_share if borrow else None, stopping=lambda: self.draining)
            await self.fleet.start(self.bus)
            # The control service answers before the first heartbeat says the worker is
            # there (whoever sees the heartbeat may ask its status at once).
            service = await self.control_service()
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
        """Give the verifier the reference outputs and baselines every worker shares
        (:mod:`services.worker.cache`); without them (turned off, or JetStream refused)
        it keeps to its own process's cache."""
        from services.worker.cache import SharedCache

        try:
            cache = await SharedCache.open(self.bus.js, self.settings, worker_id=self.worker_id)
        except Exception as exc:  # noqa: BLE001 - verifying works without the shared tier
            self.log.warning("shared_cache_unavailable", error=str(exc) or type(exc).__name__,
                             hint="reference outputs and baselines stay in this worker")
            return
        self.verifier.shared_cache = cache
        self.log.info("shared_cache", enabled=cache is not None)

    def _claim(self, msg) -> tuple[str | None, float]:
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

    async def leases_held(self) -> list[dict]:
        """This worker's entries of the ``leases`` bucket."""
        out = []
        with contextlib.suppress(Exception):
            entries = await bucket_entries(self.bus.js, subjects.BUCKET_LEASES)
            for key, entry in sorted(entries.items()):
                if key.startswith(f"{self.worker_id}."):
                    with contextlib.suppress(Exception):
                        out.append(msgspec.json.decode(entry.value))
        return out

    async def control_service(self):
        """A ``nats micro`` service (``nats micro ls`` lists it) with two endpoints on
        ``aikg.worker.<worker_id>.{status,drain}``.

        ``status`` answers WorkerInfo plus the leases held; ``drain`` stops taking new
        requests, lets the in-flight ones finish, then stops the worker. A message the
        server relayed there (:func:`relayed_by_server`) is ignored, unanswered (an
        answer to a pulled message's ack subject would ack it), logged and counted.
        """
        service = await micro.add_service(
            self.bus.nc, name="aikg-worker", version=_semver(services.__version__),
            description=f"AIKG worker {self.backend}/{self.arch}",
            metadata={"worker_id": self.worker_id, "backend": self.backend, "arch": self.arch},
        )
        prefix = subjects.worker_service(self.worker_id)

        def relayed(req: micro.Request, endpoint: str) -> bool:
            reply = req._msg.reply
            if not relayed_by_server(reply, req.headers):
                return False
            RELAYED_CONTROL.labels(endpoint=endpoint).inc()
            self.log.warning("relayed_control_request_ignored", endpoint=endpoint,
                             reply=reply[:80], headers=sorted(req.headers or {}))
            return True

        async def status(req: micro.Request) -> None:
            if relayed(req, "status"):
                return
            body = msgspec.structs.asdict(self.info())
            body["leases"] = await self.leases_held()
            await req.respond(encode(body))

        async def drain(req: micro.Request) -> None:
            if relayed(req, "drain"):
                return
            self.draining = True
            self.log.info("worker_draining", in_flight=self.in_flight)
            await req.respond(encode({"worker_id": self.worker_id, "status": "draining",
                                      "in_flight": self.in_flight}))

        await service.add_endpoint(name="status", subject=f"{prefix}.status", handler=status)
        await service.add_endpoint(name="drain", subject=f"{prefix}.drain", handler=drain)
        return service

    async def handle(self, msg, request: VerifyRequest,
                     claimed: tuple[str | None, float] | None = None) -> None:
        """Verify one decoded request on the device of ``claimed`` (``(device or None,
        monotonic arrival)``; None: the next free device, arrived now); always frees
        the device. In-progress beats, nak on failure or cancellation and
        dead-letters are the pull loop's (services/common/pull_loop.py); the arrival
        starts the request's ``fetch_to_start`` phase.
        """
        device, received = claimed if claimed is not None else (None, time.monotonic())
        released = False

        def release() -> None:
            nonlocal released
            if device is not None and not released:
                released = True
                self.free.put_nowait(device)
                self.freed.set()

        try:
            if device is None:
                # A fetch that raced a device being taken brought one more than the free
                # devices: it waits here (marked in progress) rather than being nak'ed,
                # which would count a delivery against max_deliver.
                device = await self.free.get()
            with structlog.contextvars.bound_contextvars(
                    job_id=request.job_id, request_id=request.request_id,
                    candidate_id=request.candidate_id, worker_id=self.worker_id):
                await self._handle_request(msg, request, device, received, release)
        finally:
            release()

    async def _handle_request(self, msg, request: VerifyRequest, device: str,
                              received: float | None = None,
                              release: Callable[[], None] | None = None) -> None:
        """Run one decoded request; ``release`` gives the device back as soon as the
        verification (and its lease) ended, so the next fetch overlaps this one's
        result publish and ack."""
        received = time.monotonic() if received is None else received
        bound = self.log.bind(device=device)
        delivered = deliveries(msg)
        lane_tenant = self.loop.tenant_of(msg) if self.loop is not None else request.tenant
        refused = self.tenants.refusal(request.tenant, "worker") or \
            self.tenants.refusal(lane_tenant, "worker")
        if refused is not None:
            # Like a request past max_deliver: a failed ``infrastructure`` verdict (the
            # request was never run), so its job does not wait for one.
            bound.warning("unknown_tenant_refused", tenant=request.tenant,
                          lane_tenant=lane_tenant, tenants_file=self.settings.tenants_file)
            await self._publish_claim(request, "")
            await self._publish_result(self._failure(request, "", "infrastructure", refused),
                                       request)
            await msg.ack()
            return
        async with contextlib.AsyncExitStack() as held:
            # The job's record is read while the lease is put (two round trips at
            # once, not one after the other before every run); a cancelled job's lease
            # is deleted again unused.
            leasing = time.monotonic()
            cancelled, _ = await asyncio.gather(
                self._job_cancelled(request.job_id),
                held.enter_async_context(self.lease(device, request)))
            lease_s = time.monotonic() - leasing
            if cancelled:
                bound.info("skipped_cancelled_job")
                await msg.ack()
                return
            # The claim names this worker as the request's holder: readers count a
            # verdict only from the latest claimant (services/common/verdicts.py). If
            # it cannot be published the request goes back (the pull loop naks it).
            await self._publish_claim(request, device)
            cap = self.tenants.get(request.tenant).max_timeout_s
            if cap and request.timeout_s > cap:
                # The gateway refuses such jobs; a request sent another way (nats pub,
                # RemoteWorker) runs within its tenant's limit all the same.
                bound.warning("timeout_clamped", tenant=request.tenant,
                              asked_s=request.timeout_s, max_timeout_s=cap)
                request.timeout_s = cap
            QUEUE_WAIT.labels(**self.labels, tenant=tenant_label(request.tenant)).observe(
                _age_s(request.created_at))
            bound.info("verify_started", deliveries=delivered)
            IN_FLIGHT.labels(**self.labels).inc()
            started = time.monotonic()
            try:
                result: VerifyResult = await self.verifier.verify(request, device=device)
            finally:
                IN_FLIGHT.labels(**self.labels).dec()
        if release is not None:
            release()
        elapsed = time.monotonic() - started
        result.phases = {**_stored_wait(msg, request, received),
                         "fetch_to_start": round(max(0.0, leasing - received), 6),
                         "lease": round(lease_s, 6), **result.phases}
        VERIFY_SECONDS.labels(**self.labels).observe(elapsed)
        VERIFICATIONS.labels(**self.labels, outcome="passed" if result.passed else "failed",
                             stage=result.stage or "none").inc()
        if result.stage in ("timeout", "crash"):
            SANDBOX_KILLS.labels(**self.labels, reason=result.stage).inc()
        publishing = time.monotonic()
        await self._publish_result(result, request)
        await msg.ack()
        phases = {**result.phases, "publish": time.monotonic() - publishing}
        for name, seconds in phases.items():
            VERIFY_PHASE_SECONDS.labels(**self.labels, phase=phase_label(name)).observe(seconds)
        bound.info("verify_finished", passed=result.passed, stage=result.stage,
                   duration_s=round(elapsed, 3))

    async def _dead_lettered(self, msg, request: VerifyRequest | None, reason: str,
                             why: str) -> None:
        """A request moved to the DLQ (by the pull loop): an ``error`` event on its job
        (a malformed one's job id read best-effort), and for one past max_deliver a
        failed ``infrastructure`` result, so its job does not wait for a verdict."""
        moved = f"{reason}; moved to {subjects.dlq(msg.subject)}"
        DEAD_LETTERED.labels(**self.labels, reason=why).inc()
        if request is None:
            self.log.warning("malformed_request", error=reason, subject=msg.subject)
            job_id = _job_id_of(msg.data)
            if job_id:
                await publish_event(self.bus, JobEvent(job_id=job_id, event="error",
                                                       message=moved))
            return
        self.log.error("max_deliver_exceeded", error=reason, job_id=request.job_id,
                       request_id=request.request_id)
        try:
            await self._publish_claim(request, "")
            await self._publish_result(self._failure(request, "", "infrastructure", moved),
                                       request)
        except Exception as exc:  # noqa: BLE001 - the DLQ copy keeps the request
            self.log.error("result_publish_failed", error=str(exc))
            moved += f"; its failed result could not be published: {exc}"
        await publish_event(self.bus, JobEvent(
            job_id=request.job_id, event="error", message=moved,
            request_id=request.request_id, candidate_id=request.candidate_id))

    @contextlib.asynccontextmanager
    async def lease(self, device: str, request: VerifyRequest):
        """Hold ``<worker_id>.<device>`` in the ``leases`` bucket while running.

        The first put completes before the run starts; the lease is renewed every
        heartbeat period while the run lasts (the bucket's TTL, ten periods, expires
        the lease of a worker that died) and deleted on release.
        """
        key = f"{self.worker_id}.{device}"
        value = encode({"worker_id": self.worker_id, "device": device, "job_id": request.job_id,
                        "request_id": request.request_id, "since": utcnow(),
                        "tenant": request.tenant, "backend": self.backend, "arch": self.arch})

        async def put() -> None:
            try:
                await self.bus.leases.put(key, value)
            except Exception as exc:  # noqa: BLE001 - the run goes on; the lease is advisory
                self.log.warning("lease_put_failed", lease=key, error=str(exc))

        async def renew() -> None:
            while True:
                await asyncio.sleep(self.settings.worker_heartbeat_s)
                await put()

        await put()
        renewer = asyncio.create_task(renew())
        LEASES.labels(**self.labels).inc()
        try:
            yield key
        finally:
            await cancel_and_wait(renewer)
            with contextlib.suppress(Exception):
                await self.bus.leases.delete(key)
            LEASES.labels(**self.labels).dec()

    async def _job_cancelled(self, job_id: str) -> bool:
        try:
            record, _ = await self.jobs.get(job_id)
        except JobNotFound:
            return False  # worker-only mode: RemoteWorker requests have no job record
        except Exception:  # noqa: BLE001 - a KV hiccup must not drop the request
            return False
        return record.status == "cancelled"

    async def _publish_claim(self, request: VerifyRequest, device: str) -> None:
        """Publish this worker's :class:`VerifyClaim` of ``request`` on
        ``results.<job_id>.<worker_id>.claim``, with its proof from the request's claim
        nonce, retrying (each delivery claims again: a request handed back and given
        to this worker once more is held by it again).

        Raises:
            Exception: the last attempt's error (nats errors: timeout, no responders).
        """
        claim = VerifyClaim(request_id=request.request_id, job_id=request.job_id,
                            worker_id=self.worker_id, device=device,
                            proof=proof(request.claim_nonce, "claim", self.worker_id,
                                        request.request_id))
        await retry_async(lambda: self.bus.js.publish(
            subjects.claims(request.job_id, self.worker_id), encode(claim),
        ), attempts=FINAL_PUBLISH_ATTEMPTS, first_wait_s=0.5, logger=self.log,
            event="claim_publish_retry")

    async def _publish_result(self, result: VerifyResult, request: VerifyRequest) -> None:
        """Publish on ``results.<job_id>.<worker_id>`` (deduplicated by request and
        worker), with the proof from ``request``'s claim nonce, retrying.

        Raises:
            Exception: the last attempt's error (nats errors: timeout, no responders).
        """
        result.worker_id = self.worker_id
        result.proof = proof(request.claim_nonce, "result", self.worker_id, request.request_id)
        await retry_async(lambda: self.bus.js.publish(
            subjects.results(result.job_id, self.worker_id), encode(result),
            headers={"Nats-Msg-Id": f"result-{result.request_id}-{self.worker_id}"},
        ), attempts=FINAL_PUBLISH_ATTEMPTS, first_wait_s=0.5, logger=self.log,
            event="result_publish_retry")

    def _failure(self, request: VerifyRequest, device: str, stage: str, error: str) -> VerifyResult:
        return VerifyResult(
            request_id=request.request_id, job_id=request.job_id,
            candidate_id=request.candidate_id, worker_id=self.worker_id, device=device,
            passed=False, stage=stage, error=error,
            interpreted=self.backend == "cpu",
        )


def _stored_wait(msg, request: VerifyRequest, received: float) -> dict[str, float]:
    """``{"queue": seconds}`` from the request's store in the stream (its JetStream
    timestamp; else its ``created_at``) to ``received`` (monotonic), or ``{}``."""
    stored = None
    with contextlib.suppress(Exception):
        stored = msg.metadata.timestamp
    if not isinstance(stored, dt.datetime):
        stored = request.created_at
    if stored is None:
        return {}
    if stored.tzinfo is None:
        stored = stored.replace(tzinfo=dt.UTC)
    since_received = time.monotonic() - received
    return {"queue": round(max(0.0, (utcnow() - stored).total_seconds() - since_received), 6)}


def _age_s(created_at: dt.datetime) -> float:
    """Seconds since ``created_at``; a hand-written time without an offset counts as UTC."""
    if created_at.tzinfo is None:
        created_at = created_at.replace(tzinfo=dt.UTC)
    return max(0.0, (utcnow() - created_at).total_seconds())


def _semver(version: str) -> str:
    """``nats micro`` wants semantic versions; ``0.1.0.dev1`` -> ``0.1.0``."""
    parts = (version.split(".") + ["0", "0"])[:3]
    return ".".join(p if p.isdigit() else "0" for p in parts)


def _job_id_of(data: bytes) -> str | None:
    """Best-effort job id of a malformed request, to tell its job what happened."""
    try:
        value = msgspec.json.decode(data)
    except Exception:  # noqa: BLE001
        return None
    job_id = value.get("job_id") if isinstance(value, dict) else None
    if subjects.is_token(job_id):
        return job_id
    return None


async def run_worker(settings: Settings, stop: asyncio.Event | None = None, *,
                     verifier=None) -> None:
    """Connect, serve verify requests until ``stop`` is set (or a signal), then exit;
    ``verifier`` as :class:`Worker`'s.

    Without ``stop`` (a worker process), the first SIGINT/SIGTERM stops taking
    requests and lets the in-flight verifications finish (each within its request's
    ``timeout_s``); a second one gives them up: their children are killed and their
    messages nak'ed, so another worker takes them at once rather than after ack_wait.

    Raises:
        ConnectionError: NATS is unreachable at start.
        ValueError: the device list is not usable (see :class:`Worker`).
        services.sandbox.pool.PoolBroken: the sandbox could not start.
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
