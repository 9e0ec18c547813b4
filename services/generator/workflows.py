"""Workflows: how a job's candidates are produced and judged.

Workflows know nothing of NATS (STYLE.md): they take a coder and two callables —
``verify`` (send a candidate to a worker, return its :class:`VerifyResult`) and
``report`` (tell the outside world about progress) — and return a :class:`JobResult`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol

from schemas import JobResult, JobSubmit, VerifyResult
from services.generator.coders.base import Candidate, CoderError

VerifyFn = Callable[[Candidate], Awaitable[VerifyResult]]
ReportFn = Callable[..., Awaitable[None]]


class Coder(Protocol):
    name: str

    async def generate(self, submit: JobSubmit, **params) -> Candidate: ...


class WorkflowError(Exception):
    """The job cannot go on; the message is the job's ``error``."""


def describe_failure(result: VerifyResult) -> str:
    """One line for a failed verdict: ``stage: error``."""
    return f"candidate failed verification at stage '{result.stage}': {result.error or 'no detail'}"


async def coder_only_workflow(
    submit: JobSubmit, coder: Coder | None, verify: VerifyFn, report: ReportFn
) -> JobResult:
    """Generate candidates and verify them one by one until one passes.

    Candidates, in order: ``submit.init_code`` when given, then the coder's output.
    The built-in coder is deterministic, so it gets one attempt; the first passing
    candidate completes the job.

    Returns:
        JobResult with ``passed`` True and the kernel, or False with the last verdict.

    Raises:
        WorkflowError: no candidate could be produced at all (the coder's message).
    """
    candidates: list[Candidate] = []
    if submit.init_code:
        candidates.append(Candidate(code=submit.init_code, coder="init_code"))
    attempts = 0
    last: tuple[Candidate, VerifyResult] | None = None
    coder_error: str | None = None
    pending_coder = coder is not None
    while attempts < submit.max_attempts:
        if not candidates and pending_coder:
            pending_coder = False  # deterministic: one candidate per job
            await report("progress", phase="generating", message=f"{coder.name} coder is writing a kernel")
            try:
                candidates.append(await coder.generate(submit))
            except CoderError as exc:
                coder_error = str(exc)
                break
        if not candidates:
            break
        candidate = candidates.pop(0)
        attempts += 1
        result = await verify(candidate)
        last = (candidate, result)
        if result.passed:
            break
    if last is None:
        raise WorkflowError(coder_error or "no candidate to verify: give init_code or a coder")
    candidate, result = last
    return JobResult(
        passed=result.passed,
        code=candidate.code,
        verdict=result,
        candidate_id=result.candidate_id,
        coder=candidate.coder,
        attempts=attempts,
        speedup=result.speedup,
    )
