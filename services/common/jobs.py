"""Job helpers shared by the gateway (HTTP submissions) and the generator (raw ``nats pub``).

A job may enter through either door, so validation, record creation and event
publishing live here, once.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import time

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
from services.common.bus import Bus, JobStore

log = structlog.get_logger("aikg.jobs")

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


def new_record(submit: JobSubmit, *, job_id: str | None = None, arch: str | None = None) -> JobRecord:
    """A ``pending`` job record for ``submit`` (id from the submit, the argument, or new)."""
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

    before, _ = await JobStore(bus.jobs).get(job_id)
    record = await JobStore(bus.jobs).update(job_id, change)
    if before.status not in TERMINAL_STATUSES and record.status == "cancelled":
        await publish_event(bus, JobEvent(job_id=job_id, event="cancelled", status="cancelled",
                                          message=reason))
    return record
