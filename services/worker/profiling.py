"""What a profiled verification reports beyond its times: both speedups, the fraction of
the arch's peak, and the kernels the profiler saw in the candidate's timed calls.

Pure functions, used by the worker (:class:`services.worker.procedure.profile.Profile`)
on what the sandboxed children measured:

* :func:`speedups`: ``base / candidate`` for the eager and the ``torch.compile``
  baselines.
* :func:`peak_fraction`: achieved bytes/s over the arch's peak bandwidth, or FLOP/s
  over its dense peak, whichever fraction is larger.
* :func:`classify_launches`: the profiler's device activities of the timed calls,
  sorted into the candidate's Triton kernels, copies, kernels of allowlisted ATen
  operators, and forbidden kernels (stage ``audit``).

And one function the timing child runs, :func:`profiled_launches`, that turns
``torch.profiler``'s events into plain :class:`~services.worker.wire.ProfiledLaunch`
records (name, kind, the ATen operator that launched it, the harness range around it).

The ranges: the timing loop (:func:`services.worker.timing.time_forward`) runs each
L2 flush inside ``record_function(HARNESS_RANGE)`` and each timed call inside
``record_function(TIMED_RANGE)``. A CUDA kernel is linked by the profiler (its
correlation id) to the innermost ATen operator that launched it; that operator's
ancestors tell which range it ran in and which operator the candidate's code called
(the outermost one inside the range, the one the dispatcher's allowlist judged). A
Triton kernel is launched by Triton's launcher, outside any ATen operator: it has no
operator, and is recognised by its name (the kernel function's name).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from schemas.events import ProfiledKernel
from services.worker.targets import GpuTarget
from services.worker.wire import ProfiledLaunch

# record_function names of the timing loop (services/worker/timing.py, time_forward).
HARNESS_RANGE = "aikg::l2_flush"
TIMED_RANGE = "aikg::timed_call"
# Device activities that are not kernels a candidate chose to launch: the profiler's
# own annotations of user ranges on the device timeline, synchronisation and CUPTI
# overhead records (Kineto's activity type names, libkineto ActivityType).
_NOT_LAUNCHES = frozenset({"gpu_user_annotation", "user_annotation", "cuda_sync",
                           "overhead", "cuda_runtime", "cuda_driver", "cpu_op",
                           "python_function", "cpu_instant_event", "external_correlation"})
_COPY_TYPES = {"gpu_memcpy": "memcpy", "gpu_memset": "memset"}


def speedups(base_time_us: float, compile_time_us: float | None,
             gen_time_us: float) -> tuple[float, float | None]:
    """(``speedup_eager``, ``speedup_compile``): each baseline's median time over the
    candidate's, both microseconds; infinite when ``gen_time_us`` is not positive,
    ``speedup_compile`` None when there is no compiled baseline."""
    def ratio(base: float) -> float:
        return base / gen_time_us if gen_time_us > 0 else float("inf")

    return ratio(base_time_us), None if compile_time_us is None else ratio(compile_time_us)


def _peak_of(target: GpuTarget, dtype: str) -> float:
    """The dense peak FLOP/s a matrix product of ``dtype`` inputs is held to on ``target``.

    fp32 inputs are held to the larger of the fp32 and TF32 peaks (``tl.dot``'s default
    input precision on fp32 is TF32): the fraction never overstates a kernel that uses
    tensor cores. A dtype without a peak on the target is held to its largest peak.
    """
    peaks = target.peak_flops
    if dtype == "fp32":
        return max(peaks.get("fp32", 0.0), peaks.get("tf32", 0.0))
    return peaks.get(dtype) or max(peaks.values())


@dataclass(frozen=True)
class PeakFraction:
    """``fraction`` of the arch's peak (0..1 for a physically possible time) and
    ``bound``: ``memory`` (bytes/s over the peak bandwidth) or ``compute`` (FLOP/s over
    the dense peak)."""

    fraction: float
    bound: str


def peak_fraction(bytes_min: int, dot_flops: dict[str, int], time_us: float,
                  target: GpuTarget) -> PeakFraction | None:
    """The larger of ``(bytes_min / time) / bandwidth`` and ``(time the FLOPs need at
    peak) / time`` on ``target``.

    Args:
        bytes_min: the task's minimal traffic, bytes: each input and parameter read
            once, each output written once.
        dot_flops: matrix-product FLOPs by input dtype (``fp32``, ``tf32``, ``fp16``,
            ``bf16``, ``fp8``), as counted (empty: memory alone).
        time_us: the candidate's median time, microseconds.
        target: the arch (services/worker/targets.py: datasheet bandwidth and dense
            peaks).

    Returns:
        None when the time is not positive or the target has no bandwidth.
    """
    if not time_us > 0 or not target.bandwidth_bytes_s:
        return None
    seconds = time_us * 1e-6
    memory = (max(bytes_min, 0) / seconds) / target.bandwidth_bytes_s
    compute = 0.0
    if target.peak_flops:
        compute = sum(flops / _peak_of(target, dtype) for dtype, flops in dot_flops.items()
                      if flops > 0) / seconds
    if compute > memory:
        return PeakFraction(compute, "compute")
    return PeakFraction(memory, "memory")


# ---------------------------------------------------------------- the profiler's events


def _activity(event: Any) -> str:
    return str(getattr(event, "activity_type", "") or "").lower()


def _range_and_op(event: Any) -> tuple[str | None, str | None]:
    """(the harness range around ``event``, the outermost ATen operator inside it) by
    walking the profiler's CPU event tree up from ``event``."""
    op = None
    node = event
    while node is not None:
        name = node.name
        if name in (HARNESS_RANGE, TIMED_RANGE):
            return name, op
        if name.startswith("aten::"):
            op = name
        node = node.cpu_parent
    return None, op


def profiled_launches(events: Iterable[Any], device: str) -> list[ProfiledLaunch]:
    """The launches among ``torch.profiler``'s events (``prof.events()``), as plain records.

    ``device="cuda"``: every device activity that is a kernel, a memcpy or a memset
    (not the profiler's annotations or syncs), each with the range and the ATen
    operator of the CPU event it is linked to (``linked_correlation_id``: the
    innermost operator open when it was launched; none for a Triton kernel, launched
    outside any operator). ``device="cpu"``: the innermost ATen operators inside the
    harness's ranges, each its own launch (what runs on the host), with the outermost
    operator of its range as its ``op``.
    """
    events = list(events)
    launches: list[ProfiledLaunch] = []
    if device == "cpu":
        for event in events:
            if (event.name.startswith("aten::") and not event.cpu_children
                    and str(getattr(event, "device_type", "")).endswith("CPU")):
                where, op = _range_and_op(event)
                if where is not None:
                    launches.append(ProfiledLaunch(
                        name=event.name, kind="kernel", op=op, region=where,
                        device_us=float(getattr(event, "self_cpu_time_total", 0.0) or 0.0)))
        return launches
    by_id: dict[int, Any] = {}
    for event in events:
        if str(event.device_type).endswith("CPU") and not getattr(event, "is_async", False):
            by_id.setdefault(event.id, event)
    for event in events:
        if str(event.device_type).endswith("CPU") or getattr(event, "is_user_annotation",
                                                             False):
            continue
        activity = _activity(event)
        if activity in _NOT_LAUNCHES:
            continue
        kind = _COPY_TYPES.get(activity) or (
            "memcpy" if event.name.startswith("Memcpy") else
            "memset" if event.name.startswith("Memset") else "kernel")
        linked = by_id.get(getattr(event, "linked_correlation_id", 0) or -1)
        where, op = _range_and_op(linked) if linked is not None else (None, None)
        span = event.time_range
        launches.append(ProfiledLaunch(name=event.name, kind=kind, op=op, region=where,
                                       device_us=float(span.end - span.start)))
    return launches


@dataclass(frozen=True)
class KernelAudit:
    """What :func:`classify_launches` found: ``kernels`` (what the result lists, by
    name and kind), ``forbidden`` (those of kind ``forbidden``), ``harness`` (launches
    of the harness's own flush, not listed)."""

    kernels: list[ProfiledKernel]
    forbidden: list[ProfiledKernel]
    harness: int

    def message(self) -> str | None:
        """The audit failure naming the forbidden kernels, or None when there is none."""
        if not self.forbidden:
            return None
        shown = "; ".join(f"{k.name!r} x{k.count}" + (f" (launched by {k.op})" if k.op else "")
                          for k in self.forbidden[:3])
        more = f" (+{len(self.forbidden) - 3} more)" if len(self.forbidden) > 3 else ""
        return (f"the profiler saw non-Triton compute kernels in the timed calls: {shown}{more}; "
                "only the candidate's Triton kernels, copies, memsets and allowlisted "
                "operators (fills, layout and dtype copies) may run in ModelNew.forward")


def _is_triton(name: str, triton: set[str]) -> bool:
    """Whether a device kernel's ``name`` is one of the Triton kernels ``triton``: the
    function's name (Triton 3) or it with Triton 2's signature suffix
    (``add_kernel_0d1d2d``)."""
    if name in triton:
        return True
    base, sep, suffix = name.rpartition("_")
    return bool(sep) and base in triton and suffix[:1].isdigit() and suffix.isalnum()


def _op_packet(op: str) -> str:
    """``aten::fill_`` -> ``fill_``."""
    return op.removeprefix("aten::").split(".")[0]


def classify_launches(launches: Iterable[ProfiledLaunch], triton_names: Iterable[str],
                      allowed_ops: Iterable[str], calls: int,
                      harness_names: Iterable[str] = ()) -> KernelAudit:
    """Sort the timed calls' launches (:func:`profiled_launches`) by kind.

    * launched inside the harness's flush range (:data:`HARNESS_RANGE`), or with no
      operator and a name in ``harness_names`` (the flush's kernels when the profiler
      linked none): the harness's own, not listed;
    * a memcpy or memset: ``copy``;
    * launched by an ATen operator (the outermost one the candidate's code called):
      ``op`` when its packet (``fill_``, ``copy_``, ``_to_copy`` ...) is in
      ``allowed_ops`` (services/worker/rules.py, ALLOWED_OPS: the dispatcher's
      allowlist), else ``forbidden``;
    * no operator and a name in ``triton_names`` (the candidate's Triton kernels):
      ``triton``; any other: ``forbidden`` (a kernel the candidate launched some other
      way: a library, another compiler).

    ``calls``: how many timed calls the launches cover (reported per kernel).
    """
    triton = set(triton_names)
    allowed = set(allowed_ops)
    harness_set = set(harness_names)
    groups: dict[tuple[str, str, str | None], list[float]] = {}
    harness = 0
    for launch in launches:
        if launch.region == HARNESS_RANGE or (
                launch.op is None and launch.region is None and launch.name in harness_set):
            harness += 1
            continue
        if launch.kind in ("memcpy", "memset"):
            kind = "copy"
        elif launch.op is not None:
            kind = "op" if _op_packet(launch.op) in allowed else "forbidden"
        else:
            kind = "triton" if _is_triton(launch.name, triton) else "forbidden"
        groups.setdefault((launch.name, kind, launch.op), []).append(launch.device_us)
    kernels = [ProfiledKernel(name=name, count=len(times), calls=calls, kind=kind, op=op,
                              device_time_us=round(sum(times) / len(times), 3))
               for (name, kind, op), times in groups.items()]
    order = {"forbidden": 0, "triton": 1, "op": 2, "copy": 3}
    kernels.sort(key=lambda k: (order[k.kind], -k.count, k.name))
    return KernelAudit(kernels=kernels, forbidden=[k for k in kernels if k.kind == "forbidden"],
                       harness=harness)


def missing_launches(kernels: Iterable[ProfiledKernel], planned: dict[str, int],
                     calls: int) -> str | None:
    """A message when the profiler recorded fewer launches of a Triton kernel than the
    verified plan makes (``planned``: launches per call, by kernel name) over ``calls``
    timed calls (the timed run did not run what was verified, or the profiler was
    blinded), else None."""
    seen: dict[str, int] = {}
    triton = [k for k in kernels if k.kind == "triton"]
    for name in planned:
        seen[name] = sum(k.count for k in triton if _is_triton(k.name, {name}))
    for name, per_call in sorted(planned.items()):
        if seen.get(name, 0) < per_call * calls:
            return (f"the profiler recorded {seen.get(name, 0)} launches of the Triton kernel "
                    f"{name!r} over {calls} timed calls; the verified plan launches it "
                    f"{per_call} time(s) per call: a candidate must time what it computes")
    return None
