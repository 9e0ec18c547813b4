"""Tenant limits on job submissions (services/common/tenants.py names the limits).

Checked by ``POST /api/v1/jobs/submit`` (services/gateway/jobs.py) and
``POST /api/v1/verify/batch`` (services/gateway/batches.py), in this order:

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

A batch verification counts as many as it has candidates, against both limits: its
claim has that *weight*, and once its requests are published
(:meth:`Claim.commit_batch`) the claim becomes an open batch in the entry
(``batches``: batch id -> ``[candidates, requests]``), counted in flight until its
record says it ended or every request's verdict is in ``results.<batch_id>`` (checked
by each admission, which then drops it).

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
from collections.abc import Awaitable
from dataclasses import dataclass

import msgspec
import nats.js.errors
import structlog
from litestar.datastructures import State
from litestar.exceptions import HTTPException
from nats.js.kv import KeyValue
from prometheus_client import Counter

from schemas import BatchRecord, BatchSubmit, JobSubmit, subjects, utcnow
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
    (and batch candidates) admitted in that hour; ``claims``: job or batch id ->
    ``[expiry (Unix time, seconds), hour it was counted in]`` of admissions not yet
    committed; ``weights``: a batch's claim -> its candidates (a job's claim counts 1);
    ``batches``: open batches, batch id -> ``[candidates, verify requests]``.
    """

    hour: str = ""
    used: int = 0
    claims: dict[str, tuple[float, str]] = {}
    weights: dict[str, int] = {}
    batches: dict[str, tuple[int, int]] = {}

    def held(self) -> int:
        """Slots held in this entry: claims (by weight) and open batches."""
        return (sum(self.weights.get(job_id, 1) for job_id in self.claims)
                + sum(candidates for candidates, _ in self.batches.values()))


def _refuse(tenant: Tenant, limit: str, status: int, detail: str,
            retry_after_s: float | None = None) -> HTTPException:
    REJECTIONS.labels(tenant=tenant_label(tenant.name), limit=limit).inc()
    log.info("job_rejected", tenant=tenant.name, limit=limit)
    headers = {"Retry-After": str(max(1, int(retry_after_s + 0.999)))} \
        if retry_after_s is not None else None
    return HTTPException(status_code=status, detail=detail, headers=headers,
                         extra={"tenant": tenant.name, "limit": limit})


def _check_timeout_and_priority(tenant: Tenant, data: JobSubmit | BatchSubmit, doing: str,
                                this: str, kind: str) -> None:
    """Refuse (403) ``data`` (a job or a batch) whose ``timeout_s`` is over the tenant's
    ``max_timeout_s`` or whose priority is over ``max_priority``; the messages say the
    tenant may ``doing`` (``submit jobs``) and name ``data`` "this ``this``" (timeout)
    and "this ``kind``" (priority)."""
    if tenant.max_timeout_s and data.timeout_s > tenant.max_timeout_s:
        raise _refuse(tenant, "max_timeout_s", 403, f"tenant {tenant.name!r} may {doing} "
                      f"with timeout_s up to {tenant.max_timeout_s:g} s (max_timeout_s); this "
                      f"{this} asks for {data.timeout_s:g} s: lower it, or ask an operator to "
                      "raise the limit")
    if not tenant.allows_priority(data.priority):
        raise _refuse(tenant, "max_priority", 403, f"tenant {tenant.name!r} may submit with "
                      f"priority up to {tenant.max_priority!r} (max_priority); this {kind} "
                      f"asks for {data.priority!r}")


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
    _check_timeout_and_priority(tenant, data, "submit jobs", "one", "job")


def check_batch_limits(tenant: Tenant, data: BatchSubmit) -> None:
    """Refuse (403) a batch verification its tenant may not submit: ``timeout_s`` over
    ``max_timeout_s`` or a priority over ``max_priority`` (what :func:`check_job_limits`
    says of a job); its candidates count against the in-flight and per-hour limits
    (:func:`claim`)."""
    _check_timeout_and_priority(tenant, data, "verify", "batch", "batch")


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


async def _batch_requests(bus: Bus, batch_id: str) -> int | None:
    """Verify requests of the batch ``batch_id`` while it runs; None when its record is
    gone, ended or unreadable (the batch no longer counts)."""
    if bus.batches is None:
        return None
    try:
        entry = await bus.batches.get(batch_id)
        record = msgspec.json.decode(entry.value or b"", type=BatchRecord)
    except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError,
            msgspec.ValidationError, msgspec.DecodeError):
        return None
    return record.unique if record.status == "running" else None


async def _verdicts_in(bus: Bus, batch_id: str) -> int:
    """Verdicts on ``results.<batch_id>.*`` in RESULTS, claims not counted (one per
    verified request, bar a rare second one of a request run twice)."""
    info = await bus.js.stream_info(subjects.STREAM_RESULTS,
                                    subjects_filter=subjects.job_verdicts(batch_id))
    return sum((info.state.subjects or {}).values())


async def _settle(bus: Bus, store: CheckedJobStore, state: _Admission, now: float,
                  hour: str) -> bool:
    """Start a new hour's count, settle expired claims and drop ended batches; True
    when ``state`` changed.

    An expired claim whose job (or batch) has a record keeps its place in the hour's
    count (its gateway got as far as writing the record; a batch's becomes an open
    batch); one without a record gives its slots back. An open batch whose record
    ended, or whose every request has a verdict, stops counting in flight.
    """
    changed = False
    if state.hour != hour:
        state.hour, state.used, changed = hour, 0, True
    for job_id, (expiry, counted_in) in list(state.claims.items()):
        if expiry > now:
            continue
        del state.claims[job_id]
        is_batch = job_id in state.weights
        weight = state.weights.pop(job_id, 1)
        changed = True
        exists = True
        if is_batch:
            requests = await _batch_requests(bus, job_id)
            exists = requests is not None
            if exists:
                state.batches[job_id] = (weight, requests or 0)
        else:
            try:
                await store.get(job_id)
            except JobNotFound:
                exists = False
            except JobRecordCorrupt:
                pass
        if not exists and counted_in == state.hour:
            state.used = max(0, state.used - weight)
        log.info("tenant_claim_settled", job_id=job_id, kept=exists)
    for batch_id, (_, requests) in list(state.batches.items()):
        if await _batch_requests(bus, batch_id) is None or \
                await _verdicts_in(bus, batch_id) >= requests:
            del state.batches[batch_id]
            changed = True
    return changed


@dataclass
class Claim:
    """An admitted submission's hold on one of its tenant's slots (:func:`claim`)."""

    bus: Bus
    tenant: str
    job_id: str
    active: bool = True
    weight: int = 1

    async def _release(self, give_back: bool, batch: tuple[int, int] | None = None) -> None:
        """Drop the claim (``give_back``: and its place in the hour's count; ``batch``:
        and hold its slots as an open batch of ``(candidates, requests)``). Never
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
                weight = state.weights.pop(self.job_id, 1)
                if give_back and held[1] == state.hour:
                    state.used = max(0, state.used - weight)
                if batch is not None:
                    state.batches[self.job_id] = batch
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

    async def withdraw_unless(self, created: Awaitable[bool]) -> bool:
        """Await ``created`` (the creation of the submission's record: False when its
        id is taken) and :meth:`withdraw` when it is False or raises.

        Returns:
            What ``created`` returned.

        Raises:
            Whatever ``created`` raises, after the withdrawal.
        """
        try:
            done = await created
        except Exception:
            await self.withdraw()
            raise
        if not done:
            await self.withdraw()
        return done

    async def commit_batch(self, requests: int) -> None:
        """The batch's ``requests`` verify requests are published: its candidates
        stay counted in flight as an open batch until it ends."""
        await self._release(give_back=False, batch=(self.weight, requests))


async def claim(bus: Bus, store: CheckedJobStore, tenant: Tenant, job_id: str,
                batch_candidates: int | None = None) -> Claim:
    """Take one of ``tenant``'s slots for job ``job_id`` or, with ``batch_candidates``,
    that many for the batch verification ``job_id``, or refuse.

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
    weight = 1 if batch_candidates is None else batch_candidates
    if kv is None or not (tenant.max_in_flight or tenant.max_jobs_per_hour):
        return Claim(bus, tenant.name, job_id, active=False, weight=weight)
    key = admission_key(tenant.name)
    for _ in range(CLAIM_ATTEMPTS):
        state, revision = await _read(kv, key)
        now = time.time()
        hour, left_s = _hour(utcnow())
        changed = await _settle(bus, store, state, now, hour)
        refusal = None
        asks = "" if batch_candidates is None else f"; this batch asks for {weight}"
        if tenant.max_in_flight:
            busy = await in_flight(bus, tenant.name) + state.held()
            if busy + weight > tenant.max_in_flight:
                refusal = _refuse(tenant, "max_in_flight", 429, f"tenant {tenant.name!r} has "
                                  f"{busy} jobs (or batch candidates) pending or running, its "
                                  f"limit (max_in_flight) is {tenant.max_in_flight}{asks}: "
                                  "retry when some have ended, or cancel one",
                                  retry_after_s=5)
        if refusal is None and tenant.max_jobs_per_hour and \
                state.used + weight > tenant.max_jobs_per_hour:
            refusal = _refuse(tenant, "max_jobs_per_hour", 429, f"tenant {tenant.name!r} has "
                              f"submitted {state.used} jobs (or batch candidates) this hour "
                              f"(UTC), its limit (max_jobs_per_hour) is "
                              f"{tenant.max_jobs_per_hour}{asks}: retry after {left_s:.0f} s",
                              retry_after_s=left_s)
        if refusal is not None:
            if changed:  # housekeeping only; a lost race leaves it to the next one
                with contextlib.suppress(Exception):
                    await _write(kv, key, state, revision)
            raise refusal
        state.claims[job_id] = (now + CLAIM_TTL_S, hour)
        if batch_candidates is not None:
            state.weights[job_id] = weight
        state.used += weight
        if await _write(kv, key, state, revision):
            return Claim(bus, tenant.name, job_id, weight=weight)
        await asyncio.sleep(random.uniform(0, CLAIM_RETRY_S))
    raise HTTPException(status_code=503, headers={"Retry-After": "1"},
                        detail=f"tenant {tenant.name!r} has many submissions racing for its "
                        f"limits; none of {CLAIM_ATTEMPTS} attempts won: retry shortly")
