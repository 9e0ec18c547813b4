"""GPU targets by arch: the compute capability, SM count and limits a kernel is held to,
and the bandwidth and peaks the D007 roofline and the time model (:mod:`services.worker.traffic`) use.

The ``arch`` of a request names the device family (``h100``, ``a100``, ``4090`` ...);
this table turns it into what Triton compiles for and what the device permits. The
cpu backend uses it twice: to compile each kernel ahead of time for that GPU
(:mod:`services.worker.aot`) and to answer a CUDA-written candidate's questions about
its device (:mod:`services.worker.emulation`).

Sources: NVIDIA CUDA C++ Programming Guide, "Technical Specifications per Compute
Capability" (shared memory per block, opt-in: 8.0 163 KB = 166912 B, 8.6 and 8.9
99 KB = 101376 B, 9.0 227 KB = 232448 B; grid x up to 2**31 - 1, y and z up to 65535;
1024 threads per block); SM counts from the A100, H100 SXM, H200, RTX 4090 and L4
datasheets.

Bandwidth and peak FLOPs (dense, no sparsity) from the datasheets: NVIDIA H100 Tensor
Core GPU (SXM: 3.35 TB/s, FP32 67 TFLOPS, TF32 494.7, FP16/BF16 989.4, FP8 1978.9;
PCIe: 2.0 TB/s, FP32 51, TF32 378, FP16/BF16 756, FP8 1513), NVIDIA H200 (4.8 TB/s, the
H100 SXM's compute), NVIDIA A100 (80GB SXM 2.039 TB/s, 40GB 1.555 TB/s; FP32 19.5, TF32
156, FP16/BF16 312), NVIDIA Ada (RTX 4090: 1008 GB/s, FP32 82.6, TF32 82.6, FP16/BF16
165.2 with FP32 accumulate, FP8 330.3; L4: 300 GB/s, FP32 30.3, TF32 60, FP16/BF16 121,
FP8 242; L40S: 864 GB/s, FP32 91.6, TF32 183, FP16/BF16 362, FP8 733). The launch
overhead (3 us) is an assumption of the model, the order of one CUDA kernel launch's
cost that the CUDA C++ Best Practices Guide describes; it is not measured here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_GRID = (2**31 - 1, 65535, 65535)
MAX_THREADS_PER_BLOCK = 1024
WARP_SIZE = 32


@dataclass(frozen=True)
class GpuTarget:
    """``name`` (``h100``), compute ``capability`` (90 for sm_90), ``sms`` (streaming
    multiprocessors), ``shared_bytes`` (largest shared memory one block may use),
    ``bandwidth_bytes_s`` (peak device-memory bandwidth, bytes per second),
    ``peak_flops`` (dense peak FLOP/s by input dtype: ``fp32`` on CUDA cores, ``tf32``,
    ``fp16``, ``bf16``, ``fp8`` on tensor cores), ``launch_overhead_us`` (the model's
    cost of one kernel launch, microseconds)."""

    name: str
    capability: int
    sms: int
    shared_bytes: int
    bandwidth_bytes_s: float = 0.0
    peak_flops: dict[str, float] = field(default_factory=dict, hash=False, compare=False)
    launch_overhead_us: float = 3.0

    @property
    def sm(self) -> str:
        return f"sm_{self.capability}"


_T = 1e12
_H100_SXM = {"fp32": 67 * _T, "tf32": 494.7 * _T, "fp16": 989.4 * _T, "bf16": 989.4 * _T,
             "fp8": 1978.9 * _T}
_H100_PCIE = {"fp32": 51 * _T, "tf32": 378 * _T, "fp16": 756 * _T, "bf16": 756 * _T,
              "fp8": 1513 * _T}
_A100 = {"fp32": 19.5 * _T, "tf32": 156 * _T, "fp16": 312 * _T, "bf16": 312 * _T}
_RTX4090 = {"fp32": 82.6 * _T, "tf32": 82.6 * _T, "fp16": 165.2 * _T, "bf16": 165.2 * _T,
            "fp8": 330.3 * _T}
_L4 = {"fp32": 30.3 * _T, "tf32": 60 * _T, "fp16": 121 * _T, "bf16": 121 * _T,
       "fp8": 242 * _T}
_L40S = {"fp32": 91.6 * _T, "tf32": 183 * _T, "fp16": 362 * _T, "bf16": 362 * _T,
         "fp8": 733 * _T}

TARGETS: dict[str, GpuTarget] = {t.name: t for t in (
    GpuTarget("a100", 80, 108, 166912, 2.039e12, _A100),
    GpuTarget("a100_80gb", 80, 108, 166912, 2.039e12, _A100),
    GpuTarget("a100_40gb", 80, 108, 166912, 1.555e12, _A100),
    GpuTarget("h100", 90, 132, 232448, 3.35e12, _H100_SXM),
    GpuTarget("h100_sxm", 90, 132, 232448, 3.35e12, _H100_SXM),
    GpuTarget("h100_pcie", 90, 114, 232448, 2.0e12, _H100_PCIE),
    GpuTarget("h200", 90, 132, 232448, 4.8e12, _H100_SXM),
    GpuTarget("4090", 89, 128, 101376, 1.008e12, _RTX4090),
    GpuTarget("rtx4090", 89, 128, 101376, 1.008e12, _RTX4090),
    GpuTarget("l4", 89, 58, 101376, 0.3e12, _L4),
    GpuTarget("l40s", 89, 142, 101376, 0.864e12, _L40S),
    # Compute capabilities alone: the family's datasheet part above.
    GpuTarget("sm_80", 80, 108, 166912, 2.039e12, _A100),
    GpuTarget("sm_89", 89, 128, 101376, 1.008e12, _RTX4090),
    GpuTarget("sm_90", 90, 132, 232448, 3.35e12, _H100_SXM),
)}
DEFAULT_TARGET = "h100"


def target_for(arch: str, default: str = DEFAULT_TARGET) -> GpuTarget:
    """The target an ``arch`` names, else ``default``'s (an arch such as ``x86_64``
    names a host, not a GPU).

    Raises:
        KeyError: ``default`` is not in :data:`TARGETS`.
    """
    return TARGETS.get(arch.lower()) or TARGETS[default.lower()]
