"""Coders turn a task into candidate source; this module holds what they share.

The built-in coder lowers the task's core-ATen graph, which means executing the
task's Python source. That runs only in a sandboxed child
(:meth:`services.sandbox.pool.Sandbox.lower`: unprivileged user, no network, Landlock,
seccomp, a fresh process per task killed with its group on timeout), never in the
generator itself.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import json
from dataclasses import dataclass, field

from cachetools import LRUCache

from schemas import JobSubmit, VerifyResult
from services.common.settings import LOWERING_TIMEOUT_S
from services.common.shares import TenantSlots
from services.generator.coders.lowering_role import lower_in_sandbox
from services.generator.coders.screen import decline
from services.generator.launch_configs import DEFAULT_FAMILY
from services.generator.lowering.errors import LoweringError
from services.sandbox.limits import ChildLimits
from services.sandbox.pool import PoolBroken, Sandbox

# The tenant whose job the running code serves (set per job task by the generator): a
# lowering takes one of that tenant's lowering slots (services/common/shares.py).
JOB_TENANT: contextvars.ContextVar[str] = contextvars.ContextVar("aikg_job_tenant",
                                                                 default="default")

# torch.export of a KernelBench element-wise task takes ~1-2 s on a laptop CPU; a task
# whose module-level code or forward hangs is cut off after this many seconds.
# Successful lowerings a BuiltinCoder keeps (each a few KiB of source).
LOWERED_CACHE_ENTRIES = 256
# Elements per program (``block_size`` of lower_task) of the built-in coder's kernels
# for the ``cpu`` backend when a job names none. There Triton runs in its interpreter,
# which spends about 1 ms of Python per program instance whatever its block holds
# (numpy does the elements), so fewer, larger blocks run several times faster: a
# 64 x 4096 relu took 0.26 s at 1024 elements a program and 0.06 s at 4096 (measured on
# a 2-core machine). 4096 is the largest block the evolve search space tries; GPU
# backends keep lower_task's 1024.
CPU_BLOCK_SIZE = 4096
# Tiles of the built-in coder's tl.dot kernels (matmul, convolution) on ``cpu``, for the
# same reason: the interpreter's cost is per operation on a tile, nearly whatever its
# size. AlexNet's first convolution (KernelBench level 1, problem 50, at batch 2) took
# 39 s at lower_task's 32 x 32 x 32 and 4.2 s at these tiles (measured on a loaded 2-core
# machine); a 128 x 128 x 128 matmul took 27 ms at block_n 64 and 8.5 ms at 128. All
# three are in the evolve search space. With one stage, a float32 tile pair is 64 KiB of
# shared memory: within sm_80, sm_89 and sm_90's per-block limits (the compile check).
CPU_TILES = {"block_m": 128, "block_n": 128, "block_k": 64}


def launch_defaults(backend: str, arch: str | None = None) -> dict[str, int | str]:
    """The built-in coder's launch parameters for ``backend`` when a job names none:
    ``{"block_size": CPU_BLOCK_SIZE, **CPU_TILES}`` on ``cpu``; on a GPU backend
    ``{"arch": arch}`` (the family's default, ``sm_90``, without one): every kernel
    then carries ``@triton.autotune`` over the launch-configuration table of its
    schedule and the arch's family (services/generator/launch_configs.py)."""
    if backend == "cpu":
        return {"block_size": CPU_BLOCK_SIZE, **CPU_TILES}
    return {"arch": arch or DEFAULT_FAMILY}


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


class BuiltinCoder:
    """Built-in coder (no LLM): one fused Triton kernel for element-wise operators.

    The lowering is a function of the task's source, its shape overrides and the
    launch parameters, so a successful one is kept (the last :data:`LOWERED_CACHE_ENTRIES`
    of them, keyed by the source's sha256 and the rest): a job on a task lowered before
    gets its candidate without another sandboxed child (~0.8 s here). Failures are not
    kept (a timeout may not recur).

    Args:
        sandbox: a started :class:`~services.sandbox.pool.Sandbox` the lowering runs
            in (the task's code runs there, never here).
        timeout_s: limit on one lowering, seconds (setting ``lowering_timeout_s``).
        slots: the lowering slots shared by this process's jobs, of which the job's
            tenant (:data:`JOB_TENANT`) holds at most its share; None: no bound.
        limits: the lowering child's address space and CPU time (default: the
            settings' defaults, services/sandbox/limits.py).

    Attributes:
        lowerings: sandboxed lowerings run so far (cache misses).
    """

    name = "builtin"

    def __init__(self, sandbox: Sandbox, timeout_s: float = LOWERING_TIMEOUT_S, *,
                 slots: TenantSlots | None = None, limits: ChildLimits | None = None) -> None:
        self.sandbox = sandbox
        self.timeout_s = timeout_s
        self.slots = slots
        self.limits = limits or ChildLimits()
        self.lowerings = 0
        self._lowered: LRUCache[tuple[str, str, str], str] = LRUCache(LOWERED_CACHE_ENTRIES)

    async def generate(self, submit: JobSubmit, **params) -> Candidate:
        """Lower ``submit.task_desc`` (with its shape overrides) to a candidate.

        Args:
            params: launch parameters passed to ``lower_task`` (``block_size``,
                ``num_warps``, ``num_stages``, ``block_m``/``block_n``/``block_k``); over :func:`launch_defaults` of the
                job's backend. The candidate's ``meta`` records them.

        Raises:
            CoderError: the task cannot be lowered (the message names the op), its code
                failed, or lowering took longer than ``timeout_s``.
        """
        declined = decline(submit.task_desc)
        if declined is not None:  # no sandboxed child for what the source shows
            raise CoderError(_llm_hint(declined))
        params = {**launch_defaults(submit.backend, submit.arch), **params}
        key = (hashlib.sha256(submit.task_desc.encode()).hexdigest(),
               json.dumps(submit.shape_overrides, sort_keys=True),
               json.dumps(params, sort_keys=True))
        code = self._lowered.get(key)  # a hit becomes the most recently used
        if code is not None:
            return Candidate(code=code, coder=self.name, meta=params)
        self.lowerings += 1
        hold = self.slots.hold(JOB_TENANT.get()) if self.slots is not None \
            else contextlib.nullcontext()
        try:
            async with hold:
                code = await lower_in_sandbox(self.sandbox,
                    submit.task_desc, dict(submit.shape_overrides), params,
                    timeout_s=self.timeout_s, label=submit.job_id or "lower",
                    limits=self.limits)
        except LoweringError as exc:
            raise CoderError(_llm_hint(str(exc))) from None
        except PoolBroken as exc:
            raise CoderError(f"built-in coder's sandbox is broken: {exc}") from None
        self._lowered[key] = code  # evicts the least recently used past the bound
        return Candidate(code=code, coder=self.name, meta=params)


def _llm_hint(error: str) -> str:
    """A refusal, with how to reach the LLM coder from a job."""
    if error.endswith("use the LLM coder"):
        error += (" (point the generator at one with AIKG_LLM_BASE_URL and "
                  "AIKG_LLM_MODEL, then submit with coder 'llm'; README: Using an LLM)")
    return error


def lowering_sandbox(name: str, *, require: tuple[str, ...] = (),
                     env_allow: tuple[str, ...] = ()) -> Sandbox:
    """A (not yet started) cpu :class:`Sandbox` with the built-in coder preloaded and
    warmed up (:func:`services.generator.lowering.warm_up`: one lowering of a
    task of ours in the fork server, so a child's lowering takes ~0.25 s, not ~0.8 s)."""
    return Sandbox("cpu", name=name, require=require, env_allow=env_allow,
                   preload=("services.generator.lowering",
                            "services.generator.coders.lowering_role",
                            "services.generator.lowering:warm_up"))
