"""GPU targets by arch: the compute capability, SM count and limits a kernel is held to.

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
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_GRID = (2**31 - 1, 65535, 65535)
MAX_THREADS_PER_BLOCK = 1024
WARP_SIZE = 32


@dataclass(frozen=True)
class GpuTarget:
    """``name`` (``h100``), compute ``capability`` (90 for sm_90), ``sms`` (streaming
    multiprocessors), ``shared_bytes`` (largest shared memory one block may use)."""

    name: str
    capability: int
    sms: int
    shared_bytes: int

    @property
    def sm(self) -> str:
        return f"sm_{self.capability}"


TARGETS: dict[str, GpuTarget] = {t.name: t for t in (
    GpuTarget("a100", 80, 108, 166912),
    GpuTarget("a100_80gb", 80, 108, 166912),
    GpuTarget("a100_40gb", 80, 108, 166912),
    GpuTarget("h100", 90, 132, 232448),
    GpuTarget("h100_sxm", 90, 132, 232448),
    GpuTarget("h100_pcie", 90, 114, 232448),
    GpuTarget("h200", 90, 132, 232448),
    GpuTarget("4090", 89, 128, 101376),
    GpuTarget("rtx4090", 89, 128, 101376),
    GpuTarget("l4", 89, 58, 101376),
    GpuTarget("l40s", 89, 142, 101376),
    GpuTarget("sm_80", 80, 108, 166912),
    GpuTarget("sm_89", 89, 128, 101376),
    GpuTarget("sm_90", 90, 132, 232448),
)}
DEFAULT_TARGET = "h100"


def target_for(arch: str, default: str = DEFAULT_TARGET) -> GpuTarget:
    """The target an ``arch`` names, else ``default``'s (an arch such as ``x86_64``
    names a host, not a GPU).

    Raises:
        KeyError: ``default`` is not in :data:`TARGETS`.
    """
    return TARGETS.get(arch.lower()) or TARGETS[default.lower()]
