"""The generator service: pulls jobs from ``jobs.submit`` and runs their workflow.

Every generator process binds the durable pull consumer ``generator`` on the JOBS
stream, so several instances share the jobs. For each job the generator keeps the
record in the ``jobs`` bucket (compare-and-swap) and ``jobs.events.<job_id>`` up to
date, publishes each candidate as a verify request on ``verify.<backend>.<arch>``
and waits for its verdict on ``results.<job_id>.>``.

Crash recovery. Before a candidate's verify request is published, the candidate is
written into the job record (``progress.candidates``: attempt, ids, coder, code
hash, the latest candidate's code) by compare-and-swap; the request id is
deterministic (``<job_id>-a<attempt>``) and is the message's ``Nats-Msg-Id``; the
VERIFY sequence of the acknowledged publish is recorded next, and each verdict
after it arrives. A generator that dies mid-job leaves its job message unacked, so
JetStream redelivers it (after the JOBS consumer's ack wait,
:data:`services.common.provision.JOB_ACK_WAIT_S`) to another instance or to the
restarted one, which rebuilds the attempts from the record: verdicts already
recorded are reused, a request already published is awaited again on
``results.<job_id>.>`` (read from the start of the RESULTS stream) instead of being
resent, a recorded request without a sequence is republished under the same id
(the stream drops it if the first publish did land), and the attempt loop goes on
from there. The final status is set by compare-and-swap from a non-terminal state,
so a job ends (and announces its end) once.

Intake. :mod:`services.common.pull_loop` takes the job messages (the lanes in fair
order, as many as there are free job slots), keeps each marked in progress while its
job runs, naks the jobs in hand when the generator stops, and dead-letters a
submission that does not decode or was delivered more than ``JOB_MAX_DELIVER`` times;
this module runs a decoded job (:meth:`Generator._handle`) and fails the job of a
dead-lettered message.

Cancel. While a job runs, its record is polled every :data:`CANCEL_POLL_S`; when it
turns ``cancelled`` (``POST /api/v1/jobs/{id}/cancel``), the job's task is cancelled:
its LLM call is aborted and its pending verdicts are no longer awaited (workers skip
requests of cancelled jobs).

Corrupt records. A job whose record in the ``jobs`` bucket stops decoding (garbage
put under its key) cannot be resumed: nothing says what it has done. When the
generator meets that (picking the job up, or polling it while it runs), it replaces
the bad value, by compare-and-swap on its revision, with a ``failed`` record that
names the fault and keeps the job's submission, publishes one ``failed`` event and
acks the job's message: no redelivery, no dead-letter "its generator died".

This module holds the job handler (intake, record, cancel watch, the end of a job);
one running job's candidates, requests and verdicts are
:class:`~services.generator.job_run.JobRun`'s (services/generator/job_run.py), sent
and awaited through the job's :class:`~services.common.verify_client.VerifyClient`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Awaitable
from typing import Any

import nats.errors
import structlog
from nats.aio.msg import Msg
from prometheus_client import Counter, Histogram

from schemas import (
    TERMINAL_STATUSES,
    JobEvent,
    JobRecord,
    JobResult,
    JobSubmit,
    decode,
    new_id,
    subjects,
    utcnow,
)
from services.common.bus import Bus, JobNotFound, connect_bus
from services.common.jobs import (
    CheckedJobStore,
    JobRecordCorrupt,
    describe_pairs,
    live_arch,
    new_record,
    publish_event,
)
from services.common.metrics import start_metrics_server
from services.common.pull_loop import PullLoop, open_pull_loop
from services.common.records import attempt_ids
from services.common.runtime import cancel_and_wait, install_signal_handlers
from services.common.settings import Settings
from services.common.shares import TenantSlots, share_slots
from services.common.task_source import TaskError, check_task
from services.common.tenants import load_tenants, tenant_label, warn_without_tenants_file
from services.common.verdicts import forget_job_key, job_key
from services.common.verify_client import VerifyClient
from services.generator.agents import Conductor, Designer, LLMCoder
from services.generator.coders.base import (
    JOB_TENANT,
    Attempt,
    BuiltinCoder,
    lowering_sandbox,
)
from services.generator.evolve_run import EvolveJob
from services.generator.job_run import JobCancelled, JobRun
from services.generator.llm import LLMClient, LLMConfigError
from services.generator.workflows import (
    WORKFLOWS,
    WorkflowContext,
    WorkflowError,
    describe_failure,
)
from services.sandbox.limits import child_limits_from
from services.sandbox.pool import Sandbox

log = structlog.get_logger("aikg.generator")

JOBS_FINISHED = Counter("aikg_generator_jobs_total", "Jobs finished, by outcome and tenant.",
                        ["outcome", "tenant"])
JOBS_STARTED = Counter("aikg_generator_jobs_started_total",
                       "Jobs a generator started (first start of each delivery), by tenant "
                       "and priority.", ["tenant", "priority"])
JOB_QUEUE_WAIT = Histogram(
    "aikg_job_queue_wait_seconds",
    "Time from a job's submission to its start by a generator, seconds, by tenant.",
    ["tenant", "priority"],
    buckets=(0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, 7200),
)
JOB_SECONDS = Histogram(
    "aikg_generator_job_duration_seconds", "Wall time of a job in the generator, seconds.",
    ["job_type"], buckets=(1, 2, 5, 10, 30, 60, 120, 300, 600, 1800, 3600),
)
JOB_PHASE_SECONDS = Histogram(
    "aikg_job_phase_seconds",
    "Time finished jobs spent in each phase, seconds (phase names: "
    "schemas.events.JOB_PHASES).",
    ["job_type", "phase"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 120, 600, 3600),
)

# How often a running job's record is read to notice a cancel, seconds.
CANCEL_POLL_S = 0.5


class Generator:
    """Job consumer and workflow runner.

    Args:
        bus: connected NATS bus.
        settings: concurrency, timeouts and the LLM endpoints (``llm_*``).
        sandbox: the built-in coder's sandbox; default a new one
            (:func:`~services.generator.coders.base.lowering_sandbox` with the settings'
            ``sandbox_require`` and ``sandbox_env_allow``). The generator starts it before
            its first job and closes it when it stops.
    """

    def __init__(self, bus: Bus, settings: Settings, sandbox: Sandbox | None = None) -> None:
        self.bus = bus
        self.settings = settings
        self.jobs = CheckedJobStore(bus.jobs)
        self.sandbox = sandbox or lowering_sandbox(
            f"generator-{os.getpid()}", require=settings.sandbox_require_list,
            env_allow=settings.sandbox_env_allow_list)
        # Fair shares (services/common/shares.py): of this process's job slots (the
        # pull loop's messages in hand, at_share) and of its lowering slots, a tenant
        # holds at most max_generator_share (beyond it only while nobody else waits,
        # with share_borrow_idle).
        tenants = load_tenants(settings)
        warn_without_tenants_file(settings, "generator", log)

        def share(name: str) -> float:
            return tenants.get(name).max_generator_share

        self.lowering_slots = TenantSlots(settings.generator_concurrency, share, "lowering",
                                          borrow=settings.share_borrow_idle)
        self.builtin = BuiltinCoder(self.sandbox, timeout_s=settings.lowering_timeout_s,
                                    slots=self.lowering_slots,
                                    limits=child_limits_from(settings))
        self.tenants = tenants
        # The job intake (bound in run()).
        self.loop: PullLoop | None = None
        self.llm: LLMClient | None = None
        # A broken LLM configuration fails the jobs that need the LLM, with this text,
        # instead of the whole generator.
        self.llm_error: str | None = None
        try:
            self.llm = LLMClient(settings)
        except LLMConfigError as exc:
            self.llm_error = str(exc)

    async def run(self, stop: asyncio.Event) -> None:
        """Serve jobs until ``stop`` is set; in-flight jobs are cancelled and their
        messages nak'ed, so another generator takes them at once."""
        # Jobs wait in one lane per tenant and priority; they are taken in fair order
        # (services/common/pull_loop.py), a tenant at its share of the job slots left
        # out until one of its jobs ends (with share_borrow_idle: asked after every
        # other lane came up empty).
        borrow = self.settings.share_borrow_idle
        self.loop = await open_pull_loop(
            self.bus.js, self.bus.nc, self.settings, stream=subjects.STREAM_JOBS,
            base=subjects.JOBS_SUBMIT, sweep_strays=True, kind="job submission",
            decode=lambda data: decode(data, JobSubmit), handle=self._handle,
            capacity=lambda: self.settings.generator_concurrency - self.loop.in_hand,
            exclude=None if borrow else self.at_share,
            defer=self.at_share if borrow else None, dead_lettered=self._dead_lettered)
        try:
            # Before the first job: every lowering runs the task's code in this sandbox.
            await asyncio.to_thread(self.sandbox.start)
            log.info("generator_sandbox", sandbox=self.sandbox.isolation.summary(),
                     notes=self.sandbox.isolation.notes)
            if self.llm_error:
                log.error("llm_config_invalid", error=self.llm_error)
            log.info("generator_started", concurrency=self.settings.generator_concurrency,
                     ack_wait_s=self.loop.delivery.ack_wait_s,
                     llm=self.llm.describe() if self.llm and self.llm.configured() else None)
            await self.loop.run(stop)
        finally:
            await self.loop.finish()
            await self.loop.lanes.stop()
            if self.llm is not None:
                await self.llm.aclose()
            await asyncio.to_thread(self.sandbox.close)
            log.info("generator_stopped")

    def at_share(self, tenant: str) -> bool:
        """Whether ``tenant``'s jobs hold its ``max_generator_share`` of this process's
        job slots (services/common/shares.py): its lanes are not asked meanwhile."""
        cap = share_slots(self.tenants.get(tenant).max_generator_share,
                          self.settings.generator_concurrency)
        return self.loop is not None and self.loop.held[tenant] >= cap

    @staticmethod
    def _job_id(msg: Msg, submit: JobSubmit | None) -> str | None:
        """The job's id: the submission's, else a ``Nats-Msg-Id`` that is one token."""
        header_id = (msg.headers or {}).get("Nats-Msg-Id")
        header_id = header_id if header_id and subjects.is_token(header_id) else None
        return (submit.job_id if submit is not None else None) or header_id

    async def _dead_lettered(self, msg: Msg, submit: JobSubmit | None, reason: str,
                             why: str) -> None:
        """A job message moved to the DLQ: its job fails (a malformed one: its
        ``failed`` event only, when a job id can be told)."""
        job_id = self._job_id(msg, submit)
        if job_id is None:
            return
        if why == "malformed":
            await self._fail_new(job_id, reason)
        else:
            with contextlib.suppress(JobNotFound):
                await self._finish(job_id, "failed", error=reason)

    async def _handle(self, msg: Msg, submit: JobSubmit, _slot: Any = None) -> None:
        job_id = self._job_id(msg, submit) or new_id("job-")
        # The lane it waited on says whose job it is (a raw `nats pub` on jobs.submit:
        # the default tenant).
        tenant, priority = (subjects.parse_lane(subjects.JOBS_SUBMIT, msg.subject or "")
                            or (subjects.DEFAULT_TENANT, subjects.DEFAULT_PRIORITY))
        JOB_TENANT.set(tenant)  # whose lowerings these are (BuiltinCoder's slots)
        with structlog.contextvars.bound_contextvars(job_id=job_id, tenant=tenant):
            try:
                await self._serve(msg, job_id, submit, tenant, priority)
            except JobRecordCorrupt as exc:
                await self._fail_corrupt(msg, submit, exc)

    async def _serve(self, msg: Msg, job_id: str, submit: JobSubmit,
                     tenant: str = subjects.DEFAULT_TENANT,
                     priority: str = subjects.DEFAULT_PRIORITY) -> None:
        """Run a decoded job message to its end, then ack it.

        A job whose tenant is not in the tenants file (when one is configured) fails
        at once, its error naming the tenant and the file.

        Raises:
            JobRecordCorrupt: the job's record does not decode (met at any point).
        """
        refused = self.tenants.refusal(tenant, "generator")
        if refused is not None:
            log.warning("unknown_tenant_refused", tenant=tenant,
                        tenants_file=self.settings.tenants_file)
        record = await self._ensure_record(job_id, submit, tenant, priority, refused=refused)
        if record is not None and refused is not None \
                and record.status not in TERMINAL_STATUSES:
            await self._finish(job_id, "failed", error=refused)
            record = None
        if record is None or record.status in TERMINAL_STATUSES:
            await msg.ack()
            return
        started = time.monotonic()
        try:
            outcome = await self._run_job(record)
        except (JobRecordCorrupt, nats.errors.Error, OSError, TimeoutError):
            raise  # the bus or the record, not the job: handed back for redelivery
        except Exception as exc:
            # Something in this job's own handling raised: running it again would
            # raise again, so it fails once, with the real exception.
            reason = (f"the generator could not run this job: {type(exc).__name__}: "
                      f"{exc}"[:2000])
            log.exception("job_raised", error=reason)
            await self._finish(job_id, "failed", error=reason)
            outcome = "failed"
        JOBS_FINISHED.labels(outcome=outcome, tenant=tenant_label(record.tenant)).inc()
        JOB_SECONDS.labels(job_type=record.job_type).observe(time.monotonic() - started)
        await msg.ack()

    async def _fail_corrupt(self, msg: Msg, submit: JobSubmit, corrupt: JobRecordCorrupt) -> None:
        """End a job whose record does not decode: ``failed`` once, with the reason.

        The bad value is replaced (compare-and-swap on its revision) by a ``failed``
        record built from the job's submission, its error naming the fault; one
        ``failed`` event is published and the message acked. When the key changed
        since it was read, nothing is written and the message is handed back (nak) to
        be looked at again: a good record then runs normally, a new bad one is
        replaced on the next delivery.
        """
        reason = (f"{corrupt}; the generator replaced the unreadable record with this failed "
                  "one (the job's submission is kept in `request`); resubmit the job to run it")
        record = new_record(submit, job_id=corrupt.job_id, arch=submit.arch)
        record.status = "failed"
        record.error = reason
        record.end_time = utcnow()
        record.progress.phase = "failed"
        record.progress.message = reason
        if not await self.jobs.replace_corrupt(corrupt, record):
            log.warning("job_record_changed_while_failing", fault=corrupt.fault)
            with contextlib.suppress(Exception):
                await msg.nak(delay=1)
            return
        # One warning, no traceback: the fault is the data's, not the generator's.
        log.warning("job_record_corrupt", fault=corrupt.fault, outcome="failed")
        JOBS_FINISHED.labels(outcome="failed", tenant=tenant_label(record.tenant)).inc()
        await publish_event(self.bus, JobEvent(job_id=corrupt.job_id, event="failed",
                                               status="failed", message=reason))
        with contextlib.suppress(Exception):  # already acked when it was dead-lettered
            await msg.ack()

    async def _ensure_record(self, job_id: str, submit: JobSubmit,
                             tenant: str = subjects.DEFAULT_TENANT,
                             priority: str = subjects.DEFAULT_PRIORITY, *,
                             refused: str | None = None) -> JobRecord | None:
        """The job's record; created here for a raw ``nats pub`` submission (which did
        not pass the gateway's checks, so they run now). ``refused``: why the job
        must fail (an unknown tenant); a record created here is then failed with it
        and None returned."""
        try:
            return (await self.jobs.get(job_id))[0]
        except JobNotFound:
            pass
        arch = submit.arch
        error = refused
        try:
            check_task(submit.task_desc, submit.shape_overrides)
        except TaskError as exc:
            error = error or str(exc)
        if error is None and arch is None:
            arch, workers = await live_arch(self.bus, submit.backend, None)
            if arch is None:
                error = (f"no live worker for backend={submit.backend}; live: "
                         f"{', '.join(describe_pairs(workers)) or 'none'}")
        record = new_record(submit, job_id=job_id, arch=arch, tenant=tenant, priority=priority)
        await self.jobs.create(record)
        await publish_event(self.bus, JobEvent(job_id=job_id, event="submitted", status="pending"))
        if error:
            await self._finish(job_id, "failed", error=error)
            return None
        return (await self.jobs.get(job_id))[0]

    async def _run_job(self, record: JobRecord) -> str:
        job_id = record.job_id
        submit = record.request

        first_start = [False]

        def start(r: JobRecord) -> JobRecord | None:
            first_start[0] = False
            if r.status in TERMINAL_STATUSES:
                return None
            r.status = "running"
            first_start[0] = r.start_time is None
            r.start_time = r.start_time or utcnow()
            r.progress.phase = "started"
            return r

        record = await self.jobs.update(job_id, start)
        if record.status != "running":
            return record.status
        if first_start[0] and record.start_time is not None:
            tenant = tenant_label(record.tenant)
            JOBS_STARTED.labels(tenant=tenant, priority=record.priority).inc()
            JOB_QUEUE_WAIT.labels(tenant=tenant, priority=record.priority).observe(
                max(0.0, (record.start_time - record.submit_time).total_seconds()))
        recorded = len(record.progress.candidates)
        await publish_event(self.bus, JobEvent(
            job_id=job_id, event="started", status="running",
            message=f"resumed with {recorded} recorded candidate(s)" if recorded else ""))
        log.info("job_started", op_name=record.op_name, backend=record.backend, arch=record.arch,
                 resumed_candidates=recorded)
        phases: dict[str, float] = {}
        try:
            client = VerifyClient(self.bus.js, job_id, await job_key(self.bus.js, job_id))
            await client.start()
            try:
                run = JobRun(bus=self.bus, jobs=self.jobs, settings=self.settings,
                             llm=self.llm, record=record, client=client, phases=phases)
                if submit.job_type == "evolve":
                    work = self._evolve(run)
                else:
                    ctx = self._context(run, await run.recover())
                    work = WORKFLOWS[submit.workflow](ctx)
                result = await self._until_cancelled(job_id, work)
            finally:
                await client.stop()
        except JobCancelled:
            log.info("job_cancelled")
            await forget_job_key(self.bus.js, job_id)
            return "cancelled"
        except WorkflowError as exc:
            await self._finish(job_id, "failed", error=str(exc), result=exc.result,
                               phases=phases)
            await forget_job_key(self.bus.js, job_id)
            return "failed"
        await forget_job_key(self.bus.js, job_id)
        if result.passed:
            await self._finish(job_id, "completed", result=result, phases=phases)
            return "completed"
        assert result.verdict is not None
        await self._finish(job_id, "failed", result=result, error=describe_failure(result.verdict),
                           phases=phases)
        return "failed"

    def _context(self, run: JobRun, history: list[Attempt]) -> WorkflowContext:
        """The workflow's coders and agents for the job's ``coder`` choice.

        ``coder`` None means the LLM coder when an LLM endpoint is configured, else the
        built-in coder. An LLM job also gets the built-in coder, for a first candidate.

        Raises:
            WorkflowError: ``coder="llm"`` (or None with a broken LLM configuration)
                and no usable LLM configuration.
        """
        submit = run.submit
        wants_llm = submit.coder == "llm" or (
            submit.coder is None and (self.llm_error is not None
                                      or (self.llm is not None and self.llm.configured())))
        ctx = WorkflowContext(submit=submit, verify=run.verify, report=run.report,
                              builtin=self.builtin, history=history,
                              plan=run.record.progress.plan, phases=run.phases)
        if not wants_llm:
            return ctx
        if self.llm_error is not None:
            raise WorkflowError(f"the LLM coder is misconfigured: {self.llm_error}")
        if self.llm is None or not self.llm.configured():
            raise WorkflowError("coder 'llm' requested but no LLM is configured on the generator: "
                                "set AIKG_LLM_BASE_URL and AIKG_LLM_MODEL (README, 'Using an "
                                "LLM'), or submit with coder 'builtin'")
        ctx.coder = LLMCoder(run.chat)
        if submit.workflow == "default_workflow":
            if self.llm.configured("designer"):
                ctx.designer = Designer(run.chat)
            if self.llm.configured("conductor"):
                ctx.conductor = Conductor(run.chat)
        return ctx

    async def _evolve(self, run: JobRun) -> JobResult:
        """An evolve job: the LLM mutates when the job's coder is the LLM (see
        :meth:`_context`), else the built-in coder's launch-parameter search."""
        ctx = self._context(run, [])
        job = EvolveJob(run, use_llm=ctx.coder is not None,
                        ids=lambda index: attempt_ids(run.job_id, index)[0])
        return await job.run_search(self.builtin, run.chat)

    async def _until_cancelled(self, job_id: str, work: Awaitable[JobResult]) -> JobResult:
        """Await ``work`` while polling the job's record; cancel it when the record
        says the job ended elsewhere (a cancel, or another generator finished it).

        Raises:
            JobCancelled: the job ended under us; ``work`` was cancelled.
            JobRecordCorrupt: the record stopped decoding; ``work`` was cancelled.
        """
        task = asyncio.ensure_future(work)

        async def watch() -> None:
            while True:
                await asyncio.sleep(CANCEL_POLL_S)
                try:
                    record, _ = await self.jobs.get(job_id)
                except JobNotFound:
                    return
                except JobRecordCorrupt:
                    raise  # the stored bytes are bad: reading again will not help
                except Exception as exc:  # noqa: BLE001 - a KV hiccup is not a cancel
                    log.warning("cancel_poll_failed", error=str(exc))
                    continue
                if record.status in TERMINAL_STATUSES:
                    return

        watcher = asyncio.create_task(watch())
        try:
            done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if task in done:
                return task.result()
            await cancel_and_wait(task)
            if isinstance(watcher.exception(), JobRecordCorrupt):
                raise watcher.exception()  # type: ignore[misc]
            raise JobCancelled(job_id)
        finally:
            await cancel_and_wait(task, watcher)

    async def _finish(self, job_id: str, status: str, *, result: JobResult | None = None,
                      error: str | None = None, phases: dict[str, float] | None = None) -> None:
        finished = False

        def change(r: JobRecord) -> JobRecord | None:
            nonlocal finished
            finished = False
            if r.status in TERMINAL_STATUSES:
                return None
            finished = True
            r.status = status
            r.result = result
            r.error = error
            r.end_time = utcnow()
            if phases is not None:
                r.phases = job_phases(r, phases)
            r.progress.phase = status
            if error:
                r.progress.message = error
            return r

        try:
            await self.jobs.update(job_id, change)
        except JobNotFound:
            return
        if not finished:
            # Someone else ended it first: a cancel, or another delivery of this job
            # (JetStream redelivers after a consumer leader change).
            return
        log.info("job_finished", status=status, error=error)
        if phases is not None:
            with contextlib.suppress(JobNotFound, Exception):
                record, _ = await self.jobs.get(job_id)
                for name, seconds in record.phases.items():
                    JOB_PHASE_SECONDS.labels(job_type=record.job_type,
                                             phase=name).observe(seconds)
        await publish_event(self.bus, JobEvent(
            job_id=job_id, event=status, status=status, message=error or "",
            verdict=result.verdict if result else None))

    async def _fail_new(self, job_id: str, reason: str) -> None:
        with contextlib.suppress(Exception):
            await publish_event(self.bus, JobEvent(job_id=job_id, event="failed",
                                                   status="failed", message=reason))


def job_phases(record: JobRecord, measured: dict[str, float]) -> dict[str, float]:
    """A finished job's phases (:data:`schemas.events.JOB_PHASES`), seconds: ``queue``
    from ``submit_time`` to ``start_time``, the ``measured`` ones, and ``other``, the
    rest of ``end_time - submit_time`` (never below 0)."""
    out: dict[str, float] = {}
    total = None
    if record.end_time is not None:
        total = (record.end_time - record.submit_time).total_seconds()
    if record.start_time is not None:
        out["queue"] = max(0.0, (record.start_time - record.submit_time).total_seconds())
    out.update(measured)
    if total is not None:
        out["other"] = max(0.0, total - sum(out.values()))
    return {k: round(v, 6) for k, v in out.items()}


async def run_generator(settings: Settings, stop: asyncio.Event | None = None, *,
                        sandbox: Sandbox | None = None) -> None:
    """Connect, serve jobs until ``stop`` is set (or SIGINT/SIGTERM), then exit;
    ``sandbox`` as :class:`Generator`'s.

    Raises:
        ConnectionError: NATS is unreachable at start.
    """
    restore = lambda: None  # noqa: E731
    if stop is None:
        stop = asyncio.Event()
        restore = install_signal_handlers(stop, logger=log, hint="running jobs are handed "
                                          "back to the queue (nak) for another generator")
    try:
        start_metrics_server(settings.metrics_port)
        bus = await connect_bus(settings, "aikg-generator", role="generator")
        try:
            await Generator(bus, settings, sandbox).run(stop)
        finally:
            await bus.close()
    finally:
        restore()
