"""Workflows: how a single job's candidates are produced, judged and repaired.

Workflows know nothing of NATS (the service hands them callables). They get a :class:`WorkflowContext`: the
job, the coders and agents it may use, and two callables, ``verify`` (send one
attempt's candidate to a worker and return its :class:`VerifyResult`) and ``report``
(progress for the outside world), and return a :class:`JobResult`.

Attempts are numbered from 1; each is one candidate and one verify request, and a
job makes at most ``JobSubmit.max_attempts`` of them. A workflow may start with the
attempts a previous generator recorded before it died (``history``): an attempt
still waiting for its verdict is awaited again (``verify`` does not resend it), and
the loop goes on from there, so nothing verified is redone.

Candidates come, in order, from:

- ``coder="builtin"``: ``init_code`` when given, then the built-in coder (it is
  deterministic, so it writes one candidate).
- ``coder="llm"``: ``init_code`` when given, else the built-in coder's kernel when it
  can lower the task; then the LLM coder, which after each failure gets the
  failed code and the verifier's verdict (the repair loop) until a candidate passes
  or the attempts run out. ``default_workflow`` adds the designer's plan before the
  first LLM candidate and the conductor's repair instruction after each failure.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

import structlog

from schemas import JobResult, JobSubmit, VerifyResult
from services.generator.agents import Conductor, Designer, LLMCoder
from services.generator.coders.base import Attempt, Candidate, CoderError
from services.generator.llm import LLMError

log = structlog.get_logger("aikg.workflows")

VerifyFn = Callable[[Attempt], Awaitable[VerifyResult]]
ReportFn = Callable[..., Awaitable[None]]


def add_phase(phases: dict[str, float], name: str, seconds: float) -> None:
    """Add ``seconds`` to job phase ``name`` (:data:`schemas.events.JOB_PHASES`)."""
    phases[name] = phases.get(name, 0.0) + seconds


class Coder(Protocol):
    name: str

    async def generate(self, submit: JobSubmit, **params) -> Candidate: ...


class WorkflowError(Exception):
    """The job cannot go on; the message is the job's ``error``.

    Attributes:
        result: what the job got so far (its last verdict), or None.
    """

    def __init__(self, message: str, result: JobResult | None = None) -> None:
        super().__init__(message)
        self.result = result


@dataclass
class WorkflowContext:
    """What a workflow works with.

    Attributes:
        submit: the job.
        verify: verifies one attempt's candidate; returns the worker's verdict.
        report: ``await report(event, phase=..., message=..., **progress_fields)``.
        builtin: the built-in coder, when the job may use it.
        coder: the LLM coder, for ``coder="llm"`` jobs.
        designer / conductor: LLM agents of ``default_workflow``.
        history: attempts recorded before a resume, oldest first (the last one may
            still lack its verdict).
        plan: the designer's plan recorded before a resume.
        phases: seconds per job phase; the workflow adds ``lowering`` (built-in
            coder) and ``llm`` (LLM coder and agents) to it.
    """

    submit: JobSubmit
    verify: VerifyFn
    report: ReportFn
    builtin: Coder | None = None
    coder: LLMCoder | None = None
    designer: Designer | None = None
    conductor: Conductor | None = None
    history: list[Attempt] = field(default_factory=list)
    plan: str | None = None
    phases: dict[str, float] = field(default_factory=dict)


def describe_failure(result: VerifyResult) -> str:
    """One line for a failed verdict: ``stage: error``."""
    return f"candidate failed verification at stage '{result.stage}': {result.error or 'no detail'}"


def _result(attempt: Attempt, attempts: int) -> JobResult:
    verdict = attempt.verdict
    assert verdict is not None
    return JobResult(
        passed=verdict.passed,
        code=attempt.candidate.code,
        verdict=verdict,
        candidate_id=verdict.candidate_id,
        coder=attempt.candidate.coder,
        model=attempt.candidate.meta.get("model"),
        attempts=attempts,
        speedup=verdict.speedup,
    )


class _Run:
    """One workflow run: the attempt loop shared by both workflows."""

    def __init__(self, ctx: WorkflowContext, *, agents: bool) -> None:
        self.ctx = ctx
        self.submit = ctx.submit
        self.agents = agents
        self.history = list(ctx.history)
        self.plan = ctx.plan
        self.coder_error: str | None = None

    def first_sources(self) -> list[str]:
        """Where the next non-LLM candidates come from (``init_code``, ``builtin``)."""
        used = {a.candidate.coder for a in self.history}
        if self.ctx.coder is None:
            sources = ["init_code"] if self.submit.init_code else []
            sources += ["builtin"] if self.ctx.builtin is not None else []
            return [s for s in sources if s not in used]
        if self.history:
            return []  # the first candidate was tried: the LLM writes the rest
        if self.submit.init_code:
            return ["init_code"]
        return ["builtin"] if self.ctx.builtin is not None else []

    async def from_source(self, source: str) -> Candidate | None:
        if source == "init_code":
            assert self.submit.init_code is not None
            return Candidate(code=self.submit.init_code, coder="init_code")
        assert self.ctx.builtin is not None
        await self.ctx.report("progress", phase="generating",
                              message="builtin coder is writing a kernel")
        started = time.monotonic()
        try:
            return await self.ctx.builtin.generate(self.submit)
        except CoderError as exc:
            if self.ctx.coder is None:
                self.coder_error = str(exc)
            else:
                log.info("builtin_cannot_lower", reason=str(exc))
                await self.ctx.report("progress", phase="generating",
                                      message=f"built-in coder: {exc}; the LLM coder writes "
                                      "the first candidate")
            return None
        finally:
            add_phase(self.ctx.phases, "lowering", time.monotonic() - started)

    async def from_llm(self) -> Candidate | None:
        started = time.monotonic()
        try:
            return await self._from_llm()
        finally:
            add_phase(self.ctx.phases, "llm", time.monotonic() - started)

    async def _from_llm(self) -> Candidate | None:
        coder = self.ctx.coder
        assert coder is not None
        last = self.history[-1] if self.history else None
        instruction = None
        if self.agents and self.ctx.designer is not None and self.plan is None:
            await self.ctx.report("progress", phase="designing",
                                  message="designer is planning the kernel")
            try:
                self.plan = await self.ctx.designer.plan(self.submit)
            except LLMError as exc:
                # The plan helps; without it the coder still works from the task.
                log.warning("designer_failed", error=str(exc))
                self.plan = ""
            await self.ctx.report("progress", phase="designing", message="plan written",
                                  plan=self.plan)
        if (self.agents and self.ctx.conductor is not None and last is not None
                and last.verdict is not None and not last.verdict.passed):
            await self.ctx.report("progress", phase="repairing",
                                  message=f"conductor is reading attempt {last.number}'s failure")
            try:
                instruction = await self.ctx.conductor.instruct(self.submit, last)
            except LLMError as exc:
                log.warning("conductor_failed", error=str(exc))
        verb = f"repairing attempt {last.number}" if last else "writing a kernel"
        await self.ctx.report("progress", phase="generating", message=f"LLM coder is {verb}")
        try:
            return await coder.write(self.submit, self.history, self.plan or None, instruction)
        except CoderError as exc:
            self.coder_error = str(exc)
            return None

    async def run(self) -> JobResult:
        for attempt in self.history:
            if attempt.verdict is None:
                attempt.verdict = await self.ctx.verify(attempt)
        if self.history and self.history[-1].verdict and self.history[-1].verdict.passed:
            return _result(self.history[-1], len(self.history))
        sources = self.first_sources()
        while len(self.history) < self.submit.max_attempts:
            candidate = None
            while candidate is None and sources:
                candidate = await self.from_source(sources.pop(0))
            if candidate is None and self.ctx.coder is not None and self.coder_error is None:
                candidate = await self.from_llm()
            if candidate is None:
                break
            attempt = Attempt(number=len(self.history) + 1, candidate=candidate)
            self.history.append(attempt)
            attempt.verdict = await self.ctx.verify(attempt)
            if attempt.verdict.passed:
                return _result(attempt, len(self.history))
            if attempt.verdict.stage == "task":
                # The task itself cannot be verified here (too big for the worker, its
                # reference fails): another candidate cannot change that.
                break
        if not self.history:
            raise WorkflowError(self.coder_error
                                or "no candidate to verify: give init_code or a coder")
        result = _result(self.history[-1], len(self.history))
        if self.coder_error:
            raise WorkflowError(
                f"{self.coder_error} (after {len(self.history)} candidate(s); last: "
                f"{describe_failure(self.history[-1].verdict)})", result=result)
        return result


async def coder_only_workflow(ctx: WorkflowContext) -> JobResult:
    """Candidates from the job's coder, verified one by one until one passes.

    With the LLM coder, each failure goes back to it with the failed code and the
    verifier's verdict (stage, error, log) until a candidate passes or
    ``max_attempts`` candidates were verified.

    Returns:
        JobResult with ``passed`` True and the kernel, or False with the last verdict.

    Raises:
        WorkflowError: no candidate could be produced at all, or the coder gave up
            (the coder's message; ``result`` holds the last verdict, if any).
    """
    return await _Run(ctx, agents=False).run()


async def default_workflow(ctx: WorkflowContext) -> JobResult:
    """:func:`coder_only_workflow` with the designer and the conductor.

    The designer writes a plan once per job (kept in the job record, so a resumed job
    reuses it) that the LLM coder follows; after each failed attempt the conductor
    reads the failure and writes a short repair instruction that the coder gets with
    the verdict. Without an LLM it is :func:`coder_only_workflow`.

    Returns / Raises: as :func:`coder_only_workflow`.
    """
    return await _Run(ctx, agents=True).run()


WORKFLOWS: dict[str, Callable[[WorkflowContext], Awaitable[JobResult]]] = {
    "coder_only_workflow": coder_only_workflow,
    "default_workflow": default_workflow,
}
