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

Occupancy limits (:class:`Occupancy`, what :mod:`services.worker.gpu_facts` turns a
compiled kernel's registers and shared memory into resident warps with): NVIDIA CUDA
C++ Programming Guide, "Technical Specifications per Compute Capability" (65536 32-bit
registers per SM, at most 255 per thread; resident warps per SM 64 on 8.0 and 9.0, 48 on
8.6 and 8.9; resident blocks per SM 32 on 8.0 and 9.0, 16 on 8.6, 24 on 8.9; shared
memory per SM 164 KB on 8.0, 100 KB on 8.6 and 8.9, 228 KB on 9.0) and its compute
capability 8.x/9.0 sections (the driver reserves 1 KB of shared memory per block); the
register allocation unit, 256 registers per warp, as the CUDA Occupancy Calculator and
Nsight Compute's occupancy section give it for these capabilities.

AMD Instinct targets (``backend="hip"``, wave64; a ``gfx`` arch instead of an sm): ROCm
documentation, "AMD GPU specifications" (MI300X: CDNA3, gfx942, 304 CUs, 64 KiB LDS and
a 512 KiB VGPR file per CU, 4 MB L2 per XCD; MI250X: CDNA2, gfx90a, 220 CUs, MI250: 208
CUs, 64 KiB LDS and 512 KiB VGPRs per CU, 8 MB L2 per GCD) and the AMD CDNA2/CDNA3 ISA
references: a CU has 4 SIMDs, each with 512 VGPRs per lane shared by the arch VGPRs and
the AGPRs (allocated in blocks of 8) and at most 8 resident waves, as LLVM's AMDGPU
backend computes occupancy for gfx90a and gfx942 (the ``; Occupancy:`` line it writes in
the kernel's assembly); a workgroup uses at most 64 KiB of LDS. Datasheets, dense peaks:
AMD Instinct MI300X (5.3 TB/s; FP32 163.4 TFLOPS, TF32 653.7, FP16/BF16 1307.4, FP8
2614.9), MI250X (package: 3.2 TB/s, 220 CUs; FP32 47.9 vector and 95.7 matrix, FP16/BF16
383) and MI250 (3.2 TB/s, 208 CUs; FP32 45.3 and 90.5, FP16/BF16 362.1). An MI250/MI250X
package is two GCDs that a program sees as two devices: the ``mi250``/``mi250x`` targets
are one GCD (half the CUs, half the bandwidth and peaks), the device a kernel runs on.
CDNA2 has no TF32: ``tf32`` there is the FP32 matrix rate.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_GRID = (2**31 - 1, 65535, 65535)
MAX_THREADS_PER_BLOCK = 1024
WARP_SIZE = 32


@dataclass(frozen=True)
class Occupancy:
    """What bounds the warps (waves) resident on one SM (CU) of an arch, by ``sm``
    (``sm_90``, ``gfx942``): ``registers`` (32-bit registers per SM on NVIDIA; per SIMD
    lane on AMD), ``register_unit`` (allocation granularity: registers per warp on
    NVIDIA, VGPRs per lane on AMD), ``max_registers`` (per thread), ``max_warps`` (per
    SM; per CU on AMD), ``max_blocks`` (per SM/CU), ``shared`` (shared memory or LDS
    bytes per SM/CU), ``reserved_shared`` (bytes the driver reserves per block),
    ``simds`` (SIMDs per CU that a workgroup's waves are spread over; 1 on NVIDIA).
    Sources: the module doc."""

    registers: int
    register_unit: int
    max_registers: int
    max_warps: int
    max_blocks: int
    shared: int
    reserved_shared: int = 0
    simds: int = 1


OCCUPANCY: dict[str, Occupancy] = {
    "sm_80": Occupancy(65536, 256, 255, 64, 32, 167936, 1024),
    "sm_86": Occupancy(65536, 256, 255, 48, 16, 102400, 1024),
    "sm_89": Occupancy(65536, 256, 255, 48, 24, 102400, 1024),
    "sm_90": Occupancy(65536, 256, 255, 64, 32, 233472, 1024),
    # Per SIMD lane: 512 VGPRs (arch + AGPRs), 8 waves per SIMD, 4 SIMDs per CU.
    "gfx90a": Occupancy(512, 8, 512, 32, 32, 65536, 0, 4),
    "gfx942": Occupancy(512, 8, 512, 32, 32, 65536, 0, 4),
}


@dataclass(frozen=True)
class GpuTarget:
    """``name`` (``h100``), compute ``capability`` (90 for sm_90), ``sms`` (streaming
    multiprocessors), ``shared_bytes`` (largest shared memory one block may use),
    ``bandwidth_bytes_s`` (peak device-memory bandwidth, bytes per second),
    ``peak_flops`` (dense peak FLOP/s by input dtype: ``fp32`` on CUDA cores, ``tf32``,
    ``fp16``, ``bf16``, ``fp8`` on tensor cores), ``launch_overhead_us`` (the model's
    cost of one kernel launch, microseconds), ``backend`` (``cuda``, or ``hip`` for AMD:
    then ``gfx`` names the arch, ``capability`` is what torch's
    ``get_device_capability`` reports there, 94 for gfx942, and an SM is a CU)."""

    name: str
    capability: int
    sms: int
    shared_bytes: int
    bandwidth_bytes_s: float = 0.0
    peak_flops: dict[str, float] = field(default_factory=dict, hash=False, compare=False)
    launch_overhead_us: float = 3.0
    backend: str = "cuda"
    gfx: str = ""

    @property
    def sm(self) -> str:
        """The arch Triton compiles for: ``sm_90``, or ``gfx942`` on AMD."""
        return self.gfx if self.backend == "hip" else f"sm_{self.capability}"

    @property
    def warp_size(self) -> int:
        """Threads per warp: 32, or 64 (a wave64 wavefront) on AMD CDNA."""
        return 64 if self.backend == "hip" else WARP_SIZE

    @property
    def vendor(self) -> str:
        return "AMD" if self.backend == "hip" else "NVIDIA"

    @property
    def occupancy(self) -> Occupancy:
        """The arch's occupancy limits (:data:`OCCUPANCY`; an unlisted sm takes sm_90's)."""
        return OCCUPANCY.get(self.sm) or OCCUPANCY["sm_90"]

    def triton_target(self) -> tuple[str, int | str, int]:
        """``(backend, arch, warp size)`` for ``triton.backends.compiler.GPUTarget``."""
        return (self.backend, self.gfx if self.backend == "hip" else self.capability,
                self.warp_size)


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
_MI300X = {"fp32": 163.4 * _T, "tf32": 653.7 * _T, "fp16": 1307.4 * _T, "bf16": 1307.4 * _T,
           "fp8": 2614.9 * _T}
# One GCD of the package (half its peaks): the device a program sees.
_MI250X_GCD = {"fp32": 47.9 / 2 * _T, "tf32": 95.7 / 2 * _T, "fp16": 383 / 2 * _T,
               "bf16": 383 / 2 * _T}
_MI250_GCD = {"fp32": 45.3 / 2 * _T, "tf32": 90.5 / 2 * _T, "fp16": 362.1 / 2 * _T,
              "bf16": 362.1 / 2 * _T}

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
    # AMD Instinct (hip, wave64): shared_bytes is a workgroup's LDS limit.
    GpuTarget("mi300x", 94, 304, 65536, 5.3e12, _MI300X, backend="hip", gfx="gfx942"),
    GpuTarget("gfx942", 94, 304, 65536, 5.3e12, _MI300X, backend="hip", gfx="gfx942"),
    GpuTarget("mi250x", 90, 110, 65536, 1.6e12, _MI250X_GCD, backend="hip", gfx="gfx90a"),
    GpuTarget("mi250", 90, 104, 65536, 1.6e12, _MI250_GCD, backend="hip", gfx="gfx90a"),
    GpuTarget("gfx90a", 90, 110, 65536, 1.6e12, _MI250X_GCD, backend="hip", gfx="gfx90a"),
)}
DEFAULT_TARGET = "h100"

# L2 by target: (bytes, read bandwidth in bytes/s), what the tile model of
# services.worker.traffic serves re-read bytes from. Sizes: NVIDIA A100 Tensor Core GPU
# Architecture whitepaper (40 MB), NVIDIA H100 Tensor Core GPU Architecture whitepaper
# (50 MB on H100 SXM5 and PCIe; the H200 is the same GH100 configuration with HBM3e: 50
# MB), NVIDIA Ada GPU Architecture whitepaper (RTX 4090: 72 MB; L40S: 96 MB; L4: 48 MB),
# AMD CDNA3 whitepaper and MI300X datasheet (256 MB Infinity Cache beside 4 MB of L2 per
# XCD; programs are dealt round-robin over the 8 XCDs, so a tile's re-reads by its
# neighbours meet in the Infinity Cache: the model uses it), AMD CDNA2 whitepaper (8 MB
# of L2 per GCD). Bandwidths: the A100 whitepaper's L2 read bandwidth, 5120 bytes per
# clock (108 SMs) at 1.41 GHz; NVIDIA publishes none for Hopper or Ada, so the model
# assumes A100's bytes per clock per SM at each part's clock (the one its datasheet fp16
# peak implies: 1.83 GHz H100 SXM/H200, 1.62 H100 PCIe, 2.52 RTX 4090, 2.04 L4, 2.49
# L40S); MI300X: the CDNA3 whitepaper's 17.2 TB/s peak Infinity Cache bandwidth; MI250X
# and MI250 GCDs: 128 bytes per clock per channel over 16 channels at 1.7 GHz, an
# assumption from the CDNA2 whitepaper's L2 description.
_MB = 1 << 20


def _nvidia_l2(sms: int, clock_hz: float) -> float:
    return 5120 / 108 * sms * clock_hz


L2_CACHE: dict[str, tuple[int, float]] = {
    **{name: (40 * _MB, 5120 * 1.41e9) for name in ("a100", "a100_80gb", "a100_40gb",
                                                      "sm_80")},
    **{name: (50 * _MB, _nvidia_l2(132, 1.83e9)) for name in ("h100", "h100_sxm", "h200",
                                                               "sm_90")},
    "h100_pcie": (50 * _MB, _nvidia_l2(114, 1.62e9)),
    **{name: (72 * _MB, _nvidia_l2(128, 2.52e9)) for name in ("4090", "rtx4090", "sm_89")},
    "l4": (48 * _MB, _nvidia_l2(58, 2.04e9)),
    "l40s": (96 * _MB, _nvidia_l2(142, 2.49e9)),
    **{name: (256 * _MB, 17.2e12) for name in ("mi300x", "gfx942")},
    **{name: (8 * _MB, 128 * 16 * 1.7e9) for name in ("mi250x", "mi250", "gfx90a")},
}


def l2_cache(target: GpuTarget) -> tuple[int, float]:
    """``(L2 bytes, L2 bandwidth in bytes/s)`` of ``target`` (:data:`L2_CACHE`); ``(0,
    0.0)`` for a target the table does not list (the model then has no L2)."""
    return L2_CACHE.get(target.name, (0, 0.0))


def target_for(arch: str, default: str = DEFAULT_TARGET) -> GpuTarget:
    """The target an ``arch`` names, else ``default``'s (an arch such as ``x86_64``
    names a host, not a GPU).

    Raises:
        KeyError: ``default`` is not in :data:`TARGETS`.
    """
    return TARGETS.get(arch.lower()) or TARGETS[default.lower()]
