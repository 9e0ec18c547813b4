"""The verify requests of one worker: each one leased, claimed, run by the verifier,
answered and acked.

:class:`Requests` is what the worker's pull loop (services/common/pull_loop.py) calls
for each decoded request (:meth:`Requests.handle`) and for each it dead-letters
(:meth:`Requests.dead_lettered`). One request: its tenant checked against the tenants
file (an unknown tenant's request gets a failed ``infrastructure`` verdict, unrun);
its device leased in the ``leases`` bucket (``<worker_id>.<device>``, renewed every
heartbeat period while the run lasts) while its job's record is read (a cancelled
job's request is acked unrun); this worker's :class:`~schemas.VerifyClaim` published
on ``results.<job_id>.<worker_id>.claim``; the candidate verified (a
:class:`VerifyRunner`, the worker's :class:`services.worker.verifier.Verifier`);
its phases published as they happen as ``verify_phase`` events of its job, rate
limited (services/worker/progress.py); the :class:`~schemas.VerifyResult` published
on ``results.<job_id>.<worker_id>`` with its proof; then the ack. The ack comes only
after the verdict is stored, so a worker that dies mid-run leaves its request to
JetStream's redelivery.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import functools
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

import msgspec
import structlog
from nats.aio.msg import Msg
from prometheus_client import Counter, Gauge, Histogram

from schemas import JobEvent, VerifyClaim, VerifyRequest, VerifyResult, encode, subjects, utcnow
from schemas.events import Stage, VerifyPhase, phase_label
from services.common.bus import Bus, JobNotFound, JobStore
from services.common.jobs import publish_event
from services.common.pull_loop import PullLoop, deliveries
from services.common.runtime import cancel_and_wait, retry_async
from services.common.settings import Settings
from services.common.tenants import TenantTable, tenant_label
from services.common.verdicts import proof
from services.sandbox.pool import Sandbox
from services.worker.cache import SharedCache
from services.worker.progress import PhaseEvents, PhaseObserver

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

# Attempts at each publish that ends a request (its result, its DLQ copy) before the
# handler gives up and leaves the message to JetStream's redelivery.
FINAL_PUBLISH_ATTEMPTS = 3


class VerifyRunner(Protocol):
    """What a worker needs of its verifier: :class:`services.worker.verifier.Verifier`,
    or a stand-in with the same members (a test's lent verifier, a bench's simulated
    device)."""

    shared_cache: SharedCache | None

    @property
    def sandbox(self) -> Sandbox: ...

    @property
    def sandbox_notes(self) -> list[str]: ...

    def start(self) -> None:
        """Start the sandbox (blocks for seconds; call it from a thread)."""
        ...

    def close(self) -> None:
        """Stop the sandbox and every child."""
        ...

    async def verify(self, request: VerifyRequest, *, device: str,
                     on_phase: PhaseObserver | None = None) -> VerifyResult:
        """The verdict on ``request`` run on ``device``, each phase told to
        ``on_phase`` as it happens; never raises for what the candidate or the task
        does."""
        ...


class Requests:
    """The request handling of one worker.

    Args:
        bus: the worker's connected bus (results, claims, leases, job records).
        settings: the heartbeat period (lease renewals) and the tenants file's name.
        verifier: runs each request.
        worker_id / backend / arch: the worker.
        tenants: the tenants file's table (refusals, timeout caps).
        free: the worker's free devices; a device taken for a request goes back here
            (and ``freed`` is set) as soon as its verification ends.
        logger: structlog logger with the worker's ids bound.

    Attributes:
        loop: the worker's pull loop once open (the lane a message came in on names
            its tenant).
    """

    def __init__(self, bus: Bus, settings: Settings, verifier: VerifyRunner, *,
                 worker_id: str, backend: str, arch: str, tenants: TenantTable,
                 free: asyncio.Queue[str], freed: asyncio.Event, logger: Any) -> None:
        self.bus = bus
        self.settings = settings
        self.verifier = verifier
        self.worker_id = worker_id
        self.backend = backend
        self.arch = arch
        self.tenants = tenants
        self.free = free
        self.freed = freed
        self.log = logger
        self.jobs = JobStore(bus.jobs)
        self.labels = {"backend": backend, "arch": arch}
        self.loop: PullLoop | None = None

    async def handle(self, msg: Msg, request: VerifyRequest,
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

    async def _handle_request(self, msg: Msg, request: VerifyRequest, device: str,
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
            job_status, _ = await asyncio.gather(
                self._job_status(request.job_id),
                held.enter_async_context(self.lease(device, request)))
            lease_s = time.monotonic() - leasing
            if job_status == "cancelled":
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
            # A job's phases go on its events subject, sent before its verdict; a
            # request without a job record (RemoteWorker, a batch) has no events.
            on_phase = None
            if job_status is not None:
                phases = await held.enter_async_context(
                    PhaseEvents(functools.partial(self._publish_phase, request)))
                on_phase = phases.report
            IN_FLIGHT.labels(**self.labels).inc()
            started = time.monotonic()
            try:
                result: VerifyResult = await self.verifier.verify(request, device=device,
                                                                  on_phase=on_phase)
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

    async def dead_lettered(self, msg: Msg, request: VerifyRequest | None, reason: str,
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
    async def lease(self, device: str, request: VerifyRequest) -> AsyncIterator[str]:
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

    async def _job_status(self, job_id: str) -> str | None:
        """The status of the request's job; None without a record (worker-only mode:
        RemoteWorker requests and batches have none) or when it cannot be read."""
        try:
            record, _ = await self.jobs.get(job_id)
        except JobNotFound:
            return None
        except Exception:  # noqa: BLE001 - a KV hiccup must not drop the request
            return None
        return record.status

    async def _publish_phase(self, request: VerifyRequest, phase: VerifyPhase) -> None:
        """A ``verify_phase`` event of ``request`` on its job's events subject
        (services/worker/progress.py; shown, never trusted)."""
        await publish_event(self.bus, JobEvent(
            job_id=request.job_id, event="verify_phase", message=phase.label,
            request_id=request.request_id, candidate_id=request.candidate_id,
            phase=phase))

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

    def _failure(self, request: VerifyRequest, device: str, stage: Stage,
                 error: str) -> VerifyResult:
        return VerifyResult(
            request_id=request.request_id, job_id=request.job_id,
            candidate_id=request.candidate_id, worker_id=self.worker_id, device=device,
            passed=False, stage=stage, error=error,
            interpreted=self.backend == "cpu",
        )


def _stored_wait(msg: Msg, request: VerifyRequest, received: float) -> dict[str, float]:
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
