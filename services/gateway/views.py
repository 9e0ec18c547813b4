"""What the gateway reads back for listings: job summaries, workers with load and leases.

Buckets are read with :func:`services.common.bus.bucket_entries` (the last value of
every key, without a consumer, which the gateway's user may not create): one stream
info request lists the keys, then one message get per key, so listing a thousand jobs
is a thousand requests (~0.25 ms each on loopback).
"""

from __future__ import annotations

import contextlib
import datetime as dt
from typing import Any, Literal

import msgspec
import nats.errors
from nats.js import JetStreamContext

from schemas import JobRecord, WorkerInfo, subjects
from schemas.events import JobStatus
from services.common.bus import Bus, bucket_entries
from services.common.records import JobRecordCorrupt, decode_record

# A job id is one NATS subject token (schemas.events.JobId); anything else names no job.
# A list row's status: a job status, or ``corrupt`` for a record that does not decode.
CORRUPT = "corrupt"
ListStatus = Literal[JobStatus, "corrupt"]


class JobSummary(msgspec.Struct, kw_only=True):
    """One row of ``GET /api/v1/jobs``: the record without request, result code or verdict.

    ``passed`` is None until the job has a result; ``speedup`` is None when timings were
    not meaningful (cpu backend) or the job has no result. A record that does not decode
    is a row with status ``corrupt``, ``error`` naming the fault, empty ``op_name`` /
    ``job_type`` / ``backend`` and ``submit_time`` the time the bad value was written.
    ``queue_position`` / ``estimated_start_time``: as on the job's status, while it waits.
    """

    job_id: str
    status: str
    job_type: str
    op_name: str
    backend: str
    arch: str | None
    submit_time: dt.datetime
    start_time: dt.datetime | None = None
    end_time: dt.datetime | None = None
    updated_at: dt.datetime | None = None
    phase: str = ""
    message: str = ""
    passed: bool | None = None
    speedup: float | None = None
    error: str | None = None
    tenant: str = ""
    priority: str = ""
    # Filled in by the list route while the job waits (services/gateway/queue.py).
    queue_position: int | None = None
    estimated_start_time: dt.datetime | None = None


class JobPage(msgspec.Struct, kw_only=True):
    """A page of job summaries, newest first; ``total`` counts every match."""

    jobs: list[JobSummary]
    total: int
    limit: int
    offset: int


class Lease(msgspec.Struct, kw_only=True):
    """A device held by a worker: value of ``<worker_id>.<device>`` in bucket ``leases``.

    ``since`` is when the current run took the device; ``job_id`` / ``request_id`` the
    verify request running there; ``tenant``, ``backend`` and ``arch`` whose request and
    which device pool (each worker's tenant shares count them, services/common/shares.py;
    a lease written before workers recorded the tenant: the job's record says).
    """

    worker_id: str = ""
    device: str = ""
    job_id: str | None = None
    request_id: str | None = None
    since: dt.datetime | None = None
    tenant: str | None = None
    backend: str | None = None
    arch: str | None = None


class WorkerStatus(WorkerInfo, kw_only=True):
    """A live worker with its load (``in_flight / capacity``, 0.0 to 1.0) and the
    leases it holds now."""

    load: float = 0.0
    leases: list[Lease] = msgspec.field(default_factory=list)


class WorkerList(msgspec.Struct, kw_only=True):
    """Live workers: those whose heartbeat is in the ``workers`` bucket."""

    workers: list[WorkerStatus]


async def read_bucket(js: JetStreamContext, bucket: str) -> dict[str, bytes]:
    """The current value of every key of ``bucket`` (deleted and expired keys left out;
    :func:`services.common.bus.bucket_entries`).

    Raises:
        nats.errors.Error: NATS trouble (timeouts, no permission).
    """
    return {key: entry.value or b"" for key, entry in (await bucket_entries(js, bucket)).items()}


def summarize(record: JobRecord) -> JobSummary:
    """The list row of one job record."""
    result = record.result
    return JobSummary(
        job_id=record.job_id,
        status=record.status,
        job_type=record.job_type,
        op_name=record.op_name,
        backend=record.backend,
        arch=record.arch,
        submit_time=record.submit_time,
        start_time=record.start_time,
        end_time=record.end_time,
        updated_at=record.updated_at,
        phase=record.progress.phase,
        message=record.progress.message,
        passed=None if result is None else result.passed,
        speedup=None if result is None else result.speedup,
        error=record.error,
        tenant=record.tenant,
        priority=record.priority,
    )


def summarize_corrupt(exc: JobRecordCorrupt, written: dt.datetime | None) -> JobSummary:
    """The list row of a record that does not decode: status ``corrupt``, the fault in
    ``error``, ``submit_time`` when the bad value was written (now when unknown)."""
    return JobSummary(job_id=exc.job_id, status=CORRUPT, job_type="", op_name="", backend="",
                      arch=None, submit_time=written or dt.datetime.now(dt.UTC),
                      updated_at=written, phase=CORRUPT, message=str(exc), error=str(exc))


async def list_jobs(bus: Bus, *, status: str | None, op_name: str | None,
                    limit: int, offset: int, tenant: str | None = None) -> JobPage:
    """Jobs matching ``status``, ``op_name`` and ``tenant`` (exact), newest submission first.

    A record that does not decode (written by something other than AIKG, or cut short)
    keeps its place as a ``corrupt`` row (:func:`summarize_corrupt`); ``status="corrupt"``
    lists only those. Its operator is unknown, so an ``op_name`` filter leaves it out.
    """
    rows: list[JobSummary] = []
    for key, entry in (await bucket_entries(bus.js, subjects.BUCKET_JOBS)).items():
        try:
            record = decode_record(key, entry.value or b"")
        except JobRecordCorrupt as exc:
            if status in (None, CORRUPT) and op_name is None and tenant is None:
                rows.append(summarize_corrupt(exc, entry.created))
            continue
        if status is not None and record.status != status:
            continue
        if op_name is not None and record.op_name != op_name:
            continue
        if tenant is not None and record.tenant != tenant:
            continue
        rows.append(summarize(record))
    rows.sort(key=lambda r: (r.submit_time, r.job_id), reverse=True)
    return JobPage(jobs=rows[offset:offset + limit], total=len(rows), limit=limit, offset=offset)


def _decode_lease(value: bytes) -> Lease | None:
    with contextlib.suppress(msgspec.ValidationError, msgspec.DecodeError):
        return msgspec.json.decode(value, type=Lease)
    return None


async def _lease_tenant(bus: Bus, lease: Lease, known: dict[str, str | None]) -> str | None:
    """The tenant of the job a lease serves: the lease's own ``tenant``, else the job's
    record (None when neither says, e.g. an idle lease or a job gone)."""
    if lease.tenant or not lease.job_id:
        return lease.tenant
    if lease.job_id not in known:
        known[lease.job_id] = None
        with contextlib.suppress(Exception):
            entry = await bus.jobs.get(lease.job_id)
            known[lease.job_id] = decode_record(lease.job_id, entry.value or b"").tenant
    return known[lease.job_id]


async def list_workers(bus: Bus, viewer: str | None = None) -> WorkerList:
    """Live workers sorted by backend, arch, id, each with load and leases.

    A lease's owner is the key's part before the first dot (``<worker_id>.<device>``).
    ``viewer``: a tenant sees only the leases serving its own jobs (the rest of a
    worker, its load included, is the fleet's and shown to all); None, the operator,
    sees every lease.
    """
    workers = await read_bucket(bus.js, subjects.BUCKET_WORKERS)
    try:
        leases = await read_bucket(bus.js, subjects.BUCKET_LEASES)
    except nats.errors.TimeoutError:
        leases = {}
    held: dict[str, list[Lease]] = {}
    known: dict[str, str | None] = {}
    for key, value in leases.items():
        lease = _decode_lease(value)
        if lease is None:
            continue
        owner, _, device = key.partition(".")
        if viewer is not None and await _lease_tenant(bus, lease, known) != viewer:
            continue
        lease.worker_id = lease.worker_id or owner
        lease.device = lease.device or device
        held.setdefault(owner, []).append(lease)
    out: list[WorkerStatus] = []
    for value in workers.values():
        try:
            info = msgspec.json.decode(value, type=WorkerInfo)
        except (msgspec.ValidationError, msgspec.DecodeError):
            continue
        fields: dict[str, Any] = msgspec.structs.asdict(info)
        out.append(WorkerStatus(
            **fields,
            load=round(info.in_flight / info.capacity, 4) if info.capacity > 0 else 0.0,
            leases=sorted(held.get(info.worker_id, []), key=lambda lease: lease.device),
        ))
    out.sort(key=lambda w: (w.backend, w.arch, w.worker_id))
    return WorkerList(workers=out)
