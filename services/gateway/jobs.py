"""``/api/v1/jobs``: submit, list, read, cancel and follow jobs, and read a job's kernel.

Routes keep the names of the HTTP AIKG service it replaces (docs/compatibility.md,
``AIKGClient``): ``POST /api/v1/jobs/submit`` and ``GET /api/v1/jobs/{job_id}/status``;
and add ``GET /api/v1/jobs`` (list), ``POST /api/v1/jobs/{job_id}/cancel``,
``GET /api/v1/jobs/{job_id}/events`` (SSE, services/gateway/events.py) and
``GET /api/v1/jobs/{job_id}/kernel``. A submission is validated (msgspec schema, tenant
limits, static task check, a live worker for its backend/arch), written to the ``jobs``
bucket and published on its ``jobs.submit`` lane with the job id as ``Nats-Msg-Id``;
the generator does the rest.

The bus, the job store, the queue view and the tenant are dependencies
(services/gateway/deps.py); NATS trouble is answered 503 by the app's exception handler
(services/gateway/errors.py), so the routes do not catch it.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import re
import time
from typing import Annotated, NoReturn, TypeVar

import msgspec
import nats.errors
import nats.js.errors
import numpy as np
import structlog
from litestar import Request, Response, Router, get, post
from litestar.datastructures import State
from litestar.di import NamedDependency, Provide
from litestar.exceptions import (
    ClientException,
    HTTPException,
    NotFoundException,
    ValidationException,
)
from litestar.params import FromPath, HeaderParameter, JSONBody, QueryParameter
from litestar.response import ServerSentEvent
from prometheus_client import Counter, Histogram
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception_type,
    stop_after_delay,
    wait_exponential,
)

from schemas import (
    TERMINAL_STATUSES,
    JobEvent,
    JobRecord,
    JobSubmit,
    decode,
    encode,
    subjects,
    utcnow,
)
from schemas.events import ShapeValue
from services.common import task_source
from services.common.bus import DUPLICATE_WINDOW_S, Bus, JobNotFound
from services.common.jobs import (
    CheckedJobStore,
    cancel_job,
    describe_pairs,
    live_arch,
    new_record,
    publish_event,
)
from services.common.runtime import cancel_and_wait
from services.common.tenants import Tenant, tenant_label
from services.gateway import events as job_events
from services.gateway.deps import load_record, provide_tenant
from services.gateway.errors import unknown_job
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

T = TypeVar("T")

# A job's submit message is published again with the same Nats-Msg-Id while its stream
# has no leader or does not acknowledge: a JetStream node failing over hands its
# streams to new leaders within seconds (tests/bus/test_cluster.py). For this long
# before the submission is answered, seconds.
QUEUE_RETRY_S = 10.0
# One try's wait for the stream's acknowledgement, seconds (nats-py's default: 5).
QUEUE_ACK_TIMEOUT_S = 2.5
# A job whose tries may have landed unacknowledged is published again in the background
# until its submission is this much short of the stream's duplicate window, seconds: a
# try after the window could store it twice.
REQUEUE_MARGIN_S = 10.0
# Failures worth another try: no answer in time, no stream leader (yet), a stream that
# is temporarily unavailable.
_RETRIED = (nats.errors.TimeoutError, nats.errors.NoRespondersError,
            nats.js.errors.NoStreamResponseError, nats.js.errors.ServiceUnavailableError,
            nats.errors.ConnectionReconnectingError)
# Failures that say the message was not stored: nobody took it, or the stream refused it
# (nats.js.errors.APIError: an answer of the stream's). Any other failure, a timeout
# above all, leaves open whether it landed.
_NOT_STORED = (nats.errors.NoRespondersError, nats.js.errors.NoStreamResponseError,
               nats.js.errors.APIError)

# Largest page of GET /api/v1/jobs: a page of summaries stays well under a megabyte.
MAX_PAGE = 500

# msgspec's error text ends with the field's path: "... - at `$.max_rounds`".
_FIELD_PATH_RE = re.compile(r"^(?P<message>.*) - at `\$\.?(?P<key>[^`]*)`$", re.DOTALL)


class SubmitResponse(msgspec.Struct, kw_only=True):
    """Answer to a job submission; ``job_id`` is what ``AIKGClient.submit_job`` returns."""

    job_id: str
    status: str
    backend: str
    arch: str | None
    message: str = ""


# Deepest nesting of arrays and objects a submission may have: a JobSubmit is at most
# three deep (body, shape_overrides, a shape list); 32 leaves room for clients that wrap
# and is far below the depth at which decoding would exhaust Python's stack.
MAX_JSON_DEPTH = 32
# A JSON string literal (escapes included), written as an unrolled loop so that a long
# string is matched at C speed.
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_BRACKET_STEP = np.zeros(256, dtype=np.int8)
_BRACKET_STEP[[ord("["), ord("{")]] = 1
_BRACKET_STEP[[ord("]"), ord("}")]] = -1


def json_depth(body: bytes) -> int:
    """Deepest nesting of ``[``/``{`` in a JSON text, brackets inside strings not
    counted; found without decoding it (a decoder recurses once per level). Linear
    time at C speed (a regular expression, then a running sum in numpy): a 2 MiB body
    takes milliseconds."""
    steps = _BRACKET_STEP[np.frombuffer(_JSON_STRING.sub(b'""', body), dtype=np.uint8)]
    return int(np.cumsum(steps, dtype=np.int64).max(initial=0))


async def check_submit_body(request: Request) -> None:
    """``before_request`` of the submit route, so that it runs before Litestar decodes
    the body its own (lax) way: 400 when the body nests deeper than
    :data:`MAX_JSON_DEPTH` (a decoder would fail with ``RecursionError``), then the
    strict decode (:func:`_strict_submit`), kept in ``request.state.submit``. The
    body's size is bounded by the app (``REQUEST_MAX_BODY_BYTES``, 413).

    Raises:
        ValidationException: answered 400, naming the field at fault.
    """
    refuse_deep_body(await request.body())
    request.state.submit = await _strict_submit(request)
    # Which fields the body gave (top level only, values left undecoded): a default
    # the tenant's limits do not allow is lowered, an explicit value refused.
    request.state.given = set(msgspec.json.decode(await request.body(),
                                                  type=dict[str, msgspec.Raw]))


def refuse_deep_body(body: bytes) -> None:
    """400 when ``body`` nests arrays/objects deeper than :data:`MAX_JSON_DEPTH` (a
    decoder would fail with ``RecursionError``).

    Raises:
        ValidationException: answered 400.
    """
    depth = json_depth(body)
    if depth > MAX_JSON_DEPTH:
        detail = (f"request body nests arrays/objects {depth} levels deep; at most "
                  f"{MAX_JSON_DEPTH} are accepted")
        raise ValidationException(detail=detail, extra=[
            {"message": detail, "key": "data", "source": "body"}])


def _name_shape_entry(body: bytes, text: str) -> str:
    """msgspec's error text with ``shape_overrides[...]`` (its path for a dict value)
    replaced by the entry at fault, e.g. ``shape_overrides.batch_size`` or
    ``shape_overrides.dim[1]``."""
    if "at `$.shape_overrides[...]" not in text:
        return text
    with contextlib.suppress(Exception):
        overrides = msgspec.json.decode(body).get("shape_overrides") or {}
        for name, value in overrides.items():
            try:
                msgspec.convert(value, ShapeValue, strict=True)
            except msgspec.ValidationError as exc:
                message, _, inner = str(exc).partition(" - at `$")
                return f"{message} - at `$.shape_overrides.{name}{inner.rstrip('`')}`"
    return text


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
    return strict_decode(await request.body(), JobSubmit)


def strict_decode(body: bytes, record_type: type[T]) -> T:
    """``body`` decoded as ``record_type`` with msgspec's strict rules (as
    :func:`_strict_submit` explains), for every body the gateway takes.

    Raises:
        ValidationException: answered 400, the message naming the field
            (``Expected `str`, got `int` - at `$.candidates[3]```).
    """
    try:
        return decode(body, record_type)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        text = _name_shape_entry(body, str(exc))
        match = _FIELD_PATH_RE.match(text)
        error = ({"message": match["message"], "key": match["key"] or "data", "source": "body"}
                 if match else {"message": text, "key": "data", "source": "body"})
        raise ValidationException(detail=text, extra=[error]) from exc


def check_task(task_desc: str, shape_overrides: dict[str, object] | None = None) -> None:
    """400 unless ``task_desc`` is a KernelBench-format task (static check, no run) and
    every ``shape_overrides`` name is one the task assigns at top level (the check
    ``aikg run --shape`` makes; :mod:`services.common.task_source`)."""
    try:
        task_source.check_task(task_desc, shape_overrides)
    except task_source.TaskError as exc:
        if exc.field != "shape_overrides":
            raise ClientException(detail=str(exc)) from exc
        raise ValidationException(detail=str(exc), extra=[
            {"message": str(exc), "key": "shape_overrides", "source": "body"}]) from exc


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


class Unqueued(Exception):
    """A job's submit message did not reach its stream.

    Attributes:
        cause: the last publish's error.
        maybe_stored: True when some try ended without an answer (a timed-out
            acknowledgement, a dropped connection): the message may be in the stream and
            a generator may already run the job. False when every try was refused (no
            stream leader to take it, or the stream said no): it is not there.
    """

    def __init__(self, cause: BaseException, maybe_stored: bool) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.cause = cause
        self.maybe_stored = maybe_stored


async def queue_job(bus: Bus, subject: str, request: JobSubmit, job_id: str, *,
                    within_s: float | None = None) -> None:
    """Publish a job's submit message with ``job_id`` as its ``Nats-Msg-Id``, trying
    again for up to ``within_s`` seconds (default :data:`QUEUE_RETRY_S`) while the
    stream has no leader or does not acknowledge (a node failing over). Every try
    carries the same id, so the stream stores the job once however many tries land
    (within its duplicate window, :data:`~services.common.bus.DUPLICATE_WINDOW_S`).

    Raises:
        Unqueued: no try was acknowledged in time; ``maybe_stored`` says whether one
            may have landed all the same.
    """
    within_s = QUEUE_RETRY_S if within_s is None else within_s
    maybe_stored = False
    payload = encode(request)
    headers = {"Nats-Msg-Id": job_id}

    def note(state: RetryCallState) -> None:
        nonlocal maybe_stored
        exc = state.outcome.exception() if state.outcome else None
        maybe_stored = maybe_stored or not isinstance(exc, _NOT_STORED)

    try:
        async for attempt in AsyncRetrying(
                stop=stop_after_delay(max(0.0, within_s)),
                wait=wait_exponential(multiplier=0.1, max=1.0),
                retry=retry_if_exception_type(_RETRIED), after=note, reraise=True):
            with attempt:
                await bus.js.publish(subject, payload, headers=headers,
                                     timeout=QUEUE_ACK_TIMEOUT_S)
    except Exception as exc:
        raise Unqueued(exc, maybe_stored or not isinstance(exc, _NOT_STORED)) from exc


async def _keep_queuing(bus: Bus, record: JobRecord, subject: str) -> None:
    """Publish the submit message of a job whose first tries may or may not have landed,
    for as long as the stream's duplicate window makes another try safe, then fail the
    job if none was acknowledged (a generator that meets it later skips it)."""
    left = (DUPLICATE_WINDOW_S - REQUEUE_MARGIN_S
            - (utcnow() - record.submit_time).total_seconds())
    with structlog.contextvars.bound_contextvars(job_id=record.job_id):
        try:
            await queue_job(bus, subject, record.request, record.job_id, within_s=left)
            log.info("job_queue_confirmed", subject=subject)
            return
        except Unqueued as exc:
            reason = (f"could not queue the job on {subject} within "
                      f"{DUPLICATE_WINDOW_S - REQUEUE_MARGIN_S:.0f} s of its submission: "
                      f"{exc}; NATS may be down, submit it again")

        def fail(r: JobRecord) -> JobRecord | None:
            if r.status != "pending":
                return None
            r.status = r.progress.phase = "failed"
            r.error = r.progress.message = reason
            r.end_time = utcnow()
            return r

        log.error("job_publish_failed", error=reason)
        with contextlib.suppress(Exception):
            if (await CheckedJobStore(bus.jobs).update(record.job_id, fail)).status == "failed":
                await publish_event(bus, JobEvent(job_id=record.job_id, event="failed",
                                                  status="failed", message=reason))


def _start_queuing(state: State, bus: Bus, record: JobRecord, subject: str) -> None:
    tasks: set[asyncio.Task] = state.get("requeues")
    task = asyncio.create_task(_keep_queuing(bus, record, subject),
                               name=f"requeue-{record.job_id}")
    tasks.add(task)
    task.add_done_callback(tasks.discard)


async def stop_requeues(state: State) -> None:
    """Cancel the gateway's background publishes (at shutdown: those jobs stay pending,
    and their clients' resubmissions with the same ``job_id`` publish them again)."""
    await cancel_and_wait(*state.get("requeues", set()))


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
    if existing.status == "pending" and age_s < DUPLICATE_WINDOW_S - REQUEUE_MARGIN_S:
        try:
            await queue_job(bus, subjects.job_submit(existing.tenant, existing.priority),
                            existing.request, record.job_id,
                            within_s=min(QUEUE_RETRY_S,
                                         DUPLICATE_WINDOW_S - REQUEUE_MARGIN_S - age_s))
        except Unqueued as exc:
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
            await queue_job(bus, subject, record.request, job_id)
        except Unqueued as exc:
            if not exc.maybe_stored:
                await publish_event(bus, JobEvent(job_id=job_id, event="error",
                                                  status="pending",
                                                  message=f"submission withdrawn: {exc}"))
                await _withdraw(bus, job_id, exc, subject, held)
            # A try may have landed, and a generator may be running the job: its record
            # stays (deleting it would cancel that run, and a resubmission of the same
            # job id would then be dropped by the stream as a duplicate of the first).
            log.warning("job_queue_unconfirmed", error=str(exc))
            _start_queuing(state, bus, record, subject)
            message = (f"NATS has not yet acknowledged the job's queue message ({exc}); "
                       "the gateway keeps publishing it, deduplicated by job id, and fails "
                       f"the job if that does not succeed within "
                       f"{DUPLICATE_WINDOW_S - REQUEUE_MARGIN_S:.0f} s")
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


# The largest Last-Event-ID an event stream resumes after: the next id must still be
# a JetStream sequence, which nats-server keeps as an unsigned 64-bit integer (and
# parses as one from a consumer's ``opt_start_seq``); kept within int64 for clients.
MAX_EVENT_ID = 2**63 - 2


def resume_after(last_event_id: str | None, what: str) -> int:
    """The ``Last-Event-ID`` an event stream resumes after (0: from the start).

    Raises:
        ClientException: a 400 naming ``what`` the id must be (``an event id``) when it
            is not a whole number in ASCII digits from 0 to :data:`MAX_EVENT_ID`
            (negative, too large, a sign, spaces, ``_`` or other digits).
    """
    if not last_event_id:
        return 0
    text = last_event_id.strip()
    if not (text.isascii() and text.isdigit()):
        if text.startswith("-") and text[1:].isascii() and text[1:].isdigit():
            raise ClientException(detail="Last-Event-ID must not be negative")
        raise ClientException(detail=f"Last-Event-ID must be {what} (an integer) sent by "
                              f"this route, not {last_event_id[:40]!r}")
    if len(text) > len(str(MAX_EVENT_ID)) or int(text) > MAX_EVENT_ID:
        raise ClientException(detail=f"Last-Event-ID {text[:40]}{'...' if len(text) > 40 else ''}"
                              f" is out of range: {what} sent by this route is at most "
                              f"{MAX_EVENT_ID}")
    return int(text)


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
