"""``/api/v1/jobs``: submit, list, read, cancel and follow jobs, and read a job's kernel.

Routes keep the names of the HTTP AIKG service it replaces (docs/compatibility.md,
``AIKGClient``): ``POST /api/v1/jobs/submit`` and ``GET /api/v1/jobs/{job_id}/status``;
and add ``GET /api/v1/jobs`` (list), ``POST /api/v1/jobs/{job_id}/cancel``,
``GET /api/v1/jobs/{job_id}/events`` (SSE, services/gateway/events.py) and
``GET /api/v1/jobs/{job_id}/kernel``. A submission is validated (msgspec schema, tenant
limits, static task check, a live worker for its backend/arch), written to the ``jobs``
bucket and published on its ``jobs.submit`` lane with the job id as ``Nats-Msg-Id``
(services/gateway/queuing.py); the generator does the rest. What every route takes
from a request (strict bodies, the task check, ``Last-Event-ID``) is
services/gateway/inputs.py.

The bus, the job store, the queue view and the tenant are dependencies
(services/gateway/deps.py); NATS trouble is answered 503 by the app's exception handler
(services/gateway/errors.py), so the routes do not catch it.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import time
from typing import Annotated, NoReturn

import msgspec
import structlog
from litestar import Request, Response, Router, get, post
from litestar.datastructures import State
from litestar.di import NamedDependency, Provide
from litestar.exceptions import HTTPException, NotFoundException
from litestar.params import FromPath, HeaderParameter, JSONBody, QueryParameter
from litestar.response import ServerSentEvent
from prometheus_client import Counter, Histogram

from schemas import (
    TERMINAL_STATUSES,
    JobEvent,
    JobRecord,
    JobSubmit,
    subjects,
    utcnow,
)
from services.common.bus import DUPLICATE_WINDOW_S, Bus, JobNotFound
from services.common.jobs import (
    CheckedJobStore,
    cancel_job,
    describe_pairs,
    live_arch,
    new_record,
    publish_event,
)
from services.common.tenants import Tenant, tenant_label
from services.gateway import events as job_events
from services.gateway import queuing
from services.gateway.deps import load_record, provide_tenant
from services.gateway.errors import unknown_job
from services.gateway.inputs import check_submit_body, check_task, resume_after
from services.gateway.limits import Claim, check_job_limits, claim, tenant_lock
from services.gateway.queue import QueueView
from services.gateway.views import JobPage, ListStatus, list_jobs

log = structlog.get_logger("aikg.gateway")

JOBS_SUBMITTED = Counter(
    "aikg_gateway_jobs_submitted_total",
    "Jobs accepted by the gateway, by tenant and priority.", ["tenant", "priority"],
)
SUBMIT_SECONDS = Histogram(
    "aikg_gateway_submit_seconds",
    "Time to accept a job submission (validation, record write, publish), seconds.",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
)

# Largest page of GET /api/v1/jobs: a page of summaries stays well under a megabyte.
MAX_PAGE = 500

class SubmitResponse(msgspec.Struct, kw_only=True):
    """Answer to a job submission; ``job_id`` is what ``AIKGClient.submit_job`` returns."""

    job_id: str
    status: str
    backend: str
    arch: str | None
    message: str = ""


async def routed_arch(bus: Bus, backend: str, arch: str | None) -> str:
    """The arch a submission of ``backend`` (and ``arch``, when given) goes to: the
    least loaded live one (:func:`~services.common.jobs.live_arch`).

    Raises:
        HTTPException: 409 when no live worker offers it; ``live`` lists the live pairs.
    """
    chosen, workers = await live_arch(bus, backend, arch)
    if chosen is not None:
        return chosen
    wanted = f"backend={backend}" + (f" arch={arch}" if arch else "")
    live = describe_pairs(workers)
    raise HTTPException(
        status_code=409,
        detail=f"no live worker for {wanted}; live backend/arch pairs: "
        f"{', '.join(live) or 'none'}. Start one with `aikg worker --backend "
        f"{backend}{' --arch ' + arch if arch else ''}` or submit to a live pair.",
        extra={"live": live},
    )


async def _withdraw(bus: Bus, job_id: str, exc: Exception, subject: str,
                    held: Claim) -> NoReturn:
    """The record is written but its submit message is known not to be in the stream:
    remove the record (so nothing waits on a job no generator will see), give the
    tenant's slot back and answer 503, so the client retries; the same ``job_id`` is
    free again."""
    reason = f"could not queue the job on {subject}: {exc}"
    log.error("job_publish_failed", error=reason)
    with contextlib.suppress(Exception):
        await bus.jobs.delete(job_id)
    await held.withdraw()
    raise HTTPException(status_code=503, detail=f"{reason}; NATS may be down, retry shortly")


async def _existing(store: CheckedJobStore, job_id: str) -> JobRecord | None:
    """The record of ``job_id``, or None when there is none.

    Raises:
        JobRecordCorrupt: the record does not decode; answered 500 naming the job and
            the fault, as on every route.
    """
    try:
        return (await store.get(job_id))[0]
    except JobNotFound:
        return None


async def _resubmitted(bus: Bus, tenant: Tenant, record: JobRecord,
                       existing: JobRecord) -> SubmitResponse:
    """Answer a submission whose ``job_id`` has a record already.

    The very same request of the same tenant is idempotent: the answer carries the
    job's status, and a job still ``pending`` within the stream's duplicate window is
    published again (recovering a gateway that died between the record and the
    publish; the stream drops the copy when the first one made it; outside the window
    a copy would run the job twice, so it is not sent). Anything else, and any other
    tenant's job whatever its request, is 409 with nothing about that job: another
    tenant learns neither its status nor that the request matched.

    Raises:
        HTTPException: 409.
    """
    if existing.tenant != tenant.name or existing.request != record.request:
        raise HTTPException(
            status_code=409,
            detail=f"job id {record.job_id!r} is taken; choose another job_id or omit it "
            "to get a fresh one")
    age_s = (utcnow() - existing.submit_time).total_seconds()
    if existing.status == "pending" and age_s < DUPLICATE_WINDOW_S - queuing.REQUEUE_MARGIN_S:
        try:
            await queuing.queue_job(
                bus, subjects.job_submit(existing.tenant, existing.priority),
                existing.request, record.job_id,
                within_s=min(queuing.QUEUE_RETRY_S,
                             DUPLICATE_WINDOW_S - queuing.REQUEUE_MARGIN_S - age_s))
        except queuing.Unqueued as exc:
            raise HTTPException(
                status_code=503, detail=f"job {record.job_id!r} is recorded but could not "
                f"be queued again: {exc}; NATS may be down, retry shortly") from exc
    log.info("job_resubmitted", status=existing.status)
    return SubmitResponse(job_id=record.job_id, status=existing.status,
                          backend=existing.backend, arch=existing.arch,
                          message="job already submitted")


async def _estimate(queue: QueueView | None,
                    job_id: str) -> tuple[int | None, dt.datetime | None]:
    """Queue position and estimated start of a waiting job; ``(None, None)`` when the
    stream cannot be read (the status itself must not fail for it)."""
    if queue is None:
        return None, None
    try:
        return await queue.estimate(job_id)
    except Exception as exc:  # noqa: BLE001 - a position is a hint
        log.warning("queue_position_failed", job_id=job_id, error=f"{type(exc).__name__}: {exc}")
        return None, None


@post(["/submit", "/"], status_code=200, summary="Submit a job",
      dependencies={"tenant": Provide(provide_tenant, sync_to_thread=False)},
      before_request=check_submit_body)
async def submit_job(
    data: JSONBody[JobSubmit],
    request: Request,
    state: State,
    bus: NamedDependency[Bus],
    store: NamedDependency[CheckedJobStore],
    tenant: NamedDependency[Tenant],
) -> SubmitResponse:
    """Validate a job, record it as ``pending`` and publish it on ``jobs.submit``.

    The body is decoded strictly (:func:`check_submit_body`): ``"max_rounds": "3"`` is a
    400 naming ``$.max_rounds``, as it is for a raw ``nats pub`` on ``jobs.submit``.
    Answers 400 when the task is not a KernelBench-format task, 409 when no live
    worker offers ``backend``/``arch`` (the body lists the live pairs) or when the
    client-chosen ``job_id`` is already taken by a different job, 429 over a tenant
    limit (services/gateway/limits.py), 503 when the job
    could not be queued (its record is withdrawn). Resubmitting the very same job with
    the same ``job_id`` is idempotent: the answer carries the existing job's status
    (:func:`_resubmitted`); another tenant's ``job_id`` is 409 and says nothing of its
    job.
    """
    started = time.perf_counter()
    # ``data`` (Litestar's lax conversion) documents the body in the OpenAPI schema;
    # the strict decode of check_submit_body, which ran first, decides.
    data = request.state.submit
    if "timeout_s" not in request.state.given and tenant.max_timeout_s:
        data.timeout_s = min(data.timeout_s, float(tenant.max_timeout_s))
    check_job_limits(tenant, data)
    check_task(data.task_desc, data.shape_overrides)

    arch = await routed_arch(bus, data.backend, data.arch)

    record = new_record(data, arch=arch, tenant=tenant.name)
    job_id = record.job_id
    subject = subjects.job_submit(tenant.name, record.priority)
    with structlog.contextvars.bound_contextvars(job_id=job_id, tenant=tenant.name):
        if data.job_id:
            existing = await _existing(store, job_id)
            if existing is not None:
                return await _resubmitted(bus, tenant, record, existing)
        async with tenant_lock(state, tenant.name):
            held = await claim(bus, store, tenant, job_id)
        if not await held.withdraw_unless(store.create(record)):
            # Another submission with this job id won the race since the look above.
            return await _resubmitted(bus, tenant, record, (await store.get(job_id))[0])
        # The event goes first so that a job's history starts with it: a generator may
        # pick the job up and report "started" before this handler runs on.
        await publish_event(bus, JobEvent(job_id=job_id, event="submitted",
                                          status="pending",
                                          message=f"{record.backend}/{arch}"))
        message = ""
        try:
            await queuing.queue_job(bus, subject, record.request, job_id)
        except queuing.Unqueued as exc:
            if not exc.maybe_stored:
                await publish_event(bus, JobEvent(job_id=job_id, event="error",
                                                  status="pending",
                                                  message=f"submission withdrawn: {exc}"))
                await _withdraw(bus, job_id, exc, subject, held)
            # A try may have landed, and a generator may be running the job: its record
            # stays (deleting it would cancel that run, and a resubmission of the same
            # job id would then be dropped by the stream as a duplicate of the first).
            log.warning("job_queue_unconfirmed", error=str(exc))
            queuing.start_queuing(state, bus, record, subject)
            message = (f"NATS has not yet acknowledged the job's queue message ({exc}); "
                       "the gateway keeps publishing it, deduplicated by job id, and fails "
                       f"the job if that does not succeed within "
                       f"{DUPLICATE_WINDOW_S - queuing.REQUEUE_MARGIN_S:.0f} s")
        await held.commit()
        JOBS_SUBMITTED.labels(tenant=tenant_label(tenant.name),
                              priority=record.priority).inc()
        log.info("job_submitted", op_name=record.op_name, backend=record.backend,
                 arch=arch, job_type=record.job_type, workflow=data.workflow,
                 priority=record.priority, subject=subject)
    SUBMIT_SECONDS.observe(time.perf_counter() - started)
    return SubmitResponse(job_id=job_id, status="pending", backend=record.backend,
                          arch=arch, message=message)

@get("/", summary="List jobs")
async def jobs_list(
    bus: NamedDependency[Bus],
    queue: NamedDependency[QueueView | None],
    viewer: NamedDependency[str | None],
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
    them. Waiting jobs carry their ``queue_position`` and ``estimated_start_time``.
    A tenant's token lists only its own tenant's jobs."""
    if viewer is not None:
        if tenant not in (None, viewer):
            return JobPage(jobs=[], total=0, limit=limit, offset=offset)
        tenant = viewer
    page = await list_jobs(bus, status=status, op_name=op_name, limit=limit,
                           offset=offset, tenant=tenant)
    for row in page.jobs:
        if row.status == "pending":
            row.queue_position, row.estimated_start_time = await _estimate(queue, row.job_id)
    return page

@get(["/{job_id:str}/status", "/{job_id:str}"], summary="Job status")
async def job_status(job_id: FromPath[str], store: NamedDependency[CheckedJobStore],
                     queue: NamedDependency[QueueView | None],
                     viewer: NamedDependency[str | None]) -> JobRecord:
    """The job record: status, progress, result (kernel source and verdict), error;
    while the job waits, its ``queue_position`` (1: next to start) and
    ``estimated_start_time`` (services/gateway/queue.py), null otherwise."""
    record = await load_record(store, job_id, viewer)
    if record.status == "pending":
        record.queue_position, record.estimated_start_time = await _estimate(queue, job_id)
    return record

@post("/{job_id:str}/cancel", status_code=200, summary="Cancel a job")
async def job_cancel(job_id: FromPath[str], bus: NamedDependency[Bus],
                     store: NamedDependency[CheckedJobStore],
                     viewer: NamedDependency[str | None]) -> JobRecord:
    """Mark the job ``cancelled`` and publish its ``cancelled`` event; the generator
    stops its work and workers skip its pending verify requests. Idempotent: a job
    that has already ended is returned unchanged (its ``status`` says how it ended)."""
    await load_record(store, job_id, viewer)
    try:
        record = await cancel_job(bus, job_id)
    except JobNotFound as exc:
        raise unknown_job(job_id) from exc
    log.info("job_cancel_requested", job_id=job_id, status=record.status)
    return record

@get("/{job_id:str}/kernel", summary="Best kernel source", media_type="text/x-python")
async def job_kernel(job_id: FromPath[str],
                     store: NamedDependency[CheckedJobStore],
                     viewer: NamedDependency[str | None]) -> Response[str]:
    """The job's kernel source (``text/x-python``): the passing candidate of a
    completed job, or the last candidate tried of a failed one. Headers
    ``X-AIKG-Passed`` and ``X-AIKG-Candidate-Id`` say which. 404 while the job has no
    kernel yet."""
    record = await load_record(store, job_id, viewer)
    result = record.result
    if result is None or not result.code:
        raise NotFoundException(
            detail=f"job {job_id!r} has no kernel yet (status {record.status}); it has "
            "one once it has ended with a candidate")
    headers = {
        "X-AIKG-Passed": "true" if result.passed else "false",
        "X-AIKG-Candidate-Id": result.candidate_id or "",
        "Content-Disposition": f'inline; filename="{record.op_name}_kernel.py"',
    }
    return Response(result.code, media_type="text/x-python", headers=headers)


@get("/{job_id:str}/events", summary="Job events (Server-Sent Events)",
     media_type="text/event-stream")
async def job_events_stream(
    job_id: FromPath[str],
    bus: NamedDependency[Bus],
    store: NamedDependency[CheckedJobStore],
    queue: NamedDependency[QueueView | None],
    viewer: NamedDependency[str | None],
    last_event_id: Annotated[str | None, HeaderParameter(
        name="Last-Event-ID", required=False,
        description="Resume after this event id (a JOB_EVENTS stream sequence).")] = None,
) -> ServerSentEvent:
    """The job's events as ``text/event-stream``: its whole history, then live, ending
    after the terminal event (``completed``, ``failed``, ``cancelled``). ``event:`` is
    the event kind, ``data:`` the JobEvent JSON, ``id:`` its stream sequence. A
    comment line goes out every 15 s while idle."""
    after = resume_after(last_event_id, "an event id")
    record = await load_record(store, job_id, viewer)
    try:
        sub = await job_events.open_event_subscription(bus, job_id, after)
    except Exception as exc:  # noqa: BLE001 - NATS trouble: the client may retry
        raise HTTPException(status_code=503, detail=f"cannot read the job's events from "
                            f"{subjects.STREAM_JOB_EVENTS}: {exc.__class__.__name__} "
                            f"{exc}; retry shortly") from exc
    return ServerSentEvent(job_events.job_event_stream(
        bus, job_id, sub, ended=record.status in TERMINAL_STATUSES,
        queue=queue if record.status == "pending" else None))


# Jobs: ``/api/v1/jobs`` (the ``/api/v1`` router adds the prefix). Listed in this order
# in the OpenAPI document.
jobs_router = Router(path="/jobs", route_handlers=[submit_job, jobs_list, job_status, job_cancel,
                                                   job_kernel, job_events_stream])
