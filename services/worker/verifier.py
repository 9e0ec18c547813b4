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
3. ``mode="profile"`` on a GPU backend: the candidate's child times ``ModelNew`` with
   its launches running, the reference child times ``Model`` (cached per task, arch
   and shapes, in this process and in the shared ``baselines`` bucket, whose key adds
   the torch, CUDA runtime and driver versions; ``VerifyResult.baseline_source`` /
   ``baseline_age_s`` say which and how old) on the same device: warm-up, L2 flush,
   device events, median of repeats. A child's reported total time must fit in the
   wall time this process observed, and the timed run must launch what the verified
   plan launched. The candidate's timed calls run under ``torch.profiler``: the
   kernels it recorded are listed (``profiled_kernels``) and a non-Triton compute
   kernel among them fails at ``audit`` (:mod:`services.worker.profiling`). Beside the
   eager baseline: the reference compiled with ``torch.compile`` (cached the same way;
   ``speedup_compile``, never a failure), the launch floor (``launch_floor_us``) and
   the fraction of the arch's peak (``peak_fraction``). On ``cpu`` Triton runs in its
   interpreter: the result says ``interpreted=True`` and carries no timings.

Speedups above ``speedup_flag_bound`` keep ``passed=True`` (the numbers matched)
but ``error`` starts with ``flagged:`` so a human or the generator can review the
candidate before trusting the speedup.

The trust model, what is enforced where and what a candidate can still reach, is
``docs/verification.md``.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
import json
import math
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import torch

from schemas.events import VerifyRequest, VerifyResult, utcnow
from services.sandbox import wire
from services.sandbox.limits import ChildLimits
from services.sandbox.pool import PoolBroken, Sandbox
from services.sandbox.pool import settle as settle_children
from services.sandbox.roles import register_role, runner_of
from services.sandbox.wire import ChildSpec
from services.worker import aot, profiling
from services.worker.cache import (
    CACHE_FORMAT,
    CACHE_LOOKUPS,
    Baseline,
    SharedCache,
    Versions,
    baseline_key,
)
from services.worker.children import ChildFailed
from services.worker.procedure import Outcome, Procedure, Timings, Verdict
from services.worker.rules import ALLOWED_OPS, impossible_timing
from services.worker.static_check import check_candidate
from services.worker.targets import GpuTarget, target_for

# The verification's child roles (services/sandbox/roles.py): the task's code alone,
# the candidate planning on decoys, its kernels replaying the plan, and the GPU compile.
register_role("reference", "services.worker._reference:run_reference_role")
register_role("candidate", "services.worker._planner:run_planner")
register_role("replay", "services.worker._replayer:run_replayer")
register_role("compile", "services.worker.aot:run_compile")
# Imported by the fork server before it forks (plain imports: no tensor, no thread), so
# each child starts with its role's code loaded instead of importing it: ~5-11 ms of
# CPU per child, four or five children per verification.
_ROLE_MODULES = ("services.worker._reference", "services.worker._planner",
                 "services.worker._replayer")

log = structlog.get_logger("aikg.worker.verifier")

# A child's reported timing total may exceed the wall time seen here by this much
# (clock granularity, frame latency) before it counts as inconsistent.
_TIMING_SLACK = 1.05
_TIMING_SLACK_US = 500.0
# Compile results kept in this process (kernel specialisations).
_COMPILE_CACHE_ENTRIES = 4096
# The GPU a cpu worker compiles for when the request's arch names none (setting
# worker_aot_target; see services.worker.targets).
DEFAULT_AOT_TARGET = "h100"
# The tmpfs every child works in, bytes (setting sandbox_scratch_bytes).
DEFAULT_SCRATCH_BYTES = 256 << 20
# Limit on one call into the task's code in the reference child, seconds (setting
# task_timeout_s).
DEFAULT_TASK_TIMEOUT_S = 60.0
# How long a profile waits for the torch.compile baseline, seconds (setting
# profile_compile_timeout_s).
DEFAULT_COMPILE_TIMEOUT_S = 240.0
# What a profile leaves of the request's timeout_s when it waits for the compiled
# baseline, seconds: the verdict after it (audit, outcome) still has to be sent.
_COMPILE_MARGIN_S = 10.0

# Kept for callers that catch it by this name.
_Verdict = Verdict


class PhaseClock:
    """Where one verification's time goes: consecutive spans plus children run beside them.

    :meth:`lap` closes the span that started at the previous lap (or at creation) and
    adds its length to ``name``; :meth:`add` records a child's own wall time without
    moving the mark (phases in :data:`schemas.events.VERIFY_PHASES_BESIDE`). Times are
    seconds on ``time.monotonic()``, taken in this process only: the children's own
    clocks are never read, so a candidate cannot shift them.
    """

    def __init__(self) -> None:
        self.spans: dict[str, float] = {}
        self._mark = time.monotonic()

    def lap(self, name: str) -> None:
        now = time.monotonic()
        self.spans[name] = self.spans.get(name, 0.0) + (now - self._mark)
        self._mark = now

    def add(self, name: str, seconds: float) -> None:
        self.spans[name] = self.spans.get(name, 0.0) + seconds


@dataclass
class _BaseTime:
    """A baseline as this process holds it: median time (us), when it was measured
    (UTC), and where this process got it (``measured`` here or ``shared``); ``error``:
    why it could not be measured (a failed ``torch.compile``, kept in this process
    only; ``median_us`` is 0 then)."""

    median_us: float
    measured_at: dt.datetime
    origin: str
    error: str = ""


def speedup_fields(base_time_us: float, gen_time_us: float, bound: float, *,
                   compile_time_us: float | None = None, **fields: Any) -> Timings:
    """The times of a passed, profiled result (microseconds) and their speedups
    (:func:`services.worker.profiling.speedups`): ``speedup`` = ``speedup_eager`` =
    ``base_time_us / gen_time_us``, ``speedup_compile`` = ``compile_time_us /
    gen_time_us`` (None without a compiled baseline); infinite when ``gen_time_us`` is
    not positive. ``fields``: more :class:`Timings` fields (``peak_fraction`` ...).

    A speedup over eager above ``bound`` keeps the pass but sets ``flag`` (the result's
    ``error``) to ``flagged: ...``: the numbers matched, yet such a speedup over eager
    PyTorch usually means skipped work or a gamed timer, so someone should look before
    trusting it (setting ``speedup_flag_bound``).
    """
    speedup, compiled = profiling.speedups(base_time_us, compile_time_us, gen_time_us)
    flag = None
    if speedup > bound:
        flag = (f"flagged: speedup {speedup:.1f} exceeds the bound {bound:g}; check that "
                "the kernel does all the work and does not game the timer before trusting it")
    return Timings(base_time_us=base_time_us, gen_time_us=gen_time_us, speedup=speedup,
                   flag=flag, speedup_eager=speedup, speedup_compile=compiled,
                   compile_time_us=compile_time_us, **fields)


def _size_hint(need: int, limit: int, names: Mapping[str, Any], command: str | None) -> str:
    ints = {k: v for k, v in names.items() if isinstance(v, int)}
    factor = 1 << max(1, math.ceil(math.log2(max(need / max(limit, 1), 1.0))))
    name = "batch_size" if "batch_size" in ints else (
        max(ints, key=lambda n: ints[n]) if ints else None)
    if name is None:
        return "pass smaller shape_overrides"
    value = max(1, ints[name] // factor)
    suggestion = json.dumps({name: value})
    return (f"pass shape_overrides such as {suggestion} to shrink them"
            + (f" ({command}: --shape {name}={value})" if command else ""))


def _task_key(request: VerifyRequest) -> tuple[str, str]:
    """(sha256 of the task source, the shape_overrides as canonical JSON)."""
    return (hashlib.sha256(request.task_desc.encode()).hexdigest(),
            json.dumps(request.shape_overrides, sort_keys=True))


def _join_log(*parts: str, limit: int) -> str:
    text = "\n".join(p for p in parts if p)
    data = text.encode()
    if len(data) <= limit:
        return text
    return data[-limit:].decode("utf-8", errors="replace")


class Verifier:
    """Sandboxed verification of candidates for one worker.

    Args:
        backend: ``cpu`` (Triton interpreter), ``cuda`` or ``ascend``.
        worker_id: reported in every result.
        scratch_root: where run directories and per-device Triton caches live;
            default ``<tmp>/aikg-worker-<worker_id>``.
        memory_limit_bytes: largest total size of a task's ``get_inputs()`` tensors,
            bytes (None: no bound). Larger tasks fail as ``infrastructure`` with a
            shape_overrides hint. The children's RLIMIT_AS comes from
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
        from services.worker.targets import TARGETS

        if aot_target and aot_target.lower() != "none" and aot_target.lower() not in TARGETS:
            raise ValueError(f"unknown aot target {aot_target!r}; choose from "
                             f"{', '.join(sorted(TARGETS))} or none")
        self.backend = backend
        self.worker_id = worker_id
        self.client_command = client_command
        self.memory_limit_bytes = memory_limit_bytes
        self.output_limit_bytes = output_limit_bytes
        self.speedup_flag_bound = speedup_flag_bound
        self.aot_target = "" if not aot_target or aot_target.lower() == "none" else aot_target
        extra = [t.strip().lower() for t in (compile_extra_targets or "").split(",")
                 if t.strip() and t.strip().lower() != "none"]
        unknown = [t for t in extra if t != "auto" and t not in TARGETS]
        if unknown:
            raise ValueError(f"unknown compile extra target {unknown[0]!r}; choose from "
                             f"{', '.join(sorted(TARGETS))}, auto or none")
        self.compile_extra_targets = tuple(extra)
        self.extra_targets_required = compile_extra_required
        self.scratch_bytes = scratch_bytes
        self.task_timeout_s = task_timeout_s
        self.compile_timeout_s = compile_timeout_s
        self.check_bytes = check_bytes
        self.child_limits = child_limits or ChildLimits()
        self.compare_threads = (1 if backend == "cpu" else None) if compare_threads == "auto" \
            else compare_threads
        self.reference_runs = 0
        self.candidate_runs = 0
        self.sandbox = Sandbox(backend, name=f"worker-{worker_id}", scratch_root=scratch_root,
                               require=sandbox_require, env_allow=sandbox_env_allow,
                               preload=(*_ROLE_MODULES, "services.worker.enforce:warm_up",
                                        *(("services.worker.aot:warm_up",) if self.aot_target
                                          else ())),
                               scratch_bytes=scratch_bytes)
        self.scratch_root = self.sandbox.scratch_root
        self._compiled: dict[str, wire.CompileResult] = {}
        self._base_times: dict[tuple[str, str, str, str], _BaseTime] = {}
        self.shared_cache: SharedCache | None = None
        self.versions = Versions.detect(backend)

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
    def _started(self) -> bool:
        return self.sandbox.started

    @property
    def max_frame_bytes(self) -> int:
        """The largest frame a child may send, bytes."""
        limit = self.memory_limit_bytes
        return 4 * limit + (64 << 20) if limit else 64 << 30

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
        self._base_times.clear()
        self._compiled.clear()

    def abort_start(self) -> None:
        """Make a :meth:`start` under way in another thread fail fast (PoolBroken)."""
        self.sandbox.abort_start()

    def close(self) -> None:
        """Stop the fork servers (they kill every running child's process group) and
        remove a default scratch root."""
        self.sandbox.close()

    # ------------------------------------------------------------ children

    def child_spec(self, request: VerifyRequest, role: str, device: str, *,
                   address_space_bytes: int | None = None, kernels: str | None = None,
                   **fields: Any) -> ChildSpec:
        """A ChildSpec for one of a verification's children (its scratch directory made,
        the task and the candidate, or for the replayer ``kernels``, the candidate's
        kernel module, written there)."""
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
            limit_notes=notes, **fields)

    def size_hint(self, need: int, limit: int, names: Mapping[str, Any]) -> str:
        return _size_hint(need, limit, names, self.client_command)

    def profiles(self, request: VerifyRequest) -> bool:
        return request.mode == "profile" and self.backend != "cpu"

    # ------------------------------------------------------------ verify

    async def verify(self, request: VerifyRequest, *, device: str) -> VerifyResult:
        """Verify (and with ``mode="profile"`` on a GPU, time) one candidate.

        Never raises for anything the candidate or the task does: every outcome is a
        VerifyResult with ``passed`` and, on failure, ``stage``, an actionable
        ``error`` and the captured ``log`` (at most ``output_limit_bytes``).

        Args:
            request: the candidate, its task, shape_overrides, trials, timeout_s (the
                wall-clock limit of the whole verification, seconds).
            device: the leased device (``"0"``, ``"1"`` ... on GPUs, a slot on cpu).
        """
        started = time.monotonic()
        clock = PhaseClock()
        provenance: dict[str, Any] = {}
        try:
            outcome = await self._verify(request, device, clock, provenance)
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
            phases={k: round(v, 6) for k, v in clock.spans.items()}, **provenance)
        log.info("verify.done", request_id=request.request_id, job_id=request.job_id,
                 candidate_id=request.candidate_id, passed=result.passed, stage=result.stage,
                 duration_s=round(result.duration_s, 3))
        return result

    async def _verify(self, request: VerifyRequest, device: str, clock: PhaseClock,
                      provenance: dict[str, Any]) -> Outcome:
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
        if not self._started:
            try:
                await asyncio.to_thread(self.start)
            except PoolBroken as exc:
                raise Verdict("infrastructure", f"sandbox pool broken: {exc}") from None
            clock.lap("sandbox_start")
        provenance["reference_source"] = "run"
        CACHE_LOOKUPS.labels(backend=self.backend, arch=request.arch, kind="reference",
                             result="miss").inc()
        procedure = Procedure(self, request, device, clock)
        try:
            outcome = await procedure.run()
        except Verdict as verdict:
            failed = verdict.outcome
            failed.set(log=_join_log(procedure.output_log(), failed.fields.log,
                                     limit=self.output_limit_bytes))
            failed.fill(trials=procedure.compared, notes=procedure.notes)
            if "main" in procedure.sizes:
                failed.fill(sizes_checked=procedure._checked_sizes())
            raise
        finally:
            await procedure.close()
            for name, child in procedure.children.items():
                clock.add(name.replace(":", "_"), child.seconds)
            await settle_children()
        provenance.update(getattr(procedure, "provenance", {}))
        if request.mode == "profile" and self.backend == "cpu":
            outcome.set(log=_join_log(
                outcome.fields.log, "profile: no timings on the cpu backend (Triton runs "
                "in its interpreter; times would not mean anything)",
                limit=self.output_limit_bytes))
        return outcome

    # ------------------------------------------------------------ compile check

    def extra_targets(self, primary: GpuTarget) -> list[GpuTarget]:
        """The targets every kernel is compiled for beside ``primary`` (the request's):
        those of ``compile_extra_targets``, ``auto`` being the other vendor's flagship
        (``mi300x`` beside an NVIDIA target, ``h100`` beside an AMD one); never one of
        ``primary``'s arch."""
        names = [("h100" if primary.backend == "hip" else "mi300x") if n == "auto" else n
                 for n in self.compile_extra_targets]
        found: list[GpuTarget] = []
        for name in names:
            t = target_for(name)
            if t.sm != primary.sm and all(t.sm != f.sm for f in found):
                found.append(t)
        return found

    async def compile(self, request: VerifyRequest, specs: list[aot.CompileSpec],
                      target: GpuTarget, source: str) -> tuple[
                          dict[str, wire.CompileResult], list[aot.CompileSpec],
                          aot.CompileFailure | None]:
        """Compile results of ``specs`` (from this process's cache, else a compile
        child, :func:`services.worker.aot.compile_in_child`), by key, and why the child
        gave none (None: every spec has its result). The child's address space and CPU
        time are the ``compile`` row of ``child_limits``."""
        missing = [s for s in specs if s.key not in self._compiled]
        failure = None
        if missing:
            server = self.sandbox
            scratch = server.scratch(request.request_id, "compile")
            (scratch / "candidate.py").write_text(source)
            space, cpu_seconds, notes = self.child_limits.notes(
                "compile", self.backend, aot.COMPILE_WALL_S, cores=1)
            spec = server.spec("compile", scratch, "compile",
                               candidate_path=str(scratch / "candidate.py"),
                               arch=request.arch, compile_target=target.name,
                               compile_specs=[s.wire() for s in missing],
                               frame_key=os.urandom(32), cpu_seconds=cpu_seconds,
                               address_space_bytes=space, limit_notes=notes)
            results, failure = await aot.compile_in_child(server, spec, len(missing))
            if failure is not None:
                log.warning("compile.failed", stage=failure.stage, error=failure.message)
            for result in results:
                self._compiled[result.key] = result
            while len(self._compiled) > _COMPILE_CACHE_ENTRIES:
                self._compiled.pop(next(iter(self._compiled)))
        return ({s.key: self._compiled[s.key] for s in specs if s.key in self._compiled},
                specs, failure)

    # ------------------------------------------------------------ profile (GPUs)

    def _baseline_key(self, request: VerifyRequest, task_sha: str, overrides: str,
                      kind: str = "eager") -> str:
        return baseline_key(task_sha256=task_sha, shapes=overrides, backend=self.backend,
                            arch=request.arch, versions=self.versions, kind=kind)

    async def profile(self, procedure: Procedure) -> Timings:
        """Time the candidate (its launches running, under ``torch.profiler``), the eager
        and the ``torch.compile`` baselines and the launch floor on this device: median
        times, microseconds, both speedups (:func:`speedup_fields`), the fraction of the
        arch's peak and the kernels the profiler recorded.

        Raises:
            Verdict: (audit) the timed run launched other kernels than the verified
                plan, a non-Triton compute kernel ran in its timed calls, or its timing
                is impossible; (infrastructure) no timing came.
        """
        request = procedure.request
        ref = procedure.ref
        base, origin = await self.cached_baseline(request)
        # One part per command: each check reads the phase start of its own part.
        if base is None:
            await ref.send(wire.RefProfile(key="main"))
            timing, _ = await ref.get("timing")
            self.check_timing(timing, ref.profiling_at, "the reference Model",
                              stage="infrastructure")
            base = await self._keep_baseline(request, "eager", timing.median_us)
            origin = "measured"
        await ref.send(wire.RefProfile(key="main", eager=False, floor=True))
        floor, _ = await ref.get("timing", "floor")
        self.check_timing(floor, ref.profiling_at, "the launch floor", stage="infrastructure")
        CACHE_LOOKUPS.labels(backend=self.backend, arch=request.arch, kind="baseline", result={
            "measured": "miss", "shared_cache": "shared", "worker_cache": "worker"}[origin]).inc()
        planner = procedure.planner
        await planner.send(wire.PlanProfile(model="main"), answers=2)
        timed, _ = await planner.get("dry", "profile")
        planned_events = [e for e in procedure.first_call.traced[0].events
                          if isinstance(e, dict) and "launch" in e]
        planned = [(e.get("launch"), e.get("grid")) for e in planned_events]
        ran = [(e.get("launch"), e.get("grid")) for e in timed.launches]
        if planned != ran:
            raise Verdict("audit", "the timed run launched other kernels than the verified "
                          f"one ({ran[:3]} against {planned[:3]}): a candidate must time what "
                          "it computes", trials=procedure.compared)
        timing, _ = await planner.get("timing")
        self.check_timing(timing, planner.profiling_at, "the candidate", stage="audit")
        kernels = self._kernel_audit(procedure, timing, planned_events,
                                     harness={launch.name for launch in floor.launches})
        inputs = procedure.sizes["main"].input_bytes
        real, raws = procedure.first_call.real
        outputs = sum(m.nbytes for m in real.outputs)
        impossible = impossible_timing(timing.median_us, inputs + outputs, request.arch)
        if impossible is not None:
            raise Verdict("audit", f"{impossible}; the kernel skips work or games the timer",
                          gen_time_us=timing.median_us, trials=procedure.compared)
        eager_count = await procedure.eager_count()
        compiled = await self._compiled_baseline(procedure)
        params = sum(size for _, size in procedure.first_call.traced[0].captures)
        fraction = profiling.peak_fraction(
            inputs + params + outputs, dict(eager_count.dot_flops) if eager_count else {},
            timing.median_us, target_for(request.arch))
        procedure.provenance = {"baseline_source": origin, "baseline_age_s": round(
            max(0.0, (utcnow() - base.measured_at).total_seconds()), 3)}
        return speedup_fields(
            base.median_us, timing.median_us, self.speedup_flag_bound,
            compile_time_us=compiled, launch_floor_us=floor.median_us,
            peak_fraction=round(fraction.fraction, 6) if fraction else None,
            peak_bound=fraction.bound if fraction else None, profiled_kernels=kernels)

    def _kernel_audit(self, procedure: Procedure, timing: wire.Timing,
                      planned_events: list[dict[str, Any]],
                      harness: set[str]) -> list[Any] | None:
        """The kernels the profiler recorded in the candidate's timed calls
        (:func:`services.worker.profiling.classify_launches`), or None with a note when
        the profiler recorded nothing. ``harness``: the names of the kernels the timing
        loop itself launched around the launch floor's call (its flushes), recognised
        where the profiler linked a kernel to no operator.

        Raises:
            Verdict: (audit) a forbidden kernel ran, or the profiler recorded fewer
                launches of a Triton kernel than the verified plan makes.
        """
        if not timing.profiled:
            procedure.notes.append("profiled_kernels: the profiler recorded nothing"
                                   + (f" ({timing.profiler_error})" if timing.profiler_error
                                      else ""))
            return None
        calls = len(timing.samples_us)
        triton = {e.get("launch") for e in planned_events} | set(procedure.kernels.kernels)
        audit = profiling.classify_launches(timing.launches, triton, ALLOWED_OPS, calls,
                                            harness_names=harness - triton)
        problem = audit.message()
        if problem is None and self.backend == "cuda":
            planned: dict[str, int] = {}
            for event in planned_events:
                if math.prod(event.get("grid") or [1]) > 0:
                    planned[event["launch"]] = planned.get(event["launch"], 0) + 1
            problem = profiling.missing_launches(audit.kernels, planned, calls)
        if problem is not None:
            raise Verdict("audit", problem, gen_time_us=timing.median_us,
                          profiled_kernels=audit.kernels, trials=procedure.compared)
        return audit.kernels

    async def _compiled_baseline(self, procedure: Procedure) -> float | None:
        """The ``torch.compile`` baseline's median time, microseconds (cached like the
        eager one), or None with a note: turned off, failed, or not finished within
        ``compile_timeout_s`` (and what is left of the request's ``timeout_s``). Never
        raises for the compile: the candidate's verdict does not depend on it."""
        request = procedure.request
        if not self.compile_timeout_s:
            return None
        base, origin = await self.cached_baseline(request, kind="compile")
        if base is not None and not base.error:
            CACHE_LOOKUPS.labels(backend=self.backend, arch=request.arch, kind="compile",
                                 result={"shared_cache": "shared",
                                         "worker_cache": "worker"}[origin]).inc()
            return base.median_us
        if base is not None:
            procedure.notes.append(f"speedup_compile: torch.compile failed on the reference "
                                   f"Model: {base.error}")
            return None
        CACHE_LOOKUPS.labels(backend=self.backend, arch=request.arch, kind="compile",
                             result="miss").inc()
        loop = asyncio.get_running_loop()
        left = (procedure.deadline - loop.time() - _COMPILE_MARGIN_S
                if procedure.deadline is not None else self.compile_timeout_s)
        wait = min(self.compile_timeout_s, left)
        if wait <= 0:
            procedure.notes.append("speedup_compile: no time left in the request's timeout_s "
                                   "for the torch.compile baseline")
            return None
        ref = procedure.ref
        try:
            async with asyncio.timeout(wait):
                await ref.send(wire.RefProfile(key="main", eager=False, compile=True))
                timing, _ = await ref.get("timing", "compile")
        except TimeoutError:
            # Nothing else is asked of the reference now: stop its compile.
            ref.run.kill()
            procedure.notes.append(f"speedup_compile: the torch.compile baseline did not "
                                   f"finish within {wait:.0f} s (setting "
                                   "AIKG_PROFILE_COMPILE_TIMEOUT_S)")
            return None
        except ChildFailed as exc:
            procedure.notes.append(f"speedup_compile: the reference process failed while "
                                   f"compiling: {exc.message}")
            return None
        if timing.error:
            await self._keep_baseline(request, "compile", 0.0, error=timing.error)
            procedure.notes.append(f"speedup_compile: torch.compile failed on the reference "
                                   f"Model: {timing.error}")
            return None
        try:
            self.check_timing(timing, ref.profiling_at, "the compiled reference Model")
        except Verdict as verdict:
            procedure.notes.append(f"speedup_compile: {verdict.outcome.fields.error}")
            return None
        return (await self._keep_baseline(request, "compile", timing.median_us)).median_us

    async def _keep_baseline(self, request: VerifyRequest, kind: str, median_us: float,
                             error: str = "") -> _BaseTime:
        """Keep a measured baseline of ``kind`` in this process and (not a failure) in
        the shared bucket; returns it."""
        task_sha, overrides = _task_key(request)
        base = self._base_times[kind, task_sha, request.arch, overrides] = _BaseTime(
            median_us, utcnow(), "measured", error)
        if self.shared_cache is not None and not error:
            await self.shared_cache.put_baseline(Baseline(
                format=CACHE_FORMAT, key=self._baseline_key(request, task_sha, overrides, kind),
                median_us=median_us, measured_at=base.measured_at, task_sha256=task_sha,
                shapes=overrides, backend=self.backend, arch=request.arch, kind=kind,
                versions={"torch": self.versions.torch, "cuda": self.versions.cuda,
                          "driver": self.versions.driver}))
        return base

    async def cached_baseline(self, request: VerifyRequest,
                              kind: str = "eager") -> tuple[_BaseTime | None, str]:
        """The baseline of ``kind`` (``eager``, ``compile``) of ``request``'s task, arch
        and shapes from this process (``worker_cache``) or the shared bucket
        (``shared_cache``, then kept here), or (None, ``measured``) when it must be
        measured. A ``compile`` failure this process saw comes back with its ``error``."""
        task_sha, overrides = _task_key(request)
        key = (kind, task_sha, request.arch, overrides)
        base = self._base_times.get(key)
        if base is not None:
            return base, "worker_cache"
        if self.shared_cache is not None:
            shared = await self.shared_cache.get_baseline(
                self._baseline_key(request, task_sha, overrides, kind))
            if shared is not None:
                base = self._base_times[key] = _BaseTime(shared.median_us, shared.measured_at,
                                                         "shared")
                return base, "shared_cache"
        return None, "measured"

    def check_timing(self, timing: wire.Timing, since: float | None, who: str,
                     repeats: int | None = 20, stage: str = "infrastructure") -> None:
        """Reject timings whose total exceeds the wall time observed here.

        ``since`` is when this process saw the child start the profiling phase; the
        phase ends when the Timing frame arrives, so the samples (one per timed call)
        cannot sum to more than the wall time in between. ``repeats``: the number of
        samples asked for (None: any).

        Raises:
            Verdict: (``stage``) ``timings inconsistent``.
        """
        observed_us = (time.monotonic() - since) * 1e6 if since is not None else 0.0
        total_us = sum(timing.samples_us)
        if repeats is not None and len(timing.samples_us) != repeats:
            raise Verdict(stage, f"timings inconsistent: {who} reported "
                          f"{len(timing.samples_us)} samples; {repeats} were asked for")
        if (since is None or not timing.samples_us
                or not all(math.isfinite(s) and s > 0 for s in timing.samples_us)
                or total_us > observed_us * _TIMING_SLACK + _TIMING_SLACK_US):
            raise Verdict(stage,
                          f"timings inconsistent: {who} reported {total_us:.0f} us over "
                          f"{len(timing.samples_us)} runs but only {observed_us:.0f} us of "
                          "wall time passed")

    _check_timing = check_timing
