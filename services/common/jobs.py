"""Job helpers on the bus, shared by the gateway (HTTP submissions) and the generator
(raw ``nats pub``): the checked job store, live workers, events and cancel.

A job may enter through either door, so what both need lives here, once; the pure
half (task checks, new records, arch choice) is :mod:`services.common.records`,
which the no-NATS local path imports instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import nats.errors
import nats.js.errors
import structlog
from nats.js import JetStreamContext

from schemas import (
    TERMINAL_STATUSES,
    JobEvent,
    JobRecord,
    WorkerInfo,
    decode,
    encode,
    new_id,
    subjects,
    utcnow,
)
from services.common.bus import Bus, JobNotFound, JobStore, bucket_entries
from services.common.records import (  # noqa: F401  (re-exported: the pure half lives there)
    JobRecordCorrupt,
    decode_record,
    describe_pairs,
    new_record,
    pick_arch,
)

log = structlog.get_logger("aikg.jobs")


class CheckedJobStore(JobStore):
    """:class:`~services.common.bus.JobStore` whose reads raise :class:`JobRecordCorrupt`
    (job id, decoder message, revision) instead of msgspec's bare ``DecodeError`` /
    ``ValidationError``; :meth:`update` and :meth:`list` read through it too.
    """

    async def get(self, job_id: str) -> tuple[JobRecord, int]:
        """The record and its revision.

        Raises:
            JobNotFound: no such job.
            JobRecordCorrupt: the value does not decode.
        """
        try:
            entry = await self.kv.get(job_id)
        except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError) as exc:
            raise JobNotFound(job_id) from exc
        assert entry.value is not None and entry.revision is not None
        try:
            return decode_record(job_id, entry.value), entry.revision
        except JobRecordCorrupt as exc:
            exc.revision = entry.revision
            raise

    async def replace_corrupt(self, corrupt: JobRecordCorrupt, record: JobRecord) -> bool:
        """Overwrite the bad value ``corrupt`` was raised for with ``record``, by
        compare-and-swap on its revision.

        Returns:
            False when the key changed since (someone else wrote it): nothing written.
        """
        record.updated_at = utcnow()
        try:
            await self.kv.update(corrupt.job_id, encode(record), last=corrupt.revision)
        except nats.js.errors.KeyWrongLastSequenceError:
            return False
        return True


async def heartbeats(js: JetStreamContext) -> list[WorkerInfo]:
    """The heartbeats (``WorkerInfo``) in the ``workers`` bucket now: live workers
    (expired keys are gone); values that do not decode are left out.

    Read with :func:`services.common.bus.bucket_entries`, not ``KeyValue.keys()``: that
    one watches through an ordered push consumer, and under load it came back empty
    while live workers' keys were in the bucket (a job then failed with "no live
    worker").

    Raises:
        nats.errors.Error: NATS trouble (timeouts, no permission).
    """
    try:
        entries = await bucket_entries(js, subjects.BUCKET_WORKERS)
    except nats.js.errors.NotFoundError:
        return []
    out = []
    for entry in entries.values():
        with contextlib.suppress(Exception):
            out.append(decode(entry.value or b"", WorkerInfo))
    return out


async def live_workers(bus: Bus) -> list[WorkerInfo]:
    """Workers whose heartbeat is in the ``workers`` bucket now (:func:`heartbeats`)."""
    return await heartbeats(bus.js)


# Further reads of the workers bucket before "no live worker" is the answer, and the
# pause between them, seconds (about one heartbeat in all).
NO_WORKER_RECHECKS = 4
NO_WORKER_RECHECK_S = 0.25


async def live_arch(bus: Bus, backend: str, arch: str | None
                    ) -> tuple[str | None, list[WorkerInfo]]:
    """The arch a job of ``backend`` (and ``arch``, when given) runs on
    (:func:`~services.common.records.pick_arch`), and the live workers it was chosen
    among. None when no live worker matches after looking again for about a
    heartbeat: a heartbeat between two puts, or a bucket read that raced one, can
    miss a live worker, and "no live worker" fails the job."""
    workers = await live_workers(bus)
    chosen = pick_arch(workers, backend, arch)
    for _ in range(NO_WORKER_RECHECKS):
        if chosen is not None:
            break
        await asyncio.sleep(NO_WORKER_RECHECK_S)
        workers = await live_workers(bus)
        chosen = pick_arch(workers, backend, arch)
    return chosen, workers


# How long publish_event retries while JOB_EVENTS has no leader (a cluster node
# failing over takes a few seconds; tests/bus/test_cluster.py), seconds.
EVENT_RETRY_S = 20.0
_TRANSIENT = (nats.errors.TimeoutError, nats.errors.NoRespondersError,
              nats.js.errors.NoStreamResponseError, nats.js.errors.ServiceUnavailableError)


async def publish_event(bus: Bus, event: JobEvent) -> None:
    """Publish a job event on ``jobs.events.<job_id>``, retrying for up to
    :data:`EVENT_RETRY_S` seconds while the stream fails over. Every try carries the
    same ``Nats-Msg-Id``, so a try that landed unacknowledged is not stored twice. A
    failure is logged, not raised (events are a view of the record, which stays the
    source of truth)."""
    headers = {"Nats-Msg-Id": new_id("ev-")}
    deadline = time.monotonic() + EVENT_RETRY_S
    delay = 0.1
    while True:
        try:
            await bus.js.publish(subjects.job_events(event.job_id), encode(event),
                                 headers=headers)
            return
        except _TRANSIENT as exc:
            if time.monotonic() + delay > deadline:
                log.warning("event_publish_failed", job_id=event.job_id,
                            error=f"{type(exc).__name__}: {exc}")
                return
            await asyncio.sleep(delay)
            delay = min(2 * delay, 2.0)
        except Exception as exc:  # noqa: BLE001 - events must never fail a job
            log.warning("event_publish_failed", job_id=event.job_id, error=str(exc))
            return


async def cancel_job(bus: Bus, job_id: str, reason: str = "cancelled by user") -> JobRecord:
    """Mark a job ``cancelled`` (compare-and-swap) and publish its ``cancelled`` event.

    The generator watches the record and stops the job's LLM calls and pending
    verifications; workers skip verify requests of cancelled jobs. A job that has
    already ended is returned unchanged.

    Raises:
        services.common.bus.JobNotFound: no such job.
        JobRecordCorrupt: the job's record does not decode (nothing is written).
    """
    def change(record: JobRecord) -> JobRecord | None:
        if record.status in TERMINAL_STATUSES:
            return None
        record.status = "cancelled"
        record.error = reason
        record.end_time = utcnow()
        record.progress.phase = "cancelled"
        record.progress.message = reason
        return record

    store = CheckedJobStore(bus.jobs)
    before, _ = await store.get(job_id)
    record = await store.update(job_id, change)
    if before.status not in TERMINAL_STATUSES and record.status == "cancelled":
        await publish_event(bus, JobEvent(job_id=job_id, event="cancelled", status="cancelled",
                                          message=reason))
    return record
