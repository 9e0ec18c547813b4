"""Coders turn a task into candidate source; this module holds what they share.

The built-in coder lowers the task's core-ATen graph, which means executing the
task's Python source. That runs in a child process of a :class:`pebble.ProcessPool`
(killed on timeout), never in the generator itself.
"""

from __future__ import annotations

import asyncio
import multiprocessing
from dataclasses import dataclass, field

import pebble

from schemas import JobSubmit, VerifyResult

# torch.export of a KernelBench element-wise task takes ~1-2 s on a laptop CPU; a task
# whose module-level code or forward hangs is cut off after this many seconds.
LOWERING_TIMEOUT_S = 120.0


class CoderError(Exception):
    """The coder could not produce a candidate; the message tells the user why."""


@dataclass
class Candidate:
    """One kernel candidate: complete module source defining ``ModelNew``.

    ``coder`` names who wrote it (``init_code``, ``builtin``, ``llm``); ``meta`` holds
    what the writer wants recorded (``guidance``: the repair instruction it followed).
    """

    code: str
    coder: str
    meta: dict = field(default_factory=dict)


@dataclass
class Attempt:
    """One numbered try of a job: a candidate and, once a worker judged it, its verdict.

    ``number`` counts from 1 and names the verify request (one request per attempt).
    After a resume, earlier attempts' ``candidate.code`` may be empty (the job record
    keeps only the latest candidate's code).
    """

    number: int
    candidate: Candidate
    verdict: VerifyResult | None = None


def _lower_in_child(task_desc: str, shape_overrides: dict, params: dict) -> tuple[str | None, str | None]:
    """Run the built-in coder's lowering; returns ``(code, None)`` or ``(None, error)``.

    Errors travel as strings because exception classes with extra attributes do not
    always survive pickling between processes.
    """
    from services.generator.coders.builtin import LoweringError, lower_task

    try:
        return lower_task(task_desc, shape_overrides, **params), None
    except LoweringError as exc:
        return None, str(exc)
    except Exception as exc:  # noqa: BLE001 - the task's own code may raise anything
        return None, f"built-in coder failed: {type(exc).__name__}: {exc}"


class BuiltinCoder:
    """Built-in coder (no LLM): one fused Triton kernel for element-wise operators.

    Args:
        pool: process pool the lowering runs in (the task's code runs there).
        timeout_s: limit on one lowering, seconds.
    """

    name = "builtin"

    def __init__(self, pool: pebble.ProcessPool, timeout_s: float = LOWERING_TIMEOUT_S) -> None:
        self.pool = pool
        self.timeout_s = timeout_s

    async def generate(self, submit: JobSubmit, **params) -> Candidate:
        """Lower ``submit.task_desc`` (with its shape overrides) to a candidate.

        Args:
            params: launch parameters passed to ``lower_task`` (``block_size``,
                ``num_warps``, ``num_stages``).

        Raises:
            CoderError: the task cannot be lowered (the message names the op), its code
                failed, or lowering took longer than ``timeout_s``.
        """
        future = self.pool.schedule(
            _lower_in_child,
            args=(submit.task_desc, dict(submit.shape_overrides), params),
            timeout=self.timeout_s,
        )
        try:
            code, error = await asyncio.wrap_future(future)
        except TimeoutError as exc:
            raise CoderError(
                f"built-in coder gave up after {self.timeout_s:.0f} s: the task's code did not "
                "finish (check get_inputs()/forward, or shrink it with shape_overrides)"
            ) from exc
        except pebble.ProcessExpired as exc:
            raise CoderError(f"built-in coder's process died (exit code {exc.exitcode}) while "
                             "running the task's code") from exc
        if error is not None:
            if error.endswith("use the LLM coder"):
                error += (" (point the generator at one with AIKG_LLM_BASE_URL and "
                          "AIKG_LLM_MODEL, then submit with coder 'llm'; README: Using an LLM)")
            raise CoderError(error)
        assert code is not None
        return Candidate(code=code, coder=self.name, meta=params)


def make_pool(workers: int = 1) -> pebble.ProcessPool:
    """A pool of fresh processes for lowering; ``forkserver`` so no parent state leaks."""
    return pebble.ProcessPool(max_workers=workers,
                              context=multiprocessing.get_context("forkserver"))
