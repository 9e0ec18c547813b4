"""Counted memory traffic and FLOPs of a verified call, and a GPU time model built on them.

What is **counted** (the replayer child, :mod:`services.worker.replay`, on the cpu
backend where Triton runs in its interpreter): for every kernel launch of the call,
the bytes its loads read and its stores and atomics wrote (masked-off lanes excluded:
each active lane counts its element's bytes), the FLOPs of its ``tl.dot`` calls
(``2 * M * N * K`` each) and of its floating-point element-wise operations (one per
lane of the block, masked lanes included: the interpreter computes them, as a GPU
does); and for every operator of the plan that runs a kernel in eager PyTorch (a copy,
a fill: not a view, not an ``empty``), the bytes it reads and writes. The counter is
the replayer's own (the interpreter's memory entry points and builder, wrapped before
the candidate's kernel module is loaded); the candidate's Python never runs in that
process, and a kernel that reached for it could not compile for a GPU (stage
``compile``). The parent cross-checks what it can (:func:`check_counts`).

What is **modeled** (never measured), two models on one
:class:`~services.worker.targets.GpuTarget`:

- the **roofline** (:func:`modeled_time_us`, also :func:`roofline_time_us`), the
  verdict's ``modeled_time_us`` (what evolve ranks by) ``= max(bytes / bandwidth, dot
  FLOPs / tensor-core peak) + launches x launch overhead``: every byte counted comes
  from device memory, every FLOP runs at the peak;
- the **tile model** (:func:`launch_model`, :func:`tile_time_us`), the verdict's
  ``tile_time_us`` beside it: per launch, the bytes its programs re-read within one wave
  of resident programs are served from L2, and across waves too while the launch's
  distinct bytes fit in L2 (:data:`~services.worker.targets.L2_CACHE`); achieved
  bandwidth scales with the warps resident per SM (occupancy) and the loads a
  software pipeline keeps in flight; tensor-core throughput with the ``tl.dot`` tile's
  operand bytes per FLOP read from shared memory and with occupancy; register spills
  cost local-memory traffic. See :func:`launch_model` for each term and its source.

Both model the task's eager ATen graph the same way (:class:`EagerCounter` in the
reference child: each operator's tensor inputs read once and outputs written once,
matmul-family FLOPs from ``torch.utils.flop_counter``, one launch per operator that is
not a view; the tile model takes eager's kernels at full occupancy and peak tensor
throughput, vendor libraries' tuned tiles). Not modeled: L1 and shared-memory reuse
beyond a ``tl.dot`` tile, coalescing, bank conflicts, the order programs are scheduled
in (re-reads are taken as spread evenly over the launch's waves), a grid smaller than
the device (taken as filling it, as eager's operators are), overlap of launches,
element-wise FLOPs (taken as hidden behind memory traffic).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from schemas.events import EagerCount, LaunchTraffic, Traffic
from services.worker.targets import WARP_SIZE, GpuTarget, l2_cache

__all__ = ["ELEMENTWISE_FLOPS", "EagerCount", "EagerCounter", "LaunchModel", "LaunchTraffic",
           "Traffic", "check_counts", "dot_dtype", "eager_tile_time_us", "gemm_launch",
           "launch_model", "modeled_time_us", "op_traffic", "roofline_time_us", "summarize",
           "tensor_bytes", "tile_time_us"]

# The interpreter's builder methods that compute floating-point element-wise results,
# with FLOPs per lane (Triton's interpreter, triton/runtime/interpreter.py,
# InterpreterBuilder: create_fadd ... create_fma).
ELEMENTWISE_FLOPS: dict[str, int] = {
    **{name: 1 for name in (
        "create_fadd", "create_fsub", "create_fmul", "create_fdiv", "create_frem",
        "create_fneg", "create_precise_divf", "create_approx_divf", "create_minimumf",
        "create_maximumf", "create_minnumf", "create_maxnumf", "create_exp", "create_exp2",
        "create_log", "create_log2", "create_sqrt", "create_precise_sqrt", "create_rsqrt",
        "create_sin", "create_cos", "create_erf", "create_fabs", "create_floor",
        "create_ceil")},
    "create_fma": 2,
}


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of the elements a tensor view covers (``numel x element size``)."""
    return t.numel() * t.element_size()


def _tensors(tree: Any) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, (list, tuple)):
        return [t for item in tree for t in _tensors(item)]
    if isinstance(tree, dict):
        return [t for item in tree.values() for t in _tensors(item)]
    return []


def op_traffic(op: Any, args: Any, kwargs: Any, out: Any) -> tuple[int, int] | None:
    """(bytes read, bytes written) by one ATen operator as eager PyTorch runs it, or None
    when it launches no kernel (a view, an ``empty``).

    An in-place operator (``copy_``, ``fill_`` ...) writes its first argument and reads
    the other tensors; any other reads every tensor argument and writes its outputs.
    """
    packet = getattr(op, "_overloadpacket", None)
    name = getattr(packet, "__name__", str(op)).split(".")[-1]
    if getattr(op, "is_view", False) or name.startswith(("empty", "new_empty")):
        return None
    inputs = _tensors(args) + _tensors(kwargs)
    if name.endswith("_") and inputs:
        return sum(tensor_bytes(t) for t in inputs[1:]), tensor_bytes(inputs[0])
    return sum(tensor_bytes(t) for t in inputs), sum(tensor_bytes(t) for t in _tensors(out))


def dot_dtype(dtype: torch.dtype | str, ieee: bool) -> str:
    """The peak a matrix product of ``dtype`` inputs (a torch dtype, or a Triton dtype's
    name such as ``fp32``) runs at: ``tf32`` for fp32 inputs on
    tensor cores (``tl.dot``'s default input_precision), ``fp32`` for IEEE fp32
    (``input_precision="ieee"``, or eager PyTorch with TF32 off, its default for
    matmul), else the dtype's short name."""
    name = str(dtype).replace("torch.", "")
    short = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "float64": "fp64",
             "float8_e4m3fn": "fp8", "float8_e5m2": "fp8", "int8": "int8"}.get(name, name)
    if short.startswith("fp8"):  # Triton's fp8e4nv, fp8e5 ...
        short = "fp8"
    return "fp32" if short == "fp32" and ieee else ("tf32" if short == "fp32" else short)


class EagerCounter(TorchDispatchMode):
    """Count the task's own forward as eager PyTorch runs it (see :class:`EagerCount`);
    results are unchanged (each operator runs as it would)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = EagerCount()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        moved = op_traffic(func, args, kwargs, out)
        if moved is not None:
            self.count.bytes += moved[0] + moved[1]
            self.count.launches += 1
            flops = _matmul_flops(func, args, kwargs, out)
            if flops:
                key = dot_dtype(_tensors(args)[0].dtype, ieee=True)
                self.count.dot_flops[key] = self.count.dot_flops.get(key, 0) + flops
        return out


def _matmul_flops(func: Any, args: Any, kwargs: Any, out: Any) -> int:
    from torch.utils.flop_counter import flop_registry

    packet = getattr(func, "_overloadpacket", None)
    rule = flop_registry.get(packet)
    if rule is None:
        return 0
    try:
        # The registry's formulas take the operator's own arguments and output (its
        # shape wrapper reads their shapes), as FlopCounterMode calls them.
        return int(rule(*args, **kwargs, out_val=out))
    except Exception:  # noqa: BLE001 - a formula that does not fit these arguments
        return 0


def modeled_time_us(bytes_moved: int, dot_flops: dict[str, int], launches: int,
                    target: GpuTarget) -> float:
    """Microseconds on ``target`` by the roofline (the model before the tile model, kept
    beside it): ``max(bytes_moved / bandwidth, sum over dtypes of dot_flops / peak) +
    launches x launch overhead``. A dtype the target has no
    peak for is modeled at its fp32 peak.

    Raises:
        ValueError: ``target`` has no bandwidth or peaks (nothing to model with).
    """
    if not target.bandwidth_bytes_s or not target.peak_flops:
        raise ValueError(f"the {target.name} target has no bandwidth or peak FLOPs to model")
    memory_s = bytes_moved / target.bandwidth_bytes_s
    compute_s = sum(flops / target.peak_flops.get(dtype, target.peak_flops["fp32"])
                    for dtype, flops in dot_flops.items())
    return max(memory_s, compute_s) * 1e6 + launches * target.launch_overhead_us


roofline_time_us = modeled_time_us


# ---------------------------------------------------------------- the tile model

# Shared memory delivers 32 banks x 4 bytes per clock per SM (NVIDIA CUDA C++
# Programming Guide, "Shared Memory" of compute capabilities 5.x-9.0); AMD CDNA's LDS
# 128 bytes per clock per CU (AMD CDNA3 Instruction Set Architecture, "Local Data Share").
SMEM_BYTES_PER_CLOCK = 128
# Dense fp16 tensor-core FLOPs per clock per SM (per CU): A100 whitepaper (1024 dense
# FP16 FMA per clock per SM on sm_80), H100 whitepaper (twice A100's per SM, clock for
# clock, on sm_90), Ada whitepaper (sm_89: 512 FMA per clock per SM; the RTX 4090's
# 165.2 TFLOPS with fp32 accumulate is half that rate), AMD CDNA3/CDNA2 whitepapers
# (MI300X: 2048 fp16 FLOPs per clock per CU; MI250X: 1024). Dividing a datasheet peak
# by SMs x this rate gives the clock the peak is quoted at: 1.83 GHz (H100 SXM), 1.41
# (A100), 2.52 (RTX 4090), 2.10 (MI300X), as their datasheets give.
TENSOR_FLOPS_PER_CLOCK = {"sm_80": 2048, "sm_86": 1024, "sm_89": 1024, "sm_90": 4096,
                          "gfx942": 2048, "gfx90a": 1024}
_HALF_RATE_FP16 = frozenset({"4090", "rtx4090", "sm_89"})
# The model's defaults where a launch does not say (Triton's own defaults on CUDA:
# num_warps=4, num_stages=3; triton.Config).
DEFAULT_NUM_WARPS = 4
DEFAULT_NUM_STAGES = 3
# Achieved device-memory bandwidth reaches the peak with half of an SM's warp slots
# resident (each with one load in flight) and scales linearly below: an assumption of the
# model in the spirit of the CUDA C++ Best Practices Guide's "Occupancy" (latency is
# hidden by other resident warps; past some occupancy more does not help). A ``tl.dot``
# loop pipelined over ``num_stages`` keeps ``num_stages - 1`` steps of its tiles in
# flight, each step ``(M x K + K x N) x element bytes`` loaded in 16-byte vectors
# (VECTOR_BYTES, the widest global load, ld.global.v4.b32) by the block's threads.
BANDWIDTH_OCCUPANCY = 0.5
VECTOR_BYTES = 16
# Tensor cores: each of an SM's 4 sub-partitions needs a warp issuing MMAs (CUDA C++
# Programming Guide, "Hardware Multithreading": 4 warp schedulers per SM since sm_70).
TENSOR_WARPS = 4


@dataclass(frozen=True)
class LaunchModel:
    """The tile model of one launch on one target: ``dram_bytes`` (device-memory bytes
    charged: distinct bytes read, re-reads that miss L2, stores, atomics, spills),
    ``l2_bytes`` (bytes through L2: every load, store, atomic and spill),
    ``spill_bytes`` (local-memory traffic of spills), ``resident_warps`` (per SM),
    ``occupancy_from`` (``facts``: the compiler's; ``estimate``: the model's default),
    ``waves`` (of resident programs), ``bandwidth_fraction`` and ``tensor_fraction``
    (of the peaks reached), ``dram_us``, ``l2_us``, ``compute_us`` and ``time_us``
    (their maximum plus the launch overhead), microseconds."""

    dram_bytes: int
    l2_bytes: int
    spill_bytes: int
    resident_warps: int
    occupancy_from: str
    waves: int
    bandwidth_fraction: float
    tensor_fraction: float
    dram_us: float
    l2_us: float
    compute_us: float
    time_us: float


def _clock_hz(target: GpuTarget) -> float:
    """The clock the target's fp16 peak is quoted at (see TENSOR_FLOPS_PER_CLOCK)."""
    rate = TENSOR_FLOPS_PER_CLOCK.get(target.sm, 4096)
    if target.name in _HALF_RATE_FP16:
        rate //= 2
    return target.peak_flops.get("fp16", target.peak_flops.get("fp32", 0.0)) / (
        max(1, target.sms) * rate)


def _limits(target: GpuTarget) -> tuple[int, int, int, int]:
    """(max warps, max blocks, shared bytes, registers) per SM: the target's occupancy
    table where it has one (``GpuTarget.occupancy``), else the CUDA C++ Programming
    Guide's sm_90 limits (64 warps, 32 blocks, 228 KB, 65536 registers)."""
    occ = getattr(target, "occupancy", None)
    if occ is None:
        return 64, 32, 233472, 65536
    if getattr(target, "backend", "cuda") == "hip":
        # Waves per CU; VGPRs are per SIMD lane there: count them per wave of 64 lanes.
        return occ.max_warps, occ.max_blocks, occ.shared, occ.registers * occ.simds * 64
    return occ.max_warps, occ.max_blocks, occ.shared, occ.registers


def _estimated_warps(launch: LaunchTraffic, target: GpuTarget, warps: int,
                     stages: int) -> int:
    """Resident warps per SM without the compiler's facts: blocks limited by the warp
    and block slots, by the shared memory a pipelined ``tl.dot`` loop buffers
    (``num_stages x (M x K + K x N) x element bytes``, Triton's software pipeline) and by
    registers estimated as 32 + the fp32 accumulator (``M x N`` over the block's threads)
    + one stage of operands; a kernel without ``tl.dot`` is limited by slots alone."""
    max_warps, max_blocks, shared, registers = _limits(target)
    lane = getattr(target, "warp_size", WARP_SIZE)
    blocks = min(max_blocks, max_warps // warps) if warps <= max_warps else 0
    if launch.dot_tile:
        m, n, k, size = launch.dot_tile
        threads = warps * lane
        buffered = stages * (m * k + k * n) * size
        if buffered:
            blocks = min(blocks, shared // buffered)
        per_thread = min(255, 32 + -(-m * n // threads) + -(-(m * k + k * n) * size // (
            4 * threads)))
        blocks = min(blocks, registers // (per_thread * threads))
    return max(1, blocks) * warps


def _smem_bytes_per_flop(m: int, n: int, k: int, size: int, warps: int,
                         warpgroups: bool) -> float:
    """Shared-memory operand bytes a ``M x N x K`` tile step reads per FLOP: the block's
    warps (or, with ``warpgroups``, sm_90's ``wgmma`` groups of 4 warps, at least 64 rows
    each) split the output as evenly as they can and each reads its rows of A and its
    columns of B (``mma.sync`` fragments are at least 16 x 8)."""
    units = max(1, warps // 4) if warpgroups else max(1, warps)
    min_m, min_n = (64, 8) if warpgroups else (16, 8)
    best = None
    for um in range(1, units + 1):
        if units % um:
            continue
        un = units // um
        tile_m, tile_n = max(min_m, -(-m // um)), max(min_n, -(-n // un))
        read = units * (tile_m * k + k * tile_n) * size
        best = read if best is None else min(best, read)
    return (best or 0) / max(1, 2 * m * n * k)


def launch_model(launch: LaunchTraffic, target: GpuTarget, facts: Any = None) -> LaunchModel:
    """The tile model of one counted launch on ``target`` (see the module doc).

    ``facts``: what the GPU compiler says of the launch's kernel (an object with
    ``occupancy_warps``, resident warps per SM, and ``spill_bytes``, per thread, as
    :class:`services.worker.gpu_facts.KernelFacts` has), or None: then resident warps
    are :func:`_estimated_warps` and spills 0.

    Terms: ``waves = ceil(programs / (SMs x resident blocks per SM))``; DRAM loads =
    the launch's distinct bytes ``U`` plus the re-reads across waves (``min(loaded, U x
    waves) - U``, re-reads taken as spread evenly over the launch) that miss L2, a
    share ``1 - L2 size / U`` of them (none while ``U`` fits in L2); re-reads within a
    wave hit L2. Without ``unique_loaded`` every byte loaded is a DRAM byte (the
    roofline). Stores and atomics go to DRAM once. Spills: ``spill bytes x threads x 2``
    (stored and loaded again) of local memory, charged to DRAM and L2. Achieved
    bandwidth: ``min(1, loads in flight / (0.5 x the SM's warp slots))`` of the peak,
    for DRAM and L2 alike, a load in flight being one per resident warp, and for a
    ``tl.dot`` loop ``resident warps x max(1, stages - 1) x`` the 16-byte vectors each
    thread loads per step. Tensor throughput:
    ``min(1, (FLOPs per shared-memory byte of the tile) / (the SM's tensor FLOPs per
    clock / 128 bytes per clock)) x min(1, resident warps / 4)`` of the dtype's peak;
    a launch with dot FLOPs but no tile known runs at the peak.

    Raises:
        ValueError: ``target`` has no bandwidth or peaks.
    """
    if not target.bandwidth_bytes_s or not target.peak_flops:
        raise ValueError(f"the {target.name} target has no bandwidth or peak FLOPs to model")
    warps = launch.num_warps or DEFAULT_NUM_WARPS
    stages = launch.num_stages or DEFAULT_NUM_STAGES
    lane = getattr(target, "warp_size", WARP_SIZE)
    max_warps, _, _, _ = _limits(target)
    facts_warps = int(getattr(facts, "occupancy_warps", 0) or 0)
    if facts_warps > 0:
        resident, source = facts_warps, "facts"
    else:
        resident, source = _estimated_warps(launch, target, warps, stages), "estimate"
    blocks = max(1, resident // warps)
    waves = -(-launch.programs // (target.sms * blocks)) if launch.programs else 1
    spill = int(getattr(facts, "spill_bytes", 0) or 0) * max(1, launch.programs) * warps         * lane * 2 if facts is not None else 0

    l2_size, l2_bandwidth = l2_cache(target)
    loaded, unique = launch.loaded, launch.unique_loaded
    if unique <= 0 or not l2_size:
        dram_loads = loaded
    else:
        unique = min(unique, loaded)
        across = min(loaded, unique * waves) - unique
        missing = max(0.0, 1.0 - l2_size / unique) if unique else 0.0
        dram_loads = unique + across * missing
    dram = int(dram_loads) + launch.stored + launch.atomic + spill
    through_l2 = loaded + launch.stored + launch.atomic + spill

    in_flight = resident
    if launch.dot_tile:
        m, n, k, size = launch.dot_tile
        vectors = max(1, -(-(m * k + k * n) * size // (warps * lane * VECTOR_BYTES)))
        in_flight = resident * max(1, stages - 1) * vectors
    bandwidth_fraction = min(1.0, in_flight / (BANDWIDTH_OCCUPANCY * max_warps))
    tensor_fraction = 1.0
    if launch.dot_tile:
        m, n, k, size = launch.dot_tile
        wgmma = target.sm == "sm_90" and m >= 64 and warps % 4 == 0
        per_flop = _smem_bytes_per_flop(m, n, k, size, warps, wgmma)
        rate = TENSOR_FLOPS_PER_CLOCK.get(target.sm, 4096) / (
            2 if target.name in _HALF_RATE_FP16 else 1)
        needed = SMEM_BYTES_PER_CLOCK / rate  # bytes per FLOP the SM can feed
        tensor_fraction = min(1.0, needed / per_flop) if per_flop else 1.0
        tensor_fraction *= min(1.0, resident / TENSOR_WARPS)

    dram_us = dram / (target.bandwidth_bytes_s * bandwidth_fraction) * 1e6
    l2_us = through_l2 / (l2_bandwidth * bandwidth_fraction) * 1e6 if l2_bandwidth else 0.0
    compute_us = sum(flops / (target.peak_flops.get(dtype, target.peak_flops["fp32"])
                              * tensor_fraction)
                     for dtype, flops in launch.dot_flops.items()) * 1e6
    time_us = max(dram_us, l2_us, compute_us) + target.launch_overhead_us
    return LaunchModel(dram, through_l2, spill, resident, source, waves,
                       round(bandwidth_fraction, 4), round(tensor_fraction, 4),
                       dram_us, l2_us, compute_us, time_us)


def tile_time_us(launches: list[LaunchTraffic], target: GpuTarget,
                 facts: Mapping[str, Any] | None = None) -> float:
    """Microseconds of a call's launches on ``target`` by the tile model: the sum of
    :func:`launch_model` of each (``facts`` by kernel name; launches run one after
    another). Raises ValueError as :func:`launch_model`."""
    facts = facts or {}
    return sum(launch_model(launch, target, facts.get(launch.kernel)).time_us
               for launch in launches)


def eager_tile_time_us(eager: EagerCount, target: GpuTarget) -> float:
    """The tile model of the task's eager graph: its bytes from device memory once and
    through L2 once at full occupancy, its FLOPs at the peak (vendor libraries' tuned
    tiles), plus one launch overhead per operator. Raises ValueError as
    :func:`launch_model`."""
    if not target.bandwidth_bytes_s or not target.peak_flops:
        raise ValueError(f"the {target.name} target has no bandwidth or peak FLOPs to model")
    _, l2_bandwidth = l2_cache(target)
    memory_s = max(eager.bytes / target.bandwidth_bytes_s,
                   eager.bytes / l2_bandwidth if l2_bandwidth else 0.0)
    compute_s = sum(flops / target.peak_flops.get(dtype, target.peak_flops["fp32"])
                    for dtype, flops in eager.dot_flops.items())
    return max(memory_s, compute_s) * 1e6 + eager.launches * target.launch_overhead_us


def gemm_launch(m: int, n: int, k: int, block_m: int, block_n: int, block_k: int,
                num_warps: int, num_stages: int, element_bytes: int = 2,
                dtype: str = "fp16") -> LaunchTraffic:
    """What the replayer counts for the tutorial GEMM kernel (one program per
    ``block_m x block_n`` output tile, looping over K in ``block_k`` steps; Triton's
    03-matrix-multiplication) of an ``m x k`` by ``k x n`` product at these sizes,
    written out (a 4096^3 launch is too long for the interpreter): each program reads
    its ``block_m`` rows of A and ``block_n`` columns of B once, the output is written
    once (``element_bytes`` each)."""
    grid_m, grid_n = -(-m // block_m), -(-n // block_n)
    loaded = (grid_n * m * k + grid_m * k * n) * element_bytes
    return LaunchTraffic(
        kernel="matmul_kernel", loaded=loaded, stored=m * n * element_bytes,
        dot_flops={dtype: 2 * grid_m * block_m * grid_n * block_n * k},
        programs=grid_m * grid_n, unique_loaded=(m * k + k * n) * element_bytes,
        num_warps=num_warps, num_stages=num_stages,
        dot_tile=[block_m, block_n, block_k, element_bytes])


def summarize(launches: list[LaunchTraffic], bytes_min: int, eager: EagerCount | None,
              target: GpuTarget | None, facts: Mapping[str, Any] | None = None) -> Traffic:
    """The verdict's :class:`Traffic` of one call's launches, ``bytes_min`` (its
    inputs, captured storages and outputs once) and the task's eager count; the modeled
    fields stay None without a target that can be modeled. ``modeled_*`` are the
    roofline, ``tile_*`` the tile model of the same counts (``facts``: the compiler's
    facts by kernel name, see :func:`launch_model`)."""
    moved = sum(launch.loaded + launch.stored + launch.atomic for launch in launches)
    dots: dict[str, int] = {}
    for launch in launches:
        for dtype, flops in launch.dot_flops.items():
            dots[dtype] = dots.get(dtype, 0) + flops
    summary = Traffic(
        bytes_moved=moved, bytes_min=bytes_min,
        traffic_ratio=round(moved / bytes_min, 4) if bytes_min > 0 else None,
        flops=sum(dots.values()) + sum(launch.flops for launch in launches),
        dot_flops=dots, launches=len(launches), per_launch=launches)
    if target is not None and target.bandwidth_bytes_s and target.peak_flops:
        summary.model_arch = target.name
        facts = facts or {}
        models = [launch_model(launch, target, facts.get(launch.kernel))
                  for launch in launches]
        summary.tile_time_us = round(sum(m.time_us for m in models), 4)
        summary.tile_dram_bytes = sum(m.dram_bytes for m in models)
        summary.modeled_time_us = round(modeled_time_us(moved, dots, len(launches), target), 4)
        if eager is not None and eager.launches:
            summary.tile_eager_time_us = round(eager_tile_time_us(eager, target), 4)
            summary.modeled_eager_time_us = round(modeled_time_us(
                eager.bytes, eager.dot_flops, eager.launches, target), 4)
            if summary.tile_time_us > 0:
                summary.tile_speedup = round(
                    summary.tile_eager_time_us / summary.tile_time_us, 4)
            if summary.modeled_time_us > 0:
                summary.modeled_speedup = round(
                    summary.modeled_eager_time_us / summary.modeled_time_us, 4)
    return summary


def check_counts(summary: Traffic, output_bytes: int) -> str | None:
    """A message when the counts cannot describe a call whose outputs matched (the
    outputs were checked, so their bytes were written: by a kernel or by a copy of the
    plan), else None."""
    stored = sum(launch.stored + launch.atomic for launch in summary.per_launch)
    if any(v < 0 for launch in summary.per_launch
           for v in (launch.loaded, launch.stored, launch.atomic, launch.flops)):
        return "negative traffic counts"
    if output_bytes and stored < output_bytes:
        return (f"the call's launches stored {stored} bytes but its outputs hold "
                f"{output_bytes}")
    if not math.isfinite(float(summary.bytes_moved)):
        return "traffic counts are not finite"
    return None
