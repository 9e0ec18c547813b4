"""Tenant limits on job submissions (services/common/tenants.py names the limits).

Checked by ``POST /api/v1/jobs/submit`` (services/gateway/jobs.py), in this order:

- :func:`check_job_limits`: the job is no larger than the tenant may submit
  (``max_parallel_num``, ``max_rounds``, ``max_timeout_s``, ``max_priority``), else 403
  naming the limit; retrying cannot help, so no ``Retry-After``;
- :func:`claim`: a *claim* on one of the tenant's slots, taken by compare-and-swap on
  the tenant's admission entry in the ``tenant_usage`` bucket (key
  ``admission.<tenant>``), so that N concurrent submissions through any number of
  gateways admit exactly the limit: fewer than ``max_in_flight`` jobs pending or
  running (the messages in the tenant's JOBS lanes, plus claims not yet published)
  and fewer than ``max_jobs_per_hour`` admitted this clock hour (UTC), else 429 with
  ``Retry-After``. A refused submission writes nothing.
- after the publish, :meth:`Claim.commit` drops the claim (the job's message now
  counts in its lane); when the job is not queued after all (its id was taken, the
  publish failed), :meth:`Claim.withdraw` gives the slot back.

A claim records its expiry (:data:`CLAIM_TTL_S`). A gateway that dies between its
claim and its commit leaves a claim nobody commits; the next admission of that tenant
settles it once expired: when the job's record exists (the record is written right
after the claim, before the publish) the job keeps its place in the hour's count,
else the slot is given back. The count thus never drifts by a dead gateway.

Why this order is exact for ``max_in_flight``: an admission reads the entry, then the
lanes' message counts, then writes the entry with the revision it read. A commit
happens after its job's publish was acknowledged, and changes the entry; so any
admission either reads the entry before that commit (then its write fails on the
revision and it starts again) or after it (then it reads the lanes after the
publish and counts the job there).

Refusals are counted in ``aikg_gateway_rejections_total`` by tenant and limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import random
import time
from dataclasses import dataclass

import msgspec
import nats.js.errors
import structlog
from litestar.datastructures import State
from litestar.exceptions import HTTPException
from nats.js.kv import KeyValue
from prometheus_client import Counter

from schemas import JobSubmit, subjects, utcnow
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

# Compare-and-swap attempts on a tenant's admission entry before the submission is
# answered 503 (retry), and the largest random pause between two, seconds: a lost race
# with another gateway costs one more read and write, so even a burst of many
# concurrent submissions of one tenant through several gateways settles in a few
# rounds (within one gateway they wait on the tenant's lock instead of racing).
CLAIM_ATTEMPTS = 50
CLAIM_RETRY_S = 0.02
# How long a claim holds a slot before a later admission may settle it, seconds: far
# above one submission's record write and publish (milliseconds; NATS' own request
# timeout is 5 s), so only a gateway that died or hung mid-submission leaves one.
CLAIM_TTL_S = 30.0


class _Admission(msgspec.Struct, kw_only=True):
    """The value of ``admission.<tenant>`` in ``tenant_usage``.

    ``hour``: the clock hour (UTC, ``YYYYMMDDHH``) ``used`` counts; ``used``: jobs
    admitted in that hour; ``claims``: job id -> ``[expiry (Unix time, seconds), hour
    it was counted in]`` of admissions not yet committed.
    """

    hour: str = ""
    used: int = 0
    claims: dict[str, tuple[float, str]] = {}


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
    """One lock per tenant in this gateway: its own submissions take their claims one
    after another instead of racing on the admission entry (other gateways' race is
    settled by compare-and-swap)."""
    locks: dict[str, asyncio.Lock] = state.get("tenant_locks")
    return locks.setdefault(name, asyncio.Lock())


def _hour(now: dt.datetime) -> tuple[str, float]:
    """The clock hour (UTC) as ``YYYYMMDDHH``, and seconds to its end."""
    end = now.replace(minute=0, second=0, microsecond=0) + dt.timedelta(hours=1)
    return f"{now:%Y%m%d%H}", (end - now).total_seconds()


def admission_key(tenant: str) -> str:
    """Key of the tenant's admission entry in ``tenant_usage``."""
    return f"admission.{tenant}"


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


async def _read(kv: KeyValue, key: str) -> tuple[_Admission, int]:
    """The admission entry and its revision (0: no entry yet; a value that does not
    decode is started afresh, logged)."""
    try:
        entry = await kv.get(key)
    except nats.js.errors.KeyNotFoundError:
        return _Admission(), 0
    try:
        return msgspec.json.decode(entry.value or b"{}", type=_Admission), entry.revision
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        log.warning("tenant_admission_corrupt", key=key, error=str(exc))
        return _Admission(), entry.revision


async def _write(kv: KeyValue, key: str, state: _Admission, revision: int) -> bool:
    """Compare-and-swap ``state`` over ``revision``; False when another write won."""
    value = msgspec.json.encode(state)
    try:
        if revision:
            await kv.update(key, value, last=revision)
        else:
            await kv.create(key, value)
    except nats.js.errors.KeyWrongLastSequenceError:  # also create() on a taken key
        return False
    return True


async def _settle(store: CheckedJobStore, state: _Admission, now: float, hour: str) -> bool:
    """Start a new hour's count and settle expired claims; True when ``state`` changed.

    An expired claim whose job has a record keeps its place in the hour's count (its
    gateway got as far as writing the record); one without a record gives its slot back.
    """
    changed = False
    if state.hour != hour:
        state.hour, state.used, changed = hour, 0, True
    for job_id, (expiry, counted_in) in list(state.claims.items()):
        if expiry > now:
            continue
        del state.claims[job_id]
        changed = True
        exists = True
        try:
            await store.get(job_id)
        except JobNotFound:
            exists = False
        except JobRecordCorrupt:
            pass
        if not exists and counted_in == state.hour:
            state.used = max(0, state.used - 1)
        log.info("tenant_claim_settled", job_id=job_id, kept=exists)
    return changed


@dataclass
class Claim:
    """An admitted submission's hold on one of its tenant's slots (:func:`claim`)."""

    bus: Bus
    tenant: str
    job_id: str
    active: bool = True

    async def _release(self, give_back: bool) -> None:
        """Drop the claim (``give_back``: and its place in the hour's count). Never
        raises: a claim left behind is settled by an admission once it expires."""
        kv = self.bus.tenant_usage
        if not self.active or kv is None:
            return
        self.active = False
        key = admission_key(self.tenant)
        try:
            for _ in range(CLAIM_ATTEMPTS):
                state, revision = await _read(kv, key)
                held = state.claims.pop(self.job_id, None)
                if held is None:
                    return  # settled already by another admission
                if give_back and held[1] == state.hour:
                    state.used = max(0, state.used - 1)
                if await _write(kv, key, state, revision):
                    return
                await asyncio.sleep(random.uniform(0, CLAIM_RETRY_S))
            error = f"{CLAIM_ATTEMPTS} compare-and-swap rounds lost"
        except Exception as exc:  # noqa: BLE001 - settled once it expires
            error = f"{type(exc).__name__}: {exc}"
        log.warning("tenant_claim_release_failed", job_id=self.job_id, error=error,
                    note=f"settled once it expires ({CLAIM_TTL_S:g} s)")

    async def commit(self) -> None:
        """The job is queued: drop the claim (its lane message counts from now on)."""
        await self._release(give_back=False)

    async def withdraw(self) -> None:
        """The job is not queued after all: give its slot back."""
        await self._release(give_back=True)


async def claim(bus: Bus, store: CheckedJobStore, tenant: Tenant, job_id: str) -> Claim:
    """Take one of ``tenant``'s slots for job ``job_id``, or refuse.

    Returns:
        The claim: :meth:`Claim.commit` it once the job is published,
        :meth:`Claim.withdraw` it when the job is not queued. A tenant without
        ``max_in_flight`` and ``max_jobs_per_hour`` (or a bus without the
        ``tenant_usage`` bucket) gets an inactive claim and writes nothing.

    Raises:
        HTTPException: 429 with ``Retry-After`` over ``max_in_flight`` or
            ``max_jobs_per_hour``; 503 when :data:`CLAIM_ATTEMPTS` compare-and-swap
            rounds were all lost to other submissions (retry).
    """
    kv = bus.tenant_usage
    if kv is None or not (tenant.max_in_flight or tenant.max_jobs_per_hour):
        return Claim(bus, tenant.name, job_id, active=False)
    key = admission_key(tenant.name)
    for _ in range(CLAIM_ATTEMPTS):
        state, revision = await _read(kv, key)
        now = time.time()
        hour, left_s = _hour(utcnow())
        changed = await _settle(store, state, now, hour)
        refusal = None
        if tenant.max_in_flight:
            busy = await in_flight(bus, tenant.name) + len(state.claims)
            if busy >= tenant.max_in_flight:
                refusal = _refuse(tenant, "max_in_flight", 429, f"tenant {tenant.name!r} has "
                                  f"{busy} jobs pending or running, its limit (max_in_flight) "
                                  f"is {tenant.max_in_flight}: retry when one has ended, or "
                                  "cancel one", retry_after_s=5)
        if refusal is None and tenant.max_jobs_per_hour and \
                state.used >= tenant.max_jobs_per_hour:
            refusal = _refuse(tenant, "max_jobs_per_hour", 429, f"tenant {tenant.name!r} has "
                              f"submitted {state.used} jobs this hour (UTC), its limit "
                              f"(max_jobs_per_hour) is {tenant.max_jobs_per_hour}: retry "
                              f"after {left_s:.0f} s", retry_after_s=left_s)
        if refusal is not None:
            if changed:  # housekeeping only; a lost race leaves it to the next one
                with contextlib.suppress(Exception):
                    await _write(kv, key, state, revision)
            raise refusal
        state.claims[job_id] = (now + CLAIM_TTL_S, hour)
        state.used += 1
        if await _write(kv, key, state, revision):
            return Claim(bus, tenant.name, job_id)
        await asyncio.sleep(random.uniform(0, CLAIM_RETRY_S))
    raise HTTPException(status_code=503, headers={"Retry-After": "1"},
                        detail=f"tenant {tenant.name!r} has many submissions racing for its "
                        f"limits; none of {CLAIM_ATTEMPTS} attempts won: retry shortly")
