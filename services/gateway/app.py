"""The gateway: AIKG's HTTP API (Litestar), in front of NATS.

Routes keep the names of the HTTP AIKG service it replaces (docs/compatibility.md,
``AIKGClient``): ``POST /api/v1/jobs/submit``, ``GET /api/v1/jobs/{job_id}/status``,
``GET /api/v1/workers/status``; and add what it lacked: ``GET /api/v1/jobs`` (list),
``POST /api/v1/jobs/{job_id}/cancel``, ``GET /api/v1/jobs/{job_id}/events`` (SSE),
``GET /api/v1/jobs/{job_id}/kernel``, ``GET /api/v1/kernels`` (every job's kernel with its
verdict and provenance, by cursor: services/gateway/kernels.py). A submission is validated (msgspec schema,
static task check, a live worker for its backend/arch), written to the ``jobs``
bucket and published on ``jobs.submit`` with the job id as ``Nats-Msg-Id``; the
generator does the rest. The gateway holds no state of its own, so any number of
them can run.

Errors are JSON ``{"status_code": ..., "detail": "<what was wrong and what to do>", ...}``;
extra keys (``live``, ``errors``) add what a client needs to act on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import hmac
import os
import re
import signal
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Annotated, Any, NoReturn

import msgspec
import nats.errors
import nats.js.errors
import structlog
import uvicorn
from litestar import Litestar, MediaType, Request, Response, get, post
from litestar.connection import ASGIConnection
from litestar.datastructures import State
from litestar.exceptions import (
    ClientException,
    HTTPException,
    NotAuthorizedException,
    NotFoundException,
    ValidationException,
)
from litestar.handlers.base import BaseRouteHandler
from litestar.openapi import OpenAPIConfig
from litestar.params import FromPath, HeaderParameter, JSONBody, QueryParameter
from litestar.response import ServerSentEvent
from litestar.types import Guard, Message, Scope
from prometheus_client import CONTENT_TYPE_LATEST, Counter, Histogram, generate_latest

from schemas import (
    MAX_SOURCE_BYTES,
    TERMINAL_STATUSES,
    JobEvent,
    JobRecord,
    JobSubmit,
    decode,
    subjects,
    utcnow,
)
from services.common.bus import (
    DUPLICATE_WINDOW_S,
    Bus,
    JobNotFound,
    connect_bus,
    publish_json,
)
from services.common.jobs import (
    CheckedJobStore,
    JobRecordCorrupt,
    TaskError,
    cancel_job,
    check_task_source,
    describe_pairs,
    live_workers,
    new_record,
    pick_arch,
    publish_event,
)
from services.common.queue_metrics import run_queue_metrics
from services.common.runtime import cancel_and_wait
from services.common.settings import Settings
from services.common.tenants import Tenant, TenantTable, load_tenants, tenant_label
from services.gateway import events as job_events
from services.gateway.kernels import kernels_list
from services.gateway.queue import QueueView
from services.gateway.views import (
    JobPage,
    ListStatus,
    WorkerList,
    list_jobs,
    list_workers,
)

log = structlog.get_logger("aikg.gateway")

# Tasks are at most 1 MiB (schemas.MAX_SOURCE_BYTES); a body holds a task and
# optionally an init_code of the same bound, plus JSON escaping: 2 MiB covers real
# submissions and refuses anything larger with 413 before it is read.
REQUEST_MAX_BODY_BYTES = 2 << 20

# On shutdown, open requests (event streams never end by themselves) get this long,
# seconds, before they are cancelled.
SHUTDOWN_GRACE_S = 5.0

# Routes anyone may call, also when AIKG_API_TOKEN is set: probes carry no credentials.
PUBLIC_PATHS = frozenset({"/healthz", "/readyz"})

REQUESTS = Counter(
    "aikg_gateway_requests_total",
    "HTTP requests answered by the gateway, by route template, method and status code.",
    ["route", "method", "status"],
)
JOBS_SUBMITTED = Counter(
    "aikg_gateway_jobs_submitted_total",
    "Jobs accepted by the gateway, by tenant and priority.", ["tenant", "priority"],
)
REJECTIONS = Counter(
    "aikg_gateway_rejections_total",
    "Submissions refused for a tenant limit, by tenant and limit (max_in_flight, "
    "max_jobs_per_hour: 429; max_parallel_num, max_rounds, max_priority: 403).",
    ["tenant", "limit"],
)
SUBMIT_SECONDS = Histogram(
    "aikg_gateway_submit_seconds",
    "Time to accept a job submission (validation, record write, publish), seconds.",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
)


class SubmitResponse(msgspec.Struct, kw_only=True):
    """Answer to a job submission; ``job_id`` is what ``AIKGClient.submit_job`` returns."""

    job_id: str
    status: str
    backend: str
    arch: str | None
    message: str = ""


class Health(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Probe answer; ``reason`` says why the gateway is not ready."""

    status: str
    reason: str = ""


def _bus(state: State) -> Bus:
    """The app's bus, or 503 while it is not connected yet (startup) or any more."""
    bus: Bus | None = state.get("bus")
    if bus is None:
        raise HTTPException(status_code=503, detail="gateway is not connected to NATS yet; retry",
                            headers={"Retry-After": "2"})
    if not bus.nc.is_connected:
        # Reconnecting: answer now rather than after a 10 s request timeout.
        raise HTTPException(status_code=503, detail="gateway lost its NATS connection and is "
                            "reconnecting; retry shortly", headers={"Retry-After": "2"})
    return bus


# --- routes ------------------------------------------------------------------------


# msgspec's error text ends with the field's path: "... - at `$.max_rounds`".
_FIELD_PATH_RE = re.compile(r"^(?P<message>.*) - at `\$\.?(?P<key>[^`]*)`$", re.DOTALL)


async def _strict_submit(request: Request) -> JobSubmit:
    """The body decoded as :class:`JobSubmit` with msgspec's strict rules.

    Litestar converts bodies in msgspec's lax mode (``strict=False``), which turns
    ``"max_rounds": "3"`` into 3; a raw ``nats pub`` on ``jobs.submit`` is decoded
    strictly by the generator (:func:`schemas.decode`), so the HTTP door applies the
    same rule: a number in a string, a float for an integer field or a string for a
    boolean is refused (an integer for a float field is accepted). See msgspec's
    "Strict vs Lax Mode" (https://jcristharif.com/msgspec/usage.html#strict-vs-lax-mode).

    Raises:
        ValidationException: answered 400, the message naming the field
            (``Expected `int`, got `str` - at `$.max_rounds```).
    """
    try:
        return decode(await request.body(), JobSubmit)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        text = str(exc)
        match = _FIELD_PATH_RE.match(text)
        error = ({"message": match["message"], "key": match["key"] or "data", "source": "body"}
                 if match else {"message": text, "key": "data", "source": "body"})
        raise ValidationException(detail=text, extra=[error]) from exc


@post(["/api/v1/jobs/submit", "/api/v1/jobs"], status_code=200, summary="Submit a job")
async def submit_job(data: JSONBody[JobSubmit], request: Request, state: State) -> SubmitResponse:
    """Validate a job, record it as ``pending`` and publish it on ``jobs.submit``.

    The body is decoded strictly (:func:`_strict_submit`): ``"max_rounds": "3"`` is a
    400 naming ``$.max_rounds``, as it is for a raw ``nats pub`` on ``jobs.submit``.
    Answers 400 when the task is not a KernelBench-format task, 409 when no live
    worker offers ``backend``/``arch`` (the body lists the live pairs) or when the
    client-chosen ``job_id`` is already taken by a different job, 503 when the job
    could not be queued (its record is withdrawn). Resubmitting the very same job with
    the same ``job_id`` is idempotent: the answer carries the existing job's status.
    """
    started = time.perf_counter()
    # ``data`` (Litestar's lax conversion) documents the body in the OpenAPI schema and
    # has already refused what even lax rules refuse; the strict decode decides.
    data = await _strict_submit(request)
    bus = _bus(state)
    tenant = _tenant(request, state)
    _check_job_limits(tenant, data)
    try:
        check_task_source(data.task_desc)
    except TaskError as exc:
        raise ClientException(detail=str(exc)) from exc
    except (ValueError, RecursionError, MemoryError) as exc:
        # ast.parse refuses NUL bytes with ValueError on 3.11 and very deep nesting
        # with RecursionError: the task is unusable either way.
        raise ClientException(detail=f"task_desc cannot be parsed as Python: "
                                     f"{exc.__class__.__name__}: {exc}") from exc

    workers = await live_workers(bus)
    arch = pick_arch(workers, data.backend, data.arch)
    if arch is None:
        wanted = f"backend={data.backend}" + (f" arch={data.arch}" if data.arch else "")
        live = describe_pairs(workers)
        raise HTTPException(
            status_code=409,
            detail=f"no live worker for {wanted}; live backend/arch pairs: "
            f"{', '.join(live) or 'none'}. Start one with `aikg worker --backend "
            f"{data.backend}{' --arch ' + data.arch if data.arch else ''}` or submit to a live pair.",
            extra={"live": live},
        )

    record = new_record(data, arch=arch, tenant=tenant.name)
    job_id = record.job_id
    subject = subjects.job_submit(tenant.name, record.priority)
    with structlog.contextvars.bound_contextvars(job_id=job_id, tenant=tenant.name):
        store = CheckedJobStore(bus.jobs)
        async with _tenant_lock(state, tenant.name):
            created = await _create_within_limits(bus, store, tenant, record)
        if not created:
            existing, _ = await store.get(job_id)
            if existing.request != record.request:
                raise HTTPException(
                    status_code=409,
                    detail=f"job id {job_id!r} already exists with a different request; "
                    "choose another job_id or omit it to get a fresh one",
                )
            age_s = (utcnow() - existing.submit_time).total_seconds()
            if existing.status == "pending" and age_s < DUPLICATE_WINDOW_S:
                # Recovers a gateway that died between the record and the publish; the
                # stream drops the copy when the first one made it. Outside the dedupe
                # window a copy would run the job twice, so it is not sent.
                await publish_json(bus.js, subjects.job_submit(existing.tenant, existing.priority),
                                   existing.request, msg_id=job_id)
            log.info("job_resubmitted", status=existing.status)
            return SubmitResponse(job_id=job_id, status=existing.status,
                                  backend=existing.backend, arch=existing.arch,
                                  message="job already submitted")
        # The event goes first so that a job's history starts with it: a generator may
        # pick the job up and report "started" before this handler runs on.
        await publish_event(bus, JobEvent(job_id=job_id, event="submitted", status="pending",
                                          message=f"{record.backend}/{arch}"))
        try:
            await publish_json(bus.js, subject, record.request, msg_id=job_id)
        except Exception as exc:
            await publish_event(bus, JobEvent(job_id=job_id, event="error", status="pending",
                                              message=f"submission withdrawn: {exc}"))
            await _withdraw(bus, job_id, exc, subject)
        await _count_submission(bus, tenant)
        JOBS_SUBMITTED.labels(tenant=tenant_label(tenant.name), priority=record.priority).inc()
        log.info("job_submitted", op_name=record.op_name, backend=record.backend, arch=arch,
                 job_type=record.job_type, workflow=data.workflow, priority=record.priority,
                 subject=subject)
    SUBMIT_SECONDS.observe(time.perf_counter() - started)
    return SubmitResponse(job_id=job_id, status="pending", backend=record.backend, arch=arch)


# --- tenants and their limits ---------------------------------------------------------


def _tenant(request: Request, state: State) -> Tenant:
    """The tenant the auth guard found for this request (``default`` without auth)."""
    table: TenantTable = state.get("tenants")
    name = request.scope.get("aikg_tenant") or subjects.DEFAULT_TENANT  # type: ignore[typeddict-item]
    return table.get(name)


def _refuse(tenant: Tenant, limit: str, status: int, detail: str,
            retry_after_s: float | None = None) -> HTTPException:
    REJECTIONS.labels(tenant=tenant_label(tenant.name), limit=limit).inc()
    log.info("job_rejected", tenant=tenant.name, limit=limit)
    headers = {"Retry-After": str(max(1, int(retry_after_s + 0.999)))} \
        if retry_after_s is not None else None
    return HTTPException(status_code=status, detail=detail, headers=headers,
                         extra={"tenant": tenant.name, "limit": limit})


def _check_job_limits(tenant: Tenant, data: JobSubmit) -> None:
    """Refuse (403) a job larger than the tenant may submit, naming the limit: retrying
    cannot help, so no ``Retry-After``."""
    for limit, value in (("max_parallel_num", data.parallel_num),
                         ("max_rounds", data.max_rounds)):
        bound = getattr(tenant, limit)
        if bound and value > bound:
            raise _refuse(tenant, limit, 403, f"tenant {tenant.name!r} may submit jobs with "
                          f"{limit.removeprefix('max_')} up to {bound} ({limit}); this one "
                          f"asks for {value}: lower it, or ask an operator to raise the limit")
    if not tenant.allows_priority(data.priority):
        raise _refuse(tenant, "max_priority", 403, f"tenant {tenant.name!r} may submit with "
                      f"priority up to {tenant.max_priority!r} (max_priority); this job asks "
                      f"for {data.priority!r}")


def _tenant_lock(state: State, name: str) -> asyncio.Lock:
    """One lock per tenant, so this gateway's limit check and the publish that fills
    the slot are not interleaved with another submission of the same tenant."""
    locks: dict[str, asyncio.Lock] = state.get("tenant_locks")
    return locks.setdefault(name, asyncio.Lock())


def _hour_key(tenant: str, now: dt.datetime) -> tuple[str, float]:
    """``tenant_usage`` key of the current clock hour (UTC), and seconds to its end."""
    end = now.replace(minute=0, second=0, microsecond=0) + dt.timedelta(hours=1)
    return f"{tenant}.{now:%Y%m%d%H}", (end - now).total_seconds()


async def in_flight(bus: Bus, tenant: str) -> int:
    """Jobs of ``tenant`` pending or running: the messages in its JOBS lanes (a job's
    message stays in the work-queue stream until a generator acks it at the end)."""
    info = await bus.js.stream_info(subjects.STREAM_JOBS, subjects_filter=">")
    total = 0
    for subject, count in (info.state.subjects or {}).items():
        lane = subjects.parse_lane(subjects.JOBS_SUBMIT, subject)
        if lane is not None and lane[0] == tenant:
            total += count
    return total


async def _create_within_limits(bus: Bus, store: CheckedJobStore, tenant: Tenant,
                                record: JobRecord) -> bool:
    """Create the job's record unless a tenant limit forbids it.

    Returns:
        False when the job id has a record already (an idempotent resubmit, which no
        limit stops).

    Raises:
        HTTPException: 429 with ``Retry-After`` over ``max_in_flight`` or
            ``max_jobs_per_hour``.
    """
    if record.request.job_id:
        with contextlib.suppress(JobNotFound, JobRecordCorrupt):
            await store.get(record.job_id)
            return False
    if tenant.max_in_flight:
        busy = await in_flight(bus, tenant.name)
        if busy >= tenant.max_in_flight:
            raise _refuse(tenant, "max_in_flight", 429, f"tenant {tenant.name!r} has {busy} "
                          f"jobs pending or running, its limit (max_in_flight) is "
                          f"{tenant.max_in_flight}: retry when one has ended, or cancel one",
                          retry_after_s=5)
    if tenant.max_jobs_per_hour and bus.tenant_usage is not None:
        key, left_s = _hour_key(tenant.name, utcnow())
        with contextlib.suppress(nats.js.errors.KeyNotFoundError):
            entry = await bus.tenant_usage.get(key)
            used = int(entry.value or b"0")
            if used >= tenant.max_jobs_per_hour:
                raise _refuse(tenant, "max_jobs_per_hour", 429, f"tenant {tenant.name!r} has "
                              f"submitted {used} jobs this hour (UTC), its limit "
                              f"(max_jobs_per_hour) is {tenant.max_jobs_per_hour}: retry "
                              f"after {left_s:.0f} s", retry_after_s=left_s)
    return await store.create(record)


async def _count_submission(bus: Bus, tenant: Tenant) -> None:
    """Add one to the tenant's count of this hour (compare-and-swap; best effort)."""
    if not tenant.max_jobs_per_hour or bus.tenant_usage is None:
        return
    kv = bus.tenant_usage
    key, _ = _hour_key(tenant.name, utcnow())
    for _ in range(20):
        try:
            try:
                entry = await kv.get(key)
            except nats.js.errors.KeyNotFoundError:
                await kv.create(key, b"1")
                return
            await kv.update(key, str(int(entry.value or b"0") + 1).encode(),
                            last=entry.revision)
            return
        except nats.js.errors.KeyWrongLastSequenceError:
            await asyncio.sleep(0.01)
        except Exception as exc:  # noqa: BLE001 - the job is queued; the count is bookkeeping
            log.warning("tenant_usage_update_failed", tenant=tenant.name, error=str(exc))
            return


async def _withdraw(bus: Bus, job_id: str, exc: Exception,
                    subject: str = subjects.JOBS_SUBMIT) -> NoReturn:
    """The record is written but its submit message could not be published: remove the
    record (so nothing waits on a job no generator will see) and answer 503, so the
    client retries; the same ``job_id`` is free again."""
    reason = f"could not queue the job on {subject}: {exc.__class__.__name__} {exc}"
    log.error("job_publish_failed", error=reason)
    with contextlib.suppress(Exception):
        await bus.jobs.delete(job_id)
    raise HTTPException(status_code=503, detail=f"{reason}; NATS may be down, retry shortly")


def _unknown_job(job_id: str) -> NotFoundException:
    return NotFoundException(
        detail=f"no job with id {job_id!r}: it was never submitted here, or its record was "
        "removed (job ids are letters, digits, '_' and '-'; `GET /api/v1/jobs` lists them)"
    )


# NATS failures a request can meet (server gone, reconnecting, slow): answered 503.
# JetStream's answers while a stream or consumer has no leader.
_JS_TROUBLE = (nats.js.errors.NoStreamResponseError, nats.js.errors.ServiceUnavailableError)
_NATS_TROUBLE = (nats.errors.TimeoutError, nats.errors.ConnectionClosedError,
                 nats.errors.NoRespondersError, nats.errors.StaleConnectionError, TimeoutError)


def _nats_unavailable(exc: Exception, what: str) -> HTTPException:
    return HTTPException(status_code=503, detail=f"cannot {what}: NATS did not answer "
                         f"({exc.__class__.__name__}); retry shortly")


async def _record(state: State, job_id: str) -> JobRecord:
    """The job's record, or 404 (also for ids no job can have), or 503.

    Raises:
        JobRecordCorrupt: the record does not decode; answered 500 naming the job and
            the fault (:func:`_corrupt_record_response`).
    """
    if not subjects.is_token(job_id):
        raise _unknown_job(job_id)
    try:
        record, _ = await CheckedJobStore(_bus(state).jobs).get(job_id)
    except JobNotFound as exc:
        raise _unknown_job(job_id) from exc
    except _NATS_TROUBLE as exc:
        raise _nats_unavailable(exc, "read the job record") from exc
    return record


@get(["/api/v1/jobs/{job_id:str}/status", "/api/v1/jobs/{job_id:str}"], summary="Job status")
async def job_status(job_id: FromPath[str], state: State) -> JobRecord:
    """The job record: status, progress, result (kernel source and verdict), error;
    while the job waits, its ``queue_position`` (1: next to start) and
    ``estimated_start_time`` (services/gateway/queue.py), null otherwise."""
    record = await _record(state, job_id)
    if record.status == "pending":
        record.queue_position, record.estimated_start_time = await _estimate(state, job_id)
    return record


async def _estimate(state: State, job_id: str) -> tuple[int | None, dt.datetime | None]:
    """Queue position and estimated start of a waiting job; ``(None, None)`` when the
    stream cannot be read (the status itself must not fail for it)."""
    view: QueueView | None = state.get("queue")
    if view is None:
        return None, None
    try:
        return await view.estimate(job_id)
    except Exception as exc:  # noqa: BLE001 - a position is a hint
        log.warning("queue_position_failed", job_id=job_id, error=f"{type(exc).__name__}: {exc}")
        return None, None


# Largest page of GET /api/v1/jobs: a page of summaries stays well under a megabyte.
MAX_PAGE = 500


@get("/api/v1/jobs", summary="List jobs")
async def jobs_list(
    state: State,
    status: Annotated[ListStatus | None, QueryParameter(
        description="Only jobs with this status; `corrupt`: records that do not "
        "decode.")] = None,
    op_name: Annotated[str | None, QueryParameter(
        max_length=128, description="Only jobs of this operator (exact).")] = None,
    tenant: Annotated[str | None, QueryParameter(
        max_length=32, description="Only jobs of this tenant.")] = None,
    limit: Annotated[int, QueryParameter(ge=1, le=MAX_PAGE, description="Page size.")] = 50,
    offset: Annotated[int, QueryParameter(
        ge=0, description="Jobs to skip (newest first).")] = 0,
) -> JobPage:
    """Job summaries, newest submission first, filtered by ``status``, ``op_name`` and
    ``tenant``; ``total`` counts every match, so ``offset`` + ``limit`` page through
    them. Waiting jobs carry their ``queue_position`` and ``estimated_start_time``."""
    try:
        page = await list_jobs(_bus(state), status=status, op_name=op_name, limit=limit,
                               offset=offset, tenant=tenant)
    except _NATS_TROUBLE as exc:
        raise _nats_unavailable(exc, "read the jobs bucket") from exc
    for row in page.jobs:
        if row.status == "pending":
            row.queue_position, row.estimated_start_time = await _estimate(state, row.job_id)
    return page


@post("/api/v1/jobs/{job_id:str}/cancel", status_code=200, summary="Cancel a job")
async def job_cancel(job_id: FromPath[str], state: State) -> JobRecord:
    """Mark the job ``cancelled`` and publish its ``cancelled`` event; the generator stops
    its work and workers skip its pending verify requests. Idempotent: a job that has
    already ended is returned unchanged (its ``status`` says how it ended)."""
    await _record(state, job_id)
    try:
        record = await cancel_job(_bus(state), job_id)
    except JobNotFound as exc:
        raise _unknown_job(job_id) from exc
    except _NATS_TROUBLE as exc:
        raise _nats_unavailable(exc, "update the job record") from exc
    log.info("job_cancel_requested", job_id=job_id, status=record.status)
    return record


@get("/api/v1/jobs/{job_id:str}/kernel", summary="Best kernel source",
     media_type="text/x-python")
async def job_kernel(job_id: FromPath[str], state: State) -> Response[str]:
    """The job's kernel source (``text/x-python``): the passing candidate of a completed
    job, or the last candidate tried of a failed one. Headers ``X-AIKG-Passed`` and
    ``X-AIKG-Candidate-Id`` say which. 404 while the job has no kernel yet."""
    record = await _record(state, job_id)
    result = record.result
    if result is None or not result.code:
        raise NotFoundException(
            detail=f"job {job_id!r} has no kernel yet (status {record.status}); it has one "
            "once it has ended with a candidate")
    headers = {
        "X-AIKG-Passed": "true" if result.passed else "false",
        "X-AIKG-Candidate-Id": result.candidate_id or "",
        "Content-Disposition": f'inline; filename="{record.op_name}_kernel.py"',
    }
    return Response(result.code, media_type="text/x-python", headers=headers)


@get("/api/v1/jobs/{job_id:str}/events", summary="Job events (Server-Sent Events)",
     media_type="text/event-stream")
async def job_events_stream(
    job_id: FromPath[str],
    state: State,
    last_event_id: Annotated[str | None, HeaderParameter(
        name="Last-Event-ID", required=False,
        description="Resume after this event id (a JOB_EVENTS stream sequence).")] = None,
) -> ServerSentEvent:
    """The job's events as ``text/event-stream``: its whole history, then live, ending
    after the terminal event (``completed``, ``failed``, ``cancelled``). ``event:`` is
    the event kind, ``data:`` the JobEvent JSON, ``id:`` its stream sequence. A comment
    line goes out every 15 s while idle."""
    after = 0
    if last_event_id:
        try:
            after = int(last_event_id)
        except ValueError:
            raise ClientException(detail=f"Last-Event-ID must be an event id (an integer) "
                                  f"sent by this route, not {last_event_id[:40]!r}") from None
        if after < 0:
            raise ClientException(detail="Last-Event-ID must not be negative")
    record = await _record(state, job_id)
    bus = _bus(state)
    try:
        sub = await job_events.open_event_subscription(bus, job_id, after)
    except Exception as exc:  # noqa: BLE001 - NATS trouble: the client may retry
        raise HTTPException(status_code=503, detail=f"cannot read the job's events from "
                            f"{subjects.STREAM_JOB_EVENTS}: {exc.__class__.__name__} {exc}; "
                            "retry shortly") from exc
    return ServerSentEvent(job_events.job_event_stream(
        bus, job_id, sub, ended=record.status in TERMINAL_STATUSES,
        queue=state.get("queue") if record.status == "pending" else None))


@get(["/api/v1/workers/status", "/api/v1/workers"], summary="Live workers")
async def workers_status(state: State) -> WorkerList:
    """Workers whose heartbeat is live: backend, arch, devices, capacity, in-flight,
    load (in_flight / capacity) and the device leases each holds."""
    try:
        return await list_workers(_bus(state))
    except _NATS_TROUBLE as exc:
        raise _nats_unavailable(exc, "read the workers bucket") from exc


@get("/healthz", summary="Liveness", include_in_schema=True)
async def healthz() -> Health:
    """Always 200 while the process serves HTTP."""
    return Health(status="ok")


@get("/readyz", summary="Readiness")
async def readyz(state: State) -> Response[Health]:
    """200 when NATS is connected and every stream exists; 503 with the reason otherwise."""
    bus: Bus | None = state.get("bus")
    reason = ""
    if bus is None:
        reason = "not connected to NATS yet"
    elif not bus.nc.is_connected:
        reason = f"NATS connection is {'closed' if bus.nc.is_closed else 'down (reconnecting)'}"
    else:
        for name in (subjects.STREAM_JOBS, subjects.STREAM_JOB_EVENTS, subjects.STREAM_VERIFY,
                     subjects.STREAM_RESULTS, subjects.STREAM_DLQ):
            try:
                await asyncio.wait_for(bus.js.stream_info(name), timeout=2.0)
            except Exception as exc:  # noqa: BLE001 - any failure means not ready
                reason = f"stream {name} unavailable: {exc.__class__.__name__} {exc}".strip()
                break
    if reason:
        return Response(Health(status="unavailable", reason=reason), status_code=503)
    return Response(Health(status="ok"), status_code=200)


@get("/metrics", summary="Prometheus metrics", media_type=MediaType.TEXT)
async def metrics() -> Response[bytes]:
    """The process's default Prometheus registry, text exposition format."""
    return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)


# --- cross-cutting -----------------------------------------------------------------


def _token_matches(header: str, expected: bytes) -> bool:
    """Whether an ``Authorization`` header value equals ``expected``, in time that does
    not depend on where they differ (:func:`hmac.compare_digest`, Python's documented
    defence against timing attacks on secrets). Header values arrive latin-1 decoded
    (ASGI), so any text encodes; a wrong length is refused like a wrong byte."""
    return hmac.compare_digest(header.encode("utf-8", "surrogateescape"), expected)


def _auth_guard(tenants: TenantTable) -> Guard:
    """A guard that wants ``Authorization: Bearer <token>`` of some tenant outside
    :data:`PUBLIC_PATHS`, and records that tenant for the route (``aikg_tenant`` in the
    ASGI scope).

    The token is compared by its SHA-256 against every tenant's, in constant time
    (:meth:`~services.common.tenants.TenantTable.authenticate`): a wrong token of any
    length gets 401 after the same work.
    """

    async def guard(connection: ASGIConnection, _: BaseRouteHandler) -> None:
        if connection.scope["path"] in PUBLIC_PATHS:
            return
        tenant = tenants.authenticate(connection.headers.get("authorization", ""))
        if tenant is None:
            raise NotAuthorizedException(
                detail="missing or wrong API token: send `Authorization: Bearer <token>` "
                "(the gateway's AIKG_API_TOKEN, or a tenant's token from AIKG_TENANTS_FILE)"
            )
        connection.scope["aikg_tenant"] = tenant.name  # type: ignore[typeddict-unknown-key]

    return guard


def _validation_detail(exc: ValidationException) -> str:
    """msgspec's own wording for a body error: ``Expected `int` >= 1 - at `$.max_rounds```."""
    parts = []
    for err in exc.extra if isinstance(exc.extra, list) else []:
        message = err.get("message", "") if isinstance(err, dict) else str(err)
        key = err.get("key") if isinstance(err, dict) else None
        if key and key != "data":
            message += f" - at `$.{key}`"
        parts.append(message)
    return "invalid request: " + ("; ".join(parts) if parts else exc.detail)


def _corrupt_record_response(exc: JobRecordCorrupt) -> Response[dict[str, Any]]:
    """500 for a job whose record in the ``jobs`` bucket does not decode.

    The body names the job and the decoder's fault: ``{"status_code": 500, "detail":
    "job record <id> is corrupt: <fault>; ...", "job_id": ..., "fault": ...}``.

    Why 500: the fault is in the state the service keeps, not in the request. A 4xx
    (409, 422) would tell the client that another request could succeed, and none can;
    a 503 would invite retries that meet the same bytes. What helps is an operator
    removing or restoring the record, which the detail says how to do; a generator
    that picks the job up replaces the record with a ``failed`` one naming the fault.
    """
    log.warning("job_record_corrupt", job_id=exc.job_id, fault=exc.fault)
    detail = (f"{exc}; the stored record cannot be read, so the job's state is unknown. "
              f"An operator can remove it with `nats kv del {subjects.BUCKET_JOBS} "
              f"{exc.job_id}`; a generator running the job fails it with this reason")
    return Response({"status_code": 500, "detail": detail, "job_id": exc.job_id,
                     "fault": exc.fault}, status_code=500)


def _error_response(request: Request, exc: Exception) -> Response[dict[str, Any]]:
    """One JSON error shape for every handled error: status_code, detail, extra keys."""
    if isinstance(exc, JobRecordCorrupt):
        return _corrupt_record_response(exc)
    if isinstance(exc, ValidationException):
        body: dict[str, Any] = {"status_code": 400, "detail": _validation_detail(exc)}
        if exc.extra:
            body["errors"] = exc.extra
        return Response(body, status_code=400)
    if isinstance(exc, HTTPException):
        detail = exc.detail
        if exc.status_code == 413:
            detail = (f"request body is over {REQUEST_MAX_BODY_BYTES} bytes; a task_desc may "
                      f"be at most {MAX_SOURCE_BYTES} bytes")
        body = {"status_code": exc.status_code, "detail": detail}
        if isinstance(exc.extra, dict):
            body.update(exc.extra)
        elif exc.extra:
            body["errors"] = exc.extra
        return Response(body, status_code=exc.status_code, headers=exc.headers)
    if isinstance(exc, _NATS_TROUBLE + _JS_TROUBLE):
        # Met outside the routes' own handling, e.g. while a cluster node fails over:
        # the client's retry will likely succeed, so say so instead of a 500.
        log.warning("nats_unavailable", path=request.url.path, error=exc.__class__.__name__)
        return Response({"status_code": 503, "detail": "NATS did not answer in time (a "
                         "cluster node may be failing over); retry shortly"},
                        status_code=503, headers={"Retry-After": "2"})
    log.exception("unhandled_error", path=request.url.path)
    return Response({"status_code": 500, "detail": f"internal error: {exc.__class__.__name__}"},
                    status_code=500)


async def _count_response(message: Message, scope: Scope) -> None:
    """Count each response by route template (never the raw path: it holds ids)."""
    if message["type"] == "http.response.start":
        route = scope.get("path_template") or "unmatched"
        REQUESTS.labels(route=route, method=scope.get("method", ""),
                        status=str(message["status"])).inc()


def create_app(settings: Settings, bus: Bus | None = None) -> Litestar:
    """Build the gateway's Litestar app.

    Args:
        settings: ``api_token`` and ``tenants_file`` turn on bearer auth (all routes but
            ``/healthz`` and ``/readyz``) and name the tenants and their limits;
            ``nats_url`` is used when ``bus`` is None.
        bus: an open bus to use (the caller closes it); None connects one at startup
            and closes it at shutdown.

    Raises:
        ValueError: the tenants file or limits are unusable (the message says why).

    Returns:
        The app; OpenAPI is served under ``/schema`` (``/schema/openapi.json``).
    """

    tenants = load_tenants(settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        if bus is not None:
            app.state.bus = bus
            app.state.queue = QueueView(bus)
            yield
            return
        own = await connect_bus(settings, "gateway", role="gateway")
        app.state.bus = own
        app.state.queue = QueueView(own)
        try:
            yield
        finally:
            app.state.bus = None
            app.state.queue = None
            await own.close()

    return Litestar(
        route_handlers=[submit_job, jobs_list, job_status, job_cancel, job_kernel,
                        job_events_stream, workers_status, kernels_list, healthz, readyz,
                        metrics],
        lifespan=[lifespan],
        guards=[_auth_guard(tenants)] if tenants.auth else [],
        exception_handlers={Exception: _error_response},
        before_send=[_count_response],
        request_max_body_size=REQUEST_MAX_BODY_BYTES,
        openapi_config=OpenAPIConfig(title="AIKG gateway", version="1",
                                     description="Submit, list, follow and cancel jobs; "
                                     "read their kernels; list workers."),
        state=State({"bus": bus, "queue": QueueView(bus) if bus is not None else None,
                     "tenants": tenants, "tenant_locks": {}}),
        logging_config=None,
    )


class _Server(uvicorn.Server):
    """uvicorn without its own signal capture: :func:`serve_gateway` owns shutdown."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (IPv4 or IPv6 by the address).

    Bound here rather than by uvicorn, whose bind failure is a ``sys.exit`` inside a task.

    Raises:
        OSError: the address is in use or cannot be bound; the message names it.
    """
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    try:
        return socket.create_server((host, port), family=family, backlog=2048)
    except OSError as exc:
        reason = os.strerror(exc.errno) if exc.errno else str(exc)
        raise OSError(f"gateway cannot listen on {host}:{port}: {reason}") from exc


async def serve_gateway(settings: Settings, stop: asyncio.Event | None = None) -> None:
    """Serve the gateway on ``settings.gateway_host:gateway_port`` until told to stop.

    Binds the port and connects to NATS first, so a port in use or a wrong URL fails
    here with its message; then serves until ``stop`` is set or, when running in the
    main thread, the process gets SIGINT/SIGTERM; then finishes open requests and
    closes the connection.

    Raises:
        OSError: the port cannot be bound.
        ConnectionError: NATS is not reachable at ``settings.nats_url``.
    """
    stop = stop or asyncio.Event()
    sock = _listen(settings.gateway_host, settings.gateway_port)
    try:
        bus = await connect_bus(settings, "gateway", role="gateway")
    except BaseException:
        sock.close()
        raise
    app = create_app(settings, bus)
    server = _Server(uvicorn.Config(app, log_config=None,
                                    access_log=False, lifespan="on",
                                    timeout_graceful_shutdown=SHUTDOWN_GRACE_S))
    loop = asyncio.get_running_loop()
    installed: list[tuple[int, Any]] = []
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            installed.append((sig, signal.getsignal(sig)))
            loop.add_signal_handler(sig, stop.set)
    serving = asyncio.create_task(server.serve(sockets=[sock]), name="gateway-uvicorn")
    queue_metrics = asyncio.create_task(run_queue_metrics(bus), name="gateway-queue-metrics")
    # Throughput samples for the estimated start times, also while nobody asks.
    sampler = asyncio.create_task(app.state.queue.run_sampler(), name="gateway-queue-sampler")
    stopping = asyncio.create_task(stop.wait(), name="gateway-stop")
    host, port = sock.getsockname()[:2]
    log.info("gateway_listening", url=f"http://{host}:{port}", nats_url=settings.nats_url,
             auth=bool(settings.api_token or settings.tenants_file))
    try:
        await asyncio.wait({serving, stopping}, return_when=asyncio.FIRST_COMPLETED)
        server.should_exit = True
        # uvicorn bounds open connections by its grace, not the app's own shutdown.
        await asyncio.wait({serving}, timeout=SHUTDOWN_GRACE_S + 1)
        if serving.done():
            await serving
    finally:
        stopping.cancel()
        await cancel_and_wait(queue_metrics, sampler)
        if not serving.done():
            # Cancelled while uvicorn was still shutting down: give it its grace once
            # more, bounded, then cancel it, so a stuck request cannot keep the gateway
            # (and whoever awaits it) from stopping.
            server.should_exit = True
            await asyncio.wait({serving}, timeout=SHUTDOWN_GRACE_S + 1)
            serving.cancel()
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await serving
        for sig, previous in installed:
            loop.remove_signal_handler(sig)
            signal.signal(sig, previous)
        sock.close()
        await bus.close()
        log.info("gateway_stopped")
