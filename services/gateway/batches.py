"""``/api/v1/verify/batch``: verify many candidates of one task (RL loops, leaderboards).

A batch is one task (the task fields of a job) and up to ``batch_max_candidates``
candidates, each a module defining ``class ModelNew``. It travels the bus the way a
job's candidates do (docs/architecture.md, "The life of a verify request"): no new
path, only the gateway in the generator's place.

- **Admission** (services/gateway/limits.py): the tenant's in-flight and per-hour
  limits count the batch's candidates, a batch of 50 as 50 jobs; ``max_timeout_s`` and
  ``max_priority`` apply as to a job.
- **Identical candidates** (same normalised AST,
  :func:`services.common.records.normalised_hash`, the hash evolve jobs dedupe by)
  are verified once: only the first of them gets a verify request, the others reuse
  its verdict (``duplicate_of``).
- **Record**: a :class:`~schemas.events.BatchRecord` under ``<batch_id>`` in the
  ``batches`` bucket, every change a compare-and-swap on its revision.
- **Requests**: one :class:`~schemas.events.VerifyRequest` per distinct candidate on
  the tenant's VERIFY lane (``verify.<backend>.<arch>`` for the default tenant), the
  batch id as ``job_id``, ``<batch_id>-r<index>`` as request id and ``Nats-Msg-Id``;
  workers answer on ``results.<batch_id>``.
- **Verdicts** are folded into the record (:func:`fold`) in the order the RESULTS
  stream holds them, i.e. the order they finished, by whoever reads first: a task of
  the gateway that took the batch follows it until it ends, and every read of the
  record or its event stream folds too, so a batch whose gateway died is still
  brought up to date. A result already folded (a redelivered request run twice) is
  skipped.
- **Cancel**: the record turns ``cancelled``; requests no worker has been given yet
  (VERIFY sequence above the lane consumer's delivered one) are deleted from the
  stream, so they are never verified, and their candidates marked ``cancelled``;
  verdicts of verifications already started still land and are kept.

The bus, the tenant and the viewer are dependencies (services/gateway/deps.py); NATS
trouble is answered 503 by the app's exception handler (services/gateway/errors.py).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Annotated

import msgspec
import nats.errors
import nats.js.errors
import structlog
from cachetools import LRUCache
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
from nats.js.kv import KeyValue
from prometheus_client import Counter

from schemas import (
    BatchCandidate,
    BatchRecord,
    BatchSubmit,
    BatchVerdict,
    VerifyRequest,
    VerifyResult,
    decode,
    encode,
    new_id,
    subjects,
    utcnow,
)
from schemas.events import BatchTask
from services.common.bus import Bus, create_record, update_record
from services.common.jobs import CheckedJobStore
from services.common.lane_watch import LaneWatch
from services.common.records import normalised_hash
from services.common.runtime import cancel_and_wait
from services.common.tenants import Tenant, tenant_label
from services.common.verdicts import ResultsReader, batch_key, claim_nonce
from services.gateway.deps import provide_tenant
from services.gateway.jobs import (
    check_task,
    refuse_deep_body,
    resume_after,
    routed_arch,
    strict_decode,
)
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

# How often a follower (the accepting gateway's task, an event stream) reads the
# RESULTS stream for new verdicts, seconds: verdicts take seconds each, so half a
# second adds little to when a client sees one.
POLL_S = 0.5
# Keepalive comment period of the event stream, seconds (as the job event stream,
# services/gateway/events.py).
HEARTBEAT_S = 15.0
# Longest error text kept per verdict in the record, characters: a record holds up
# to batch_max_candidates verdicts and must stay well under NATS' 1 MiB payload; the
# whole error stays in the RESULTS stream.
ERROR_CHARS = 500
# Compare-and-swap attempts on a batch record before giving up (RuntimeError, a 500).
CAS_ATTEMPTS = 50


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


class BatchStore:
    """The ``batches`` bucket: one :class:`BatchRecord` per batch id.

    Raises (every method): ``nats.errors.Error`` when NATS fails (answered 503).
    """

    def __init__(self, kv: KeyValue) -> None:
        self.kv = kv

    async def get(self, batch_id: str) -> tuple[BatchRecord, int] | None:
        """The record and its revision, or None when there is none.

        Raises:
            RuntimeError: the stored value is not a BatchRecord (written by something
                other than AIKG); answered 500 naming the batch.
        """
        try:
            entry = await self.kv.get(batch_id)
        except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
            return None
        try:
            return decode(entry.value or b"", BatchRecord), entry.revision
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise RuntimeError(f"batch record {batch_id} is corrupt: {exc}") from exc

    async def create(self, record: BatchRecord) -> bool:
        """Create the record; False when the id is taken."""
        return await create_record(self.kv, record.batch_id, record)

    async def update(self, batch_id: str,
                     change: Callable[[BatchRecord], bool]) -> BatchRecord | None:
        """Apply ``change`` (True: it changed the record) by compare-and-swap, again on
        a fresh read when another write won; the record as stored, None when gone.

        Raises:
            RuntimeError: :data:`CAS_ATTEMPTS` writes all lost, or the record is corrupt.
        """
        return await update_record(self.kv, batch_id, lambda: self.get(batch_id),
                                   lambda record: record if change(record) else None,
                                   attempts=CAS_ATTEMPTS, what="batch")

    async def delete(self, batch_id: str) -> None:
        """Remove the record (a batch withdrawn before its requests went out)."""
        await self.kv.delete(batch_id)


def provide_batches(bus: NamedDependency[Bus]) -> BatchStore:
    """The ``batches`` bucket of the gateway's bus."""
    if bus.batches is None:  # a Bus built by hand without it
        raise HTTPException(status_code=503, detail="the gateway's bus has no batches "
                            "bucket; restart the gateway")
    return BatchStore(bus.batches)


# --- pure logic -------------------------------------------------------------------


def plan_candidates(batch_id: str, codes: list[str]) -> list[BatchCandidate]:
    """One :class:`BatchCandidate` per code, in order; a code whose normalised hash an
    earlier one has gets that one's request id and ``duplicate_of`` its index."""
    first: dict[str, int] = {}
    planned = []
    for index, code in enumerate(codes):
        digest = normalised_hash(code)
        original = first.setdefault(digest, index)
        planned.append(BatchCandidate(
            index=index, candidate_id=f"{batch_id}-c{index}",
            request_id=f"{batch_id}-r{original}", code_hash=digest,
            duplicate_of=None if original == index else original))
    return planned


def settled(record: BatchRecord) -> bool:
    """Whether no more verdicts are awaited: every candidate has one or was cancelled
    unstarted (a cancelled batch's started verifications may still add one)."""
    decided = {v.index for v in record.verdicts}
    return all(c.index in decided or c.cancelled for c in record.candidates)


def add_verdicts(record: BatchRecord, results: list[tuple[int, VerifyResult]]) -> bool:
    """Append the verdicts of ``results`` (``(RESULTS sequence, result)``, in stream
    order) for each candidate of their request that has none yet; a running batch
    whose every candidate then has one is ``completed``. True when the record changed."""
    by_request: dict[str, list[BatchCandidate]] = {}
    for c in record.candidates:
        by_request.setdefault(c.request_id, []).append(c)
    decided = {v.index for v in record.verdicts}
    changed = False
    for seq, result in results:
        for c in by_request.get(result.request_id, []):
            if c.index in decided:
                continue
            decided.add(c.index)
            changed = True
            record.verdicts.append(BatchVerdict(
                index=c.index, candidate_id=c.candidate_id, request_id=c.request_id,
                passed=result.passed, stage=result.stage,
                error=(result.error or "")[:ERROR_CHARS] or None,
                duplicate_of=c.duplicate_of, speedup=result.speedup,
                base_time_us=result.base_time_us, gen_time_us=result.gen_time_us,
                max_abs_error=result.max_abs_error, trials=result.trials,
                interpreted=result.interpreted, duration_s=result.duration_s,
                worker_id=result.worker_id, reference_source=result.reference_source,
                baseline_source=result.baseline_source, finished_at=result.finished_at,
                seq=seq))
    if record.status == "running" and len(decided) == len(record.candidates):
        record.status, record.end_time, changed = "completed", utcnow(), True
    return changed


# --- on the bus -------------------------------------------------------------------


# One reader per batch this gateway folds (its place in the stream and the holders
# of the batch's requests; services/common/verdicts.py), so a fold reads only what
# landed since the last; a gateway that restarts reads a batch's subject from the start
# once.
_READERS: LRUCache[str, ResultsReader] = LRUCache(maxsize=4096)


async def _results_after(bus: Bus, batch_id: str, after: int) -> list[tuple[int, VerifyResult]]:
    """The verdicts that count (services/common/verdicts.py: from the worker that holds
    the request) on ``results.<batch_id>.>`` after RESULTS sequence ``after``, read
    with the stream's message-get API (no consumer)."""
    reader = _READERS.get(batch_id)
    if reader is None or reader.js is not bus.js:
        key = await batch_key(bus.batches, batch_id)
        reader = _READERS[batch_id] = ResultsReader(bus.js, batch_id, key)
    return [(seq, result) for seq, result in await reader.read() if seq > after]


async def fold(bus: Bus, store: BatchStore, batch_id: str) -> BatchRecord | None:
    """Bring the batch's record up to date with ``results.<batch_id>``; the record as
    stored (None when there is none)."""
    found = await store.get(batch_id)
    if found is None:
        return None
    record = found[0]
    after = max((v.seq for v in record.verdicts), default=0)
    results = await _results_after(bus, batch_id, after)
    if not results:
        return record
    return await store.update(batch_id, lambda r: add_verdicts(r, results))


async def follow(bus: Bus, batch_id: str) -> None:
    """Fold the batch's verdicts into its record as they land, until it is settled or
    its record is gone; NATS trouble is logged and retried. When the batch's
    backend/arch has had no live worker for ``verify_unserved_timeout_s``
    (services/common/lane_watch.py), every candidate still without a verdict fails
    with a message naming the lane (:func:`fail_unserved`)."""
    store = BatchStore(bus.batches)  # type: ignore[arg-type]
    watch: LaneWatch | None = None
    while True:
        try:
            record = await fold(bus, store, batch_id)
            if record is None or settled(record):
                return
            if watch is None:
                watch = LaneWatch(bus.js, record.task.backend, record.task.arch,
                                  bus.settings.verify_unserved_timeout_s, waiter="batch")
            if record.status == "running" and (message := await watch.check()):
                await fail_unserved(bus, store, record, message)
                return
        except (nats.errors.Error, nats.js.errors.Error, TimeoutError, OSError) as exc:
            log.warning("batch_follow_failed", batch_id=batch_id, error=repr(exc))
        await asyncio.sleep(POLL_S)


def add_unserved(record: BatchRecord, message: str) -> bool:
    """Give every candidate of a running ``record`` that has no verdict and was not
    cancelled a failed one (stage ``infrastructure``, ``error`` ``message``, no
    worker), and mark the batch ``completed``. True when the record changed."""
    if record.status != "running":
        return False
    decided = {v.index for v in record.verdicts}
    for c in record.candidates:
        if c.index in decided or c.cancelled:
            continue
        record.verdicts.append(BatchVerdict(
            index=c.index, candidate_id=c.candidate_id, request_id=c.request_id,
            passed=False, stage="infrastructure", error=message[:ERROR_CHARS],
            duplicate_of=c.duplicate_of))
    record.status, record.end_time = "completed", utcnow()
    return True


async def fail_unserved(bus: Bus, store: BatchStore, record: BatchRecord, message: str) -> None:
    """Fail the candidates of ``record`` without a verdict because no worker serves its
    lane (:func:`add_unserved`), after taking their requests out of VERIFY: no live
    worker holds them (it would heartbeat), so they would only wait there for a
    worker of a pair nobody serves."""
    decided = {v.request_id for v in record.verdicts}
    for c in record.candidates:
        if c.duplicate_of is None and c.request_id not in decided and c.verify_seq:
            with contextlib.suppress(nats.js.errors.NotFoundError):
                await bus.js.delete_msg(subjects.STREAM_VERIFY, c.verify_seq)
    await fold(bus, store, record.batch_id)  # verdicts that landed meanwhile count
    await store.update(record.batch_id, lambda r: add_unserved(r, message))
    log.warning("batch_unserved", batch_id=record.batch_id, backend=record.task.backend,
                arch=record.task.arch, message=message)


def _start_follower(state: State, bus: Bus, batch_id: str) -> None:
    followers: set[asyncio.Task] = state.get("batch_followers")
    task = asyncio.create_task(follow(bus, batch_id), name=f"batch-{batch_id}")
    followers.add(task)
    task.add_done_callback(followers.discard)


async def stop_followers(state: State) -> None:
    """Cancel the gateway's batch followers (at shutdown; the records stay, and any
    later read folds what they would have)."""
    await cancel_and_wait(*state.get("batch_followers", set()))


async def _delivered_seq(bus: Bus, record: BatchRecord) -> int | None:
    """The VERIFY sequence up to which the batch's lane consumer has handed requests to
    workers, or None when it cannot be read."""
    task = record.task
    consumer = subjects.verify_lane_consumer(task.backend, task.arch, record.tenant,
                                             task.priority)
    try:
        info = await bus.js.consumer_info(subjects.STREAM_VERIFY, consumer)
    except (nats.errors.Error, nats.js.errors.Error, TimeoutError) as exc:
        log.warning("batch_consumer_info_failed", consumer=consumer, error=repr(exc))
        return None
    return info.delivered.stream_seq or 0


async def _take_back(bus: Bus, record: BatchRecord) -> set[str]:
    """Delete from VERIFY the requests of ``record`` without a verdict that no worker
    has been given; their request ids. With the consumer unreadable, every request
    without a verdict is deleted (a worker already running one still answers it)."""
    delivered = await _delivered_seq(bus, record)
    decided = {v.request_id for v in record.verdicts}
    taken = set()
    for c in record.candidates:
        if c.duplicate_of is not None or c.request_id in decided or not c.verify_seq:
            continue
        if delivered is not None and c.verify_seq <= delivered:
            continue
        try:
            if await bus.js.delete_msg(subjects.STREAM_VERIFY, c.verify_seq):
                taken.add(c.request_id)
        except nats.js.errors.NotFoundError:
            pass  # acked already: its verdict is in RESULTS
    return taken


# --- routes -----------------------------------------------------------------------


async def check_batch_body(request: Request) -> None:
    """``before_request`` of the submit route: depth bound, then the strict decode
    (services/gateway/jobs.py, :func:`~services.gateway.jobs.strict_decode`), kept in
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


async def _publish_requests(bus: Bus, record: BatchRecord, codes: list[str]) -> dict[str, int]:
    """Publish the verify request of each distinct candidate; request id -> VERIFY
    sequence. On a failure the ones published are deleted again before it raises."""
    task = record.task
    subject = subjects.verify_lane(task.backend, task.arch, record.tenant, task.priority)
    seqs: dict[str, int] = {}
    key = await batch_key(bus.batches, record.batch_id)
    try:
        for c in record.candidates:
            if c.duplicate_of is not None:
                continue
            request = VerifyRequest(
                request_id=c.request_id, job_id=record.batch_id, candidate_id=c.candidate_id,
                op_name=task.op_name, task_desc=task.task_desc, code=codes[c.index],
                backend=task.backend, arch=task.arch, dsl=task.dsl, framework=task.framework,
                mode="verify" if task.backend == "cpu" else "profile",
                shape_overrides=task.shape_overrides, timeout_s=task.timeout_s,
                trials=task.trials, tenant=record.tenant, priority=task.priority,
                allow_unchecked=task.allow_unchecked,
                claim_nonce=claim_nonce(key, c.request_id))
            ack = await bus.js.publish(subject, encode(request),
                                       headers={"Nats-Msg-Id": c.request_id})
            seqs[c.request_id] = ack.seq
    except Exception:
        for seq in seqs.values():
            with contextlib.suppress(Exception):
                await bus.js.delete_msg(subjects.STREAM_VERIFY, seq)
        raise
    return seqs


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
            seqs = await _publish_requests(bus, record, data.candidates)
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
            await _cancel_unstarted(bus, batches, stored)
        await held.commit_batch(unique)
        _start_follower(state, bus, batch_id)
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
        await _cancel_unstarted(bus, batches, record)
    return _load(await fold(bus, batches, batch_id), batch_id, viewer)


async def _cancel_unstarted(bus: Bus, batches: BatchStore, record: BatchRecord) -> None:
    """Take back the cancelled batch's requests no worker was given
    (:func:`_take_back`) and mark their candidates (duplicates included) ``cancelled``."""
    taken = await _take_back(bus, record)

    def mark(r: BatchRecord) -> bool:
        hit = [c for c in r.candidates if c.request_id in taken and not c.cancelled]
        for c in hit:
            c.cancelled = True
        return bool(hit)

    await batches.update(record.batch_id, mark)
    log.info("batch_cancelled", batch_id=record.batch_id, taken_back=len(taken))


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
