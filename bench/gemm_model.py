"""The two time models side by side on the configurations of one GEMM.

``python -m bench.gemm_model [--arch h100] [--size 4096] [--dtype fp16]``

For an ``M x K`` by ``K x N`` product (``--size`` each, or ``--m --n --k``) and each
launch configuration (``BLOCK_M x BLOCK_N x BLOCK_K``, warps, stages: the tutorial
kernel's small default and the field's tuned tiles, Triton's 03-matrix-multiplication
tutorial and Inductor's mm configs), prints what the replayer would count
(:func:`services.worker.traffic.gemm_launch`: bytes loaded, distinct bytes, programs),
the roofline time (every byte from device memory, FLOPs at the peak), the tile model's
time (:func:`services.worker.traffic.launch_model`: L2, occupancy, the tile's tensor
throughput) with its DRAM bytes, waves and the fractions of the peaks it reached, and
the TFLOP/s each time means. ``--json`` prints one JSON object per configuration.
Nothing is measured: both are models (docs/verification.md, "Counted traffic").
"""

from __future__ import annotations

import argparse
import json
import sys

from services.worker.targets import TARGETS, target_for
from services.worker.traffic import gemm_launch, launch_model, roofline_time_us

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages): the built-in coder's old cpu-sized
# default first, then tiles from Triton's tutorial 03 (get_cuda_autotune_config) and
# Inductor's mm configs (torch/_inductor/kernel/mm_common.py).
CONFIGS: list[tuple[int, int, int, int, int]] = [
    (32, 32, 32, 4, 1),
    (64, 64, 32, 4, 4),
    (64, 128, 32, 4, 4),
    (128, 64, 32, 4, 4),
    (128, 128, 64, 8, 3),
    (128, 256, 64, 8, 3),
]


def rows(m: int, n: int, k: int, arch: str, dtype: str = "fp16",
         configs: list[tuple[int, int, int, int, int]] | None = None) -> list[dict]:
    """One row per configuration: its counts, both models' times (microseconds) and
    TFLOP/s. Raises KeyError for an arch :data:`TARGETS` does not list."""
    if arch.lower() not in TARGETS:
        raise KeyError(f"unknown arch {arch!r}; one of {', '.join(sorted(TARGETS))}")
    target = target_for(arch)
    size = {"fp16": 2, "bf16": 2, "fp32": 4, "tf32": 4, "fp8": 1}[dtype]
    flops = 2 * m * n * k
    out = []
    for bm, bn, bk, warps, stages in configs or CONFIGS:
        launch = gemm_launch(m, n, k, bm, bn, bk, warps, stages, size, dtype)
        model = launch_model(launch, target)
        roof = roofline_time_us(launch.loaded + launch.stored, launch.dot_flops, 1, target)
        out.append({
            "config": f"{bm}x{bn}x{bk}/{warps}w/{stages}s", "programs": launch.programs,
            "loaded": launch.loaded, "unique_loaded": launch.unique_loaded,
            "roofline_us": round(roof, 2), "tile_model_us": round(model.time_us, 2),
            "roofline_tflops": round(flops / roof / 1e6, 1),
            "tile_model_tflops": round(flops / model.time_us / 1e6, 1),
            "dram_bytes": model.dram_bytes, "waves": model.waves,
            "resident_warps": model.resident_warps,
            "bandwidth_fraction": model.bandwidth_fraction,
            "tensor_fraction": model.tensor_fraction})
    return out


def table(found: list[dict], m: int, n: int, k: int, arch: str, dtype: str) -> str:
    """The rows as text."""
    lines = [f"{m}x{k} @ {k}x{n} {dtype} on {arch} (modeled, not measured)",
             f"{'config':22} {'roofline us':>11} {'tile us':>9} {'roof TF/s':>9} "
             f"{'tile TF/s':>9} {'DRAM MB':>8} {'waves':>5} {'bw':>5} {'tensor':>6}"]
    lines += [f"{r['config']:22} {r['roofline_us']:>11.1f} {r['tile_model_us']:>9.1f} "
              f"{r['roofline_tflops']:>9.1f} {r['tile_model_tflops']:>9.1f} "
              f"{r['dram_bytes'] / 1e6:>8.1f} {r['waves']:>5} "
              f"{r['bandwidth_fraction']:>5.2f} {r['tensor_fraction']:>6.2f}" for r in found]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default="h100", help="a target of services/worker/targets.py")
    parser.add_argument("--size", type=int, default=4096, help="M = N = K unless given")
    parser.add_argument("--m", type=int)
    parser.add_argument("--n", type=int)
    parser.add_argument("--k", type=int)
    parser.add_argument("--dtype", default="fp16", choices=("fp16", "bf16", "fp32", "tf32",
                                                            "fp8"))
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    m, n, k = (args.m or args.size), (args.n or args.size), (args.k or args.size)
    try:
        found = rows(m, n, k, args.arch, args.dtype)
    except KeyError as exc:
        parser.error(str(exc))
    if args.json:
        for row in found:
            print(json.dumps(row))
    else:
        print(table(found, m, n, k, args.arch, args.dtype))
    return 0


if __name__ == "__main__":
    sys.exit(main())
