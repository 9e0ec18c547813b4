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

What is **modeled** (never measured): :func:`modeled_time_us` ``= max(bytes /
bandwidth, dot FLOPs / tensor-core peak) + launches x launch overhead`` on one
:class:`~services.worker.targets.GpuTarget`, and the same model of the task's eager
ATen graph (:class:`EagerCounter` in the reference child: each operator's tensor
inputs read once and outputs written once, matmul-family FLOPs from
``torch.utils.flop_counter``, one launch per operator that is not a view). Not modeled:
caches (every byte counted comes from device memory), occupancy, coalescing, overlap of
launches, element-wise FLOPs (taken as hidden behind memory traffic).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from schemas.events import EagerCount, LaunchTraffic, Traffic
from services.worker.targets import GpuTarget

__all__ = ["ELEMENTWISE_FLOPS", "EagerCount", "EagerCounter", "LaunchTraffic",
           "Traffic", "check_counts", "dot_dtype", "modeled_time_us", "op_traffic",
           "summarize", "tensor_bytes"]

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
    """Microseconds on ``target`` by the model: ``max(bytes_moved / bandwidth, sum over
    dtypes of dot_flops / peak) + launches x launch overhead``. A dtype the target has no
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


def summarize(launches: list[LaunchTraffic], bytes_min: int, eager: EagerCount | None,
              target: GpuTarget | None) -> Traffic:
    """The verdict's :class:`Traffic` of one call's launches, ``bytes_min`` (its
    inputs, captured storages and outputs once) and the task's eager count; the modeled
    fields stay None without a target that can be modeled."""
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
        summary.modeled_time_us = round(modeled_time_us(moved, dots, len(launches), target), 4)
        if eager is not None and eager.launches:
            summary.modeled_eager_time_us = round(modeled_time_us(
                eager.bytes, eager.dot_flops, eager.launches, target), 4)
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
