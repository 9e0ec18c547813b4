"""Job helpers shared by the gateway (HTTP submissions) and the generator (raw ``nats pub``).

A job may enter through either door, so validation, record creation and event
publishing live here, once.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import time

import msgspec
import nats.errors
import nats.js.errors
import structlog

from schemas import (
    TERMINAL_STATUSES,
    JobEvent,
    JobRecord,
    JobSubmit,
    WorkerInfo,
    decode,
    encode,
    new_id,
    subjects,
    utcnow,
)
from services.common.bus import Bus, JobNotFound, JobStore

log = structlog.get_logger("aikg.jobs")

# Longest piece of a decoder's complaint kept in a corrupt record's error text, characters.
_FAULT_CHARS = 300


class JobRecordCorrupt(Exception):
    """A job's value in the ``jobs`` bucket does not decode as a :class:`JobRecord`.

    Written by something other than AIKG (``nats kv put``, a task's code with bus
    access, a newer or broken client) or truncated. Not a :class:`JobNotFound`: the
    job exists, its record cannot be read.

    Attributes:
        job_id: the key.
        fault: what the decoder said (``JSON is malformed: ...`` or ``Expected `str`,
            got `int` - at `$.status```), at most 300 characters.
        revision: the key's revision holding the bad value, for a compare-and-swap
            that replaces exactly that value.
    """

    def __init__(self, job_id: str, fault: str, revision: int | None = None) -> None:
        self.job_id = job_id
        self.fault = fault[:_FAULT_CHARS]
        self.revision = revision
        super().__init__(f"job record {job_id} is corrupt: {self.fault}")


def decode_record(job_id: str, value: bytes) -> JobRecord:
    """Decode a ``jobs`` bucket value, naming the job when it does not decode.

    Raises:
        JobRecordCorrupt: not JSON, or JSON that breaks the :class:`JobRecord` schema.
    """
    try:
        return decode(value, JobRecord)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise JobRecordCorrupt(job_id, str(exc) or exc.__class__.__name__) from exc


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

REQUIRED_TASK_NAMES = ("Model", "get_inputs", "get_init_inputs")


class TaskError(ValueError):
    """The task source is not a usable KernelBench-format task; the message says why."""


def check_task_source(task_desc: str) -> None:
    """Statically check a KernelBench-format task without running it.

    The task must parse as Python and define ``class Model``, ``get_inputs`` and
    ``get_init_inputs`` at module level (KernelBench's problem format).

    Raises:
        TaskError: syntax error (with line number) or a missing definition.
    """
    try:
        tree = ast.parse(task_desc)
    except SyntaxError as exc:
        raise TaskError(f"task_desc is not valid Python: line {exc.lineno}: {exc.msg}") from exc
    defined = {
        node.name
        for node in tree.body
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
    }
    defined |= {
        t.id
        for node in tree.body
        if isinstance(node, ast.Assign)
        for t in node.targets
        if isinstance(t, ast.Name)
    }
    missing = [n for n in REQUIRED_TASK_NAMES if n not in defined]
    if missing:
        raise TaskError(
            "task_desc must define class Model, get_inputs() and get_init_inputs() "
            f"(KernelBench format); missing: {', '.join(missing)}"
        )


def new_record(submit: JobSubmit, *, job_id: str | None = None, arch: str | None = None,
               tenant: str = subjects.DEFAULT_TENANT, priority: str | None = None) -> JobRecord:
    """A ``pending`` job record for ``submit`` (id from the submit, the argument, or new),
    of ``tenant``, at ``priority`` (the submission's when None)."""
    job_id = submit.job_id or job_id or new_id("job-")
    submit.job_id = job_id
    if arch:
        submit.arch = arch
    return JobRecord(
        job_id=job_id,
        status="pending",
        job_type=submit.job_type,
        op_name=submit.op_name,
        submit_time=utcnow(),
        backend=submit.backend,
        arch=submit.arch,
        request=submit,
        tenant=tenant,
        priority=priority or submit.priority,
    )


async def live_workers(bus: Bus) -> list[WorkerInfo]:
    """Workers whose heartbeat is in the ``workers`` bucket now (expired keys are gone)."""
    try:
        keys = await bus.workers.keys()
    except nats.js.errors.NoKeysError:
        return []
    out = []
    for key in keys:
        with contextlib.suppress(nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
            entry = await bus.workers.get(key)
            if entry.value:
                with contextlib.suppress(Exception):
                    out.append(decode(entry.value, WorkerInfo))
    return out


def pick_arch(workers: list[WorkerInfo], backend: str, arch: str | None) -> str | None:
    """The arch to run on: ``arch`` when a live worker offers backend/arch, else the
    arch of the least loaded live worker of ``backend`` when ``arch`` is None; None when
    no live worker matches."""
    matching = [w for w in workers if w.backend == backend and (arch is None or w.arch == arch)]
    if not matching:
        return None
    if arch is not None:
        return arch
    best = min(matching, key=lambda w: w.in_flight / max(w.capacity, 1))
    return best.arch


def describe_pairs(workers: list[WorkerInfo]) -> list[str]:
    """Sorted ``backend/arch`` pairs with a live worker, for error messages."""
    return sorted({f"{w.backend}/{w.arch}" for w in workers})


# How long publish_event retries while JOB_EVENTS has no leader (a cluster node
# failing over takes a few seconds; tests/test_cluster.py), seconds.
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
