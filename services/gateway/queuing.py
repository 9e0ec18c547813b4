"""Queuing a job's submit message on its ``jobs.submit`` lane: published with the job
id as ``Nats-Msg-Id`` and tried again while the stream has no leader or does not
acknowledge (:func:`queue_job`); a job whose tries may have landed unacknowledged is
published again in the background while the stream's duplicate window makes that safe,
then failed (:func:`start_queuing`).
"""

from __future__ import annotations

import asyncio
import contextlib

import nats.errors
import nats.js.errors
import structlog
from litestar.datastructures import State
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception_type,
    stop_after_delay,
    wait_exponential,
)

from schemas import JobEvent, JobRecord, JobSubmit, encode, utcnow
from services.common.bus import DUPLICATE_WINDOW_S, Bus
from services.common.jobs import CheckedJobStore, publish_event
from services.common.runtime import cancel_and_wait

log = structlog.get_logger("aikg.gateway")

# A job's submit message is published again with the same Nats-Msg-Id while its stream
# has no leader or does not acknowledge: a JetStream node failing over hands its
# streams to new leaders within seconds (tests/bus/test_cluster.py). For this long
# before the submission is answered, seconds.
QUEUE_RETRY_S = 10.0
# One try's wait for the stream's acknowledgement, seconds (nats-py's default: 5).
QUEUE_ACK_TIMEOUT_S = 2.5
# A job whose tries may have landed unacknowledged is published again in the background
# until its submission is this much short of the stream's duplicate window, seconds: a
# try after the window could store it twice.
REQUEUE_MARGIN_S = 10.0
# Failures worth another try: no answer in time, no stream leader (yet), a stream that
# is temporarily unavailable.
_RETRIED = (nats.errors.TimeoutError, nats.errors.NoRespondersError,
            nats.js.errors.NoStreamResponseError, nats.js.errors.ServiceUnavailableError,
            nats.errors.ConnectionReconnectingError)
# Failures that say the message was not stored: nobody took it, or the stream refused it
# (nats.js.errors.APIError: an answer of the stream's). Any other failure, a timeout
# above all, leaves open whether it landed.
_NOT_STORED = (nats.errors.NoRespondersError, nats.js.errors.NoStreamResponseError,
               nats.js.errors.APIError)


class Unqueued(Exception):
    """A job's submit message did not reach its stream.

    Attributes:
        cause: the last publish's error.
        maybe_stored: True when some try ended without an answer (a timed-out
            acknowledgement, a dropped connection): the message may be in the stream and
            a generator may already run the job. False when every try was refused (no
            stream leader to take it, or the stream said no): it is not there.
    """

    def __init__(self, cause: BaseException, maybe_stored: bool) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.cause = cause
        self.maybe_stored = maybe_stored


async def queue_job(bus: Bus, subject: str, request: JobSubmit, job_id: str, *,
                    within_s: float | None = None) -> None:
    """Publish a job's submit message with ``job_id`` as its ``Nats-Msg-Id``, trying
    again for up to ``within_s`` seconds (default :data:`QUEUE_RETRY_S`) while the
    stream has no leader or does not acknowledge (a node failing over). Every try
    carries the same id, so the stream stores the job once however many tries land
    (within its duplicate window, :data:`~services.common.bus.DUPLICATE_WINDOW_S`).

    Raises:
        Unqueued: no try was acknowledged in time; ``maybe_stored`` says whether one
            may have landed all the same.
    """
    within_s = QUEUE_RETRY_S if within_s is None else within_s
    maybe_stored = False
    payload = encode(request)
    headers = {"Nats-Msg-Id": job_id}

    def note(state: RetryCallState) -> None:
        nonlocal maybe_stored
        exc = state.outcome.exception() if state.outcome else None
        maybe_stored = maybe_stored or not isinstance(exc, _NOT_STORED)

    try:
        async for attempt in AsyncRetrying(
                stop=stop_after_delay(max(0.0, within_s)),
                wait=wait_exponential(multiplier=0.1, max=1.0),
                retry=retry_if_exception_type(_RETRIED), after=note, reraise=True):
            with attempt:
                await bus.js.publish(subject, payload, headers=headers,
                                     timeout=QUEUE_ACK_TIMEOUT_S)
    except Exception as exc:
        raise Unqueued(exc, maybe_stored or not isinstance(exc, _NOT_STORED)) from exc


async def keep_queuing(bus: Bus, record: JobRecord, subject: str) -> None:
    """Publish the submit message of a job whose first tries may or may not have landed,
    for as long as the stream's duplicate window makes another try safe, then fail the
    job if none was acknowledged (a generator that meets it later skips it)."""
    left = (DUPLICATE_WINDOW_S - REQUEUE_MARGIN_S
            - (utcnow() - record.submit_time).total_seconds())
    with structlog.contextvars.bound_contextvars(job_id=record.job_id):
        try:
            await queue_job(bus, subject, record.request, record.job_id, within_s=left)
            log.info("job_queue_confirmed", subject=subject)
            return
        except Unqueued as exc:
            reason = (f"could not queue the job on {subject} within "
                      f"{DUPLICATE_WINDOW_S - REQUEUE_MARGIN_S:.0f} s of its submission: "
                      f"{exc}; NATS may be down, submit it again")

        def fail(r: JobRecord) -> JobRecord | None:
            if r.status != "pending":
                return None
            r.status = r.progress.phase = "failed"
            r.error = r.progress.message = reason
            r.end_time = utcnow()
            return r

        log.error("job_publish_failed", error=reason)
        with contextlib.suppress(Exception):
            if (await CheckedJobStore(bus.jobs).update(record.job_id, fail)).status == "failed":
                await publish_event(bus, JobEvent(job_id=record.job_id, event="failed",
                                                  status="failed", message=reason))


def start_queuing(state: State, bus: Bus, record: JobRecord, subject: str) -> None:
    """Run :func:`keep_queuing` in the background, held in ``state.requeues`` (the
    set :func:`stop_requeues` cancels at shutdown)."""
    tasks: set[asyncio.Task] = state.get("requeues")
    task = asyncio.create_task(keep_queuing(bus, record, subject),
                               name=f"requeue-{record.job_id}")
    tasks.add(task)
    task.add_done_callback(tasks.discard)


async def stop_requeues(state: State) -> None:
    """Cancel the gateway's background publishes (at shutdown: those jobs stay pending,
    and their clients' resubmissions with the same ``job_id`` publish them again)."""
    await cancel_and_wait(*state.get("requeues", set()))
