"""Launch configurations of the built-in coder's GPU kernels: a table per schedule and
arch family, and the ``@triton.autotune`` decorators written from it.

On a GPU backend every kernel the built-in coder emits carries ``@triton.autotune``
over its schedule's list for the request's arch family (:func:`family_of`), keyed on
the extents that matter (``M, N, K`` of a GEMM, ``n_elements`` of an element-wise
kernel, the row length ``R`` of a reduction); where a tile must cover a row (row
reductions, scans, the fused rows and the recurrent layers' tiles), the tile stays a
size-dependent choice made in forward and the list tunes ``num_warps`` and
``num_stages`` alone. The ``cpu`` backend (Triton's interpreter) keeps its one
configuration: it never reads this table.

Families: NVIDIA ``sm_80`` (A100), ``sm_89`` (Ada: RTX 4090, L4, L40S), ``sm_90``
(H100, H200); AMD ``gfx90a`` (MI200) and ``gfx942`` (MI300), whose wavefronts are 64
lanes wide: there ``num_warps`` counts wavefronts (Triton's HIP backend), so a list
holds half the warps of its NVIDIA counterpart for the same threads, as Inductor's
``_num_warps`` halves them for wave64. ``matrix_instr_nonkdim`` and ``waves_per_eu``
(AMD-only compile options) are left at the compiler's defaults: CUDA and the
interpreter refuse them as keyword arguments, and Triton's HIP backend picks the
MFMA size itself.

Where each list comes from (shapes ``(BLOCK_M, BLOCK_N, BLOCK_K, num_stages,
num_warps)`` as in the sources):

- ``matmul`` (mm, bmm, addmm, baddbmm, the matmul-rows fusion), NVIDIA: the Triton
  tutorial ``python/tutorials/03-matrix-multiplication.py``, ``get_cuda_autotune_config``
  (128x256x64/3/8, 64x256x32/4/4, 128x128x32/4/4, 128x64x32/4/4, 64x128x32/4/4,
  128x32x32/4/4, 64x32x32/5/2, 32x64x32/5/2) with 128x256x64/3/8 replaced by
  PyTorch Inductor's ``persistent_mm_configs`` 128x128x64/3/8
  (``torch/_inductor/template_heuristics/triton.py``, ``BaseConfigHeuristic``):
  the kernels here compute ``tl.dot`` on float32 operands, twice the bytes of the
  tutorial's fp16 tiles; and 128x32x32/4/4 replaced by a 64x64x32 tile over 8 warps
  in 3 stages (the 8 warps of Inductor's 64x64x64/3/8 ``mm_configs`` entry): the
  compiler's facts of KernelBench level 2's fused GEMMs (Gemm + Multiply +
  LeakyReLU, the matmul-rows fusion of problem 18) show every other entry spilling
  on sm_90 (32-760 bytes a thread) and this one not (154-158 registers). ``sm_89`` (99 KB of shared memory per block) takes
  Inductor's ``mm_configs`` entries of at most 3 stages instead (128x128x32/2/8,
  64x128x32/3/4, 128x64x32/3/4, 64x64x64/3/8, 64x64x32/2/4) and the tutorial's
  two-warp tiles; so does ``sm_80``, where the compiler's facts show every tile of
  the tutorial's list spilling on these float32 kernels (48-2280 bytes a thread) and
  Inductor's 64x64x32/2/4 not.
- ``matmul``, AMD: the tutorial's ``get_hip_autotune_config`` (128x256x16/2/4,
  128x128x32/2/8, 64x128x32/2/4, 64x64x32/2/4) and Inductor's ``ROCmConfigHeuristic``
  ``mm_configs`` (128x64x32, 64x64x64; ``num_stages`` 2, Inductor's
  ``get_backend_num_stages`` on ROCm).
- ``conv`` (implicit-GEMM and direct convolutions): Inductor's ``conv_configs``
  (``BaseConfigHeuristic``: 64x256x16/2/4, 256x64x16/2/4, 128x128x32/2/8,
  64x256x32/2/8, 256x64x32/2/8, 128x128x64/3/8, 64x128x64/4/4, 128x64x64/4/4,
  64x64x32/2/4), those that fit the family's shared memory (on ``sm_90`` the eight
  largest but 256x64x32/2/8), each NVIDIA list ending in 64x64x32 over 8 warps (the
  8 warps of Inductor's 64x64x64/3/8 ``mm_configs`` entry): the compiler's facts of
  the fused convolutions KernelBench level 2 has (a convolution with its epilogue in
  one kernel, problem 1's Conv2d + ReLU + bias) show every 4-warp tile spilling on
  sm_90 (255 registers; 8-744 bytes a thread) and this one not (146 registers), so
  every list keeps a configuration that does not spill (``bench.kernelbench
  --facts``); AMD: the same entries with ``num_warps`` capped at ``BLOCK_M * BLOCK_N
  // 256`` and 2 stages, as ``ROCmConfigHeuristic`` does to its conv configs.
- ``elementwise`` (element-wise chains, concatenation, flips, pooling): Inductor's
  ``pointwise`` heuristic (``torch/_inductor/runtime/triton_heuristics.py``): XBLOCK
  ``bs`` with 256 elements per warp and ``bs // 2`` with 64 per warp, at least 4
  warps on NVIDIA (``triton_config``), up to ``TRITON_MAX_BLOCK["X"]`` (4096) with at
  most 8 warps (``_num_warps``); on ROCm also 4096 and 2048/8 warps/2 stages (the
  extra configs Inductor appends when ``torch.version.hip``).
- ``reduction`` (row reductions, scans, fused rows, the recurrent layers): Inductor's
  ``triton_config_reduction`` and ``_persistent_reduction_configs``: ``num_warps``
  from 2 to 16 (``_num_warps(r // 128)``, at most 16 for rows up to 8192), one stage;
  halved on wave64. The tile is a size-dependent choice: a row up to
  :data:`ROW_BLOCK` elements (Inductor's ``MAX_PERSISTENT_BLOCK_NUMEL``, 4096) is one
  tile, read once; longer rows loop over tiles of that many elements.

Configurations a family cannot launch are dropped when the list is written
(:func:`configs_for`): a tile pair whose pipelined buffers (``num_stages`` x
``(BLOCK_M + BLOCK_N) x BLOCK_K`` float32 elements, the kernels' ``tl.dot`` operands)
exceed the family's shared memory per block (NVIDIA CUDA C++ Programming Guide,
"Technical Specifications per Compute Capability": 8.0 163 KB, 8.9 99 KB, 9.0 227 KB;
AMD CDNA2/CDNA3 ISA: 64 KiB of LDS per workgroup), and any the compiler's own facts
say spill heavily or cannot launch (:data:`FACTS_CACHE`, :func:`facts_ok`).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

__all__ = ["FAMILIES", "ROW_BLOCK", "TABLE", "LaunchConfig", "autotune_decorator",
           "configs_for", "facts_ok", "family_of"]


@dataclass(frozen=True)
class LaunchConfig:
    """One launch configuration: ``num_warps`` (wavefronts of 64 lanes on AMD),
    ``num_stages`` (software-pipelining depth), and the tile it sets: ``block_size``
    (elements per program of an element-wise kernel) or ``block_m``/``block_n``/
    ``block_k`` (a ``tl.dot`` kernel's output rows, columns and reduction slice); 0
    where the schedule has no such tile."""

    num_warps: int
    num_stages: int
    block_size: int = 0
    block_m: int = 0
    block_n: int = 0
    block_k: int = 0

    def constexprs(self, names: tuple[str, ...]) -> dict[str, int]:
        """The kernel's tuned ``tl.constexpr`` values among ``names`` (``BLOCK_SIZE``,
        ``BLOCK_M``, ``BLOCK_N``, ``BLOCK_K``)."""
        values = {"BLOCK_SIZE": self.block_size, "BLOCK_M": self.block_m,
                  "BLOCK_N": self.block_n, "BLOCK_K": self.block_k}
        return {name: values[name] for name in names}


def _tiles(*rows: tuple[int, int, int, int, int]) -> tuple[LaunchConfig, ...]:
    """``(BLOCK_M, BLOCK_N, BLOCK_K, num_stages, num_warps)`` rows, the sources' order."""
    return tuple(LaunchConfig(w, s, block_m=m, block_n=n, block_k=k) for m, n, k, s, w in rows)


def _blocks(*rows: tuple[int, int, int]) -> tuple[LaunchConfig, ...]:
    """``(BLOCK_SIZE, num_warps, num_stages)`` rows."""
    return tuple(LaunchConfig(w, s, block_size=b) for b, w, s in rows)


def _warps(*warps: int) -> tuple[LaunchConfig, ...]:
    return tuple(LaunchConfig(w, 1) for w in warps)


def _amd_conv(rows: tuple[LaunchConfig, ...]) -> tuple[LaunchConfig, ...]:
    """Inductor's ROCm conv adjustment: 2 stages, ``num_warps`` at most
    ``BLOCK_M * BLOCK_N // 256``."""
    return tuple(LaunchConfig(min(c.num_warps, c.block_m * c.block_n // 256), 2,
                              block_m=c.block_m, block_n=c.block_n, block_k=c.block_k)
                 for c in rows)


_CONV = _tiles((64, 256, 16, 2, 4), (256, 64, 16, 2, 4), (128, 128, 32, 2, 8),
               (64, 256, 32, 2, 8), (128, 128, 64, 3, 8), (64, 128, 64, 4, 4),
               (128, 64, 64, 4, 4), (64, 64, 32, 2, 8))
_CONV_SMALL = _tiles((64, 256, 16, 2, 4), (256, 64, 16, 2, 4), (128, 128, 32, 2, 8),
                     (64, 256, 32, 2, 8), (256, 64, 32, 2, 8), (64, 64, 32, 2, 4),
                     (64, 64, 32, 2, 8))
_MM_NV = _tiles((128, 128, 64, 3, 8), (64, 256, 32, 4, 4), (128, 128, 32, 4, 4),
                (128, 64, 32, 4, 4), (64, 128, 32, 4, 4), (64, 64, 32, 3, 8),
                (64, 32, 32, 5, 2), (32, 64, 32, 5, 2))
_MM_ADA = _tiles((128, 128, 32, 2, 8), (64, 128, 32, 3, 4), (128, 64, 32, 3, 4),
                 (64, 64, 64, 3, 8), (64, 64, 32, 2, 4), (64, 32, 32, 5, 2),
                 (32, 64, 32, 5, 2))
_MM_AMD = _tiles((128, 256, 16, 2, 4), (128, 128, 32, 2, 8), (64, 128, 32, 2, 4),
                 (128, 64, 32, 2, 4), (64, 64, 64, 2, 4), (64, 64, 32, 2, 4))
_EW_NV = _blocks((1024, 4, 1), (512, 8, 1), (256, 4, 1), (2048, 8, 1), (4096, 8, 1))
_EW_AMD = _blocks((1024, 4, 1), (512, 4, 1), (256, 2, 1), (2048, 8, 2), (4096, 4, 1))
_RED_NV = _warps(4, 2, 8, 16)
_RED_AMD = _warps(2, 1, 4, 8)

# family -> schedule -> configurations, the first the one a single launch would take.
TABLE: dict[str, dict[str, tuple[LaunchConfig, ...]]] = {
    "sm_80": {"matmul": _MM_ADA, "conv": _CONV_SMALL, "elementwise": _EW_NV,
              "reduction": _RED_NV},
    "sm_89": {"matmul": _MM_ADA, "conv": _CONV_SMALL, "elementwise": _EW_NV,
              "reduction": _RED_NV},
    "sm_90": {"matmul": _MM_NV, "conv": _CONV, "elementwise": _EW_NV,
              "reduction": _RED_NV},
    "gfx90a": {"matmul": _MM_AMD, "conv": _amd_conv(_CONV_SMALL), "elementwise": _EW_AMD,
               "reduction": _RED_AMD},
    "gfx942": {"matmul": _MM_AMD, "conv": _amd_conv(_CONV_SMALL), "elementwise": _EW_AMD,
               "reduction": _RED_AMD},
}
FAMILIES = tuple(TABLE)
SCHEDULES = ("matmul", "conv", "elementwise", "reduction")

# Elements of one reduction tile on a GPU (Inductor's MAX_PERSISTENT_BLOCK_NUMEL): a
# row up to this long is read once.
ROW_BLOCK = 4096

# Shared memory (LDS) one block may use, bytes: the CUDA C++ Programming Guide's opt-in
# limits per compute capability; 64 KiB of LDS per workgroup on CDNA2 and CDNA3.
SHARED_BYTES = {"sm_80": 166912, "sm_89": 101376, "sm_90": 232448,
                "gfx90a": 65536, "gfx942": 65536}
# Lanes of a warp (wavefront) per family.
WARP_SIZE = {"sm_80": 32, "sm_89": 32, "sm_90": 32, "gfx90a": 64, "gfx942": 64}

# arch names a request may give, by family (services/worker/targets.py names the
# NVIDIA ones; compute capabilities and gfx names are accepted as they are).
_ARCH_FAMILY = {
    "a100": "sm_80", "a100_80gb": "sm_80", "a100_40gb": "sm_80", "a10": "sm_80",
    "a10g": "sm_80", "a6000": "sm_80", "3090": "sm_80", "rtx3090": "sm_80",
    "4090": "sm_89", "rtx4090": "sm_89", "l4": "sm_89", "l40": "sm_89", "l40s": "sm_89",
    "h100": "sm_90", "h100_sxm": "sm_90", "h100_pcie": "sm_90", "h200": "sm_90",
    "h20": "sm_90", "gh200": "sm_90",
    "mi200": "gfx90a", "mi210": "gfx90a", "mi250": "gfx90a", "mi250x": "gfx90a",
    "mi300": "gfx942", "mi300x": "gfx942", "mi300a": "gfx942", "mi325x": "gfx942",
}
DEFAULT_FAMILY = "sm_90"


def family_of(arch: str | None) -> str:
    """The arch family of a request's ``arch`` (``h100`` -> ``sm_90``, ``mi300x`` ->
    ``gfx942``, ``sm_86`` -> ``sm_80``, ``gfx90a`` as it is); an arch this table does
    not know (or None) gets :data:`DEFAULT_FAMILY` (``sm_90``, the H100 the GPU
    targets default to)."""
    name = (arch or "").lower()
    if name in TABLE:
        return name
    if name in _ARCH_FAMILY:
        return _ARCH_FAMILY[name]
    if name.startswith("sm_") and name[3:].isdigit():
        cc = int(name[3:])
        return "sm_90" if cc >= 90 else "sm_89" if cc >= 89 else "sm_80"
    if name.startswith("gfx94"):
        return "gfx942"
    if name.startswith("gfx9"):
        return "gfx90a"
    return DEFAULT_FAMILY


def shared_bytes(config: LaunchConfig) -> int:
    """Bytes of the pipelined ``tl.dot`` operand tiles of ``config``: ``num_stages``
    buffers of ``(BLOCK_M + BLOCK_N) x BLOCK_K`` float32 elements (0 without a tile
    pair). An upper bound of what Triton allocates for the kernels here, which load
    operands in their dtype and convert them to float32 for ``tl.dot``."""
    if not config.block_k:
        return 0
    return max(1, config.num_stages) * (config.block_m + config.block_n) * config.block_k * 4


# Compiler facts of the table's configurations (see :func:`facts_ok`), next to this
# module: {"<schedule>|<dtype>|<family>|<config>": {"ok": bool, "spill_bytes": int,
# ...}}. Missing entries count as launchable.
FACTS_CACHE = Path(__file__).with_name("launch_config_facts.json")
# A configuration whose compiled kernel spills more than this many bytes per thread
# (stack / scratch) is dropped: a few bytes of stack are register-allocation noise; a
# tile that spills whole accumulator rows (the 256x256x64 GEMM's 4480 B on sm_90) is
# not what the list is for.
MAX_SPILL_BYTES = 256


def config_id(config: LaunchConfig) -> str:
    """A configuration as the facts cache names it: ``w4s3`` then its tiles
    (``b1024`` or ``m128n128k64``)."""
    tile = (f"b{config.block_size}" if config.block_size else
            f"m{config.block_m}n{config.block_n}k{config.block_k}" if config.block_m else "")
    return f"w{config.num_warps}s{config.num_stages}{tile}"


def facts_key(schedule: str, dtype: str, family: str, config: LaunchConfig) -> str:
    return f"{schedule}|{dtype}|{family}|{config_id(config)}"


@functools.lru_cache(maxsize=1)
def _facts() -> dict[str, dict]:
    try:
        return json.loads(FACTS_CACHE.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def facts_ok(schedule: str, dtype: str, family: str, config: LaunchConfig) -> bool:
    """Whether the GPU compiler's facts of ``config`` (cached in :data:`FACTS_CACHE`,
    written by ``python -m services.generator.lowering.launch_facts``) let it stay in the
    list: it compiled and launches on the family's target (``ok``) and spills at most
    :data:`MAX_SPILL_BYTES`. A configuration without cached facts stays."""
    facts = _facts().get(facts_key(schedule, dtype, family, config))
    if facts is None:
        return True
    return bool(facts.get("ok", True)) and int(facts.get("spill_bytes") or 0) <= MAX_SPILL_BYTES


def configs_for(schedule: str, arch: str | None, names: tuple[str, ...] = (),
                dtype: str = "float32") -> list[LaunchConfig]:
    """The configurations of ``schedule`` (``matmul``, ``conv``, ``elementwise``,
    ``reduction``) for ``arch``'s family, in the table's order: those whose shared
    memory fits the family (:func:`shared_bytes` against :data:`SHARED_BYTES`) and
    whose compiler facts allow them (:func:`facts_ok` for ``dtype``, the kernel's
    widest operand dtype), one per distinct ``(names' values, num_warps, num_stages)``
    (a kernel without ``BLOCK_K`` tunes ``BLOCK_M``/``BLOCK_N`` only). Never empty: if
    every configuration were dropped, the first is kept.

    Raises:
        KeyError: ``schedule`` is not one of the table's.
    """
    family = family_of(arch)
    rows = TABLE[family][schedule]
    kept: list[LaunchConfig] = []
    seen: set[tuple] = set()
    for config in rows:
        if "BLOCK_K" not in names and config.block_k:
            config = LaunchConfig(config.num_warps, config.num_stages, config.block_size,
                                  config.block_m, config.block_n, 0)
        key = (tuple(config.constexprs(names).items()), config.num_warps, config.num_stages)
        if key in seen:
            continue
        if shared_bytes(config) > SHARED_BYTES[family]:
            continue
        if not facts_ok(schedule, dtype, family, config):
            continue
        seen.add(key)
        kept.append(config)
    return kept or [rows[0]]


def autotune_decorator(configs: list[LaunchConfig], names: tuple[str, ...],
                       key: list[str]) -> str:
    """``@triton.autotune(configs=[triton.Config({...}, num_warps=..., num_stages=...),
    ...], key=[...])`` for a kernel whose tuned constexprs are ``names``, re-tuned when
    the kernel parameters ``key`` change."""
    lines = ["@triton.autotune(", "    configs=["]
    for c in configs:
        lines.append(f"        triton.Config({c.constexprs(names)!r}, "
                     f"num_warps={c.num_warps}, num_stages={c.num_stages}),")
    lines += ["    ],", f"    key={key!r},", ")"]
    return "\n".join(lines)


# ---- writing the table into a lowering ------------------------------------------------
# A Lowerer's ``p`` holds ``arch`` (a GPU arch: kernels carry @triton.autotune; "" on
# cpu: one configuration, as before) and ``tune`` (1: the table's list; 0: a one-config
# list of the launch parameters given, an evolve point).


def on_gpu(lw) -> bool:
    """Whether the lowering writes GPU kernels (``arch`` given), not the cpu's."""
    return bool(lw.p.get("arch"))


def _configs(lw, schedule: str, names: tuple[str, ...]) -> list[LaunchConfig]:
    if lw.p.get("tune", 1):
        return configs_for(schedule, lw.p["arch"], names)
    p = lw.p
    return [LaunchConfig(p["num_warps"], p["num_stages"], p["block_size"], p["block_m"],
                         p["block_n"], p["block_k"] if "BLOCK_K" in names else 0)]


def autotune(lw, kname: str, schedule: str, key: list[str],
             names: tuple[str, ...] = ()) -> None:
    """Put ``@triton.autotune`` over ``schedule``'s list (its constexprs ``names``,
    re-tuned on the kernel parameters ``key``) on the lowerer's kernel ``kname``."""
    kernel = next(k for k in reversed(lw.kernels) if k.name == kname)
    kernel.source = (autotune_decorator(_configs(lw, schedule, names), names, key)
                     + "\n" + kernel.source)


def launch_options(lw, kname: str, schedule: str, key: list[str]) -> str:
    """The launch's ``num_warps=..., num_stages=...`` on cpu; on a GPU ``""``, the kernel
    ``kname`` tuned over ``schedule``'s ``num_warps``/``num_stages`` (its tiles stay
    the size-dependent ones forward computes)."""
    if not on_gpu(lw):
        return f"num_warps={lw.p['num_warps']}, num_stages={lw.p['num_stages']}"
    autotune(lw, kname, schedule, key)
    return ""
