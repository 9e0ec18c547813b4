"""Profiling, a step of a verification that passed on a GPU: the candidate, the eager
and the ``torch.compile`` baselines and the launch floor timed on the leased device.

With ``mode="profile"`` on a GPU backend, :class:`Profile` (a step of
:class:`~services.worker.procedure.core.Procedure`, after the trials and the compile
check) has the candidate's child time ``ModelNew`` with its launches running, and the
reference child time ``Model`` (a baseline the verifier's
:class:`~services.worker.procedure.host.Baselines` keep per task, arch and shapes, in
this process and in the shared ``baselines`` bucket; ``VerifyResult.baseline_source``
/ ``baseline_age_s`` say which and how old) on the same device: warm-up, L2 flush,
device events, median of repeats. A child's reported total time must fit in the wall
time this process observed (:func:`check_timing`), and the timed run must launch what
the verified plan launched. The candidate's timed calls run under ``torch.profiler``:
the kernels it recorded are listed (``profiled_kernels``) and a non-Triton compute
kernel among them fails at ``audit`` (:mod:`services.worker.profiling`). Beside the
eager baseline: the reference compiled with ``torch.compile`` (cached the same way;
``speedup_compile``, never a failure), the launch floor (``launch_floor_us``) and the
fraction of the arch's peak (``peak_fraction``).

Speedups above the verifier's ``speedup_flag_bound`` keep ``passed=True`` (the numbers
matched) but ``error`` starts with ``flagged:`` (:func:`speedup_fields`).
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any

from schemas.events import ProfiledKernel, utcnow
from services.worker import profiling, wire
from services.worker.cache import CACHE_LOOKUPS, BaselineOrigin
from services.worker.children import ChildFailed
from services.worker.procedure.host import Baselines, Limits
from services.worker.procedure.outcome import Timings, Verdict
from services.worker.procedure.state import RunState
from services.worker.rules import ALLOWED_OPS, impossible_timing
from services.worker.targets import target_for

# A child's reported timing total may exceed the wall time seen here by this much
# (clock granularity, frame latency) before it counts as inconsistent.
_TIMING_SLACK = 1.05
_TIMING_SLACK_US = 500.0
# What a profile leaves of the request's timeout_s when it waits for the compiled
# baseline, seconds: the verdict after it (audit, outcome) still has to be sent.
_COMPILE_MARGIN_S = 10.0
# aikg_worker_cache_lookups_total's result label of each baseline origin.
_LOOKUP_RESULT: dict[BaselineOrigin, str] = {
    "measured": "miss", "shared_cache": "shared", "worker_cache": "worker"}


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


def check_timing(timing: wire.Timing, since: float | None, who: str,
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


class Profile:
    """The profile of one verification (``state``) that passed, on the verifier's
    ``limits`` (backend, speedup bound, compile timeout), its ``baselines`` kept."""

    def __init__(self, state: RunState, limits: Limits, baselines: Baselines) -> None:
        self.state = state
        self.limits = limits
        self.baselines = baselines

    async def run(self) -> Timings:
        """Time the candidate (its launches running, under ``torch.profiler``), the eager
        and the ``torch.compile`` baselines and the launch floor on this device: median
        times, microseconds, both speedups (:func:`speedup_fields`), the fraction of the
        arch's peak and the kernels the profiler recorded.

        Raises:
            Verdict: (audit) the timed run launched other kernels than the verified
                plan, a non-Triton compute kernel ran in its timed calls, or its timing
                is impossible; (infrastructure) no timing came.
        """
        request = self.state.request
        ref = self.state.ref
        base, origin = await self.baselines.cached_baseline(request)
        # One part per command: each check reads the phase start of its own part.
        if base is None:
            await ref.send(wire.RefProfile(key="main"))
            timing, _ = await ref.get("timing")
            check_timing(timing, ref.profiling_at, "the reference Model",
                         stage="infrastructure")
            base = await self.baselines.keep_baseline(request, "eager", timing.median_us)
            origin = "measured"
        await ref.send(wire.RefProfile(key="main", eager=False, floor=True))
        floor, _ = await ref.get("timing", "floor")
        check_timing(floor, ref.profiling_at, "the launch floor", stage="infrastructure")
        CACHE_LOOKUPS.labels(backend=self.limits.backend, arch=request.arch, kind="baseline",
                             result=_LOOKUP_RESULT[origin]).inc()
        first = self.state.first_call
        assert first is not None and first.traced is not None and first.real is not None
        planner = self.state.planner
        await planner.send(wire.PlanProfile(model="main"), answers=2)
        timed, _ = await planner.get("dry", "profile")
        planned_events = [e for e in first.traced[0].events
                          if isinstance(e, dict) and "launch" in e]
        planned = [(e.get("launch"), e.get("grid")) for e in planned_events]
        ran = [(e.get("launch"), e.get("grid")) for e in timed.launches]
        if planned != ran:
            raise Verdict("audit", "the timed run launched other kernels than the verified "
                          f"one ({ran[:3]} against {planned[:3]}): a candidate must time what "
                          "it computes", trials=self.state.compared)
        timing, _ = await planner.get("timing")
        check_timing(timing, planner.profiling_at, "the candidate", stage="audit")
        kernels = self._kernel_audit(timing, planned_events,
                                     harness={launch.name for launch in floor.launches})
        inputs = self.state.sizes["main"].input_bytes
        real = first.real[0]
        outputs = sum(m.nbytes for m in real.outputs)
        impossible = impossible_timing(timing.median_us, inputs + outputs, request.arch)
        if impossible is not None:
            raise Verdict("audit", f"{impossible}; the kernel skips work or games the timer",
                          gen_time_us=timing.median_us, trials=self.state.compared)
        eager_count = await self.state.eager_count()
        compiled = await self._compiled_baseline()
        params = sum(size for _, size in first.traced[0].captures)
        fraction = profiling.peak_fraction(
            inputs + params + outputs, dict(eager_count.dot_flops) if eager_count else {},
            timing.median_us, target_for(request.arch))
        return speedup_fields(
            base.median_us, timing.median_us, self.limits.speedup_flag_bound,
            compile_time_us=compiled, launch_floor_us=floor.median_us,
            peak_fraction=round(fraction.fraction, 6) if fraction else None,
            peak_bound=fraction.bound if fraction else None, profiled_kernels=kernels,
            baseline_source=origin, baseline_age_s=round(
                max(0.0, (utcnow() - base.measured_at).total_seconds()), 3))

    def _kernel_audit(self, timing: wire.Timing,
                      planned_events: list[dict[str, Any]],
                      harness: set[str]) -> list[ProfiledKernel] | None:
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
            self.state.notes.append("profiled_kernels: the profiler recorded nothing"
                                    + (f" ({timing.profiler_error})" if timing.profiler_error
                                       else ""))
            return None
        calls = len(timing.samples_us)
        triton = {str(e["launch"]) for e in planned_events} | set(self.state.kernels.kernels)
        audit = profiling.classify_launches(timing.launches, triton, ALLOWED_OPS, calls,
                                            harness_names=harness - triton)
        problem = audit.message()
        if problem is None and self.limits.backend == "cuda":
            planned: dict[str, int] = {}
            for event in planned_events:
                if math.prod(event.get("grid") or [1]) > 0:
                    planned[event["launch"]] = planned.get(event["launch"], 0) + 1
            problem = profiling.missing_launches(audit.kernels, planned, calls)
        if problem is not None:
            raise Verdict("audit", problem, gen_time_us=timing.median_us,
                          profiled_kernels=audit.kernels, trials=self.state.compared)
        return audit.kernels

    async def _compiled_baseline(self) -> float | None:
        """The ``torch.compile`` baseline's median time, microseconds (cached like the
        eager one), or None with a note: turned off, failed, or not finished within
        ``compile_timeout_s`` (and what is left of the request's ``timeout_s``). Never
        raises for the compile: the candidate's verdict does not depend on it."""
        request = self.state.request
        if not self.limits.compile_timeout_s:
            return None
        base, origin = await self.baselines.cached_baseline(request, kind="compile")
        if base is not None and not base.error:
            CACHE_LOOKUPS.labels(backend=self.limits.backend, arch=request.arch,
                                 kind="compile", result=_LOOKUP_RESULT[origin]).inc()
            return base.median_us
        if base is not None:
            self.state.notes.append(f"speedup_compile: torch.compile failed on the reference "
                                    f"Model: {base.error}")
            return None
        CACHE_LOOKUPS.labels(backend=self.limits.backend, arch=request.arch, kind="compile",
                             result="miss").inc()
        loop = asyncio.get_running_loop()
        left = (self.state.deadline - loop.time() - _COMPILE_MARGIN_S
                if self.state.deadline is not None else self.limits.compile_timeout_s)
        wait = min(self.limits.compile_timeout_s, left)
        if wait <= 0:
            self.state.notes.append("speedup_compile: no time left in the request's timeout_s "
                                    "for the torch.compile baseline")
            return None
        ref = self.state.ref
        try:
            async with asyncio.timeout(wait):
                await ref.send(wire.RefProfile(key="main", eager=False, compile=True))
                timing, _ = await ref.get("timing", "compile")
        except TimeoutError:
            # Nothing else is asked of the reference now: stop its compile.
            ref.run.kill()
            self.state.notes.append(f"speedup_compile: the torch.compile baseline did not "
                                    f"finish within {wait:.0f} s (setting "
                                    "AIKG_PROFILE_COMPILE_TIMEOUT_S)")
            return None
        except ChildFailed as exc:
            self.state.notes.append(f"speedup_compile: the reference process failed while "
                                    f"compiling: {exc.message}")
            return None
        if timing.error:
            await self.baselines.keep_baseline(request, "compile", 0.0, error=timing.error)
            self.state.notes.append(f"speedup_compile: torch.compile failed on the reference "
                                    f"Model: {timing.error}")
            return None
        try:
            check_timing(timing, ref.profiling_at, "the compiled reference Model")
        except Verdict as verdict:
            self.state.notes.append(f"speedup_compile: {verdict.outcome.fields.error}")
            return None
        return (await self.baselines.keep_baseline(request, "compile", timing.median_us)).median_us
