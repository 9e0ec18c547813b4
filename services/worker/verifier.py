"""Verify candidate kernels against the task's PyTorch reference: the worker's core.

:class:`Verifier` takes a :class:`~schemas.events.VerifyRequest` and returns a
:class:`~schemas.events.VerifyResult`; it knows nothing of NATS. One verification:

1. Static checks of the candidate's source (:mod:`services.worker.static_check`);
   a syntax error is stage ``compile``, any other finding stage ``static``.
2. Reference outputs, from a sandboxed child that runs only the task's ``Model``,
   cached per (task source sha256, seed, shape_overrides) in this process and, when
   :attr:`Verifier.shared_cache` is set, in the JetStream buckets every worker shares
   (:mod:`services.worker.cache`; keys add backend, arch and library versions).
   ``VerifyResult.reference_source`` says where they came from. Before allocating,
   that child measures the task's inputs on fake tensors; inputs above
   ``memory_limit_bytes`` fail as ``infrastructure`` with a shape_overrides hint.
3. The candidate, in its own sandboxed child, for ``request.trials`` seeds
   (``1000 + i``): for each seed ``torch.manual_seed(seed)`` before
   ``get_init_inputs()`` and again before constructing ``ModelNew``, and again before
   ``get_inputs()``; the candidate runs on clones of the inputs. The child sends the
   raw outputs; this process compares them with the reference (tolerances in
   :mod:`services.worker.correctness`), checks the inputs were not modified (sha256
   before/after, against the reference's) and that outputs do not share memory with
   inputs or each other.
4. ``mode="profile"`` on a GPU backend: the candidate child times ``ModelNew`` and a
   reference child times ``Model`` (cached per task, arch and shapes, in this process
   and in the shared ``baselines`` bucket, whose key adds the torch, CUDA runtime
   and driver versions; ``VerifyResult.baseline_source`` / ``baseline_age_s`` say
   which and how old) on the same device: warm-up, L2 flush, device events, median
   of repeats. A child's reported
   total time must fit in the wall time this process observed. On ``cpu`` Triton
   runs in its interpreter: the result says ``interpreted=True`` and carries no
   timings.

5. Dynamic checks (ids and sources in :mod:`services.worker.rules`): the ATen ops
   ``forward`` ran, outside the allocation/view/copy allowlist, fail at stage
   ``audit``; so do events the child's audit hook refused and frames on the result
   channel that fail the keyed tag chain. A ghost replay (a fresh child with every
   Triton launch a no-op) whose outputs still match fails at ``audit``; a second input
   size (the task's own when it fits, else reduced non-power-of-two extents, one seed)
   runs beside it. On ``cpu`` (nothing is timed there) these two children start
   together with the candidate's own run; their findings are judged only once that
   run passed, so the verdict is the one a sequential run gives. A profiled time
   below the arch's roofline floor is ``audit``.
   A run that compares no elements never passes.

Speedups above ``speedup_flag_bound`` keep ``passed=True`` (the numbers matched)
but ``error`` starts with ``flagged:`` so a human or the generator can review the
candidate before trusting the speedup: a kernel that is 50x faster than eager
PyTorch usually skips work or games the timer.

Sandbox (see :mod:`services.worker.sandbox`, :func:`services.worker.hardening.enter_sandbox`):
own process group killed at the end, RLIMIT_CPU/FSIZE/NOFILE/CORE (and RLIMIT_AS on
cpu), scratch directory, no secrets in the environment, own Triton cache per
device, one visible device, a private network namespace and an unprivileged user
where the machine permits (probed by :meth:`Verifier.start`: a sandboxed child
compiles and launches a tiny Triton kernel on the backend's device as that user, and
the worker keeps its own user when that fails).

Why one module: the verdict is one procedure (reference, candidate, ghost replay,
second size, comparison, timing rules) and its order is part of what makes it hard
to game; keeping every step that feeds a verdict in one file keeps the trust
boundary auditable in one read. The wire format, sandbox entry and comparison
helpers are already apart (:mod:`services.worker.wire`,
:mod:`services.worker.hardening`, :mod:`services.worker.correctness`).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
import json
import math
import os
import time
import weakref
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import structlog
import torch

from schemas.events import VerifyRequest, VerifyResult, utcnow
from services.worker import _child, wire
from services.worker.cache import (
    CACHE_FORMAT,
    CACHE_LOOKUPS,
    Baseline,
    MalformedEntry,
    ReferenceHeader,
    SharedCache,
    TensorEntry,
    Versions,
    baseline_key,
    reference_key,
)
from services.worker.correctness import (
    check_meta,
    compare_outputs,
    compared_elements,
    tolerance_for,
)
from services.worker.rules import audit_findings, host_read_finding, impossible_timing
from services.worker.sandbox import (
    ChildRun,
    ForgedFrame,
    PoolBroken,
    ProtocolError,
    Sandbox,
    describe_exit,
)
from services.worker.sandbox import settle as settle_children
from services.worker.static_check import check_candidate
from services.worker.wire import ChildSpec

log = structlog.get_logger("aikg.worker.verifier")

SEED_BASE = 1000
# Reference outputs kept in this process: entries and total bytes (LRU).
REFERENCE_CACHE_ENTRIES = 64
REFERENCE_CACHE_BYTES = 1 << 30
# Candidate address space beyond the forked child's own, as a multiple of its task's
# input + output bytes, plus slack for libraries. An interpreted elementwise kernel
# on 128 MiB of inputs + outputs grew the address space by 1.6x that (the inputs'
# clones); 8x leaves room for kernels with large temporaries.
_ADDRESS_SPACE_SLACK = 2 << 30
_ADDRESS_SPACE_FACTOR = 8
_EXIT_WAIT_S = 5.0
# A child's reported timing total may exceed the wall time seen here by this much
# (clock granularity, frame latency) before it counts as inconsistent.
_TIMING_SLACK = 1.05
_TIMING_SLACK_US = 500.0
_STAGES = {"static", "compile", "runtime", "timeout", "mismatch", "crash", "infrastructure",
           "audit"}
# The second input size (see _second_size) on cpu: at most this many input bytes, so
# the interpreter finishes in seconds.
_CPU_SECOND_SIZE_BYTES = 1 << 20
# Module-level ints with these substrings are parameters, not extents: a reduced
# second size leaves them alone (kernels may specialise on them).
_NOT_EXTENTS = ("kernel", "stride", "pad", "dilation", "group", "class", "head", "axis",
                "seed", "eps")


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


class _Verdict(Exception):
    """Stop verifying; the keyword fields go into the VerifyResult."""

    def __init__(self, stage: str, error: str, **fields: Any) -> None:
        super().__init__(error)
        self.fields = {"passed": False, "stage": stage, "error": error, **fields}


@dataclass
class _Reference:
    """The reference run for one seed (outputs on CPU)."""

    seed: int
    outputs: list[torch.Tensor]
    inputs_before: list[str]
    inputs_after: list[str]
    aliasing: list[str]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.outputs)


@dataclass
class _BaseTime:
    """An eager baseline as this process holds it: median time (us), when it was
    measured (UTC), and where this process got it (``measured`` here or ``shared``)."""

    median_us: float
    measured_at: dt.datetime
    origin: str


@dataclass
class _LRU:
    """Bounded map (entries and bytes) of reference runs, least recently used out first."""

    max_entries: int
    max_bytes: int
    items: OrderedDict[Any, _Reference] = field(default_factory=OrderedDict)
    nbytes: int = 0

    def get(self, key: Any) -> _Reference | None:
        value = self.items.get(key)
        if value is not None:
            self.items.move_to_end(key)
        return value

    def put(self, key: Any, value: _Reference) -> None:
        if value.nbytes > self.max_bytes:
            return
        old = self.items.pop(key, None)
        if old is not None:
            self.nbytes -= old.nbytes
        self.items[key] = value
        self.nbytes += value.nbytes
        while len(self.items) > self.max_entries or self.nbytes > self.max_bytes:
            _, evicted = self.items.popitem(last=False)
            self.nbytes -= evicted.nbytes


@dataclass
class _ChildState:
    """Where a sandboxed child is: its last announced phase, and when (this process's
    monotonic clock, seconds) it announced ``profiling``."""

    phase: str = "starting"
    profiling_at: float | None = None


@dataclass
class _CandidateState(_ChildState):
    """What the parent learned from a candidate child so far."""

    compared: int = 0
    max_abs_error: float | None = None
    max_rel_error: float | None = None
    rel_l2_error: float | None = None
    tolerance: Any = None
    gen_time_us: float | None = None
    audit: wire.Audit | None = None


async def _child_frames(run: ChildRun, state: _ChildState,
                        lost: Callable[[int | None, str], BaseException],
                        on_phase: Callable[[str], None] | None = None
                        ) -> AsyncIterator[wire.Frame]:
    """The one loop over a reference or candidate child's frames, shared by both runs
    (probe and lowering children speak other protocols, in :mod:`sandbox`): yields
    every frame up to and including ``Done``, so an iteration that ends without an
    exception has seen ``Done``.

    ``Progress`` frames are consumed here: they move ``state.phase`` (and set
    ``state.profiling_at`` when profiling starts), then ``on_phase`` sees the new phase.
    When the child's channel ends before ``Done``, the child's exit status (None when
    the sandbox server itself went away) and the phase it was in go to ``lost``, whose
    exception is raised.

    The generator holds nothing to release (no ``finally``), so a caller may stop
    iterating at any frame, by ``return`` or by raising its verdict.

    Raises:
        ProtocolError, ForgedFrame: malformed or forged frames (from ``run.frame()``).
        BaseException: what ``lost`` returns, when the channel ends early.
    """
    while True:
        frame = await run.frame()
        if frame is None:
            raise lost(await run.wait(_EXIT_WAIT_S), state.phase)
        if isinstance(frame, wire.Progress):
            state.phase = frame.phase
            if frame.phase == "profiling":
                state.profiling_at = time.monotonic()
            if on_phase is not None:
                on_phase(frame.phase)
            continue
        yield frame
        if isinstance(frame, wire.Done):
            return


def _candidate_lost(status: int | None, phase: str) -> _Verdict:
    """The verdict when a candidate child's channel ends before ``Done``: the sandbox
    server went away (``status`` None, ``infrastructure``), else ``crash`` with how the
    process ended."""
    if status is None:
        return _Verdict("infrastructure", f"the sandbox server went away during {phase}")
    what = describe_exit(status)
    if what.startswith("killed"):
        what = f"was {what}"
    if os.WIFEXITED(status):
        what += " before returning results (does the candidate call os._exit or sys.exit?)"
    return _Verdict("crash", f"the candidate's process {what} during {phase}")


def speedup_fields(base_time_us: float, gen_time_us: float, bound: float) -> dict[str, Any]:
    """``base_time_us``, ``speedup`` and ``error`` of a passed, profiled result.

    A speedup above ``bound`` keeps the pass but sets ``error`` to ``flagged: ...``:
    the numbers matched, yet such a speedup over eager PyTorch usually means skipped
    work or a gamed timer, so someone should look before trusting it.
    """
    speedup = base_time_us / gen_time_us if gen_time_us > 0 else math.inf
    error = None
    if speedup > bound:
        error = (f"flagged: speedup {speedup:.1f} exceeds the bound {bound:g}; check that "
                 "the kernel does all the work and does not game the timer before trusting it")
    return {"base_time_us": base_time_us, "speedup": speedup, "error": error}


def _format_bytes(n: float) -> str:
    if n >= 1 << 30:
        return f"{n / (1 << 30):.1f} GiB"
    if n >= 1 << 20:
        return f"{n / (1 << 20):.1f} MiB"
    return f"{n / 1024:.1f} KiB"


def _size_hint(need: int, limit: int, names: dict[str, int], command: str | None) -> str:
    factor = 1 << max(1, math.ceil(math.log2(max(need / max(limit, 1), 1.0))))
    name = "batch_size" if "batch_size" in names else (
        max(names, key=lambda n: names[n]) if names else None)
    if name is None:
        return "pass smaller shape_overrides"
    value = max(1, names[name] // factor)
    suggestion = json.dumps({name: value})
    return (f"pass shape_overrides such as {suggestion} to shrink them"
            + (f" ({command}: --shape {name}={value})" if command else ""))


def _decode_tensor(meta: wire.TensorMeta, data: bytearray) -> torch.Tensor:
    """A CPU tensor from a child's metadata and bytes (both untrusted; validated)."""
    dtype = wire.dtype_from_name(meta.dtype)
    if any(d < 0 for d in meta.shape):
        raise ProtocolError(f"negative dimension in shape {meta.shape}")
    numel = math.prod(meta.shape)
    itemsize = torch.empty((), dtype=dtype).element_size()
    if numel * itemsize != meta.nbytes or len(data) != meta.nbytes:
        raise ProtocolError(f"tensor of shape {meta.shape} and dtype {meta.dtype} "
                            f"cannot hold {len(data)} bytes")
    if numel == 0:
        return torch.empty(meta.shape, dtype=dtype)
    return torch.frombuffer(data, dtype=dtype).reshape(meta.shape)


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
            shape_overrides hint. On cpu it also sizes the reference child's
            RLIMIT_AS (4x this plus 2 GiB; none when None). A candidate child's
            RLIMIT_AS on cpu is 8x its task's input + output bytes plus 2 GiB.
        output_limit_bytes: cap on the captured stdout/stderr/traceback in
            ``VerifyResult.log``, bytes.
        speedup_flag_bound: speedups above this are flagged for review (``error``
            starts with ``flagged:``; ``passed`` stays True).
        compare_threads: intra-op threads of this process's torch (the comparisons),
            set by :meth:`start`; default 1 on cpu, where the children are busy on
            the same cores: two OpenMP threads there spun at barriers and made one
            comparison of a 1 MiB output 5-10x slower (measured at load 3 on 2
            cores); None (GPU default) leaves torch's setting alone.
        client_command: the command whose ``--shape`` option the too-large-inputs hint
            names (``aikg submit`` for a worker service, whose jobs come through the
            gateway; ``aikg run`` for the CLI's local mode); None names no command.

    Attributes:
        shared_cache: the reference outputs and baselines every worker shares
            (:class:`~services.worker.cache.SharedCache`), consulted after this
            process's own cache and filled after each reference run; None (the
            default, and local mode) keeps to this process.
        reference_runs: reference children spawned so far (cache misses).
        candidate_runs: candidate children spawned so far.
        network_isolated: whether children run in a private network namespace
            (None before :meth:`start`).
        run_as: (uid, gid) children switch to, or None when they keep this user.
        sandbox_notes: isolation steps this machine did not permit.
    """

    def __init__(self, backend: str, *, worker_id: str, scratch_root: str | Path | None = None,
                 memory_limit_bytes: int | None = None, output_limit_bytes: int = 64 * 1024,
                 speedup_flag_bound: float = 50.0, sandbox_require: tuple[str, ...] = (),
                 sandbox_env_allow: tuple[str, ...] = (),
                 compare_threads: int | None | str = "auto",
                 client_command: str | None = "aikg submit") -> None:
        if backend not in ("cpu", "cuda", "ascend"):
            raise ValueError(f"backend must be cpu, cuda or ascend, not {backend!r}")
        self.backend = backend
        self.worker_id = worker_id
        self.client_command = client_command
        self.memory_limit_bytes = memory_limit_bytes
        self.output_limit_bytes = output_limit_bytes
        self.speedup_flag_bound = speedup_flag_bound
        self.compare_threads = (1 if backend == "cpu" else None) if compare_threads == "auto" \
            else compare_threads
        # Ghost replay and second size start with the candidate's own run (cpu: nothing
        # is timed there); False runs them after it.
        self.side_by_side = backend == "cpu"
        self.reference_runs = 0
        self.candidate_runs = 0
        # A default scratch root is this worker's own and goes with it on close(); a
        # given one (e.g. to keep Triton caches across restarts) is left in place.
        self.sandbox = Sandbox(backend, name=f"worker-{worker_id}", scratch_root=scratch_root,
                               require=sandbox_require, env_allow=sandbox_env_allow)
        self.scratch_root = self.sandbox.scratch_root
        self._references = _LRU(REFERENCE_CACHE_ENTRIES, REFERENCE_CACHE_BYTES)
        self._input_bytes: dict[tuple[str, str], int] = {}
        self._size_names: dict[tuple[str, str], dict[str, int]] = {}
        self._base_times: dict[tuple[str, str, str], _BaseTime] = {}
        # The JetStream tier shared by every worker (set by the worker service); None:
        # this process's caches only.
        self.shared_cache: SharedCache | None = None
        self.versions = Versions.detect(backend)
        self._reference_locks: weakref.WeakValueDictionary[Any, asyncio.Lock] = (
            weakref.WeakValueDictionary())

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
        """Forget this process's reference outputs, input sizes and baselines (what a
        fresh worker process starts with); the shared tier keeps its entries."""
        self._references = _LRU(REFERENCE_CACHE_ENTRIES, REFERENCE_CACHE_BYTES)
        self._input_bytes.clear()
        self._size_names.clear()
        self._base_times.clear()

    def abort_start(self) -> None:
        """Make a :meth:`start` under way in another thread fail fast (PoolBroken)
        instead of waiting for its fork server's imports; a started verifier is left
        alone. A later :meth:`start` starts afresh."""
        self.sandbox.abort_start()

    def close(self) -> None:
        """Stop the fork server (it kills every running child's process group) and
        remove a default scratch root."""
        self.sandbox.close()

    # ------------------------------------------------------------ helpers

    def _scratch(self, request_id: str, role: str, run_as: tuple[int, int] | None) -> Path:
        return self.sandbox.scratch(request_id, role, run_as)

    def _child_env(self, device: str, run_as: tuple[int, int] | None) -> dict[str, str]:
        return self.sandbox.child_env(device, run_as)

    async def _spawn(self, spec: ChildSpec, max_frame_bytes: int) -> ChildRun:
        try:
            return await self.sandbox.spawn(spec, max_frame_bytes)
        except PoolBroken as exc:
            raise _Verdict("infrastructure", f"sandbox pool broken: {exc}") from None

    def _spec(self, request: VerifyRequest, role: str, device: str, seeds: list[int],
              **kwargs: Any) -> ChildSpec:
        scratch = self._scratch(request.request_id, role, self.run_as)
        (scratch / "task.py").write_text(request.task_desc)
        candidate = ""
        if role == "candidate":
            (scratch / "candidate.py").write_text(request.code)
            candidate = str(scratch / "candidate.py")
        cpu_seconds = math.ceil(request.timeout_s) * max(1, os.cpu_count() or 1) + 10
        # A fresh key per child: frames it did not write fail the tag check.
        return ChildSpec(
            role=role, scratch_dir=str(scratch), backend=self.backend,
            env=self._child_env(device, self.run_as), task_path=str(scratch / "task.py"),
            candidate_path=candidate, seeds=seeds,
            shape_overrides=dict(request.shape_overrides), cpu_seconds=cpu_seconds,
            run_as=self.run_as, isolate_network=True, frame_key=os.urandom(32),
            env_allow=list(self.sandbox.env_allow), **kwargs)

    # ------------------------------------------------------------ verify

    async def verify(self, request: VerifyRequest, *, device: str) -> VerifyResult:
        """Verify (and with ``mode="profile"`` on a GPU, time) one candidate.

        Never raises for anything the candidate or the task does: every outcome is a
        VerifyResult with ``passed`` and, on failure, ``stage``, an actionable
        ``error`` and the captured ``log`` (at most ``output_limit_bytes``).

        Args:
            request: the candidate, its task, shape_overrides, trials, timeout_s (the
                wall-clock limit, seconds, of the candidate's run; the reference run,
                when not cached, has the same limit).
            device: the leased device (``"0"``, ``"1"`` ... on GPUs, a slot on cpu).
        """
        started = time.monotonic()
        clock = PhaseClock()
        provenance: dict[str, Any] = {}
        try:
            fields = await self._verify(request, device, clock, provenance)
        except _Verdict as verdict:
            fields = verdict.fields
        except Exception as exc:
            log.exception("verify.worker_error", request_id=request.request_id)
            fields = {"passed": False, "stage": "infrastructure",
                      "error": f"worker error: {type(exc).__name__}: {exc}"}
        clock.lap("verdict")
        result = VerifyResult(
            request_id=request.request_id, job_id=request.job_id,
            candidate_id=request.candidate_id, worker_id=self.worker_id, device=device,
            interpreted=self.backend == "cpu", duration_s=time.monotonic() - started,
            phases={k: round(v, 6) for k, v in clock.spans.items()},
            **{**provenance, **fields})
        log.info("verify.done", request_id=request.request_id, job_id=request.job_id,
                 candidate_id=request.candidate_id, passed=result.passed, stage=result.stage,
                 duration_s=round(result.duration_s, 3))
        return result

    async def _verify(self, request: VerifyRequest, device: str, clock: PhaseClock,
                      provenance: dict[str, Any]) -> dict[str, Any]:
        if request.backend != self.backend:
            raise _Verdict("infrastructure", f"this worker verifies on {self.backend}; the "
                           f"request is for {request.backend}")
        findings = check_candidate(request.code, request.dsl)
        if findings:
            text = "\n".join(str(f) for f in findings)
            if findings[0].rule == "syntax":
                raise _Verdict("compile", str(findings[0]), log=text)
            shown = "; ".join(str(f) for f in findings[:3])
            more = f" (+{len(findings) - 3} more)" if len(findings) > 3 else ""
            raise _Verdict("static", f"static check failed: {shown}{more}", log=text)
        clock.lap("static")
        if not self._started:
            try:
                await asyncio.to_thread(self.start)
            except PoolBroken as exc:
                raise _Verdict("infrastructure", f"sandbox pool broken: {exc}") from None
            clock.lap("sandbox_start")

        seeds = [SEED_BASE + i for i in range(request.trials)]
        task_sha = hashlib.sha256(request.task_desc.encode()).hexdigest()
        overrides = json.dumps(request.shape_overrides, sort_keys=True)
        profile = request.mode == "profile" and self.backend != "cpu"
        references = await self._references_for(request, device, seeds, task_sha, overrides,
                                                profile, clock=clock, provenance=provenance)
        total, empty = compared_elements(references[0].outputs)
        if total == 0:
            raise _Verdict("infrastructure", f"nothing to compare: the reference {empty or 'returned no outputs'} "
                           f"(no elements) at shape_overrides {overrides}; pass sizes above zero")
        sizes = [dict(self._size_names.get((task_sha, overrides), {}))]
        side_notes: list[str] = []

        def side_checks() -> asyncio.Future:
            # Independent children (each fresh, each with its own frame key); their
            # outcomes are judged only after the candidate's own run passed, ghost
            # replay first, exactly as if they had run after it.
            return asyncio.gather(
                _timed(clock, "ghost_replay", self._ghost_replay(
                    request, device, seeds[0], references, task_sha, overrides)),
                _timed(clock, "second_size", self._second_size(
                    request, device, task_sha, overrides, side_notes)),
                return_exceptions=True)

        # On cpu nothing is timed, so the side children start with the candidate's
        # own run instead of after it; on GPUs they would share the device with it.
        side = side_checks() if self.side_by_side else None
        try:
            fields = await self._run_candidate(request, device, seeds, references, task_sha,
                                               overrides, profile, clock=clock)
        except BaseException as exc:
            if isinstance(exc, _Verdict):
                exc.fields.setdefault("sizes_checked", sizes)
            if side is not None:
                # The candidate's verdict stands; the side children are killed, and
                # their cleanups (which outlive the cancel) end before the verdict.
                side.cancel()
                await asyncio.gather(side, return_exceptions=True)
                await settle_children()
            raise
        notes = fields["notes"]
        ghost, sized = await (side if side is not None else side_checks())
        clock.lap("checks")
        notes.extend(side_notes)
        for outcome in (ghost, sized):
            if isinstance(outcome, BaseException):
                raise outcome
        fields["ghost_replay"] = ghost
        checked_own, second = sized
        if second is not None:
            sizes.append(second)
        fields.update(sizes_checked=sizes, task_sizes_checked=(
            not request.shape_overrides or checked_own))
        if not fields["task_sizes_checked"]:
            notes.append("the task's own sizes were not checked (they do not fit this "
                         "worker); the result holds for the sizes listed in sizes_checked")
        if request.mode == "profile" and self.backend == "cpu":
            fields["log"] = _join_log(
                fields.get("log", ""), "profile: no timings on the cpu backend (Triton runs "
                "in its interpreter; times would not mean anything)",
                limit=self.output_limit_bytes)
        if profile:
            nbytes = self._input_bytes.get((task_sha, overrides), 0) + sum(
                t.numel() * t.element_size() for t in references[0].outputs)
            impossible = impossible_timing(fields["gen_time_us"], nbytes, request.arch)
            if impossible is not None:
                raise _Verdict("audit", f"{impossible}; the kernel skips work or games the "
                               "timer", gen_time_us=fields["gen_time_us"],
                               trials=fields["trials"], log=fields.get("log", ""))
            fields.update(speedup_fields(
                self._base_times[(task_sha, request.arch, overrides)].median_us,
                fields["gen_time_us"], self.speedup_flag_bound))
            if fields["error"]:
                fields["log"] = _join_log(fields.get("log", ""), fields["error"],
                                          limit=self.output_limit_bytes)
        return fields

    async def _ghost_replay(self, request: VerifyRequest, device: str, seed: int,
                            references: list[_Reference], task_sha: str,
                            overrides: str) -> str:
        """Rule D003: run the candidate with every Triton launch a no-op; its outputs
        must then differ from the reference's.

        In that fresh child new allocations (``torch.empty`` and friends) are
        NaN-filled, so an output the kernels should have written cannot equal the
        reference by chance. One seed. Skipped where every reference output is
        constant (a no-op candidate could match it honestly).

        Returns:
            What the replay showed, for ``VerifyResult.ghost_replay``.

        Raises:
            _Verdict: (audit) the outputs still matched; or the replay child's own
                audit/infrastructure failure.
        """
        if all(_constant(t) for r in references for t in r.outputs) and all(
                len({tuple(r.outputs[i].reshape(-1)[:1].tolist()) for r in references}) <= 1
                for i in range(len(references[0].outputs))):
            return "skipped: the reference output is constant"
        try:
            await self._run_candidate(request, device, [seed], references[:1], task_sha,
                                      overrides, False, ghost=True, audit_ops=False)
        except _Verdict as verdict:
            if verdict.fields["stage"] in ("audit", "infrastructure"):
                raise
            return "outputs depend on the Triton kernels"
        raise _Verdict("audit", "outputs do not depend on the Triton kernels: with every "
                       "Triton launch a no-op (and new tensors NaN-filled) ModelNew.forward "
                       f"still returned the expected outputs for seed {seed}; compute them "
                       "in the kernels", ghost_replay="outputs matched without the kernels",
                       trials=len(references))

    async def _second_size(self, request: VerifyRequest, device: str, task_sha: str,
                           overrides: str, notes: list[str]
                           ) -> tuple[bool, dict[str, int] | None]:
        """Rule D008: check one more input size, one seed.

        The task's own sizes when shape_overrides were given and the task's inputs fit
        (``memory_limit_bytes``; on cpu at most 1 MiB, so the interpreter finishes);
        otherwise a reduced size: every extent of the requested sizes (module-level
        ints of 8 or more whose names do not look like parameters, see _NOT_EXTENTS)
        to about 3/4, never a power of two. A reference that cannot run at that size
        skips the check, with a note.

        Returns:
            (whether the task's own sizes were checked, the sizes checked or None).

        Raises:
            _Verdict: the candidate failed at the second size (its message names it).
        """
        limit = self.memory_limit_bytes
        if self.backend == "cpu":
            limit = min(limit or _CPU_SECOND_SIZE_BYTES, _CPU_SECOND_SIZE_BYTES)
        seeds = [SEED_BASE]
        own = None
        if request.shape_overrides:
            try:
                own = await self._references_for(
                    msgspec.structs.replace(request, shape_overrides={}), device, seeds,
                    task_sha, "{}", False, input_limit=limit)
            except _Verdict as verdict:
                notes.append(f"the task's own sizes were not run: {verdict.fields['error']}")
        if own is not None:
            target: dict[str, Any] = {}
            references = own
        else:
            names = self._size_names.get((task_sha, overrides), {})
            target = dict(request.shape_overrides)
            target.update({n: _reduced(v) for n, v in names.items()
                           if v >= 8 and not any(p in n.lower() for p in _NOT_EXTENTS)})
            if not any(target.get(n) != v for n, v in names.items()):
                notes.append("no second size: the task has no extents to vary")
                return False, None
            try:
                references = await self._references_for(
                    msgspec.structs.replace(request, shape_overrides=target), device, seeds,
                    task_sha, json.dumps(target, sort_keys=True), False, input_limit=limit)
            except _Verdict as verdict:
                notes.append(f"no second size: the reference failed at {_sizes_text(target)}: "
                             f"{verdict.fields['error']}")
                return False, None
        key = json.dumps(target, sort_keys=True)
        checked = dict(self._size_names.get((task_sha, key), target))
        label = _sizes_text(checked) + (" (the task's own sizes)" if own is not None else "")
        if compared_elements(references[0].outputs)[0] == 0:
            notes.append(f"no second size: nothing to compare at {label}")
            return own is not None, None
        try:
            await self._run_candidate(msgspec.structs.replace(request, shape_overrides=target),
                                      device, seeds, references, task_sha, key, False)
        except _Verdict as verdict:
            verdict.fields["error"] = f"at the second size {label}: {verdict.fields['error']}"
            verdict.fields["sizes_checked"] = [
                dict(self._size_names.get((task_sha, json.dumps(
                    request.shape_overrides, sort_keys=True)), {})), checked]
            raise
        return own is not None, checked

    # ------------------------------------------------------------ reference

    async def _references_for(self, request: VerifyRequest, device: str, seeds: list[int],
                              task_sha: str, overrides: str, profile: bool,
                              input_limit: int | None = None,
                              clock: PhaseClock | None = None,
                              provenance: dict[str, Any] | None = None) -> list[_Reference]:
        """The reference runs of ``seeds`` (and, with ``profile``, the eager baseline):
        from this process's cache, else the shared cache, else a reference child.

        Each lookup is counted in ``aikg_worker_cache_lookups_total``; ``provenance``
        (the main lookup's) gets ``reference_source`` and, when profiling,
        ``baseline_source`` / ``baseline_age_s`` for the result.

        Raises:
            _Verdict: the reference child failed (``infrastructure``).
        """
        lock_key = (task_sha, overrides)
        lock = self._reference_locks.get(lock_key)
        if lock is None:
            lock = asyncio.Lock()
            self._reference_locks[lock_key] = lock
        async with lock:
            found = {s: self._references.get((task_sha, s, overrides)) for s in seeds}
            missing = [s for s, ref in found.items() if ref is None]
            shared_hit = False
            if missing and self.shared_cache is not None:
                for seed in missing:
                    ref = await self._shared_reference(request, task_sha, overrides, seed)
                    if ref is not None:
                        found[seed] = ref
                        self._references.put((task_sha, seed, overrides), ref)
                        shared_hit = True
                missing = [s for s, ref in found.items() if ref is None]
            timing_key = (task_sha, request.arch, overrides)
            baseline_origin = "worker_cache"
            need_timing = profile and timing_key not in self._base_times
            if need_timing and self.shared_cache is not None:
                baseline = await self.shared_cache.get_baseline(
                    self._baseline_key(request, task_sha, overrides))
                if baseline is not None:
                    self._base_times[timing_key] = _BaseTime(
                        baseline.median_us, baseline.measured_at, "shared")
                    baseline_origin = "shared_cache"
                    need_timing = False
            if missing or need_timing:
                fresh = await self._run_reference(request, device, missing or seeds[-1:],
                                                  bool(missing), need_timing, timing_key,
                                                  input_limit)
                for ref in fresh:
                    found[ref.seed] = ref
                    self._references.put((task_sha, ref.seed, overrides), ref)
                if need_timing:
                    baseline_origin = "measured"
                await self._share(request, task_sha, overrides, fresh,
                                  timing_key if need_timing else None)
            if clock is not None:
                clock.lap("reference" if missing or need_timing else "reference_cache")
            labels = {"backend": self.backend, "arch": request.arch}
            reference_origin = ("run" if missing else
                                "shared_cache" if shared_hit else "worker_cache")
            CACHE_LOOKUPS.labels(**labels, kind="reference", result={
                "run": "miss", "shared_cache": "shared", "worker_cache": "worker"}[
                    reference_origin]).inc()
            if profile:
                CACHE_LOOKUPS.labels(**labels, kind="baseline", result={
                    "measured": "miss", "shared_cache": "shared", "worker_cache": "worker"}[
                        baseline_origin]).inc()
            if provenance is not None:
                provenance["reference_source"] = reference_origin
                if profile:
                    base = self._base_times[timing_key]
                    provenance["baseline_source"] = baseline_origin
                    provenance["baseline_age_s"] = round(
                        max(0.0, (utcnow() - base.measured_at).total_seconds()), 3)
            return [found[s] for s in seeds]

    def _reference_key(self, request: VerifyRequest, task_sha: str, overrides: str,
                       seed: int) -> str:
        return reference_key(task_sha256=task_sha, shapes=overrides, seed=seed,
                             backend=self.backend, arch=request.arch, versions=self.versions)

    def _baseline_key(self, request: VerifyRequest, task_sha: str, overrides: str) -> str:
        return baseline_key(task_sha256=task_sha, shapes=overrides, backend=self.backend,
                            arch=request.arch, versions=self.versions)

    async def _shared_reference(self, request: VerifyRequest, task_sha: str, overrides: str,
                                seed: int) -> _Reference | None:
        """One seed's reference run from the shared cache, checked as a child's frames
        are (:func:`_decode_tensor`), or None. Also restores the task's input size and
        size names at these shapes, which the reference child would have sent."""
        assert self.shared_cache is not None
        key = self._reference_key(request, task_sha, overrides, seed)
        stored = await self.shared_cache.get_reference(key)
        if stored is None:
            return None
        header, parts = stored
        try:
            if header.seed != seed:
                raise MalformedEntry(f"seed {header.seed} stored under seed {seed}")
            outputs = [_decode_tensor(wire.TensorMeta(t.dtype, t.shape, t.nbytes), data)
                       for t, data in zip(header.outputs, parts, strict=True)]
        except (MalformedEntry, ProtocolError, ValueError) as exc:
            self.shared_cache._failed("reference", "decode", key, exc)
            return None
        self._input_bytes.setdefault((task_sha, overrides), header.input_bytes)
        self._size_names.setdefault((task_sha, overrides), dict(header.size_names))
        return _Reference(seed, outputs, list(header.inputs_before),
                          list(header.inputs_after), list(header.aliasing))

    async def _share(self, request: VerifyRequest, task_sha: str, overrides: str,
                     fresh: list[_Reference],
                     timing_key: tuple[str, str, str] | None) -> None:
        """Put what a reference child just produced into the shared cache: its runs
        (each seed's outputs) and, when ``timing_key`` is given, its baseline."""
        cache = self.shared_cache
        if cache is None:
            return
        for ref in fresh:
            header = ReferenceHeader(
                format=CACHE_FORMAT, key=self._reference_key(request, task_sha, overrides,
                                                             ref.seed),
                seed=ref.seed, outputs=[
                    TensorEntry(wire.dtype_name(t.dtype), list(t.shape),
                                t.numel() * t.element_size()) for t in ref.outputs],
                inputs_before=ref.inputs_before, inputs_after=ref.inputs_after,
                aliasing=ref.aliasing,
                input_bytes=self._input_bytes.get((task_sha, overrides), 0),
                size_names=self._size_names.get((task_sha, overrides), {}))
            # Outputs are contiguous CPU tensors (decoded from the child's frames).
            await cache.put_reference(header, [
                t.contiguous().reshape(-1).view(torch.uint8).numpy().data
                if t.numel() else b"" for t in ref.outputs])
        if timing_key is not None and timing_key in self._base_times:
            base = self._base_times[timing_key]
            await cache.put_baseline(Baseline(
                format=CACHE_FORMAT, key=self._baseline_key(request, task_sha, overrides),
                median_us=base.median_us, measured_at=base.measured_at, task_sha256=task_sha,
                shapes=overrides, backend=self.backend, arch=request.arch,
                versions={"torch": self.versions.torch, "cuda": self.versions.cuda,
                          "driver": self.versions.driver}))

    async def _run_reference(self, request: VerifyRequest, device: str, seeds: list[int],
                             want_outputs: bool, need_timing: bool,
                             timing_key: tuple[str, str, str],
                             input_limit: int | None = None) -> list[_Reference]:
        limit = self.memory_limit_bytes
        address_space = None
        if self.backend == "cpu" and limit is not None:
            address_space = 4 * limit + _ADDRESS_SPACE_SLACK
        spec = self._spec(request, "reference", device, seeds, want_outputs=want_outputs,
                          profile=need_timing, input_limit_bytes=(
                              limit if input_limit is None else input_limit),
                          address_space_bytes=address_space)
        self.reference_runs += 1
        run = await self._spawn(spec, max_frame_bytes=4 * limit if limit else 64 << 30)
        fresh: list[_Reference] = []
        state = _ChildState()

        def lost(status: int | None, phase: str) -> _Verdict:
            return _Verdict("infrastructure", f"the reference run's process "
                            f"{describe_exit(status)} during {phase}",
                            log=run.output(self.output_limit_bytes))

        try:
            async with asyncio.timeout(request.timeout_s):
                async for frame in _child_frames(run, state, lost):
                    if isinstance(frame, wire.Sizes):
                        self._input_bytes[timing_key[0], timing_key[2]] = frame.input_bytes
                        self._size_names[timing_key[0], timing_key[2]] = frame.size_names
                        if spec.input_limit_bytes is not None and (
                                frame.input_bytes > spec.input_limit_bytes):
                            limit = spec.input_limit_bytes
                            raise _Verdict(
                                "infrastructure",
                                f"task inputs need {_format_bytes(frame.input_bytes)} (limit "
                                f"{_format_bytes(limit)}); "
                                f"{_size_hint(frame.input_bytes, limit, frame.size_names, self.client_command)}")
                    elif isinstance(frame, wire.Trial):
                        outputs = []
                        for meta in frame.outputs:
                            data = await run.raw(meta.nbytes)
                            if data is None:
                                break
                            outputs.append(_decode_tensor(meta, data))
                        fresh.append(_Reference(frame.seed, outputs, frame.inputs_before,
                                                frame.inputs_after, frame.aliasing))
                    elif isinstance(frame, wire.Timing):
                        self._check_timing(frame, state.profiling_at, "the reference Model",
                                           repeats=spec.repeats)
                        self._base_times[timing_key] = _BaseTime(frame.median_us, utcnow(),
                                                                 "measured")
                    elif isinstance(frame, wire.Failure):
                        raise _Verdict("infrastructure", f"reference run: {frame.message}",
                                       log=_join_log(run.output(self.output_limit_bytes),
                                                     frame.traceback,
                                                     limit=self.output_limit_bytes))
                # _child_frames ends only after Done (or raises): the run is complete.
                if need_timing and timing_key not in self._base_times:
                    raise _Verdict("infrastructure", "the reference child sent no timing")
                return fresh
        except TimeoutError:
            raise _Verdict("infrastructure",
                           f"the reference Model did not finish within {request.timeout_s:g} s "
                           f"(during {state.phase}); pass smaller shape_overrides") from None
        except ProtocolError as exc:
            raise _Verdict("infrastructure", f"reference run: {exc}") from None
        finally:
            await run.close()

    def _check_timing(self, timing: wire.Timing, since: float | None, who: str,
                      repeats: int | None = None, stage: str = "infrastructure") -> None:
        """Reject timings whose total exceeds the wall time observed here.

        ``since`` is when this process saw the child start the profiling phase; the
        phase ends when the Timing frame arrives, so the samples (one per timed call)
        cannot sum to more than the wall time in between. ``repeats``: the number of
        samples asked for (None: any).

        Raises:
            _Verdict: (``stage``) ``timings inconsistent``.
        """
        observed_us = (time.monotonic() - since) * 1e6 if since is not None else 0.0
        total_us = sum(timing.samples_us)
        if repeats is not None and len(timing.samples_us) != repeats:
            raise _Verdict(stage, f"timings inconsistent: {who} reported "
                           f"{len(timing.samples_us)} samples; {repeats} were asked for")
        if (since is None or not timing.samples_us
                or not all(math.isfinite(s) and s > 0 for s in timing.samples_us)
                or total_us > observed_us * _TIMING_SLACK + _TIMING_SLACK_US):
            raise _Verdict(stage,
                           f"timings inconsistent: {who} reported {total_us:.0f} us over "
                           f"{len(timing.samples_us)} runs but only {observed_us:.0f} us of "
                           "wall time passed")

    # ------------------------------------------------------------ candidate

    async def _run_candidate(self, request: VerifyRequest, device: str, seeds: list[int],
                             references: list[_Reference], task_sha: str, overrides: str,
                             profile: bool, *, ghost: bool = False,
                             audit_ops: bool = True,
                             clock: PhaseClock | None = None) -> dict[str, Any]:
        """Run the candidate in a sandboxed child for ``seeds`` and judge its frames.

        ``ghost``: every Triton launch is a no-op in that child (the ghost replay).
        ``audit_ops``: fail on compute ops recorded in ``forward`` (rule D002).
        ``clock``: laps the candidate's phases on it (the main run only).

        Raises:
            _Verdict: the candidate failed; otherwise returns the passed result's fields.
        """
        address_space = None
        input_bytes = self._input_bytes.get((task_sha, overrides), 0)
        if self.backend == "cpu":
            data = input_bytes + max(r.nbytes for r in references)
            address_space = _ADDRESS_SPACE_FACTOR * data + _ADDRESS_SPACE_SLACK
        spec = self._spec(request, "candidate", device, seeds, profile=profile,
                          address_space_bytes=address_space, ghost=ghost)
        largest = max(max((t.numel() * t.element_size() for t in r.outputs), default=0)
                      for r in references)
        self.candidate_runs += 1
        run = await self._spawn(spec, max_frame_bytes=max(largest, input_bytes, 1 << 20))
        state = _CandidateState()
        try:
            try:
                async with asyncio.timeout(request.timeout_s):
                    await self._candidate_frames(run, state, references, spec, audit_ops,
                                                 clock)
            except TimeoutError:
                raise _Verdict("timeout", f"the candidate did not finish within "
                               f"{request.timeout_s:g} s (during {state.phase}); its process "
                               "group was killed") from None
            except ForgedFrame as exc:
                raise _Verdict("audit", "the candidate wrote on the result channel during "
                               f"{state.phase}: {exc}; candidates must not touch the "
                               "harness's file descriptors") from None
            except ProtocolError as exc:
                raise _Verdict("crash", "the candidate's process sent malformed results: "
                               f"{exc}") from None
        except _Verdict as verdict:
            run.kill()
            await run.wait(_EXIT_WAIT_S)
            verdict.fields["log"] = _join_log(run.output(self.output_limit_bytes),
                                              verdict.fields.get("log", ""),
                                              limit=self.output_limit_bytes)
            verdict.fields.setdefault("trials", state.compared)
            raise
        finally:
            output = run.output(self.output_limit_bytes)
            await run.close()
            if clock is not None:
                clock.lap("candidate_finish")
        if profile and state.gen_time_us is None:
            raise _Verdict("infrastructure", "the candidate's child sent no timing",
                           trials=state.compared, log=output)
        tol = state.tolerance or tolerance_for(
            references[0].outputs[0].dtype if references[0].outputs else torch.float32,
            self.backend)
        return {"passed": True, "stage": None, "error": None, "log": output,
                "max_abs_error": state.max_abs_error, "max_rel_error": state.max_rel_error,
                "rel_l2_error": state.rel_l2_error,
                "mismatch_count": 0, "atol": tol.atol, "rtol": tol.rtol,
                "trials": state.compared, "gen_time_us": state.gen_time_us,
                "notes": list(state.audit.notes) if state.audit else []}

    async def _candidate_frames(self, run: ChildRun, state: _CandidateState,
                                references: list[_Reference], spec: ChildSpec,
                                audit_ops: bool = True,
                                clock: PhaseClock | None = None) -> None:
        """Consume the candidate child's frames until Done.

        The protocol is checked here, not trusted: trials in order, a Timing only when
        profiling was asked for, after the child announced the phase, and once; an
        Audit frame (the op record) before Done.

        Raises:
            _Verdict: the candidate failed (its Failure frame, a mismatch, an audit
                finding, a crash).
            ProtocolError: malformed frames.
        """
        def on_phase(phase: str) -> None:
            if clock is not None and phase == wire.IMPORT_PHASE:
                clock.lap("candidate_start")
            elif clock is not None and phase == "profiling":
                clock.lap("candidate_finish")

        async for frame in _child_frames(run, state, _candidate_lost, on_phase):
            if isinstance(frame, wire.Trial):
                if frame.index != state.compared or frame.index >= len(references):
                    raise ProtocolError(f"trial {frame.index} arrived out of order")
                if clock is not None:
                    clock.lap("compile" if frame.index == 0 else f"trial_{frame.index}")
                # The ghost replay only asks whether its outputs still match.
                comparison = await self._compare_trial(run, frame, references[frame.index],
                                                       detail=not spec.ghost)
                if clock is not None:
                    clock.lap("compare")
                state.compared += 1
                if comparison.outputs and state.tolerance is None:
                    state.tolerance = comparison.outputs[0].tolerance
                state.max_abs_error = _max(state.max_abs_error, comparison.max_abs_error)
                state.max_rel_error = _max(state.max_rel_error, comparison.max_rel_error)
                state.rel_l2_error = _max(state.rel_l2_error, comparison.rel_l2_error)
            elif isinstance(frame, wire.Timing):
                if (not spec.profile or state.phase != "profiling"
                        or state.gen_time_us is not None):
                    raise _Verdict("audit", "the candidate wrote on the result channel: a "
                                   f"timing frame arrived during {state.phase}, where the "
                                   "harness sends none")
                self._check_timing(frame, state.profiling_at, "the candidate",
                                   repeats=spec.repeats, stage="audit")
                state.gen_time_us = frame.median_us
                if clock is not None:
                    clock.lap("profile")
            elif isinstance(frame, wire.Audit):
                state.audit = frame
                if frame.refused:
                    raise _Verdict("audit", f"the sandbox refused {frame.refused[0]} in "
                                   "candidate code: candidates may not inspect the harness, "
                                   "its frames or its file descriptors",
                                   log="\n".join(frame.refused))
                host = host_read_finding(frame.host_reads, frame.host_elements) \
                    if audit_ops else None
                if host is not None:
                    raise _Verdict("audit", host, log="\n".join(
                        f"{name}: {count}" for name, count in sorted(frame.host_reads.items())))
                findings = audit_findings(frame.ops, frame.launcher_ops) if audit_ops else []
                if findings:
                    raise _Verdict("audit", "; ".join(findings[:3]) + (
                        f" (+{len(findings) - 3} more)" if len(findings) > 3 else "") +
                        ": PyTorch computed in forward; do the work in Triton kernels (only "
                        "allocation, views and layout copies are allowed)",
                        log="\n".join(findings))
            elif isinstance(frame, wire.Failure):
                stage = frame.stage if frame.stage in _STAGES else "runtime"
                raise _Verdict(stage, frame.message, log=frame.traceback)
            elif isinstance(frame, wire.Done):
                # Done is only a claim; every trial must have been compared here.
                if state.compared != len(references):
                    raise _Verdict("crash", f"the candidate's process reported results for "
                                   f"{state.compared} of {len(references)} trials")
                if state.audit is None:
                    raise _Verdict("audit", "the candidate's process finished without the "
                                   "harness's op record; something replaced the harness")

    async def _compare_trial(self, run: ChildRun, frame: wire.Trial, ref: _Reference,
                             *, detail: bool = True):
        """Check one candidate trial against its reference (``detail``: as in
        :func:`~services.worker.correctness.compare_output`).

        Raises:
            _Verdict: mismatch (values, shapes, dtypes, input modification, aliasing) or
                infrastructure (the task's inputs are not reproducible).
        """
        where = f"trial {frame.index} (seed {frame.seed})"
        if frame.seed != ref.seed:
            raise ProtocolError(f"trial {frame.index} ran seed {frame.seed}, not {ref.seed}")
        if frame.inputs_before != ref.inputs_before:
            raise _Verdict("infrastructure", f"the task's get_inputs() gave different inputs "
                           f"for seed {ref.seed} in the reference and candidate runs; it must "
                           "be deterministic under torch.manual_seed")
        for i, (got, want) in enumerate(zip(frame.inputs_after, ref.inputs_after,
                                            strict=False)):
            if got != want:
                raise _Verdict("mismatch", f"candidate modified input {i} in place during "
                               f"{where}; kernels must leave their inputs unchanged and write "
                               "only to tensors they allocate", trials=frame.index + 1)
        if frame.aliasing and not ref.aliasing:
            raise _Verdict("mismatch", f"{frame.aliasing[0]} in {where}; return new tensors "
                           "that the kernel wrote, not inputs or views of them",
                           trials=frame.index + 1)
        if len(frame.outputs) != len(ref.outputs):
            raise _Verdict("mismatch", f"ModelNew.forward returned {len(frame.outputs)} "
                           f"output(s); expected {len(ref.outputs)} in {where}",
                           trials=frame.index + 1)
        for i, (meta, want) in enumerate(zip(frame.outputs, ref.outputs, strict=True)):
            try:
                dtype = wire.dtype_from_name(meta.dtype)
            except ValueError as exc:
                raise ProtocolError(str(exc)) from None
            problem = check_meta(i, list(want.shape), want.dtype, meta.shape, dtype)
            if problem is not None:
                raise _Verdict("mismatch", f"{problem} in {where}", trials=frame.index + 1)
        outputs = []
        for meta in frame.outputs:
            data = await run.raw(meta.nbytes)
            if data is None:
                raise ProtocolError("the output stream ended early")
            outputs.append(_decode_tensor(meta, data))
        if len(frame.inputs) != len(ref.inputs_after):
            raise ProtocolError(f"trial {frame.index} described {len(frame.inputs)} inputs; "
                                f"the task has {len(ref.inputs_after)}")
        for i, meta in enumerate(frame.inputs):
            if meta is None:
                continue
            data = await run.raw(meta.nbytes)
            if data is None:
                raise ProtocolError("the input stream ended early")
            # Digested here, from bytes received: the candidate's process cannot vouch
            # for its own inputs (rule D001).
            digest = await asyncio.to_thread(_child._digest, _decode_tensor(meta, data))
            if digest != ref.inputs_after[i]:
                raise _Verdict("mismatch", f"candidate modified input {i} in place during "
                               f"{where}; kernels must leave their inputs unchanged and write "
                               "only to tensors they allocate", trials=frame.index + 1)
            empty = math.prod(meta.shape) == 0
            if empty:
                raise _Verdict("infrastructure", f"nothing to compare: input {i} has shape "
                               f"{tuple(meta.shape)} (no elements) in {where}; pass "
                               "shape_overrides with sizes above zero")
        comparison = await asyncio.to_thread(compare_outputs, ref.outputs, outputs,
                                             self.backend, detail=detail)
        if not comparison.passed:
            failed = comparison.first_failure
            details = "\n".join(o.message for o in comparison.outputs if o.message)
            fields: dict[str, Any] = {"trials": frame.index + 1, "log": details}
            if failed is not None:
                fields.update(max_abs_error=failed.max_abs_error,
                              max_rel_error=failed.max_rel_error,
                              mismatch_count=failed.mismatch_count,
                              mismatch_indices=failed.mismatch_indices,
                              atol=failed.tolerance.atol, rtol=failed.tolerance.rtol)
            raise _Verdict("mismatch", f"{comparison.message} in {where}", **fields)
        return comparison


async def _timed(clock: PhaseClock, name: str, work: Any) -> Any:
    """``await work``, adding its wall time to ``name`` on ``clock`` (a child run beside)."""
    started = time.monotonic()
    try:
        return await work
    finally:
        clock.add(name, time.monotonic() - started)


def _constant(t: torch.Tensor) -> bool:
    flat = t.reshape(-1)
    return flat.numel() == 0 or bool((flat == flat[0]).all())


def _reduced(value: int) -> int:
    """About 3/4 of ``value``, never a power of two (64 -> 48, 1024 -> 768, 16 -> 12)."""
    reduced = max(2, value * 3 // 4)
    return reduced + 1 if reduced & (reduced - 1) == 0 else reduced


def _sizes_text(sizes: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(sizes.items())) or "the task's own sizes"


def _max(a: float | None, b: float | None) -> float | None:
    if a is None:
        return b
    if b is None:
        return a
    return max(a, b)

