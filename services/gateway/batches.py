"""``/api/v1/verify/batch``: verify many candidates of one task (RL loops, leaderboards).

A batch is one task (the task fields of a job) and up to ``batch_max_candidates``
candidates, each a module defining ``class ModelNew``. It travels the bus the way a
job's candidates do (docs/architecture.md, "The life of a verify request"): no new
path, only the gateway in the generator's place.

- **Admission** (services/gateway/limits.py): the tenant's in-flight and per-hour
  limits count the batch's candidates, a batch of 50 as 50 jobs; ``max_timeout_s`` and
  ``max_priority`` apply as to a job.
- **Identical candidates** (same normalised AST,
  :func:`services.common.verify_client.originals`, the hash evolve jobs dedupe by)
  are verified once: only the first of them gets a verify request, the others reuse
  its verdict (``duplicate_of``).
- **Record**: a :class:`~schemas.events.BatchRecord` under ``<batch_id>`` in the
  ``batches`` bucket, every change a compare-and-swap on its revision.
- **Requests**: one :class:`~schemas.events.VerifyRequest` per distinct candidate,
  sent through the batch's :class:`~services.common.verify_client.VerifyClient`, on
  the tenant's VERIFY lane (``verify.<backend>.<arch>`` for the default tenant), the
  batch id as ``job_id``, ``<batch_id>-r<index>`` as request id and ``Nats-Msg-Id``;
  workers answer on ``results.<batch_id>``.
- **Verdicts** are folded into the record
  (:func:`~services.gateway.batch_follow.fold`) in the order the RESULTS
  stream holds them, i.e. the order they finished, by whoever reads first: a task of
  the gateway that took the batch follows it until it ends, and every read of the
  record or its event stream folds too, so a batch whose gateway died is still
  brought up to date. A result already folded (a redelivered request run twice) is
  skipped.
- **Cancel**: the record turns ``cancelled``; requests no worker has been given yet
  (VERIFY sequence above the lane consumer's delivered one) are deleted from the
  stream, so they are never verified, and their candidates marked ``cancelled``;
  verdicts of verifications already started still land and are kept.

This module holds the routes and the verdicts' event stream; the ``batches`` bucket and
the record's pure steps are in services/gateway/batch_store.py, the requests and
verdicts on the bus in services/gateway/batch_follow.py. The bus, the tenant and the
viewer are dependencies (services/gateway/deps.py); NATS
trouble is answered 503 by the app's exception handler (services/gateway/errors.py).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Annotated

import msgspec
import nats.errors
import nats.js.errors
import structlog
from litestar import Request, Router, get, post
from litestar.datastructures import State
from litestar.di import NamedDependency, Provide
from litestar.exceptions import (
    HTTPException,
    NotFoundException,
    ValidationException,
)
from litestar.params import FromPath, HeaderParameter, JSONBody
from litestar.response import ServerSentEvent, ServerSentEventMessage
from prometheus_client import Counter

from schemas import (
    BatchRecord,
    BatchSubmit,
    BatchVerdict,
    encode,
    new_id,
    subjects,
    utcnow,
)
from schemas.events import BatchTask
from services.common.bus import Bus
from services.common.jobs import CheckedJobStore
from services.common.tenants import Tenant, tenant_label
from services.gateway.batch_follow import (
    POLL_S,
    cancel_unstarted,
    fold,
    publish_requests,
    start_follower,
)
from services.gateway.batch_store import (
    BatchStore,
    plan_candidates,
    provide_batches,
    settled,
)
from services.gateway.deps import provide_tenant
from services.gateway.inputs import check_task, refuse_deep_body, resume_after, strict_decode
from services.gateway.jobs import routed_arch
from services.gateway.limits import check_batch_limits, claim, tenant_lock

log = structlog.get_logger("aikg.gateway")

BATCHES_SUBMITTED = Counter(
    "aikg_gateway_batches_submitted_total",
    "Batch verifications accepted by the gateway, by tenant.", ["tenant"],
)
BATCH_CANDIDATES = Counter(
    "aikg_gateway_batch_candidates_total",
    "Candidates of accepted batches, by tenant and what became of them: verified (a "
    "verify request was sent) or reused (identical to an earlier candidate of the "
    "batch, whose verdict it gets).", ["tenant", "kind"],
)

# Keepalive comment period of the event stream, seconds (as the job event stream,
# services/gateway/events.py).
HEARTBEAT_S = 15.0


class BatchSubmitResponse(msgspec.Struct, kw_only=True):
    """Answer to a batch submission: its id, ``candidates`` submitted and ``unique``
    verify requests sent (candidates less duplicates), the backend/arch it goes to."""

    batch_id: str
    status: str
    candidates: int
    unique: int
    backend: str
    arch: str
    message: str = ""


async def check_batch_body(request: Request) -> None:
    """``before_request`` of the submit route: depth bound, then the strict decode
    (services/gateway/inputs.py, :func:`~services.gateway.inputs.strict_decode`), kept in
    ``request.state.batch``, and which top-level fields the body gave.

    Raises:
        ValidationException: answered 400, naming the field at fault.
    """
    body = await request.body()
    refuse_deep_body(body)
    request.state.batch = strict_decode(body, BatchSubmit)
    request.state.given = set(msgspec.json.decode(body, type=dict[str, msgspec.Raw]))


def _load(record: BatchRecord | None, batch_id: str, viewer: str | None) -> BatchRecord:
    """``record`` when ``viewer`` may see it (None: the operator sees all).

    Raises:
        NotFoundException: no such batch, or another tenant's (answered alike: 404).
    """
    if record is None or (viewer is not None and record.tenant != viewer):
        raise NotFoundException(detail=f"unknown batch {batch_id[:80]!r}: no batch "
                                "verification has this id (or it is another tenant's); "
                                "POST /api/v1/verify/batch returns the id")
    return record


def _same_batch(existing: BatchRecord, record: BatchRecord) -> bool:
    return (existing.tenant == record.tenant and existing.task == record.task
            and [c.code_hash for c in existing.candidates]
            == [c.code_hash for c in record.candidates])


@post("/batch", status_code=200, summary="Verify a batch of candidates",
      dependencies={"tenant": Provide(provide_tenant, sync_to_thread=False)},
      before_request=check_batch_body)
async def submit_batch(
    data: JSONBody[BatchSubmit],
    request: Request,
    state: State,
    bus: NamedDependency[Bus],
    batches: NamedDependency[BatchStore],
    store: NamedDependency[CheckedJobStore],
    tenant: NamedDependency[Tenant],
) -> BatchSubmitResponse:
    """Verify every candidate against the task; identical ones (same normalised AST)
    once. Returns the batch id at once; verdicts land in the batch's record
    (``GET /api/v1/verify/batch/{batch_id}``) and stream from its ``/events``.

    Answers 400 for a bad body (empty ``candidates``, more than
    ``AIKG_BATCH_MAX_CANDIDATES``, a candidate that is not a string: the message names
    the field) or a task that is not a KernelBench-format task, 403 over a tenant's
    ``max_timeout_s`` / ``max_priority``, 409 when no live worker offers the
    backend/arch or the ``batch_id`` is taken, 429 when the candidates would exceed the
    tenant's in-flight or per-hour limit, 503 when the requests could not be queued
    (nothing is kept). The very same batch again under the same ``batch_id`` is
    idempotent: the answer carries its status.
    """
    data: BatchSubmit = request.state.batch
    limit = bus.settings.batch_max_candidates
    if len(data.candidates) > limit:
        detail = (f"a batch carries at most {limit} candidates (AIKG_BATCH_MAX_CANDIDATES); "
                  f"this one has {len(data.candidates)}: split it into several batches")
        raise ValidationException(detail=detail, extra=[
            {"message": detail, "key": "candidates", "source": "body"}])
    if "timeout_s" not in request.state.given and tenant.max_timeout_s:
        data.timeout_s = min(data.timeout_s, float(tenant.max_timeout_s))
    check_batch_limits(tenant, data)
    check_task(data.task_desc, data.shape_overrides)
    arch = await routed_arch(bus, data.backend, data.arch)
    batch_id = data.batch_id or new_id("batch-")
    if data.batch_id and await _is_job(bus, batch_id):
        # Its verdicts would share results.<id> with the job's.
        raise HTTPException(status_code=409, detail=f"batch id {batch_id!r} is taken; "
                            "choose another batch_id or omit it to get a fresh one")
    candidates = await asyncio.to_thread(plan_candidates, batch_id, data.candidates)
    unique = sum(c.duplicate_of is None for c in candidates)
    record = BatchRecord(
        batch_id=batch_id, status="running", tenant=tenant.name, submit_time=utcnow(),
        task=BatchTask(op_name=data.op_name, task_desc=data.task_desc, backend=data.backend,
                       arch=arch, dsl=data.dsl, framework=data.framework,
                       shape_overrides=data.shape_overrides, timeout_s=data.timeout_s,
                       trials=data.trials, priority=data.priority,
                       allow_unchecked=data.allow_unchecked),
        candidates=candidates, unique=unique)
    with structlog.contextvars.bound_contextvars(batch_id=batch_id, tenant=tenant.name):
        async with tenant_lock(state, tenant.name):
            held = await claim(bus, store, tenant, batch_id,
                               batch_candidates=len(candidates))
        if not await held.withdraw_unless(batches.create(record)):
            existing = await batches.get(batch_id)
            if existing is None or not _same_batch(existing[0], record):
                raise HTTPException(status_code=409, detail=f"batch id {batch_id!r} is "
                                    "taken; choose another batch_id or omit it")
            return BatchSubmitResponse(
                batch_id=batch_id, status=existing[0].status, candidates=len(candidates),
                unique=existing[0].unique, backend=data.backend, arch=arch,
                message="batch already submitted")
        try:
            seqs = await publish_requests(bus, record, data.candidates)
        except Exception as exc:
            with contextlib.suppress(Exception):
                await batches.delete(batch_id)
            await held.withdraw()
            reason = f"could not queue the batch's verify requests: {type(exc).__name__} {exc}"
            log.error("batch_publish_failed", error=reason)
            raise HTTPException(status_code=503, detail=f"{reason}; NATS may be down, "
                                "retry shortly") from exc

        def record_seqs(r: BatchRecord) -> bool:
            for c in r.candidates:
                c.verify_seq = seqs.get(c.request_id, 0) if c.duplicate_of is None else 0
            return True

        stored = await batches.update(batch_id, record_seqs)
        if stored is not None and stored.status == "cancelled":
            # Cancelled while its requests went out: the cancel saw no sequences yet.
            await cancel_unstarted(bus, batches, stored)
        await held.commit_batch(unique)
        start_follower(state, bus, batch_id)
        label = tenant_label(tenant.name)
        BATCHES_SUBMITTED.labels(tenant=label).inc()
        BATCH_CANDIDATES.labels(tenant=label, kind="verified").inc(unique)
        BATCH_CANDIDATES.labels(tenant=label, kind="reused").inc(len(candidates) - unique)
        log.info("batch_submitted", op_name=data.op_name, backend=data.backend, arch=arch,
                 candidates=len(candidates), unique=unique)
    return BatchSubmitResponse(batch_id=batch_id, status="running",
                               candidates=len(candidates), unique=unique,
                               backend=data.backend, arch=arch)


async def _is_job(bus: Bus, job_id: str) -> bool:
    """Whether the ``jobs`` bucket has a key ``job_id``."""
    try:
        await bus.jobs.get(job_id)
    except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
        return False
    return True


@get("/batch/{batch_id:str}", summary="Batch record with its verdicts")
async def batch_status(batch_id: FromPath[str], bus: NamedDependency[Bus],
                       batches: NamedDependency[BatchStore],
                       viewer: NamedDependency[str | None]) -> BatchRecord:
    """The batch's record: its task, every candidate (index, ids, code hash,
    ``duplicate_of``, ``cancelled``) and every verdict so far, in the order they
    finished; ``status`` ``running``, ``completed`` or ``cancelled``. 404 for an
    unknown batch or another tenant's."""
    if not subjects.is_token(batch_id):
        _load(None, batch_id, viewer)
    return _load(await fold(bus, batches, batch_id), batch_id, viewer)


@post("/batch/{batch_id:str}/cancel", status_code=200, summary="Cancel a batch")
async def batch_cancel(batch_id: FromPath[str], bus: NamedDependency[Bus],
                       batches: NamedDependency[BatchStore],
                       viewer: NamedDependency[str | None]) -> BatchRecord:
    """Cancel the batch: requests no worker has been given yet are taken back and
    their candidates marked ``cancelled`` (they get no verdict); verdicts of
    verifications already started may still land. Returns the record; a batch that
    has ended is returned unchanged. 404 for an unknown batch or another tenant's."""
    if not subjects.is_token(batch_id):
        _load(None, batch_id, viewer)
    found = await batches.get(batch_id)
    record = _load(found[0] if found else None, batch_id, viewer)
    if record.status != "running":
        return record

    def cancel(r: BatchRecord) -> bool:
        if r.status != "running":
            return False
        r.status, r.end_time = "cancelled", utcnow()
        return True

    record = await batches.update(batch_id, cancel) or record
    if record.status == "cancelled":
        await cancel_unstarted(bus, batches, record)
    return _load(await fold(bus, batches, batch_id), batch_id, viewer)


def _verdict_message(verdict: BatchVerdict, number: int) -> ServerSentEventMessage:
    return ServerSentEventMessage(data=encode(verdict).decode(), event="verdict", id=number)


async def _batch_stream(bus: Bus, batches: BatchStore, batch_id: str,
                        after: int) -> AsyncIterator[ServerSentEventMessage]:
    """SSE messages: every verdict after the ``after``-th (finish order), as it lands,
    then one ``end`` message once the batch is settled (:func:`settled`)."""
    loop = asyncio.get_running_loop()
    sent = after
    last_beat = loop.time()
    while True:
        try:
            record = await fold(bus, batches, batch_id)
        except (nats.errors.Error, nats.js.errors.Error, TimeoutError) as exc:
            log.warning("batch_stream_read_failed", batch_id=batch_id, error=repr(exc))
            record = None
            await asyncio.sleep(POLL_S)
            continue
        if record is None:
            return
        for verdict in record.verdicts[sent:]:
            sent += 1
            last_beat = loop.time()
            yield _verdict_message(verdict, sent)
        if settled(record):
            body = {"batch_id": batch_id, "status": record.status,
                    "candidates": len(record.candidates), "verdicts": len(record.verdicts),
                    "cancelled": sum(c.cancelled for c in record.candidates)}
            yield ServerSentEventMessage(data=msgspec.json.encode(body).decode(), event="end")
            return
        if loop.time() - last_beat >= HEARTBEAT_S:
            last_beat = loop.time()
            yield ServerSentEventMessage(data=None, comment="keepalive")
        await asyncio.sleep(POLL_S)


@get("/batch/{batch_id:str}/events", summary="Batch verdicts (Server-Sent Events)",
     media_type="text/event-stream")
async def batch_events(
    batch_id: FromPath[str],
    bus: NamedDependency[Bus],
    batches: NamedDependency[BatchStore],
    viewer: NamedDependency[str | None],
    last_event_id: Annotated[str | None, HeaderParameter(
        name="Last-Event-ID", required=False,
        description="Resume after this many verdicts (an id this route sent).")] = None,
) -> ServerSentEvent:
    """The batch's verdicts as ``text/event-stream``: those landed so far, then each as
    it lands, in the order they finished (``event: verdict``, ``data:`` a BatchVerdict,
    ``id:`` its place in that order, from 1); then ``event: end`` (``data``:
    ``batch_id``, ``status``, ``candidates``, ``verdicts``, ``cancelled``) once no
    verdict is awaited. A comment line goes out every 15 s while idle."""
    after = resume_after(last_event_id, "a verdict id")
    if not subjects.is_token(batch_id):
        _load(None, batch_id, viewer)
    found = await batches.get(batch_id)
    _load(found[0] if found else None, batch_id, viewer)
    return ServerSentEvent(_batch_stream(bus, batches, batch_id, after))


# Batch verification: ``/api/v1/verify`` (the ``/api/v1`` router adds the prefix).
verify_router = Router(path="/verify", route_handlers=[submit_batch, batch_status,
                                                       batch_cancel, batch_events],
                       dependencies={"batches": Provide(provide_batches, sync_to_thread=False)})
