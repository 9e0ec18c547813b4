"""The computations of a profiled verdict (services/worker/profiling.py): both speedups,
the fraction of the arch's peak, and the sorting of the profiler's launches, on
injected timings and launch lists; then the timing loop's profiler on a real CPU region.
"""

from __future__ import annotations

import math

import pytest
import torch

from services.sandbox.wire import ChildSpec, command_decoder, encode_frame, frame_decoder
from services.worker import profiling, wire
from services.worker import timing as worker_timing
from services.worker.procedure import Outcome
from services.worker.procedure.profile import speedup_fields
from services.worker.profiling import (
    HARNESS_RANGE,
    TIMED_RANGE,
    classify_launches,
    missing_launches,
    peak_fraction,
    profiled_launches,
    speedups,
)
from services.worker.rules import ALLOWED_OPS
from services.worker.targets import TARGETS
from services.worker.wire import ProfiledLaunch

H200 = TARGETS["h200"]


def test_both_speedups_are_base_over_candidate():
    assert speedups(100.0, 40.0, 20.0) == (5.0, 2.0)
    assert speedups(100.0, None, 20.0) == (5.0, None)
    assert speedups(100.0, 40.0, 0.0) == (math.inf, math.inf)


def test_speedup_fields_keep_speedup_as_the_eager_one():
    timings = speedup_fields(300.0, 100.0, 50.0, compile_time_us=150.0, launch_floor_us=4.0)
    assert (timings.speedup, timings.speedup_eager, timings.speedup_compile) == (3.0, 3.0, 1.5)
    timed = Outcome(passed=True, trials=3).timed(timings).fields
    assert (timed.speedup, timed.speedup_eager, timed.speedup_compile,
            timed.compile_time_us, timed.launch_floor_us) == (3.0, 3.0, 1.5, 150.0, 4.0)
    # The flag stays on the eager speedup; no compiled baseline leaves its speedup None.
    flagged = speedup_fields(1000.0, 10.0, 50.0)
    assert flagged.flag.startswith("flagged: speedup 100.0") and flagged.speedup_compile is None


def test_peak_fraction_of_a_memory_bound_kernel():
    # 4.8e9 bytes in 2 s on an h200 (4.8 TB/s): 0.5e-3 of the peak ... scaled: 4.8 GB in
    # 2 ms is 2.4 TB/s, half the peak.
    got = peak_fraction(4_800_000_000, {}, 2000.0, H200)
    assert got.bound == "memory" and got.fraction == pytest.approx(0.5)


def test_peak_fraction_of_a_compute_bound_matmul():
    # 4096^3 fp16 matmul: 2 * 4096^3 FLOPs; at 989.4 TFLOP/s that takes ~139 us; in
    # 278 us the kernel reaches half the peak, and its 3 x 32 MiB are far below memory.
    flops = 2 * 4096 ** 3
    at_peak_us = flops / H200.peak_flops["fp16"] * 1e6
    got = peak_fraction(3 * 4096 * 4096 * 2, {"fp16": flops}, 2 * at_peak_us, H200)
    assert got.bound == "compute" and got.fraction == pytest.approx(0.5)


def test_fp32_products_are_held_to_the_tensor_core_peak():
    flops = 10 ** 12
    got = peak_fraction(0, {"fp32": flops}, 1e6, H200)  # 1 TFLOP/s
    assert got.fraction == pytest.approx(1e12 / H200.peak_flops["tf32"])


def test_peak_fraction_without_a_time_or_a_bandwidth_is_none():
    assert peak_fraction(1 << 20, {}, 0.0, H200) is None
    from services.worker.targets import GpuTarget

    assert peak_fraction(1 << 20, {}, 10.0, GpuTarget("x", 90, 1, 1)) is None


def _launch(name, op=None, region=TIMED_RANGE, kind="kernel", us=1.0):
    return ProfiledLaunch(name=name, kind=kind, op=op, region=region, device_us=us)


def test_launches_are_sorted_into_triton_copies_allowed_ops_and_forbidden():
    calls = 2
    launches = []
    for _ in range(calls):
        launches += [
            _launch("at::native::vectorized_elementwise_kernel<FillFunctor<unsigned char>>",
                    op="aten::fill_", region=HARNESS_RANGE),
            _launch("fused_gelu_kernel", us=10.0),
            _launch("Memcpy DtoD (Device -> Device)", kind="memcpy"),
            _launch("at::native::vectorized_elementwise_kernel<FillFunctor<float>>",
                    op="aten::zeros"),
            _launch("ampere_sgemm_128x64_nn", op="aten::mm"),
        ]
    launches.append(_launch("cutlass_gemm_from_a_library"))
    audit = classify_launches(launches, {"fused_gelu_kernel"}, ALLOWED_OPS, calls)
    kinds = {k.name: (k.kind, k.count, k.op) for k in audit.kernels}
    assert kinds["fused_gelu_kernel"] == ("triton", 2, None)
    assert kinds["Memcpy DtoD (Device -> Device)"][0] == "copy"
    assert kinds["at::native::vectorized_elementwise_kernel<FillFunctor<float>>"] == (
        "op", 2, "aten::zeros")
    assert kinds["ampere_sgemm_128x64_nn"] == ("forbidden", 2, "aten::mm")
    assert kinds["cutlass_gemm_from_a_library"] == ("forbidden", 1, None)
    # The harness's flush is not listed; every kernel says over how many calls it counts.
    assert audit.harness == 2 and not any("unsigned char" in k.name for k in audit.kernels)
    assert all(k.calls == calls for k in audit.kernels)
    assert audit.kernels[0].kind == "forbidden"
    message = audit.message()
    assert "'ampere_sgemm_128x64_nn' x2 (launched by aten::mm)" in message
    assert "cutlass_gemm_from_a_library" in message


def test_an_honest_timed_region_has_no_forbidden_kernel():
    launches = [_launch("relu_kernel", us=3.0), _launch("relu_kernel", us=5.0),
                _launch("direct_copy_kernel_cuda", op="aten::contiguous")]
    audit = classify_launches(launches, {"relu_kernel"}, ALLOWED_OPS, 2)
    assert audit.message() is None and audit.forbidden == []
    relu = audit.kernels[0]
    assert (relu.name, relu.kind, relu.count, relu.device_time_us) == ("relu_kernel", "triton",
                                                                       2, 4.0)


def test_unlinked_flush_kernels_are_recognised_by_name_and_old_triton_names_match():
    flush = "at::native::vectorized_elementwise_kernel<FillFunctor<unsigned char>>"
    launches = [_launch(flush, region=None), _launch("add_kernel_0d1d2d3de", region=None)]
    audit = classify_launches(launches, {"add_kernel"}, ALLOWED_OPS, 1, harness_names={flush})
    assert audit.harness == 1 and audit.message() is None
    assert audit.kernels[0].kind == "triton"
    # A name that only starts like a kernel's is not that kernel.
    odd = classify_launches([_launch("add_kernelx", region=None)], {"add_kernel"},
                            ALLOWED_OPS, 1)
    assert odd.forbidden and odd.forbidden[0].name == "add_kernelx"


def test_fewer_triton_launches_than_the_plan_makes_are_named():
    audit = classify_launches([_launch("k1")] * 3 + [_launch("k2")] * 4, {"k1", "k2"},
                              ALLOWED_OPS, 2)
    assert missing_launches(audit.kernels, {"k2": 2}, 2) is None
    problem = missing_launches(audit.kernels, {"k1": 2, "k2": 2}, 2)
    assert "recorded 3 launches of the Triton kernel 'k1' over 2 timed calls" in problem


def test_the_timing_loop_profiles_a_real_cpu_region():
    """The harness's timed loop with torch.profiler on the CPU: the flush is the
    harness's, the operators of the timed calls are attributed to what the code called."""
    def forward(x):
        scratch = torch.zeros_like(x)     # an allocation: allowed
        y = x.contiguous()                # a layout copy: allowed
        return torch.relu(y) + scratch    # compute in PyTorch: forbidden

    spec = ChildSpec(role="candidate", scratch_dir="/tmp",
                     params={"warmup": 1, "repeats": 3, "flush_bytes": 4096})
    timing = worker_timing.time_forward(forward, [torch.randn(256)], spec,
                                        profile=profiled_launches)
    assert timing.profiled and not timing.profiler_error and len(timing.samples_us) == 3
    assert {launch.region for launch in timing.launches} == {HARNESS_RANGE, TIMED_RANGE}
    audit = classify_launches(timing.launches, set(), ALLOWED_OPS, 3)
    assert audit.harness == 3
    forbidden = {k.op for k in audit.forbidden}
    assert forbidden == {"aten::relu", "aten::add"}
    assert all(k.count == 3 and k.calls == 3 for k in audit.forbidden)
    allowed = {k.op for k in audit.kernels if k.kind == "op"}
    assert "aten::zeros_like" in allowed
    assert "aten::relu" in audit.message()
    # Without a profiler the loop is what it was: samples and no launches.
    plain = worker_timing.time_forward(forward, [torch.randn(256)], spec)
    assert not plain.profiled and plain.launches == [] and len(plain.samples_us) == 3


def test_a_compile_that_fails_is_a_timing_with_an_error():
    spec = ChildSpec(role="reference", scratch_dir="/tmp",
                     params={"warmup": 1, "repeats": 2, "flush_bytes": 1024})
    timing = worker_timing.time_compiled(object(), [], spec)
    assert timing.label == "compile" and timing.samples_us == [] and timing.error


def test_the_launch_floor_is_a_labelled_timing_of_one_tiny_launch():
    spec = ChildSpec(role="reference", scratch_dir="/tmp",
                     params={"warmup": 1, "repeats": 3, "flush_bytes": 1024})
    floor = worker_timing.time_floor(spec, profile=profiled_launches)
    assert floor.label == "floor" and len(floor.samples_us) == 3 and floor.median_us > 0
    assert {launch.op for launch in floor.launches} == {"aten::fill_"}


def test_profiled_launches_read_cuda_device_events():
    """The CUDA branch on event objects shaped as torch.profiler's FunctionEvents (a
    GPU's event list cannot be recorded on a CPU machine)."""
    class Range:
        def __init__(self, start, end):
            self.start, self.end = start, end

    class Event:
        def __init__(self, name, device_type, id_=0, linked=0, parent=None,
                     activity="cpu_op", annotation=False, span=(0.0, 0.0)):
            self.name, self.device_type, self.id = name, device_type, id_
            self.linked_correlation_id, self.cpu_parent = linked, parent
            self.activity_type, self.is_user_annotation = activity, annotation
            self.is_async, self.time_range = False, Range(*span)

    flush_range = Event(HARNESS_RANGE, "DeviceType.CPU", 1, activity="user_annotation")
    fill = Event("aten::fill_", "DeviceType.CPU", 2, parent=flush_range)
    call = Event(TIMED_RANGE, "DeviceType.CPU", 3, activity="user_annotation")
    zeros = Event("aten::zeros", "DeviceType.CPU", 4, parent=call)
    inner = Event("aten::fill_", "DeviceType.CPU", 5, parent=zeros)
    events = [
        flush_range, fill, call, zeros, inner,
        Event("FillFunctor<unsigned char>", "DeviceType.CUDA", linked=2, activity="kernel"),
        Event("FillFunctor<float>", "DeviceType.CUDA", linked=5, activity="kernel",
              span=(10.0, 12.5)),
        Event("relu_kernel", "DeviceType.CUDA", activity="kernel"),
        Event("Memset (Device)", "DeviceType.CUDA", activity="gpu_memset"),
        Event(TIMED_RANGE, "DeviceType.CUDA", activity="gpu_user_annotation", annotation=True),
    ]
    got = profiled_launches(events, "cuda")
    assert [(g.name, g.kind, g.op, g.region) for g in got] == [
        ("FillFunctor<unsigned char>", "kernel", "aten::fill_", HARNESS_RANGE),
        ("FillFunctor<float>", "kernel", "aten::zeros", TIMED_RANGE),
        ("relu_kernel", "kernel", None, None),
        ("Memset (Device)", "memset", None, None),
    ]
    assert got[1].device_us == 2.5
    audit = profiling.classify_launches(got, {"relu_kernel"}, ALLOWED_OPS, 1)
    assert audit.message() is None and audit.harness == 1


def test_profile_frames_cross_the_wire():
    """The new frames and commands encode and decode as the channel carries them, and
    the worker keys each labelled timing apart."""
    from services.worker.children import _key

    timing = wire.Timing(median_us=3.0, samples_us=[3.0, 3.0], wall_s=0.01, label="floor",
                         launches=[_launch("relu_kernel")], profiled=True)
    decoded = frame_decoder("reference").decode(encode_frame(timing))
    assert decoded == timing and decoded.launches[0].name == "relu_kernel"
    assert _key(decoded) == ("timing", "floor")
    assert _key(wire.Timing(median_us=1.0, samples_us=[1.0], wall_s=0.1)) == ("timing",)
    command = wire.RefProfile(key="main", eager=False, compile=True)
    assert command_decoder("reference").decode(encode_frame(command)) == command
    # A command that names no parts means the eager baseline alone.
    plain = command_decoder("reference").decode(encode_frame(wire.RefProfile(key="main")))
    assert (plain.eager, plain.floor, plain.compile) == (True, False, False)


def test_a_childs_parameters_and_commands_read_after_the_harness_is_hidden():
    """The planner times on a GPU after hiding the harness's modules
    (guard.hide_harness): the spec's timing parameters and its commands must still
    decode there, read for the first time (a fresh process)."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        from services.sandbox import guard
        from services.sandbox.wire import ChildSpec, command_decoder, encode_frame
        from services.worker import wire
        spec = ChildSpec(role="candidate", scratch_dir="/tmp", params={"repeats": 2})
        command = encode_frame(wire.PlanProfile(model="main"))
        guard.hide_harness()
        print(wire.params_of(spec).repeats, command_decoder("candidate").decode(command).model)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["2", "main"]


@pytest.mark.slow  # a fork server of its own
def test_the_profiled_loop_runs_under_the_candidates_compute_block():
    """In the candidate's process PyTorch compute is refused at the dispatcher before the
    timed run: the profiler's start, stop and reading must not need it (a fresh process,
    since the block cannot be lifted)."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        import torch
        from services.sandbox.wire import ChildSpec
        from services.worker import enforce, timing as worker_timing
        from services.worker.profiling import profiled_launches
        enforce.block_compute("cpu")
        try:
            torch.relu(torch.ones(2))
            raise SystemExit("compute was not refused")
        except RuntimeError:
            pass
        spec = ChildSpec(role="candidate", scratch_dir="/tmp",
                         params={"warmup": 1, "repeats": 2, "flush_bytes": 1024})
        timing = worker_timing.time_forward(lambda x: x.contiguous().clone(), [torch.ones(8)],
                                            spec, profile=profiled_launches)
        assert timing.profiled, timing.profiler_error
        print(sorted({launch.op for launch in timing.launches}))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "aten::clone" in done.stdout and "aten::fill_" in done.stdout
