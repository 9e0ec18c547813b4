"""The worker service: pulls verify requests for its backend/arch and runs them.

One durable pull consumer per ``verify.<backend>.<arch>`` is shared by every worker
of that pair (DESIGN.md, "Flow" step 3). A worker fetches only as many requests as it
has free devices, leases the device in the ``leases`` bucket, runs the candidate in
the sandbox (:class:`services.worker.verifier.Verifier`), publishes the
:class:`VerifyResult` on ``results.<job_id>``, acks, and releases the lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import socket
import time

import msgspec
import structlog
from nats import micro
from prometheus_client import Counter, Gauge, Histogram

import services
from schemas import (
    JobEvent,
    VerifyRequest,
    VerifyResult,
    WorkerInfo,
    decode,
    encode,
    subjects,
    utcnow,
)
from services.common.bus import Bus, JobNotFound, JobStore, connect_bus
from services.common.consumer import (
    dead_letter,
    deliveries,
    durable_pull,
    fetch_some,
    run_with_progress,
)
from services.common.jobs import publish_event
from services.common.metrics import start_metrics_server
from services.common.runtime import install_signal_handlers
from services.common.settings import Settings

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
    "Time from a verify request's creation to the start of its run, seconds.",
    ["backend", "arch"],
    buckets=(0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 300),
)
IN_FLIGHT = Gauge("aikg_worker_in_flight", "Verifications running now.", ["backend", "arch"])
DEVICES = Gauge("aikg_worker_devices", "Devices (cpu: slots) this worker offers.",
                ["backend", "arch"])
LEASES = Gauge("aikg_worker_leases_held", "Device leases held now.", ["backend", "arch"])
DEAD_LETTERED = Counter("aikg_worker_dead_lettered_total",
                        "Verify requests moved to the DLQ, by reason.", ["backend", "arch", "reason"])


def default_worker_id() -> str:
    """``<host>-<pid>`` with characters a NATS subject/KV key cannot hold replaced."""
    host = re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname())[:40]
    return f"{host}-{os.getpid()}"


class Worker:
    """A verify consumer bound to one backend/arch and a list of devices.

    Args:
        bus: connected NATS bus.
        settings: backend, arch, devices, timings.
        verifier: the sandboxed verifier (started by :meth:`run` if not yet).
    """

    def __init__(self, bus: Bus, settings: Settings, verifier=None) -> None:
        from services.worker.verifier import Verifier

        self.bus = bus
        self.settings = settings
        self.backend = settings.worker_backend
        self.arch = settings.arch
        self.devices = settings.devices or ["0"]
        self.worker_id = settings.worker_id or default_worker_id()
        self.started_at = utcnow()
        self.free: asyncio.Queue[str] = asyncio.Queue()
        for d in self.devices:
            self.free.put_nowait(d)
        self.tasks: set[asyncio.Task] = set()
        self.draining = False
        memory = settings.memory_limit_bytes or (4 << 30 if self.backend == "cpu" else None)
        self.verifier = verifier or Verifier(
            self.backend, worker_id=self.worker_id, memory_limit_bytes=memory
        )
        self.jobs = JobStore(bus.jobs)
        self.labels = {"backend": self.backend, "arch": self.arch}
        self.log = log.bind(worker_id=self.worker_id, backend=self.backend, arch=self.arch)

    @property
    def in_flight(self) -> int:
        return len(self.devices) - self.free.qsize()

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
            status="draining" if self.draining else "running",
        )

    async def heartbeat(self) -> None:
        """Put WorkerInfo into the ``workers`` bucket every ``worker_heartbeat_s``."""
        while True:
            try:
                await self.bus.workers.put(self.worker_id, encode(self.info()))
            except Exception as exc:  # noqa: BLE001 - keep beating through reconnects
                self.log.warning("heartbeat_failed", error=str(exc))
            await asyncio.sleep(self.settings.worker_heartbeat_s)

    async def run(self, stop: asyncio.Event) -> None:
        """Serve until ``stop`` is set; then finish in-flight runs and clean up."""
        await asyncio.to_thread(self.verifier.start)
        DEVICES.labels(**self.labels).set(len(self.devices))
        subject = subjects.verify(self.backend, self.arch)
        psub = await durable_pull(
            self.bus.js,
            stream=subjects.STREAM_VERIFY,
            subject=subject,
            durable=subjects.verify_consumer(self.backend, self.arch),
            ack_wait_s=self.settings.verify_ack_wait_s,
            # One delivery beyond the limit reaches us so we can dead-letter it.
            max_deliver=self.settings.verify_max_deliver + 1,
        )
        beat = asyncio.create_task(self.heartbeat())
        service = await self.control_service()
        self.log.info("worker_started", subject=subject, devices=self.devices)
        try:
            while not stop.is_set() and not self.draining:
                # Wait for at least one free device before asking for work.
                if self.free.empty():
                    await asyncio.sleep(0.05)
                    continue
                msgs = await fetch_some(psub, self.free.qsize(), timeout=1.0)
                for msg in msgs:
                    device = self.free.get_nowait()
                    task = asyncio.create_task(self.handle(msg, device))
                    self.tasks.add(task)
                    task.add_done_callback(self.tasks.discard)
        finally:
            self.draining = True
            if self.tasks:
                await asyncio.gather(*self.tasks, return_exceptions=True)
            with contextlib.suppress(Exception):
                await service.stop()
            beat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await beat
            with contextlib.suppress(Exception):
                await self.bus.workers.delete(self.worker_id)
            with contextlib.suppress(Exception):
                await psub.unsubscribe()
            await asyncio.to_thread(self.verifier.close)
            self.log.info("worker_stopped")

    async def leases_held(self) -> list[dict]:
        """This worker's entries of the ``leases`` bucket."""
        out = []
        with contextlib.suppress(Exception):
            for key in await self.bus.leases.keys():
                if key.startswith(f"{self.worker_id}."):
                    with contextlib.suppress(Exception):
                        entry = await self.bus.leases.get(key)
                        out.append(msgspec.json.decode(entry.value))
        return out

    async def control_service(self):
        """A ``nats micro`` service (``nats micro ls`` lists it) with two endpoints on
        ``aikg.worker.<worker_id>.{status,drain}``.

        ``status`` answers WorkerInfo plus the leases held; ``drain`` stops taking new
        requests, lets the in-flight ones finish, then stops the worker.
        """
        service = await micro.add_service(
            self.bus.nc, name="aikg-worker", version=_semver(services.__version__),
            description=f"AIKG worker {self.backend}/{self.arch}",
            metadata={"worker_id": self.worker_id, "backend": self.backend, "arch": self.arch},
        )
        prefix = subjects.worker_service(self.worker_id)

        async def status(req: micro.Request) -> None:
            body = msgspec.structs.asdict(self.info())
            body["leases"] = await self.leases_held()
            await req.respond(encode(body))

        async def drain(req: micro.Request) -> None:
            self.draining = True
            self.log.info("worker_draining", in_flight=self.in_flight)
            await req.respond(encode({"worker_id": self.worker_id, "status": "draining",
                                      "in_flight": self.in_flight}))

        await service.add_endpoint(name="status", subject=f"{prefix}.status", handler=status)
        await service.add_endpoint(name="drain", subject=f"{prefix}.drain", handler=drain)
        return service

    async def handle(self, msg, device: str) -> None:
        """Verify one request on ``device``; always frees the device."""
        try:
            await self._handle(msg, device)
        except Exception:  # noqa: BLE001 - one bad run must not stop the consumer
            self.log.exception("verify_handler_failed")
            with contextlib.suppress(Exception):
                await msg.nak(delay=1)
        finally:
            self.free.put_nowait(device)

    async def _handle(self, msg, device: str) -> None:
        try:
            request = decode(msg.data, VerifyRequest)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            reason = f"malformed verify request: {exc}"
            self.log.warning("malformed_request", error=reason, subject=msg.subject)
            DEAD_LETTERED.labels(**self.labels, reason="malformed").inc()
            await dead_letter(self.bus.js, msg, reason)
            job_id = _job_id_of(msg.data)
            if job_id:
                await publish_event(self.bus, JobEvent(job_id=job_id, event="error", message=reason))
            return
        bound = self.log.bind(job_id=request.job_id, request_id=request.request_id,
                              candidate_id=request.candidate_id, device=device)
        if deliveries(msg) > self.settings.verify_max_deliver:
            reason = (f"verify request delivered {deliveries(msg)} times without a verdict "
                      "(the worker running it died or timed out each time)")
            bound.error("max_deliver_exceeded", error=reason)
            DEAD_LETTERED.labels(**self.labels, reason="max_deliver").inc()
            result = self._failure(request, device, "infrastructure", reason)
            await self._publish_result(result)
            await dead_letter(self.bus.js, msg, reason)
            return
        if await self._job_cancelled(request.job_id):
            bound.info("skipped_cancelled_job")
            await msg.ack()
            return
        QUEUE_WAIT.labels(**self.labels).observe(
            max(0.0, (utcnow() - request.created_at).total_seconds()))
        bound.info("verify_started", deliveries=deliveries(msg))
        IN_FLIGHT.labels(**self.labels).inc()
        started = time.monotonic()
        holder: dict[str, VerifyResult] = {}

        async def work() -> None:
            async with self.lease(device, request):
                holder["result"] = await self.verifier.verify(request, device=device)

        try:
            await run_with_progress(msg, max(1.0, self.settings.verify_ack_wait_s / 3), work)
        finally:
            IN_FLIGHT.labels(**self.labels).dec()
        result = holder["result"]
        elapsed = time.monotonic() - started
        VERIFY_SECONDS.labels(**self.labels).observe(elapsed)
        VERIFICATIONS.labels(**self.labels, outcome="passed" if result.passed else "failed",
                             stage=result.stage or "none").inc()
        await self._publish_result(result)
        await msg.ack()
        bound.info("verify_finished", passed=result.passed, stage=result.stage,
                   duration_s=round(elapsed, 3))

    @contextlib.asynccontextmanager
    async def lease(self, device: str, request: VerifyRequest):
        """Hold ``<worker_id>.<device>`` in the ``leases`` bucket while running.

        The bucket's TTL expires a lease whose worker died; we renew it every
        heartbeat period while the run lasts and delete it on release.
        """
        key = f"{self.worker_id}.{device}"
        value = encode({"worker_id": self.worker_id, "device": device, "job_id": request.job_id,
                        "request_id": request.request_id, "since": utcnow()})

        async def renew() -> None:
            while True:
                with contextlib.suppress(Exception):
                    await self.bus.leases.put(key, value)
                await asyncio.sleep(self.settings.worker_heartbeat_s)

        renewer = asyncio.create_task(renew())
        LEASES.labels(**self.labels).inc()
        try:
            yield key
        finally:
            renewer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await renewer
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

    async def _publish_result(self, result: VerifyResult) -> None:
        await self.bus.js.publish(
            subjects.results(result.job_id), encode(result),
            headers={"Nats-Msg-Id": f"result-{result.request_id}"},
        )

    def _failure(self, request: VerifyRequest, device: str, stage: str, error: str) -> VerifyResult:
        return VerifyResult(
            request_id=request.request_id, job_id=request.job_id,
            candidate_id=request.candidate_id, worker_id=self.worker_id, device=device,
            passed=False, stage=stage, error=error,
            interpreted=self.backend == "cpu",
        )


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
    if isinstance(job_id, str) and re.fullmatch(r"[A-Za-z0-9_-]{1,64}", job_id):
        return job_id
    return None


async def run_worker(settings: Settings, stop: asyncio.Event | None = None) -> None:
    """Connect, serve verify requests until ``stop`` is set (or SIGINT/SIGTERM), then exit.

    Raises:
        ConnectionError: NATS is unreachable at start.
    """
    if stop is None:
        stop = asyncio.Event()
        install_signal_handlers(stop)
    start_metrics_server(settings.metrics_port)
    bus = await connect_bus(settings, f"aikg-worker-{settings.worker_id or default_worker_id()}")
    try:
        await Worker(bus, settings).run(stop)
    finally:
        await bus.close()

