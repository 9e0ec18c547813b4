"""Tenant limits on job submissions (services/common/tenants.py names the limits).

Checked by ``POST /api/v1/jobs/submit`` (services/gateway/jobs.py), in this order:

- :func:`check_job_limits`: the job is no larger than the tenant may submit
  (``max_parallel_num``, ``max_rounds``, ``max_timeout_s``, ``max_priority``), else 403
  naming the limit;
  retrying cannot help, so no ``Retry-After``;
- :func:`create_within_limits`, under the tenant's lock (:func:`tenant_lock`): fewer
  than ``max_in_flight`` jobs pending or running (the messages in the tenant's JOBS
  lanes) and fewer than ``max_jobs_per_hour`` submissions this clock hour (UTC, counted
  in the ``tenant_usage`` bucket by :func:`count_submission`), else 429 with
  ``Retry-After``; then the job's record is created.

Refusals are counted in ``aikg_gateway_rejections_total`` by tenant and limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt

import nats.js.errors
import structlog
from litestar.datastructures import State
from litestar.exceptions import HTTPException
from prometheus_client import Counter
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_fixed

from schemas import JobRecord, JobSubmit, subjects, utcnow
from services.common.bus import Bus, JobNotFound
from services.common.jobs import CheckedJobStore, JobRecordCorrupt
from services.common.tenants import Tenant, tenant_label

log = structlog.get_logger("aikg.gateway")

REJECTIONS = Counter(
    "aikg_gateway_rejections_total",
    "Submissions refused for a tenant limit, by tenant and limit (max_in_flight, "
    "max_jobs_per_hour: 429; max_parallel_num, max_rounds, max_priority: 403).",
    ["tenant", "limit"],
)

# Compare-and-swap attempts on a tenant's hourly count, and the pause between them,
# seconds: submissions of one tenant through several gateways race on one key.
COUNT_ATTEMPTS = 20
COUNT_RETRY_S = 0.01


def _refuse(tenant: Tenant, limit: str, status: int, detail: str,
            retry_after_s: float | None = None) -> HTTPException:
    REJECTIONS.labels(tenant=tenant_label(tenant.name), limit=limit).inc()
    log.info("job_rejected", tenant=tenant.name, limit=limit)
    headers = {"Retry-After": str(max(1, int(retry_after_s + 0.999)))} \
        if retry_after_s is not None else None
    return HTTPException(status_code=status, detail=detail, headers=headers,
                         extra={"tenant": tenant.name, "limit": limit})


def check_job_limits(tenant: Tenant, data: JobSubmit) -> None:
    """Refuse (403) a job larger than the tenant may submit, naming the limit: retrying
    cannot help, so no ``Retry-After``."""
    for limit, value in (("max_parallel_num", data.parallel_num),
                         ("max_rounds", data.max_rounds)):
        bound = getattr(tenant, limit)
        if bound and value > bound:
            raise _refuse(tenant, limit, 403, f"tenant {tenant.name!r} may submit jobs with "
                          f"{limit.removeprefix('max_')} up to {bound} ({limit}); this one "
                          f"asks for {value}: lower it, or ask an operator to raise the limit")
    if tenant.max_timeout_s and data.timeout_s > tenant.max_timeout_s:
        raise _refuse(tenant, "max_timeout_s", 403, f"tenant {tenant.name!r} may submit jobs "
                      f"with timeout_s up to {tenant.max_timeout_s:g} s (max_timeout_s); this "
                      f"one asks for {data.timeout_s:g} s: lower it, or ask an operator to "
                      "raise the limit")
    if not tenant.allows_priority(data.priority):
        raise _refuse(tenant, "max_priority", 403, f"tenant {tenant.name!r} may submit with "
                      f"priority up to {tenant.max_priority!r} (max_priority); this job asks "
                      f"for {data.priority!r}")


def tenant_lock(state: State, name: str) -> asyncio.Lock:
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


async def create_within_limits(bus: Bus, store: CheckedJobStore, tenant: Tenant,
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


async def count_submission(bus: Bus, tenant: Tenant) -> None:
    """Add one to the tenant's count of this hour (compare-and-swap; best effort).

    A lost race with another gateway (``KeyWrongLastSequenceError``) is retried, up to
    :data:`COUNT_ATTEMPTS` times; any other failure, or running out of attempts, is
    logged and the count left short, since the job is already queued.
    """
    if not tenant.max_jobs_per_hour or bus.tenant_usage is None:
        return
    kv = bus.tenant_usage
    key, _ = _hour_key(tenant.name, utcnow())
    try:
        async for attempt in AsyncRetrying(
                retry=retry_if_exception_type(nats.js.errors.KeyWrongLastSequenceError),
                stop=stop_after_attempt(COUNT_ATTEMPTS), wait=wait_fixed(COUNT_RETRY_S),
                reraise=True):
            with attempt:
                try:
                    entry = await kv.get(key)
                except nats.js.errors.KeyNotFoundError:
                    entry = None
                if entry is None:
                    await kv.create(key, b"1")
                else:
                    await kv.update(key, str(int(entry.value or b"0") + 1).encode(),
                                    last=entry.revision)
    except Exception as exc:  # noqa: BLE001 - the job is queued; the count is bookkeeping
        log.warning("tenant_usage_update_failed", tenant=tenant.name,
                    error=f"{type(exc).__name__}: {exc}")
