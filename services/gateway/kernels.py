"""``GET /api/v1/kernels``: every job's kernel as a flat row, page by page, by cursor.

Rows (:class:`schemas.KernelRow`) come from the job records in the ``jobs`` bucket:
one per job that ended with a kernel (``result.code``), ordered by the job's
``end_time``, then ``job_id``. The cursor names the last row a page returned; the
next page starts after it, so a client that keeps the cursor resumes an export
later and gets only the kernels of jobs that ended since. (A generator whose clock
runs behind another's can end a job "earlier" than a row already exported; such a
row is missed by a resumed export. ``end_time`` comes from the generators' clocks.)
"""

from __future__ import annotations

import base64
import binascii
import datetime as dt
import hashlib
import json
from typing import Annotated

import msgspec
from litestar import Router, get
from litestar.di import NamedDependency
from litestar.exceptions import ClientException
from litestar.params import QueryParameter

from schemas import JobRecord, KernelRow, subjects
from services.common.bus import Bus
from services.common.jobs import JobRecordCorrupt, decode_record
from services.gateway.views import read_bucket

# Largest page: a row carries its task and kernel sources (a few KiB each, at most
# 1 MiB each), so pages stay in the low megabytes.
MAX_KERNEL_PAGE = 500
_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)


class KernelPage(msgspec.Struct, kw_only=True):
    """A page of kernel rows.

    ``next_cursor``: pass it as ``cursor`` to get the rows after this page; it is set
    on every page (on an empty one it is the cursor that was given), so a client can
    keep it and come back for kernels of jobs that end later. ``more``: rows after
    this page exist now.
    """

    kernels: list[KernelRow]
    next_cursor: str | None
    more: bool


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def kernel_row(record: JobRecord) -> KernelRow | None:
    """The export row of a job record, or None when the job has no kernel."""
    result = record.result
    if result is None or not result.code:
        return None
    verdict = result.verdict
    request = record.request
    return KernelRow(
        job_id=record.job_id, candidate_id=result.candidate_id, op_name=record.op_name,
        job_type=record.job_type, status=record.status, backend=record.backend,
        arch=record.arch, dsl=request.dsl, framework=request.framework,
        workflow=request.workflow, coder=result.coder, model=result.model,
        task_desc=request.task_desc, task_sha256=_sha256(request.task_desc),
        shape_overrides=json.dumps(request.shape_overrides, sort_keys=True),
        code=result.code, code_sha256=_sha256(result.code), passed=result.passed,
        stage=verdict.stage if verdict else None, error=verdict.error if verdict else None,
        attempts=result.attempts, trials=verdict.trials if verdict else None,
        max_abs_error=verdict.max_abs_error if verdict else None,
        max_rel_error=verdict.max_rel_error if verdict else None,
        atol=verdict.atol if verdict else None, rtol=verdict.rtol if verdict else None,
        base_time_us=verdict.base_time_us if verdict else None,
        gen_time_us=verdict.gen_time_us if verdict else None,
        speedup=verdict.speedup if verdict else result.speedup,
        interpreted=verdict.interpreted if verdict else None,
        worker_id=verdict.worker_id if verdict else None,
        device=verdict.device if verdict else None,
        verify_duration_s=verdict.duration_s if verdict else None,
        baseline_source=verdict.baseline_source if verdict else None,
        submit_time=record.submit_time, end_time=record.end_time,
    )


def _position(row: KernelRow) -> tuple[dt.datetime, str]:
    return (row.end_time or row.submit_time or _EPOCH, row.job_id)


def encode_cursor(position: tuple[dt.datetime, str]) -> str:
    """An opaque cursor (URL-safe base64 of ``[end_time, job_id]``)."""
    raw = json.dumps([position[0].isoformat(), position[1]]).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str) -> tuple[dt.datetime, str]:
    """The position a cursor names.

    Raises:
        ClientException: (400) it is not a cursor this route sent.
    """
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        when, job_id = json.loads(raw)
        moment = dt.datetime.fromisoformat(when)
        if moment.tzinfo is None or not isinstance(job_id, str):
            raise ValueError("not a cursor")
    except (binascii.Error, ValueError, TypeError, UnicodeDecodeError):
        raise ClientException(detail=f"cursor {cursor[:40]!r} is not a cursor of this route: "
                              "pass the next_cursor of an earlier page, or leave it out to "
                              "start from the first kernel") from None
    return moment, job_id


def kernel_page(records: dict[str, bytes], *, passed: bool | None, op_name: str | None,
                      backend: str | None, arch: str | None, cursor: str | None,
                      limit: int, tenant: str | None = None) -> KernelPage:
    """The page of rows after ``cursor`` among ``records`` (key -> stored value)
    matching the filters (``tenant``: only that tenant's jobs); corrupt records are
    left out."""
    after = decode_cursor(cursor) if cursor else None
    rows = []
    for key, value in records.items():
        try:
            record = decode_record(key, value)
        except JobRecordCorrupt:
            continue
        if tenant is not None and record.tenant != tenant:
            continue
        row = kernel_row(record)
        if row is None or (passed is not None and row.passed != passed):
            continue
        if (op_name is not None and row.op_name != op_name) or (
                backend is not None and row.backend != backend) or (
                arch is not None and row.arch != arch):
            continue
        if after is not None and _position(row) <= after:
            continue
        rows.append(row)
    rows.sort(key=_position)
    page = rows[:limit]
    next_cursor = encode_cursor(_position(page[-1])) if page else cursor
    return KernelPage(kernels=page, next_cursor=next_cursor, more=len(rows) > limit)


@get("/", summary="Kernels (export)")
async def kernels_list(
    bus: NamedDependency[Bus],
    viewer: NamedDependency[str | None],
    passed: Annotated[bool | None, QueryParameter(
        description="Only kernels that passed (true) or failed (false) verification; "
        "leave out for both.")] = None,
    op_name: Annotated[str | None, QueryParameter(
        max_length=128, description="Only kernels of this operator (exact).")] = None,
    backend: Annotated[str | None, QueryParameter(
        max_length=64, description="Only kernels verified on this backend.")] = None,
    arch: Annotated[str | None, QueryParameter(
        max_length=64, description="Only kernels verified on this arch.")] = None,
    cursor: Annotated[str | None, QueryParameter(
        max_length=1024, description="Resume after this cursor (next_cursor of an "
        "earlier page).")] = None,
    limit: Annotated[int, QueryParameter(ge=1, le=MAX_KERNEL_PAGE,
                                         description="Page size, rows.")] = 100,
) -> KernelPage:
    """Every job's kernel with its task, verdict, timings, arch and provenance (job,
    candidate, coder, model, worker), ordered by the job's end time; page on with
    ``cursor``. ``aikg export`` writes them as JSON Lines or Parquet. A tenant's token
    exports only its own tenant's kernels."""
    return kernel_page(await read_bucket(bus.js, subjects.BUCKET_JOBS), passed=passed,
                       op_name=op_name, backend=backend, arch=arch, cursor=cursor,
                       limit=limit, tenant=viewer)


# Kernels: ``/api/v1/kernels`` (the ``/api/v1`` router adds the prefix).
kernels_router = Router(path="/kernels", route_handlers=[kernels_list])
