"""The generator service: pulls jobs from ``jobs.submit`` and runs their workflow.

Every generator process binds the durable pull consumer ``generator`` on the JOBS
stream, so several instances share the jobs. For each job the generator keeps the
record in the ``jobs`` bucket (compare-and-swap) and ``jobs.events.<job_id>`` up to
date, publishes each candidate as a verify request on ``verify.<backend>.<arch>``
and waits for its verdict on ``results.<job_id>``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import msgspec
import structlog
from nats.aio.msg import Msg
from prometheus_client import Counter, Histogram

from schemas import (
    TERMINAL_STATUSES,
    JobEvent,
    JobRecord,
    JobResult,
    JobSubmit,
    VerifyRequest,
    VerifyResult,
    decode,
    encode,
    new_id,
    subjects,
    utcnow,
)
from services.common.bus import Bus, JobNotFound, JobStore, connect_bus
from services.common.consumer import (
    dead_letter,
    deliveries,
    durable_pull,
    fetch_some,
    run_with_progress,
)
from services.common.jobs import (
    TaskError,
    check_task_source,
    describe_pairs,
    live_workers,
    new_record,
    pick_arch,
    publish_event,
)
from services.common.metrics import start_metrics_server
from services.common.runtime import install_signal_handlers
from services.common.settings import Settings
from services.generator.coders.base import BuiltinCoder, Candidate, make_pool
from services.generator.workflows import WorkflowError, coder_only_workflow, describe_failure

log = structlog.get_logger("aikg.generator")

JOBS_FINISHED = Counter("aikg_generator_jobs_total", "Jobs finished, by outcome.", ["outcome"])
CANDIDATES = Counter("aikg_generator_candidates_total", "Candidates generated, by coder.", ["coder"])
JOB_SECONDS = Histogram(
    "aikg_generator_job_duration_seconds", "Wall time of a job in the generator, seconds.",
    ["job_type"], buckets=(1, 2, 5, 10, 30, 60, 120, 300, 600, 1800, 3600),
)

# JOBS consumer: a job is redelivered if its generator stops heartbeating for this
# long; the generator sends in_progress() every third of it.
JOB_ACK_WAIT_S = 30.0
JOB_MAX_DELIVER = 5


class JobCancelled(Exception):
    """The job's record says ``cancelled``: stop working on it."""


class Generator:
    """Job consumer and workflow runner.

    Args:
        bus: connected NATS bus.
        settings: concurrency and timeouts.
    """

    def __init__(self, bus: Bus, settings: Settings) -> None:
        self.bus = bus
        self.settings = settings
        self.jobs = JobStore(bus.jobs)
        self.pool = make_pool(workers=max(1, min(2, settings.generator_concurrency)))
        self.builtin = BuiltinCoder(self.pool)
        self.slots = asyncio.Semaphore(settings.generator_concurrency)
        self.tasks: set[asyncio.Task] = set()

    async def run(self, stop: asyncio.Event) -> None:
        """Serve jobs until ``stop`` is set; in-flight jobs are left unacked so that
        another generator picks them up after the ack wait."""
        psub = await durable_pull(
            self.bus.js, stream=subjects.STREAM_JOBS, subject=subjects.JOBS_SUBMIT,
            durable=subjects.CONSUMER_GENERATOR, ack_wait_s=JOB_ACK_WAIT_S,
            max_deliver=JOB_MAX_DELIVER + 1,
        )
        log.info("generator_started", concurrency=self.settings.generator_concurrency)
        try:
            while not stop.is_set():
                free = self.settings.generator_concurrency - len(self.tasks)
                if free <= 0:
                    await asyncio.sleep(0.05)
                    continue
                for msg in await fetch_some(psub, free, timeout=1.0):
                    task = asyncio.create_task(self.handle(msg))
                    self.tasks.add(task)
                    task.add_done_callback(self.tasks.discard)
        finally:
            for task in list(self.tasks):
                task.cancel()
            await asyncio.gather(*self.tasks, return_exceptions=True)
            with contextlib.suppress(Exception):
                await psub.unsubscribe()
            self.pool.stop()
            await asyncio.to_thread(self.pool.join, 10)
            log.info("generator_stopped")

    async def handle(self, msg: Msg) -> None:
        """Run one job message to the end; never raises (a bad job must not stop us)."""
        try:
            await run_with_progress(msg, JOB_ACK_WAIT_S / 3, lambda: self._handle(msg))
        except asyncio.CancelledError:
            # Shutting down mid-job: hand the job straight back to the stream.
            with contextlib.suppress(Exception):
                await msg.nak()
            raise
        except Exception:  # noqa: BLE001
            log.exception("job_handler_failed")
            with contextlib.suppress(Exception):
                await msg.nak(delay=2)

    async def _handle(self, msg: Msg) -> None:
        header_id = (msg.headers or {}).get("Nats-Msg-Id")
        try:
            submit = decode(msg.data, JobSubmit)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            reason = f"malformed job submission: {exc}"
            log.warning("malformed_job", error=reason)
            await dead_letter(self.bus.js, msg, reason)
            job_id = header_id if header_id and _is_token(header_id) else None
            if job_id:
                await self._fail_new(job_id, reason)
            return
        job_id = submit.job_id or (header_id if header_id and _is_token(header_id) else None)
        job_id = job_id or new_id("job-")
        with structlog.contextvars.bound_contextvars(job_id=job_id):
            if deliveries(msg) > JOB_MAX_DELIVER:
                reason = (f"job delivered {deliveries(msg)} times without finishing "
                          "(its generator died each time)")
                await dead_letter(self.bus.js, msg, reason)
                await self._finish(job_id, "failed", error=reason)
                return
            record = await self._ensure_record(job_id, submit)
            if record is None or record.status in TERMINAL_STATUSES:
                await msg.ack()
                return
            started = time.monotonic()
            outcome = await self._run_job(record)
            JOBS_FINISHED.labels(outcome=outcome).inc()
            JOB_SECONDS.labels(job_type=record.job_type).observe(time.monotonic() - started)
            await msg.ack()

    async def _ensure_record(self, job_id: str, submit: JobSubmit) -> JobRecord | None:
        """The job's record; created here for a raw ``nats pub`` submission (which did
        not pass the gateway's checks, so they run now)."""
        try:
            return (await self.jobs.get(job_id))[0]
        except JobNotFound:
            pass
        arch = submit.arch
        error = None
        try:
            check_task_source(submit.task_desc)
        except TaskError as exc:
            error = str(exc)
        if error is None and arch is None:
            workers = await live_workers(self.bus)
            arch = pick_arch(workers, submit.backend, None)
            if arch is None:
                error = (f"no live worker for backend={submit.backend}; live: "
                         f"{', '.join(describe_pairs(workers)) or 'none'}")
        record = new_record(submit, job_id=job_id, arch=arch)
        await self.jobs.create(record)
        await publish_event(self.bus, JobEvent(job_id=job_id, event="submitted", status="pending"))
        if error:
            await self._finish(job_id, "failed", error=error)
            return None
        return (await self.jobs.get(job_id))[0]

    async def _run_job(self, record: JobRecord) -> str:
        job_id = record.job_id
        submit = record.request

        def start(r: JobRecord) -> JobRecord | None:
            if r.status in TERMINAL_STATUSES:
                return None
            r.status = "running"
            r.start_time = r.start_time or utcnow()
            r.progress.phase = "started"
            return r

        record = await self.jobs.update(job_id, start)
        if record.status != "running":
            return record.status
        await publish_event(self.bus, JobEvent(job_id=job_id, event="started", status="running"))
        log.info("job_started", op_name=record.op_name, backend=record.backend, arch=record.arch)
        try:
            if submit.job_type == "evolve":
                raise WorkflowError("job_type 'evolve' is not available in this version; "
                                    "submit job_type 'single'")
            coder = self._coder(submit)
            waiter = ResultWaiter(self.bus, job_id)
            await waiter.start()
            try:
                result = await coder_only_workflow(
                    submit, coder, lambda c: self._verify(record, c, waiter),
                    lambda event, **kw: self._report(job_id, event, **kw),
                )
            finally:
                await waiter.stop()
        except JobCancelled:
            log.info("job_cancelled")
            return "cancelled"
        except WorkflowError as exc:
            await self._finish(job_id, "failed", error=str(exc))
            return "failed"
        if result.passed:
            await self._finish(job_id, "completed", result=result)
            return "completed"
        assert result.verdict is not None
        await self._finish(job_id, "failed", result=result, error=describe_failure(result.verdict))
        return "failed"

    def _coder(self, submit: JobSubmit) -> BuiltinCoder | None:
        if submit.coder == "llm":
            raise WorkflowError("coder 'llm' requested but no LLM is configured in this version; "
                                "use coder 'builtin' or give init_code")
        return self.builtin

    async def _report(self, job_id: str, event: str, *, phase: str = "", message: str = "",
                      **data) -> None:
        def change(r: JobRecord) -> JobRecord | None:
            if r.status in TERMINAL_STATUSES:
                return None
            if phase:
                r.progress.phase = phase
            if message:
                r.progress.message = message
            for key, value in data.items():
                if hasattr(r.progress, key):
                    setattr(r.progress, key, value)
            return r

        record = await self.jobs.update(job_id, change)
        if record.status == "cancelled":
            raise JobCancelled(job_id)
        await publish_event(self.bus, JobEvent(job_id=job_id, event=event, status=record.status,
                                               message=message, data=data))

    async def _verify(self, record: JobRecord, candidate: Candidate,
                      waiter: ResultWaiter) -> VerifyResult:
        job_id = record.job_id
        submit = record.request
        candidate_id = new_id("cand-")
        request = VerifyRequest(
            request_id=new_id("req-"), job_id=job_id, candidate_id=candidate_id,
            op_name=submit.op_name, task_desc=submit.task_desc, code=candidate.code,
            dsl=submit.dsl, framework=submit.framework, backend=submit.backend,
            arch=record.arch or "", mode="verify" if submit.backend == "cpu" else "profile",
            shape_overrides=submit.shape_overrides, timeout_s=submit.timeout_s,
            trials=submit.trials,
        )
        CANDIDATES.labels(coder=candidate.coder).inc()

        def generated(r: JobRecord) -> JobRecord | None:
            if r.status in TERMINAL_STATUSES:
                return None
            r.progress.candidates_generated += 1
            r.progress.phase = "verifying"
            r.progress.message = f"verifying candidate {candidate_id} on {submit.backend}/{record.arch}"
            return r

        current = await self.jobs.update(job_id, generated)
        if current.status == "cancelled":
            raise JobCancelled(job_id)
        await publish_event(self.bus, JobEvent(
            job_id=job_id, event="candidate_generated", status="running",
            candidate_id=candidate_id, data={"coder": candidate.coder}))
        future = waiter.expect(request.request_id)
        await self.bus.js.publish(subjects.verify(request.backend, request.arch), encode(request),
                                  headers={"Nats-Msg-Id": request.request_id})
        await publish_event(self.bus, JobEvent(
            job_id=job_id, event="verify_started", status="running",
            candidate_id=candidate_id, request_id=request.request_id))
        log.info("verify_requested", candidate_id=candidate_id, request_id=request.request_id)
        try:
            result = await asyncio.wait_for(future, self.settings.verify_result_timeout_s)
        except TimeoutError as exc:
            raise WorkflowError(
                f"no verdict for candidate {candidate_id} within "
                f"{self.settings.verify_result_timeout_s:.0f} s: is a worker for "
                f"{request.backend}/{request.arch} running?") from exc

        def verified(r: JobRecord) -> JobRecord | None:
            if r.status in TERMINAL_STATUSES:
                return None
            r.progress.candidates_verified += 1
            r.progress.candidates_passed += int(result.passed)
            r.progress.message = ("candidate passed" if result.passed
                                  else f"candidate failed at stage '{result.stage}'")
            return r

        current = await self.jobs.update(job_id, verified)
        await publish_event(self.bus, JobEvent(
            job_id=job_id, event="verify_result", status=current.status,
            candidate_id=candidate_id, request_id=request.request_id, verdict=result,
            message=current.progress.message))
        if current.status == "cancelled":
            raise JobCancelled(job_id)
        return result

    async def _finish(self, job_id: str, status: str, *, result: JobResult | None = None,
                      error: str | None = None) -> None:
        def change(r: JobRecord) -> JobRecord | None:
            if r.status in TERMINAL_STATUSES:
                return None
            r.status = status
            r.result = result
            r.error = error
            r.end_time = utcnow()
            r.progress.phase = status
            if error:
                r.progress.message = error
            return r

        try:
            record = await self.jobs.update(job_id, change)
        except JobNotFound:
            return
        if record.status != status:
            return  # someone else (a cancel) finished it first
        log.info("job_finished", status=status, error=error)
        await publish_event(self.bus, JobEvent(
            job_id=job_id, event=status, status=status, message=error or "",
            verdict=result.verdict if result else None))

    async def _fail_new(self, job_id: str, reason: str) -> None:
        with contextlib.suppress(Exception):
            await publish_event(self.bus, JobEvent(job_id=job_id, event="failed",
                                                   status="failed", message=reason))


class ResultWaiter:
    """Collects a job's verdicts from ``results.<job_id>`` and hands each to the
    coroutine waiting for its ``request_id``.

    Reads the RESULTS stream from its start for this subject (an ordered consumer),
    so a verdict published before we subscribed is not missed.
    """

    def __init__(self, bus: Bus, job_id: str) -> None:
        self.bus = bus
        self.job_id = job_id
        self.futures: dict[str, asyncio.Future[VerifyResult]] = {}
        self.early: dict[str, VerifyResult] = {}
        self.sub = None

    async def start(self) -> None:
        async def on_msg(msg: Msg) -> None:
            try:
                result = decode(msg.data, VerifyResult)
            except (msgspec.ValidationError, msgspec.DecodeError) as exc:
                log.warning("malformed_result", error=str(exc))
                return
            future = self.futures.get(result.request_id)
            if future is None:
                self.early[result.request_id] = result
            elif not future.done():
                future.set_result(result)

        self.sub = await self.bus.js.subscribe(
            subjects.results(self.job_id), cb=on_msg, ordered_consumer=True)

    def expect(self, request_id: str) -> asyncio.Future[VerifyResult]:
        """A future resolved with the verdict of ``request_id``."""
        future = asyncio.get_running_loop().create_future()
        if request_id in self.early:
            future.set_result(self.early.pop(request_id))
        self.futures[request_id] = future
        return future

    async def stop(self) -> None:
        if self.sub is not None:
            with contextlib.suppress(Exception):
                await self.sub.unsubscribe()


def _is_token(value: str) -> bool:
    try:
        subjects.job_events(value)
    except ValueError:
        return False
    return len(value) <= 64


async def run_generator(settings: Settings, stop: asyncio.Event | None = None) -> None:
    """Connect, serve jobs until ``stop`` is set (or SIGINT/SIGTERM), then exit.

    Raises:
        ConnectionError: NATS is unreachable at start.
    """
    if stop is None:
        stop = asyncio.Event()
        install_signal_handlers(stop)
    start_metrics_server(settings.metrics_port)
    bus = await connect_bus(settings, "aikg-generator")
    try:
        await Generator(bus, settings).run(stop)
    finally:
        await bus.close()
