"""Verify candidate kernels against the task's PyTorch reference: the worker's core.

:class:`Verifier` takes a :class:`~schemas.events.VerifyRequest` and returns a
:class:`~schemas.events.VerifyResult`; it knows nothing of NATS. One verification:

1. Static checks of the candidate's source (:mod:`services.worker.static_check`);
   a syntax error is stage ``compile``, any other finding stage ``static``.
2. The procedure of :mod:`services.worker.procedure`, in sandboxed children: the
   reference child makes every input from secret seeds and the outputs to match; the
   candidate's own child plans its kernel launches on decoys; the replayer child runs
   that plan on the real inputs with the candidate's kernels only; this process
   compares. Beside them: the plan without launches, every autotune config, a size
   congruent with the task's own, the task's declared shapes, an awkward size for
   ``shape_generic``, and every kernel compiled for a GPU target.
3. ``mode="profile"`` on a GPU backend: the candidate and the task's Model timed on
   the same device, with the baselines cached per task, arch and shapes
   (:mod:`services.worker.procedure.profile`). On ``cpu`` Triton runs in its
   interpreter: the result says ``interpreted=True`` and carries no timings.

The verifier is the procedure's :class:`~services.worker.procedure.host.Host`: it
lends the sandbox and its children (:meth:`Verifier.spawn`), the GPU compiler
(:class:`services.worker.compiler.KernelCompiler`), the baselines
(:class:`services.worker.cache.BaselineCache`) and its settings.

The trust model, what is enforced where and what a candidate can still reach, is
``docs/verification.md``.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import structlog
import torch

from schemas.events import VerifyRequest, VerifyResult
from services.sandbox.channel import ChildRun
from services.sandbox.channel import settle as settle_children
from services.sandbox.errors import PoolBroken
from services.sandbox.limits import ChildLimits
from services.sandbox.pool import Sandbox
from services.sandbox.roles import runner_of
from services.sandbox.wire import ChildSpec
from services.worker import aot
from services.worker.cache import (
    CACHE_LOOKUPS,
    BaselineCache,
    BaselineKind,
    BaselineOrigin,
    BaseTime,
    SharedCache,
)
from services.worker.compiler import DEFAULT_AOT_TARGET, KernelCompiler
from services.worker.procedure import Outcome, PhaseClock, Procedure, Verdict
from services.worker.progress import PhaseObserver
from services.worker.static_check import check_candidate
from services.worker.targets import GpuTarget
from services.worker.wire import CompileResult

# The verification's child roles (the task's code alone, the candidate planning on
# decoys, its kernels replaying the plan, the GPU compile) are registered with the
# sandbox by services/worker/wire.py, with their messages and limits.
# Imported by the fork server before it forks (plain imports: no tensor, no thread), so
# each child starts with its role's code loaded instead of importing it: ~5-11 ms of
# CPU per child, four or five children per verification.
_ROLE_MODULES = ("services.worker._reference", "services.worker._planner",
                 "services.worker._replayer")

log = structlog.get_logger("aikg.worker.verifier")

# The tmpfs every child works in, bytes (setting sandbox_scratch_bytes).
DEFAULT_SCRATCH_BYTES = 256 << 20
# Limit on one call into the task's code in the reference child, seconds (setting
# task_timeout_s).
DEFAULT_TASK_TIMEOUT_S = 60.0
# How long a profile waits for the torch.compile baseline, seconds (setting
# profile_compile_timeout_s).
DEFAULT_COMPILE_TIMEOUT_S = 240.0


# The candidate's file in a child's scratch directory (services/worker/verifier.py
# writes it as candidate.py, the replayer's kernel module too), with the directory a
# traceback names: what a verdict shows as the request's source_name.
_CANDIDATE_FILE = re.compile(r"""(?:/[^\s"'()<>:,]*/)?(?<![\w.+-])candidate\.py(?![\w])""")


def shown_as(text: str, source_name: str) -> str:
    """``text`` (a verdict's message, log or note) with the candidate's file as the
    worker wrote it (``/scratch/.../candidate.py``, ``candidate.py``) named
    ``source_name`` (the request's display name, ``kernel.py``): ``kernel.py line 30``,
    ``File "kernel.py", line 30``. Line numbers stay: the candidate is written as sent,
    and the kernel module keeps its lines."""
    return _CANDIDATE_FILE.sub(lambda _: source_name, text)


# How many of the task's largest sizes the too-large hint names.
_HINT_NAMES = 3


def _size_hint(need: int, limit: int, names: Mapping[str, Any], command: str | None) -> str:
    ints = {k: v for k, v in names.items() if isinstance(v, int) and not isinstance(v, bool)}
    factor = 1 << max(1, math.ceil(math.log2(max(need / max(limit, 1), 1.0))))
    name = "batch_size" if "batch_size" in ints else (
        max(ints, key=lambda n: ints[n]) if ints else None)
    if name is None:
        return "pass smaller shape_overrides"
    value = max(1, ints[name] // factor)
    suggestion = json.dumps({name: value})
    largest = sorted(ints, key=lambda n: (-ints[n], n))[:_HINT_NAMES]
    return (f"pass shape_overrides such as {suggestion} to shrink them"
            + (f" ({command}: --shape {name}={value})" if command else "")
            + "; the task's largest sizes: "
            + ", ".join(f"{n}={ints[n]}" for n in largest))


class Verifier:
    """Sandboxed verification of candidates for one worker.

    Args:
        backend: ``cpu`` (Triton interpreter), ``cuda`` or ``ascend``.
        worker_id: reported in every result.
        scratch_root: where run directories and per-device Triton caches live;
            default ``<tmp>/aikg-worker-<worker_id>``.
        memory_limit_bytes: largest total size of a task's ``get_inputs()`` tensors,
            bytes (None: no bound). Larger tasks fail at stage ``task`` (the user's
            to shrink, not the worker's fault) with a shape_overrides hint naming the
            task's largest sizes. The children's RLIMIT_AS comes from
            ``child_limits``.
        output_limit_bytes: cap on the captured stdout/stderr/traceback in
            ``VerifyResult.log``, bytes.
        speedup_flag_bound: speedups above this are flagged for review (``error``
            starts with ``flagged:``; ``passed`` stays True).
        compare_threads: intra-op threads of this process's torch (the comparisons),
            set by :meth:`start`; default 1 on cpu, where the children are busy on
            the same cores; None (GPU default) leaves torch's setting alone.
        client_command: the command whose ``--shape`` option the too-large-inputs hint
            names (``aikg submit`` for a worker service; ``aikg run`` for the CLI's
            local mode); None names no command.
        aot_target: the GPU (:data:`services.worker.targets.TARGETS`) every kernel is
            compiled for ahead of time when the request's arch names none; ``""`` or
            ``"none"`` turns the compile check off.
        compile_extra_targets: GPU targets every kernel is also compiled for, beside
            the request's, comma-separated (setting ``worker_compile_extra_targets``):
            ``auto`` the other vendor's (:meth:`extra_targets`), ``none`` or ``""``
            none.
        compile_extra_required: a kernel that does not compile for an extra target
            fails at stage ``compile`` (setting ``worker_compile_extra_required``;
            default: a note).
        scratch_bytes: the size of the tmpfs each child works in (None: no tmpfs).
        task_timeout_s: limit on one call into the task's own code in the reference
            child, seconds (setting ``task_timeout_s``; 0: only the request's
            ``timeout_s``); past it the verdict is stage ``task`` naming the call.
        child_limits: address space and CPU time of the reference and candidate
            children (:class:`services.sandbox.limits.ChildLimits`; default: the
            settings' defaults).
        compile_timeout_s: how long a profile waits for the ``torch.compile``
            baseline, seconds (setting ``profile_compile_timeout_s``; 0: no compiled
            baseline).
        check_bytes: on cpu, the most input bytes of the sizes checked besides the
            requested ones (the task's own, a congruent one, the shape-generality
            one), bytes (setting ``worker_check_bytes``; None: the default,
            :data:`services.worker.procedure.size_choice.CPU_CHECK_BYTES`).

    Attributes:
        shared_cache: the baselines (eager and ``torch.compile``) every worker shares
            (:class:`~services.worker.cache.SharedCache`); None keeps to this process.
        baselines: this process's baselines and the shared tier
            (:class:`~services.worker.cache.BaselineCache`).
        compiler: the GPU compile check's compiler and its results
            (:class:`~services.worker.compiler.KernelCompiler`).
        reference_runs: reference children spawned so far.
        candidate_runs: candidate (planner) children spawned so far.
        network_isolated / run_as / sandbox_notes: what the sandbox probe found.
    """

    def __init__(self, backend: str, *, worker_id: str, scratch_root: str | Path | None = None,
                 memory_limit_bytes: int | None = None, output_limit_bytes: int = 64 * 1024,
                 speedup_flag_bound: float = 50.0, sandbox_require: tuple[str, ...] = (),
                 sandbox_env_allow: tuple[str, ...] = (),
                 compare_threads: int | None | str = "auto",
                 client_command: str | None = "aikg submit",
                 aot_target: str = DEFAULT_AOT_TARGET,
                 compile_extra_targets: str = "auto",
                 compile_extra_required: bool = False,
                 scratch_bytes: int | None = DEFAULT_SCRATCH_BYTES,
                 task_timeout_s: float = DEFAULT_TASK_TIMEOUT_S,
                 child_limits: ChildLimits | None = None,
                 compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
                 check_bytes: int | None = None) -> None:
        if backend not in ("cpu", "cuda", "ascend"):
            raise ValueError(f"backend must be cpu, cuda or ascend, not {backend!r}")
        self.compiler = KernelCompiler(backend, aot_target, compile_extra_targets)
        self.backend = backend
        self.worker_id = worker_id
        self.client_command = client_command
        self.memory_limit_bytes = memory_limit_bytes
        self.output_limit_bytes = output_limit_bytes
        self.speedup_flag_bound = speedup_flag_bound
        self.extra_targets_required = compile_extra_required
        self.scratch_bytes = scratch_bytes
        self.task_timeout_s = task_timeout_s
        self.compile_timeout_s = compile_timeout_s
        self.check_bytes = check_bytes
        self.child_limits = child_limits or ChildLimits()
        self.compare_threads: int | None = (1 if backend == "cpu" else None) \
            if isinstance(compare_threads, str) else compare_threads
        self.reference_runs = 0
        self.candidate_runs = 0
        self.sandbox = Sandbox(backend, name=f"worker-{worker_id}", scratch_root=scratch_root,
                               require=sandbox_require, env_allow=sandbox_env_allow,
                               preload=(*_ROLE_MODULES, "services.worker.enforce:warm_up",
                                        *(("services.worker.aot:warm_up",) if self.aot_target
                                          else ())),
                               scratch_bytes=scratch_bytes)
        self.scratch_root = self.sandbox.scratch_root
        self.baselines = BaselineCache(backend)

    # ------------------------------------------------------------ lifecycle

    @property
    def run_as(self) -> tuple[int, int] | None:
        """(uid, gid) children switch to, or None when they keep this user."""
        return self.sandbox.isolation.run_as

    @property
    def network_isolated(self) -> bool | None:
        """Whether children run in a private network namespace (None before :meth:`start`)."""
        return self.sandbox.isolation.network_isolated if self.sandbox.started else None

    @property
    def sandbox_notes(self) -> list[str]:
        """Isolation steps this machine did not permit."""
        return self.sandbox.isolation.notes

    @property
    def max_frame_bytes(self) -> int:
        """The largest frame a child may send, bytes."""
        limit = self.memory_limit_bytes
        return 4 * limit + (64 << 20) if limit else 64 << 30

    @property
    def shared_cache(self) -> SharedCache | None:
        """The baselines every worker shares; None keeps to this process."""
        return self.baselines.shared

    @shared_cache.setter
    def shared_cache(self, cache: SharedCache | None) -> None:
        self.baselines.shared = cache

    def start(self) -> None:
        """Start the fork server (imports torch and triton there once) and probe the sandbox.

        Blocks for a few seconds; call it from a thread in async code. Idempotent.

        Raises:
            PoolBroken: the server did not start, or no sandboxed child could run.
            SandboxRefused: a mechanism in ``sandbox_require`` is not available.
        """
        if self.sandbox.started:
            return
        if self.compare_threads is not None:
            torch.set_num_threads(self.compare_threads)
        self.sandbox.start()
        log.info("verifier.started", backend=self.backend, worker_id=self.worker_id,
                 sandbox=self.sandbox.isolation.summary(), notes=self.sandbox_notes)

    def clear_caches(self) -> None:
        """Forget this process's baselines and compile results (what a fresh worker
        process starts with); the shared tier keeps its entries."""
        self.baselines.clear()
        self.compiler.clear()

    def abort_start(self) -> None:
        """Make a :meth:`start` under way in another thread fail fast (PoolBroken)."""
        self.sandbox.abort_start()

    def close(self) -> None:
        """Stop the fork servers (they kill every running child's process group) and
        remove a default scratch root."""
        self.sandbox.close()

    # ------------------------------------------------------------ children (Host)

    async def spawn(self, request: VerifyRequest, role: str, device: str, *,
                    address_space_bytes: int | None = None,
                    kernels: str | None = None) -> ChildRun:
        """A started child of ``role`` for ``request`` on ``device`` (its scratch
        directory made, the task and the candidate, or for the replayer ``kernels``,
        the candidate's kernel module, written there); ``address_space_bytes``: the
        candidate's derived address space (from its task's sizes).

        Raises:
            PoolBroken: the sandbox cannot fork it.
        """
        spec = self._child_spec(request, role, device, address_space_bytes=address_space_bytes,
                                kernels=kernels)
        return await self.sandbox.spawn(spec, max_frame_bytes=self.max_frame_bytes)

    def _child_spec(self, request: VerifyRequest, role: str, device: str, *,
                    address_space_bytes: int | None = None,
                    kernels: str | None = None) -> ChildSpec:
        scratch = self.sandbox.scratch(request.request_id, role)
        (scratch / "task.py").write_text(request.task_desc)
        candidate = ""
        if role == "candidate":
            (scratch / "candidate.py").write_text(request.code)
            candidate = str(scratch / "candidate.py")
            self.candidate_runs += 1
        elif role == "replay" and kernels is not None:
            (scratch / "candidate.py").write_text(kernels)
            candidate = str(scratch / "candidate.py")
        if role == "reference":
            self.reference_runs += 1
        # One table for every child's limits (services/sandbox/limits.py); the
        # candidate's derived address space comes from its task's sizes.
        address_space_bytes, cpu_seconds, notes = self.child_limits.notes(
            role, self.backend, request.timeout_s, derived_as=address_space_bytes)
        return ChildSpec(
            role=role, runner=runner_of(role), scratch_dir=str(scratch), backend=self.backend,
            arch=request.arch,
            env=self.sandbox.child_env(device), task_path=str(scratch / "task.py"),
            candidate_path=candidate, cpu_seconds=cpu_seconds, run_as=self.run_as,
            isolate_network=True, frame_key=os.urandom(32), scratch_bytes=self.scratch_bytes,
            env_allow=list(self.sandbox.env_allow), address_space_bytes=address_space_bytes,
            limit_notes=notes)

    def size_hint(self, need: int, limit: int, names: Mapping[str, Any]) -> str:
        """How to shrink inputs of ``need`` bytes below ``limit``: a shape_overrides
        suggestion halving one of ``names`` enough times (``batch_size`` first, else
        the largest), with the ``--shape`` option of ``client_command``, and the
        task's largest sizes (``the task's largest sizes: dim=65536, batch_size=4096``)."""
        return _size_hint(need, limit, names, self.client_command)

    # ------------------------------------------------------------ compile check (Host)

    @property
    def aot_target(self) -> str:
        """The GPU every kernel is compiled for when the request's arch names none
        (``""``: the compile check is off)."""
        return self.compiler.aot_target

    def extra_targets(self, primary: GpuTarget) -> list[GpuTarget]:
        """See :meth:`services.worker.compiler.KernelCompiler.extra_targets`."""
        return self.compiler.extra_targets(primary)

    async def compile(self, request: VerifyRequest, specs: list[aot.CompileSpec],
                      target: GpuTarget, source: str) -> tuple[
                          dict[str, CompileResult], list[aot.CompileSpec],
                          aot.CompileFailure | None]:
        """Compile results of ``specs`` in this worker's sandbox, within the ``compile``
        row of ``child_limits`` (:meth:`services.worker.compiler.KernelCompiler.compile`)."""
        return await self.compiler.compile(self.sandbox, self.child_limits, request, specs,
                                           target, source)

    # ------------------------------------------------------------ baselines (Host)

    async def cached_baseline(self, request: VerifyRequest, kind: BaselineKind = "eager"
                              ) -> tuple[BaseTime | None, BaselineOrigin]:
        """See :meth:`services.worker.cache.BaselineCache.cached`."""
        return await self.baselines.cached(request, kind)

    async def keep_baseline(self, request: VerifyRequest, kind: BaselineKind,
                            median_us: float, error: str = "") -> BaseTime:
        """See :meth:`services.worker.cache.BaselineCache.keep`."""
        return await self.baselines.keep(request, kind, median_us, error)

    # ------------------------------------------------------------ verify

    async def verify(self, request: VerifyRequest, *, device: str,
                     on_phase: PhaseObserver | None = None) -> VerifyResult:
        """Verify (and with ``mode="profile"`` on a GPU, time) one candidate.

        Never raises for anything the candidate or the task does: every outcome is a
        VerifyResult with ``passed`` and, on failure, ``stage``, an actionable
        ``error`` and the captured ``log`` (at most ``output_limit_bytes``).

        Args:
            request: the candidate, its task, shape_overrides, trials, timeout_s (the
                wall-clock limit of the whole verification, seconds).
            device: the leased device (``"0"``, ``"1"`` ... on GPUs, a slot on cpu).
            on_phase: told each phase as it starts and ends
                (:mod:`services.worker.progress`), in this event loop.
        """
        started = time.monotonic()
        clock = PhaseClock(on_phase)
        clock.begin("static")
        envelope: dict[str, Any] = {}
        try:
            outcome = await self._verify(request, device, clock, envelope)
        except Verdict as verdict:
            outcome = verdict.outcome
        except Exception as exc:
            log.exception("verify.worker_error", request_id=request.request_id)
            outcome = Outcome(stage="infrastructure",
                              error=f"worker error: {type(exc).__name__}: {exc}")
        clock.lap("verdict")
        result = outcome.result(
            request_id=request.request_id, job_id=request.job_id,
            candidate_id=request.candidate_id, worker_id=self.worker_id, device=device,
            interpreted=self.backend == "cpu", duration_s=time.monotonic() - started,
            phases={k: round(v, 6) for k, v in clock.spans.items()}, **envelope)
        name = request.source_name
        if result.error:
            result.error = shown_as(result.error, name)
        result.log = shown_as(result.log, name)
        result.notes = [shown_as(n, name) for n in result.notes]
        result.unchecked = [shown_as(u, name) for u in result.unchecked]
        log.info("verify.done", request_id=request.request_id, job_id=request.job_id,
                 candidate_id=request.candidate_id, passed=result.passed, stage=result.stage,
                 duration_s=round(result.duration_s, 3))
        return result

    async def _verify(self, request: VerifyRequest, device: str, clock: PhaseClock,
                      envelope: dict[str, Any]) -> Outcome:
        if request.backend != self.backend:
            raise Verdict("infrastructure", f"this worker verifies on {self.backend}; the "
                          f"request is for {request.backend}")
        # In a thread: a lowered network of thousands of lines takes seconds to check,
        # and this event loop also runs the worker's heartbeats and other verifications.
        findings = await asyncio.to_thread(check_candidate, request.code, request.dsl)
        if findings:
            text = "\n".join(str(f) for f in findings)
            if findings[0].rule == "syntax":
                raise Verdict("compile", str(findings[0]), log=text)
            shown = "; ".join(str(f) for f in findings[:3])
            more = f" (+{len(findings) - 3} more)" if len(findings) > 3 else ""
            raise Verdict("static", f"static check failed: {shown}{more}", log=text)
        clock.lap("static")
        if not self.sandbox.started:
            clock.begin("sandbox_start")
            try:
                await asyncio.to_thread(self.start)
            except PoolBroken as exc:
                raise Verdict("infrastructure", f"sandbox pool broken: {exc}") from None
            clock.lap("sandbox_start")
        envelope["reference_source"] = "run"
        CACHE_LOOKUPS.labels(backend=self.backend, arch=request.arch, kind="reference",
                             result="miss").inc()
        procedure = Procedure(self, request, device, clock)
        try:
            return await procedure.run()
        finally:
            await procedure.close()
            await settle_children()
