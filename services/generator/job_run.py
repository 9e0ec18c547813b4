"""One running job, the generator's side: :class:`JobRun` keeps its candidates in the
job record, sends their verify requests through the job's
:class:`~services.common.verify_client.VerifyClient`, awaits their verdicts, and
reports its progress and LLM usage.

Its part of the crash-recovery protocol (services/generator/service.py, module
docstring): a candidate is written into the job record (compare-and-swap) before its
request is published under a deterministic request id (``<job_id>-a<attempt>``,
:func:`services.common.records.attempt_ids`), the VERIFY sequence of the acknowledged
publish is recorded next and each verdict once it counts; a resumed run
(:meth:`JobRun.recover`) rebuilds the attempts from the record and awaits or resends
only what is missing.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from typing import Any

import structlog
from nats.js.api import PubAck
from prometheus_client import Counter

from schemas import TERMINAL_STATUSES, JobEvent, JobRecord, VerifyResult
from schemas.events import CandidateRecord
from services.common.bus import Bus
from services.common.jobs import CheckedJobStore, publish_event
from services.common.lane_watch import LaneWatch, UnservedLane
from services.common.records import attempt_ids
from services.common.settings import Settings
from services.common.verify_client import VerifyClient, task_fields
from services.generator.coders.base import Attempt, Candidate
from services.generator.llm import Completion, LLMClient, Message
from services.generator.workflows import WorkflowError, add_phase

log = structlog.get_logger("aikg.generator")

CANDIDATES = Counter("aikg_generator_candidates_total", "Candidates generated, by coder.", ["coder"])

# How long a resumed job waits for the full verdict of an attempt whose summary the
# record already holds (RESULTS replays its history at once; past max age it is gone).
RECORDED_VERDICT_WAIT_S = 2.0
# Verdict error text kept per candidate in the record, characters.
RECORD_ERROR_CHARS = 2000


class JobCancelled(Exception):
    """The job's record says ``cancelled`` (or another generator ended it): stop."""


def code_sha256(code: str) -> str:
    return hashlib.sha256(code.encode()).hexdigest()


class JobRun:
    """The generator's side of one running job: its candidates in the job record,
    their verify requests and verdicts, its progress and its LLM usage.

    Args:
        bus: the connection (verify requests, events).
        jobs: the ``jobs`` bucket's store (the record, by compare-and-swap).
        settings: the generator's settings (``verify_result_timeout_s``).
        llm: the LLM client for :meth:`chat`, or None without one.
        record: the job's record when the run started.
        client: the job's verify client (its requests and verdicts), started.
        phases: seconds per job phase, added to by the run and its workflow.
    """

    def __init__(self, *, bus: Bus, jobs: CheckedJobStore, settings: Settings,
                 llm: LLMClient | None, record: JobRecord, client: VerifyClient,
                 phases: dict[str, float] | None = None) -> None:
        # Seconds per job phase measured here (verify_wait) and by the workflow.
        self.phases: dict[str, float] = {} if phases is None else phases
        self.bus = bus
        self.jobs = jobs
        self.settings = settings
        self.llm = llm
        self.record = record
        self.job_id = record.job_id
        self.submit = record.request
        self.client = client
        # What every candidate's request takes from the job: its task, arch and lane.
        self.task = task_fields(self.submit, arch=record.arch or "", tenant=record.tenant,
                                priority=record.priority)

    async def recover(self) -> list[Attempt]:
        """Attempts recorded by earlier runs of this job, oldest first.

        A recorded verdict is taken from RESULTS when it is still there (the full
        verdict, with the log a repair prompt wants), else rebuilt from the record's
        summary. An attempt without a verdict keeps ``verdict`` None; the workflow
        awaits it again through :meth:`verify`.
        """
        attempts = []
        entries = sorted(self.record.progress.candidates, key=lambda e: e.attempt)
        for entry in entries:
            verdict = None
            if entry.passed is not None:
                verdict = self.client.results.get(entry.request_id)
                if verdict is None and entry is entries[-1]:
                    verdict = await self._recorded_verdict(entry)
                verdict = verdict or self._summary_verdict(entry)
            attempts.append(Attempt(
                number=entry.attempt,
                candidate=Candidate(code=entry.code or "", coder=entry.coder,
                                    meta={"guidance": entry.guidance} if entry.guidance else {}),
                verdict=verdict))
        return attempts

    def _summary_verdict(self, entry: CandidateRecord) -> VerifyResult:
        return VerifyResult(request_id=entry.request_id, job_id=self.job_id,
                            candidate_id=entry.candidate_id, worker_id="", device="",
                            passed=bool(entry.passed), stage=entry.stage, error=entry.error)

    # --- progress and usage ---------------------------------------------------------

    async def report(self, event: str, *, phase: str = "", message: str = "", **data) -> None:
        """Update progress fields of the record and publish ``event``.

        Raises:
            JobCancelled: the record says the job ended.
        """
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

        record = await self.jobs.update(self.job_id, change)
        if record.status in TERMINAL_STATUSES:
            raise JobCancelled(self.job_id)
        await publish_event(self.bus, JobEvent(job_id=self.job_id, event=event,
                                               status=record.status, message=message, data=data))

    async def chat(self, agent: str, messages: list[Message]) -> Completion:
        """The LLM client's chat, with the call's usage added to the job record."""
        assert self.llm is not None
        return await self.llm.chat(agent, messages, usage=self._add_usage)

    async def _add_usage(self, completion: Completion) -> None:
        def change(r: JobRecord) -> JobRecord | None:
            if r.status in TERMINAL_STATUSES:
                return None
            usage = r.progress.llm_usage
            usage.requests += completion.calls
            usage.prompt_tokens += completion.prompt_tokens
            usage.completion_tokens += completion.completion_tokens
            usage.duration_s = round(usage.duration_s + completion.duration_s, 3)
            return r

        try:
            await self.jobs.update(self.job_id, change)
        except Exception as exc:  # noqa: BLE001 - usage is bookkeeping, not the job
            log.warning("llm_usage_update_failed", error=str(exc))

    # --- candidates -----------------------------------------------------------------

    async def verify(self, attempt: Attempt) -> VerifyResult:
        """Record ``attempt``'s candidate, send its verify request, return the verdict.

        Idempotent per attempt number: a candidate already in the record is not
        recorded again, a request already published (its VERIFY sequence recorded) is
        not resent, and a verdict already recorded is returned at once.

        Raises:
            JobCancelled: the job ended meanwhile.
            WorkflowError: no verdict within ``verify_result_timeout_s``.
        """
        entry = await self._record_candidate(attempt)
        if entry.passed is not None:
            return await self._recorded_verdict(entry)
        if entry.code is None:
            raise WorkflowError(f"attempt {entry.attempt}'s code is not in the job record; "
                                "resubmit the job")
        bound = log.bind(candidate_id=entry.candidate_id, request_id=entry.request_id,
                         attempt=entry.attempt)
        if entry.verify_seq is None:
            ack = await self.send_request(entry.candidate_id, entry.request_id, entry.code,
                                          data={"attempt": entry.attempt})
            await self._update_entry(entry.attempt, verify_seq=ack.seq)
            bound.info("verify_requested", seq=ack.seq, duplicate=bool(ack.duplicate))
        else:
            bound.info("verify_reawaited", seq=entry.verify_seq)
        result = await self.await_verdict(entry.candidate_id, entry.request_id)
        current = await self._update_entry(entry.attempt, verdict=result)
        await publish_event(self.bus, JobEvent(
            job_id=self.job_id, event="verify_result", status=current.status,
            candidate_id=entry.candidate_id, request_id=entry.request_id, verdict=result,
            message=current.progress.message, data={"attempt": entry.attempt}))
        if current.status in TERMINAL_STATUSES:
            raise JobCancelled(self.job_id)
        return result

    async def send_request(self, candidate_id: str, request_id: str, code: str, *,
                           data: dict[str, Any] | None = None) -> PubAck:
        """Publish ``code``'s verify request on the job's lane of
        ``verify.<backend>.<arch>`` with ``request_id`` as its ``Nats-Msg-Id`` (a
        resend inside the stream's duplicate window is dropped by the stream;
        :func:`services.common.verify_client.publish`) and report ``verify_started``.

        The verdict is awaited with :meth:`await_verdict`; the job's client reads
        ``results.<job_id>.>`` from the run's start, so a verdict that comes before the
        await is kept.

        Returns:
            The stream's acknowledgement (``seq``, ``duplicate``).
        """
        request = self.client.request(code=code, request_id=request_id,
                                      candidate_id=candidate_id, **self.task)
        ack = await self.client.publish(request)
        await publish_event(self.bus, JobEvent(
            job_id=self.job_id, event="verify_started", status="running",
            candidate_id=candidate_id, request_id=request_id,
            data={**(data or {}), "duplicate": bool(ack.duplicate)}))
        return ack

    async def await_verdict(self, candidate_id: str, request_id: str) -> VerifyResult:
        """The verdict of ``request_id`` (sent now or before a restart), its wait added
        to the job's ``verify_wait`` phase.

        Raises:
            WorkflowError: no verdict within ``verify_result_timeout_s``, or no live
                worker of the job's backend/arch for ``verify_unserved_timeout_s``
                (services/common/lane_watch.py; the message names the lane).
        """
        waiting = time.monotonic()
        timeout = self.settings.verify_result_timeout_s
        watch = LaneWatch(self.bus.js, self.submit.backend, self.record.arch or "",
                          self.settings.verify_unserved_timeout_s, waiter="generator")
        try:
            return await self.client.wait(request_id, timeout, watch=watch)
        except UnservedLane as exc:
            raise WorkflowError(f"candidate {candidate_id}: {exc}") from exc
        except TimeoutError as exc:
            raise WorkflowError(
                f"no verdict for candidate {candidate_id} within {timeout:.0f} s: is a "
                f"worker for {self.submit.backend}/{self.record.arch} running?") from exc
        finally:
            add_phase(self.phases, "verify_wait", time.monotonic() - waiting)

    async def _record_candidate(self, attempt: Attempt) -> CandidateRecord:
        candidate = attempt.candidate
        candidate_id, request_id = attempt_ids(self.job_id, attempt.number)
        digest = code_sha256(candidate.code)
        created: list[bool] = [False]

        def change(r: JobRecord) -> JobRecord | None:
            created[0] = False
            if r.status in TERMINAL_STATUSES:
                return None
            entries = r.progress.candidates
            if any(e.attempt == attempt.number for e in entries):
                return None  # recorded by an earlier run (or a racing generator)
            for e in entries:
                e.code = None  # only the latest candidate's code is kept
            entries.append(CandidateRecord(
                attempt=attempt.number, candidate_id=candidate_id, request_id=request_id,
                coder=candidate.coder, code_sha256=digest, code=candidate.code,
                guidance=str(candidate.meta.get("guidance", ""))))
            _count(r)
            r.progress.phase = "verifying"
            r.progress.message = (f"verifying attempt {attempt.number} ({candidate.coder}) on "
                                  f"{r.backend}/{r.arch}")
            created[0] = True
            return r

        record = await self.jobs.update(self.job_id, change)
        if record.status in TERMINAL_STATUSES:
            raise JobCancelled(self.job_id)
        entry = next(e for e in record.progress.candidates if e.attempt == attempt.number)
        if created[0]:
            CANDIDATES.labels(coder=candidate.coder).inc()
            await publish_event(self.bus, JobEvent(
                job_id=self.job_id, event="candidate_generated", status="running",
                candidate_id=candidate_id,
                data={"coder": candidate.coder, "attempt": attempt.number,
                      "code_sha256": digest}))
        elif entry.code_sha256 != digest and entry.code is not None:
            # Another run recorded this attempt with other code: its request is the
            # one on the bus, so that code is what gets judged.
            log.warning("attempt_recorded_elsewhere", attempt=attempt.number)
            attempt.candidate = Candidate(code=entry.code, coder=entry.coder)
        return entry

    async def _recorded_verdict(self, entry: CandidateRecord) -> VerifyResult:
        """The full verdict from RESULTS when it is still there, else the record's summary."""
        future = self.client.expect(entry.request_id)
        try:
            return await asyncio.wait_for(future, RECORDED_VERDICT_WAIT_S)
        except TimeoutError:
            return self._summary_verdict(entry)

    async def _update_entry(self, number: int, *, verify_seq: int | None = None,
                            verdict: VerifyResult | None = None) -> JobRecord:
        def change(r: JobRecord) -> JobRecord | None:
            if r.status in TERMINAL_STATUSES:
                return None
            entry = next((e for e in r.progress.candidates if e.attempt == number), None)
            if entry is None:
                return None
            if verify_seq is not None:
                if entry.verify_seq == verify_seq:
                    return None
                entry.verify_seq = verify_seq
            if verdict is not None:
                if entry.passed is not None:
                    return None  # recorded already (a resumed run re-awaited it)
                entry.passed = verdict.passed
                entry.stage = verdict.stage
                entry.error = (verdict.error or "")[:RECORD_ERROR_CHARS] or None
                _count(r)
                r.progress.message = (
                    f"attempt {number} passed" if verdict.passed
                    else f"attempt {number} failed at stage '{verdict.stage}'")
            return r

        return await self.jobs.update(self.job_id, change)


def _count(r: JobRecord) -> None:
    """Progress counters from the candidate list (so a resumed job counts each once)."""
    entries = r.progress.candidates
    r.progress.candidates_generated = len(entries)
    r.progress.candidates_verified = sum(e.passed is not None for e in entries)
    r.progress.candidates_passed = sum(bool(e.passed) for e in entries)


