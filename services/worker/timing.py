"""The timing loop of the worker's children: how the reference times ``Model`` (eager,
compiled, the launch floor) and the planner times the candidate's ``forward``.

Runs inside a sandboxed child (:mod:`services.worker._reference`,
:mod:`services.worker._planner`); each timing is a :class:`~services.worker.wire.Timing`
frame the parent checks against the wall time it saw
(:meth:`services.worker.verifier.Verifier.check_timing`). The number of calls and the
L2 flush's size are the spec's :class:`~services.worker.wire.ChildParams`.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from typing import Any

import torch

from services.sandbox.child import accelerator, clip, device_of, synchronize
from services.sandbox.wire import ChildSpec
from services.worker.profiling import HARNESS_RANGE, TIMED_RANGE
from services.worker.wire import Timing, params_of


class _HostEvent:
    """A stand-in for ``torch.cuda.Event`` on the host clock (``time.perf_counter``), so
    the timing loop runs on ``cpu`` too (tests; no verdict times on cpu)."""

    def __init__(self, enable_timing: bool = True) -> None:
        self.at = 0.0

    def record(self) -> None:
        self.at = time.perf_counter()

    def synchronize(self) -> None:
        """Nothing to wait for: :meth:`record` read the host clock at once."""

    def elapsed_time(self, end: _HostEvent) -> float:
        return (end.at - self.at) * 1000.0  # milliseconds, like torch.cuda.Event


class _Host:
    Event = _HostEvent

    @staticmethod
    def synchronize() -> None:
        """Nothing to wait for: the host runs the calls synchronously."""


def time_forward(model: Any, args: list[Any], spec: ChildSpec,
                 profile: Any = None, harness: Any = contextlib.nullcontext) -> Timing:
    """Median device-event time of ``model(*args)``, microseconds.

    The spec's ``warmup`` untimed calls first (its
    :class:`~services.worker.wire.ChildParams`); before each of ``repeats`` timed calls
    a ``flush_bytes`` buffer is overwritten so the call starts with a cold L2
    (H100/H200 L2 is 50-60 MiB; 256 MiB is well above it). On ``cpu`` the host clock
    stands in for device events.

    ``profile``: None, or a function turning ``torch.profiler``'s events into launch
    records (:func:`services.worker.profiling.profiled_launches`, given the events and
    ``"cuda"`` or ``"cpu"``); then the timed calls themselves (not the warm-up) run under
    ``torch.profiler`` (CPU and, on a GPU, CUDA activities), each flush inside
    ``record_function(HARNESS_RANGE)`` and each call inside
    ``record_function(TIMED_RANGE)`` (:mod:`services.worker.profiling`), and the Timing
    carries the launches. A profiler that does not start or stop leaves ``launches``
    empty and says why in ``profiler_error`` (the samples stand).
    """
    params = params_of(spec)
    accel = accelerator(spec.backend) or _Host
    flush = torch.empty(params.flush_bytes, dtype=torch.uint8, device=device_of(spec.backend))
    start_wall = time.perf_counter()
    prof = None
    profiler_error = ""
    ranges = (contextlib.nullcontext, contextlib.nullcontext)
    with torch.no_grad():
        for _ in range(params.warmup):
            model(*args)
        accel.synchronize()
        samples = []
        if profile is not None:
            from torch.profiler import ProfilerActivity, record_function
            from torch.profiler import profile as torch_profile

            activities = [ProfilerActivity.CPU]
            if spec.backend == "cuda":
                activities.append(ProfilerActivity.CUDA)
            try:
                with harness():
                    prof = torch_profile(activities=activities)
                    prof.__enter__()
                ranges = (lambda: record_function(HARNESS_RANGE),
                          lambda: record_function(TIMED_RANGE))
            except Exception as exc:  # noqa: BLE001 - the timing stands without it
                prof, profiler_error = None, f"{type(exc).__name__}: {str(exc)[:300]}"
        try:
            for _ in range(params.repeats):
                with ranges[0]():
                    flush.fill_(0)
                begin = accel.Event(enable_timing=True)
                end = accel.Event(enable_timing=True)
                with ranges[1]():
                    begin.record()
                    model(*args)
                    end.record()
                end.synchronize()
                samples.append(begin.elapsed_time(end) * 1000.0)
        finally:
            launches = []
            if prof is not None:
                try:
                    accel.synchronize()
                    with harness():
                        prof.__exit__(None, None, None)
                        launches = profile(prof.events(), "cuda" if spec.backend == "cuda"
                                           else "cpu")
                except Exception as exc:  # noqa: BLE001 - the timing stands without it
                    profiler_error = f"{type(exc).__name__}: {str(exc)[:300]}"
    return Timing(median_us=statistics.median(samples), samples_us=samples,
                  wall_s=time.perf_counter() - start_wall, launches=launches,
                  profiled=prof is not None and not profiler_error,
                  profiler_error=profiler_error)


def time_compiled(model: Any, args: list[Any], spec: ChildSpec,
                  on_compiled: Any = None) -> Timing:
    """:func:`time_forward` of ``torch.compile(model)`` (default mode, Inductor), after
    one call that compiles it; labelled ``compile``. A compile that raises gives a
    Timing with ``error`` and no samples (the caller's verdict never depends on it).

    ``on_compiled``: called once the compile is done, before the timing loop (the
    reference child announces its ``profiling`` phase there, so the parent's wall-time
    check covers the timed calls, not the compile).
    """
    started = time.perf_counter()
    try:
        import torch._inductor.config as inductor_config

        # One process: the sandbox is no place for a pool of compile workers.
        inductor_config.compile_threads = 1
        compiled = torch.compile(model)
        with torch.no_grad():
            compiled(*args)
        synchronize(spec.backend)
    except Exception as exc:  # noqa: BLE001 - torch.compile on the task's code
        message = clip(f"{type(exc).__name__}: {exc}".strip(), 600)
        return Timing(median_us=0.0, samples_us=[], wall_s=time.perf_counter() - started,
                      label="compile", error=message)
    if on_compiled is not None:
        on_compiled()
    try:
        timing = time_forward(compiled, args, spec)
    except Exception as exc:  # noqa: BLE001 - the compiled code failed where eager ran
        message = clip(f"{type(exc).__name__}: {exc}".strip(), 600)
        return Timing(median_us=0.0, samples_us=[], wall_s=time.perf_counter() - started,
                      label="compile", error=f"the compiled Model failed: {message}")
    timing.label = "compile"
    return timing


def time_floor(spec: ChildSpec, profile: Any = None) -> Timing:
    """:func:`time_forward` of a one-element ``fill_`` (one kernel launch doing no work),
    labelled ``floor``: what the timing method gives the cheapest launch. Its
    ``launches`` are what the harness's own timing loop launches around a call that
    does nothing (the flushes, that fill)."""
    tiny = torch.empty(1, dtype=torch.float32, device=device_of(spec.backend))
    timing = time_forward(lambda: tiny.fill_(0), [], spec, profile=profile)
    timing.label = "floor"
    return timing
