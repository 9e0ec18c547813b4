"""The worker's CUDA path on a real NVIDIA GPU, in one run: ``python -m bench.gpu_check``.

Prepared for a GPU machine with the repo's venv (a CUDA build of torch, and triton);
on a machine without one it stops at once with exit status 2 and says why. One
:class:`services.worker.verifier.Verifier` (``backend="cuda"``, the fork server and
sandbox a worker uses) checks, in order:

1. a correct fused element-wise kernel (the built-in coder's output for
   ``tasks/gelu.py`` at batch 4096 x dim 16384, float32: 256 MiB per tensor) in
   profile mode: it must pass, with base (eager PyTorch) and kernel times and a
   speedup;
2. the same kernel with its store mask removed and a large offset added to the
   store address (an out-of-bounds write far past any allocation): it must fail as
   ``runtime`` (the illegal address surfaces as a CUDA error at synchronize);
   ``crash`` (the child died) is printed as what came and accepted, since the issue
   asks only that it fails without harming the worker;
3. the correct kernel again on the same Verifier: it must pass, showing that the
   device and the pool survived the faulting candidate.

Exit status 0 when every expectation holds, 1 when one does not, 2 when the machine
cannot run the check (no CUDA).
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TASK_PATH = ROOT / "tasks" / "gelu.py"
# Elements past the output tensor the faulting store writes to: 2**36 float32 is 256 GiB,
# beyond the memory of any current GPU, so the address cannot be another allocation.
OOB_OFFSET = 1 << 36


def cuda_problem() -> str | None:
    """Why this machine cannot run the check, or None when it can."""
    try:
        import torch
    except ImportError as exc:
        return f"torch is not importable ({exc}); run with the repo's venv (.venv/bin/python)"
    if torch.version.cuda is None:
        return (f"this torch ({torch.__version__}) is a CPU-only build (torch.version.cuda is "
                "None); install a CUDA build of torch in the venv on the GPU machine")
    # Only the driver is asked here; no context is created in this process (the
    # Verifier's children each create their own).
    if not torch.cuda.is_available():
        return ("torch has CUDA support but sees no usable GPU (torch.cuda.is_available() is "
                "False): check the driver, nvidia-smi and CUDA_VISIBLE_DEVICES")
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        return f"triton is not importable ({exc})"
    return None


def out_of_bounds(candidate: str) -> str:
    """``candidate`` with its store unmasked and moved ``OOB_OFFSET`` elements past the output.

    Raises:
        ValueError: the candidate has no ``tl.store(out_ptr + offsets, ..., mask=mask)``
            (the built-in coder's output changed; update this function).
    """
    pattern = re.compile(r"tl\.store\(out_ptr \+ offsets, (.*), mask=mask\)")
    if not pattern.search(candidate):
        raise ValueError("no masked tl.store(out_ptr + offsets, ...) in the built-in coder's "
                         "output; update bench/gpu_check.py's out_of_bounds()")
    return pattern.sub(rf"tl.store(out_ptr + offsets + {OOB_OFFSET}, \1)", candidate, count=1)


def describe(result) -> str:
    parts = [f"passed={result.passed}", f"stage={result.stage}"]
    if result.base_time_us is not None:
        parts.append(f"base={result.base_time_us:.1f} us")
    if result.gen_time_us is not None:
        parts.append(f"kernel={result.gen_time_us:.1f} us")
    if result.speedup is not None:
        parts.append(f"speedup={result.speedup:.2f}x")
    if result.max_abs_error is not None:
        parts.append(f"max_abs_error={result.max_abs_error:.2e}")
    parts.append(f"duration={result.duration_s:.1f} s")
    if result.error:
        parts.append(f"error={result.error[:300]!r}")
    return ", ".join(parts)


async def run_checks(args: argparse.Namespace) -> int:
    from schemas import VerifyRequest
    from services.generator.coders.builtin import lower_task
    from services.worker.verifier import Verifier

    shapes = {"batch_size": args.batch, "dim": args.dim}
    task = TASK_PATH.read_text()
    correct = lower_task(task, shapes)
    faulty = out_of_bounds(correct)
    tensor_bytes = 4 * args.batch * args.dim
    verifier = Verifier("cuda", worker_id="gpu-check",
                        memory_limit_bytes=max(8 << 30, 4 * tensor_bytes))
    print(f"task {TASK_PATH.relative_to(ROOT)} at {shapes} (float32, "
          f"{tensor_bytes / (1 << 20):.0f} MiB per tensor) on cuda device {args.device}")
    started = time.perf_counter()
    verifier.start()
    print(f"verifier started in {time.perf_counter() - started:.1f} s "
          f"(network isolated: {verifier.network_isolated}, run as: {verifier.run_as}, "
          f"notes: {verifier.sandbox_notes or 'none'})")

    def request(name: str, code: str, mode: str) -> VerifyRequest:
        return VerifyRequest(
            request_id=f"gpu-check-{name}", job_id="gpu-check", candidate_id=name,
            op_name="gelu", task_desc=task, code=code, backend="cuda", arch=args.arch,
            mode=mode, shape_overrides=shapes, timeout_s=args.timeout, trials=args.trials)

    checks: list[tuple[str, str, bool, str]] = []
    try:
        first = await verifier.verify(request("correct", correct, "profile"), device=args.device)
        print(f"\n1. correct kernel, profile: {describe(first)}")
        ok = (first.passed and first.speedup is not None and first.gen_time_us is not None
              and first.base_time_us is not None and first.gen_time_us > 0)
        checks.append(("correct kernel passes with a measured speedup",
                       "passed, speedup", ok,
                       f"passed={first.passed} speedup={first.speedup}"))

        second = await verifier.verify(request("oob-store", faulty, "verify"),
                                       device=args.device)
        print(f"\n2. out-of-bounds store: {describe(second)}")
        if second.log:
            print("   log tail: " + second.log[-600:].replace("\n", "\n   "))
        if second.stage == "crash":
            print("   note: the issue asks for stage runtime; the child died instead (crash), "
                  "which still fails the candidate without harming the worker")
        checks.append(("out-of-bounds store fails", "stage runtime (crash accepted)",
                       not second.passed and second.stage in ("runtime", "crash"),
                       f"passed={second.passed} stage={second.stage}"))

        third = await verifier.verify(request("correct-again", correct, "profile"),
                                      device=args.device)
        print(f"\n3. correct kernel again, same verifier: {describe(third)}")
        checks.append(("next candidate on the same verifier passes", "passed",
                       third.passed, f"passed={third.passed} stage={third.stage}"))
    finally:
        verifier.close()

    print("\nsummary")
    for name, want, ok, got in checks:
        print(f"  [{'ok' if ok else 'FAIL'}] {name}: expected {want}; got {got}")
    failed = [c for c in checks if not c[2]]
    print("gpu_check: " + ("all expectations hold" if not failed and len(checks) == 3
                           else f"{len(failed) or 3 - len(checks)} expectation(s) failed"))
    return 0 if not failed and len(checks) == 3 else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.gpu_check",
        description="Run the worker's CUDA verification path on this machine's GPU: a "
                    "correct kernel (profiled), an out-of-bounds store, the correct one again.")
    parser.add_argument("--device", default="0", help="CUDA device ordinal to use (default 0)")
    parser.add_argument("--arch", default="h200", help="arch name in the requests (default h200)")
    parser.add_argument("--batch", type=int, default=4096, help="batch_size (default 4096)")
    parser.add_argument("--dim", type=int, default=16384, help="dim (default 16384)")
    parser.add_argument("--trials", type=int, default=3, help="trials per candidate (default 3)")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="timeout_s of each verification, seconds (default 600)")
    args = parser.parse_args(argv)
    problem = cuda_problem()
    if problem is not None:
        print(f"gpu_check: cannot run here: {problem}", file=sys.stderr)
        return 2
    from services.common.logging import configure_logging

    configure_logging("gpu_check", "warning", "console")
    try:
        return asyncio.run(run_checks(args))
    except Exception as exc:  # noqa: BLE001 - one clear line, then the traceback
        print(f"gpu_check: the check itself failed: {type(exc).__name__}: {exc}",
              file=sys.stderr)
        raise


if __name__ == "__main__":
    sys.exit(main())
