"""The CUDA path on a real NVIDIA GPU, in one run: ``python -m bench.gpu_check``.

Prepared for a GPU machine with a CUDA build of torch and triton (the repo's venv, or
a machine's own torch with the other dependencies installed from a wheelhouse: see
the README, "Offline GPU machines"); on a machine without one it stops at once with
exit status 2 and says why.

Part ``worker``: one :class:`services.worker.verifier.Verifier` (``backend="cuda"``,
the fork server and sandbox a worker uses) checks, in order:

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

Part ``profile``: the built-in coder's kernel for three bundled tasks of different
kinds (``tasks/gelu.py`` element-wise, ``tasks/softmax.py`` a row reduction,
``tasks/matmul.py`` a matrix product), each verified in profile mode; it prints both
speedups (over eager PyTorch and over ``torch.compile``), the peak fraction and its
bound, the launch floor and the kernels the profiler recorded in the timed calls.
Each must pass with an eager speedup and a kernel list holding a Triton kernel of
the candidate and nothing ``forbidden``; ``speedup_compile`` is printed as it came
(null, with its note, when torch.compile failed).

Part ``corpus``: every candidate of ``tests/corpus`` on the same backend, with the
static check off (the dynamic checks alone, as ``tests/hostile/test_corpus.py`` runs them on
``cpu``): each hostile one must fail (its stage and message are printed beside the
stage it gets on ``cpu``), each honest one must pass. Files written for one compile
target (an ``arch`` field, e.g. shared memory beyond sm_89) are run with that arch's
compile check as on ``cpu``; the figure is how many of each held.

Part ``evolve``: the whole product path. An embedded stack (``aikg up``: NATS,
gateway, generator, one ``cuda`` worker on ``--device``) runs an evolve job over
HTTP on ``tasks/swish_chain.py`` (six eager PyTorch kernels that the built-in coder
fuses into one), 3 rounds x 4 candidates x 2 islands by default, with the built-in
coder's launch-parameter search; the job must complete and its best candidate must
have a worker-measured speedup above 1.0 over eager PyTorch.

Exit status 0 when every expectation holds, 1 when one does not, 2 when the machine
cannot run the check (no CUDA).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TASK_PATH = ROOT / "tasks" / "gelu.py"
EVOLVE_TASK_PATH = ROOT / "tasks" / "swish_chain.py"
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
        return (f"this torch ({torch.__version__}, in {sys.executable}) is a CPU-only build "
                "(torch.version.cuda is None); run with a Python that has a CUDA build of torch "
                "(README, \"Offline GPU machines\")")
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


Check = tuple[str, str, bool, str]  # (name, expected, held, what came)


async def worker_checks(args: argparse.Namespace) -> list[Check]:
    """Part ``worker``: correct kernel, out-of-bounds store, correct kernel again."""
    from schemas import VerifyRequest
    from services.common.verify_client import build_request
    from services.generator.lowering import lower_task
    from services.worker.verifier import Verifier

    shapes = {"batch_size": args.batch, "dim": args.dim}
    task = TASK_PATH.read_text()
    correct = lower_task(task, shapes)
    faulty = out_of_bounds(correct)
    tensor_bytes = 4 * args.batch * args.dim
    verifier = Verifier("cuda", worker_id="gpu-check",
                        memory_limit_bytes=max(8 << 30, 4 * tensor_bytes))
    print(f"part worker: task {TASK_PATH.relative_to(ROOT)} at {shapes} (float32, "
          f"{tensor_bytes / (1 << 20):.0f} MiB per tensor) on cuda device {args.device}",
          flush=True)
    started = time.perf_counter()
    verifier.start()
    print(f"verifier started in {time.perf_counter() - started:.1f} s "
          f"(network isolated: {verifier.network_isolated}, run as: {verifier.run_as}, "
          f"notes: {verifier.sandbox_notes or 'none'})", flush=True)

    def request(name: str, code: str, mode: str) -> VerifyRequest:
        return build_request(
            request_id=f"gpu-check-{name}", job_id="gpu-check", candidate_id=name,
            op_name="gelu", task_desc=task, code=code, backend="cuda", arch=args.arch,
            mode=mode, shape_overrides=shapes, timeout_s=args.timeout, trials=args.trials)

    checks: list[Check] = []
    try:
        first = await verifier.verify(request("correct", correct, "profile"), device=args.device)
        print(f"\n1. correct kernel, profile: {describe(first)}", flush=True)
        ok = (first.passed and first.speedup is not None and first.gen_time_us is not None
              and first.base_time_us is not None and first.gen_time_us > 0)
        checks.append(("correct kernel passes with a measured speedup",
                       "passed, speedup", ok,
                       f"passed={first.passed} speedup={first.speedup}"))

        second = await verifier.verify(request("oob-store", faulty, "verify"),
                                       device=args.device)
        print(f"\n2. out-of-bounds store: {describe(second)}", flush=True)
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
        print(f"\n3. correct kernel again, same verifier: {describe(third)}", flush=True)
        checks.append(("next candidate on the same verifier passes", "passed",
                       third.passed, f"passed={third.passed} stage={third.stage}"))
    finally:
        verifier.close()
    return checks


# Part profile: (task, its shapes) at sizes a large GPU times meaningfully.
PROFILE_TASKS = (("gelu.py", {"batch_size": 4096, "dim": 16384}),
                 ("softmax.py", {"batch_size": 4096, "dim": 16384}),
                 ("matmul.py", {"N": 4096}))


def describe_profile(result) -> str:
    """The profile fields of a result, one line each after the first."""
    def num(value, unit=""):
        return "-" if value is None else f"{value:.3g}{unit}"

    lines = [f"speedup_eager={num(result.speedup_eager, 'x')} "
             f"speedup_compile={num(result.speedup_compile, 'x')} "
             f"compile={num(result.compile_time_us, ' us')} "
             f"peak_fraction={num(result.peak_fraction)} ({result.peak_bound or '-'}) "
             f"launch_floor={num(result.launch_floor_us, ' us')}"]
    for kernel in result.profiled_kernels:
        lines.append(f"kernel {kernel.kind:<9} {kernel.name[:90]} x{kernel.count} over "
                     f"{kernel.calls} calls, {kernel.device_time_us:.1f} us each"
                     + (f" ({kernel.op})" if kernel.op else ""))
    lines += [n for n in result.notes if n.startswith(("speedup_compile", "profiled_kernels"))]
    return "\n   ".join(lines)


async def profile_checks(args: argparse.Namespace) -> list[Check]:
    """Part ``profile``: three bundled tasks, the built-in coder's kernel, profiled."""
    from services.common.verify_client import build_request
    from services.generator.lowering import lower_task
    from services.worker.verifier import Verifier

    verifier = Verifier("cuda", worker_id="gpu-check-profile", memory_limit_bytes=8 << 30)
    print(f"\npart profile: {len(PROFILE_TASKS)} bundled tasks on cuda device {args.device}",
          flush=True)
    verifier.start()
    checks: list[Check] = []
    try:
        for name, shapes in PROFILE_TASKS:
            task = (ROOT / "tasks" / name).read_text()
            code = lower_task(task, shapes)
            result = await verifier.verify(build_request(
                request_id=f"gpu-check-profile-{Path(name).stem}", job_id="gpu-check",
                candidate_id=Path(name).stem, op_name=Path(name).stem, task_desc=task,
                code=code, backend="cuda", arch=args.arch, mode="profile",
                shape_overrides=shapes, timeout_s=args.timeout, trials=args.trials),
                device=args.device)
            print(f"\n{name} at {shapes}: {describe(result)}\n   {describe_profile(result)}",
                  flush=True)
            kinds = {k.kind for k in result.profiled_kernels}
            ok = (result.passed and result.speedup_eager is not None and "triton" in kinds
                  and "forbidden" not in kinds and result.peak_fraction is not None
                  and result.launch_floor_us is not None)
            checks.append((f"{name} profiled: both speedups, peak fraction, kernel list",
                           "passed, a Triton kernel listed, none forbidden", ok,
                           f"passed={result.passed} stage={result.stage} kinds={sorted(kinds)} "
                           f"speedup_compile={result.speedup_compile}"))
    finally:
        verifier.close()
    return checks


async def corpus_checks(args: argparse.Namespace, backend: str = "cuda",
                        only: list[str] | None = None) -> list[Check]:
    """Part ``corpus``: the hostile candidates fail, the honest ones pass (``only``: these
    file stems); two checks, with the counts as what came."""
    from services.common.verify_client import build_request
    from services.worker import verifier as verifier_module
    from services.worker.verifier import Verifier
    from tests.corpus import TASKS, files, load

    verifier = Verifier(backend, worker_id="gpu-check-corpus", memory_limit_bytes=8 << 30)
    print(f"\npart corpus: tests/corpus on {backend} device {args.device}, static check off",
          flush=True)
    verifier.start()
    static = verifier_module.check_candidate
    verifier_module.check_candidate = lambda code, dsl="triton": []
    held = {"hostile": [0, 0], "honest": [0, 0]}
    try:
        for kind in ("hostile", "honest"):
            for path in files(kind):
                if only is not None and path.stem not in only:
                    continue
                code, meta = load(path)
                request = build_request(
                    request_id=f"gpu-check-corpus-{path.stem}", job_id="gpu-check",
                    candidate_id=path.stem, op_name=path.stem, task_desc=TASKS[meta["task"]],
                    code=code, backend=backend, arch=meta.get("arch", args.arch or "h200"),
                    timeout_s=args.timeout, trials=meta.get("trials", 3),
                    shape_overrides=meta.get("shape_overrides", {}))
                result = await verifier.verify(request, device=args.device)
                ok = not result.passed if kind == "hostile" else result.passed
                held[kind][0] += ok
                held[kind][1] += 1
                print(f"  [{'ok' if ok else 'FAIL'}] {kind} {path.stem}: passed={result.passed}"
                      f" stage={result.stage} (cpu: {'/'.join(meta.get('stage', ['pass']))}) "
                      f"{(result.error or '')[:160]!r}", flush=True)
    finally:
        verifier_module.check_candidate = static
        verifier.close()
    return [("hostile corpus candidates fail", "all", held["hostile"][0] == held["hostile"][1],
             f"{held['hostile'][0]} of {held['hostile'][1]}"),
            ("honest corpus candidates pass", "all", held["honest"][0] == held["honest"][1],
             f"{held['honest'][0]} of {held['honest'][1]}")]


def evolve_checks(args: argparse.Namespace, backend: str = "cuda") -> list[Check]:
    """Part ``evolve``: an evolve job through ``aikg up``'s stack with one worker.

    ``backend`` is ``cuda`` here; ``cpu`` (with ``args.arch`` None) runs the same
    plumbing without a GPU, where the speedup expectation cannot hold.
    """
    from services.cli.render import event_line
    from services.common.runtime import free_port
    from services.common.settings import load_settings
    from services.sdk import AIKGClient
    from services.stack import local_stack

    shapes = {"batch_size": args.batch, "dim": args.dim}
    log_dir = Path(args.log_dir) if args.log_dir else Path(
        tempfile.mkdtemp(prefix="aikg-gpu-check-"))
    settings = load_settings()
    print(f"\npart evolve: task {EVOLVE_TASK_PATH.relative_to(ROOT)} at {shapes}, "
          f"{args.rounds} rounds x {args.parallel} candidates x {args.islands} islands on "
          f"{backend}/{args.arch or 'any'} device {args.device}; service logs in {log_dir}",
          flush=True)
    started = time.monotonic()
    checks: list[Check] = []
    with local_stack(settings, host="127.0.0.1", port=free_port(), backend=backend,
                     arch=args.arch, devices=args.device, store_dir=None, log_dir=log_dir,
                     verbose=False, ready_timeout=300.0,
                     stopping=threading.Event()) as stack:
        print(f"stack up in {time.monotonic() - started:.1f} s: {stack.describe()}",
              flush=True)
        with AIKGClient(stack.gateway_url, token=settings.api_token or None) as client:
            job_id = client.submit_job(
                EVOLVE_TASK_PATH.stem, EVOLVE_TASK_PATH.read_text(), job_type="evolve",
                backend=backend, arch=args.arch, coder="builtin", max_rounds=args.rounds,
                parallel_num=args.parallel, num_islands=args.islands, shape_overrides=shapes)
            print(f"submitted evolve job {job_id}", flush=True)
            deadline = time.monotonic() + args.evolve_timeout
            for event in client.stream_events(job_id):
                print("  " + event_line(event).plain, flush=True)
                if time.monotonic() > deadline:
                    client.cancel_job(job_id)
                    print(f"  cancelled: no end within {args.evolve_timeout:g} s")
                    break
            record = client.get_job_status(job_id)
    if args.record_out:
        Path(args.record_out).write_text(json.dumps(record, indent=1))
    if not args.log_dir and record.get("status") == "completed":
        shutil.rmtree(log_dir, ignore_errors=True)
    summary = record.get("evolve") or {}
    candidates = summary.get("candidates", [])
    print(f"\njob {job_id}: status {record.get('status')}, fitness "
          f"{summary.get('fitness')}, {len(candidates)} candidates, "
          f"{len(summary.get('migrations', []))} migrations, "
          f"{time.monotonic() - started:.0f} s")
    print(f"  round island {'candidate':<10} {'params':<46} passed speedup")
    for c in candidates:
        params = ",".join(f"{k}={v}" for k, v in sorted((c.get("params") or {}).items()))
        speedup = f"{c['speedup']:.2f}x" if c.get("speedup") is not None else "-"
        print(f"  {c.get('round', '?'):>5} {c.get('island', '?'):>6} "
              f"{str(c.get('candidate_id')).removeprefix(job_id + '-'):<10} {params[:46]:<46} "
              f"{str(c.get('passed')):<6} {speedup}")
    result = record.get("result") or {}
    best = (result.get("best") or [None])[0] or {}
    print(f"best: {best.get('candidate_id')} speedup={best.get('speedup')} "
          f"kernel={best.get('gen_time_us')} us eager={best.get('base_time_us')} us "
          f"params={best.get('params')}")
    checks.append(("evolve job completes", "status completed, passed",
                   record.get("status") == "completed" and bool(result.get("passed")),
                   f"status={record.get('status')} passed={result.get('passed')} "
                   f"error={record.get('error')!r}"))
    speedup = best.get("speedup")
    checks.append(("best evolve candidate beats eager PyTorch", "worker-measured speedup > 1.0",
                   bool(best.get("passed")) and speedup is not None and speedup > 1.0
                   and best.get("gen_time_us") is not None,
                   f"speedup={speedup}"))
    return checks


def run_checks(args: argparse.Namespace) -> int:
    """Run the selected parts; print a summary; 0 when every expectation holds, else 1."""
    from services.stack import StackError

    checks: list[Check] = []
    expected = 0
    if "worker" in args.parts:
        expected += 3
        checks += asyncio.run(worker_checks(args))
    if "profile" in args.parts:
        expected += len(PROFILE_TASKS)
        checks += asyncio.run(profile_checks(args))
    if "corpus" in args.parts:
        expected += 2
        checks += asyncio.run(corpus_checks(args))
    if "evolve" in args.parts:
        expected += 2
        try:
            checks += evolve_checks(args)
        except StackError as exc:
            print(f"the stack did not come up: {exc}", flush=True)
    print("\nsummary")
    for name, want, ok, got in checks:
        print(f"  [{'ok' if ok else 'FAIL'}] {name}: expected {want}; got {got}")
    failed = sum(not c[2] for c in checks) + expected - len(checks)
    print("gpu_check: " + ("all expectations hold" if not failed
                           else f"{failed} expectation(s) failed"))
    return 0 if not failed else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.gpu_check",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run AIKG's CUDA path on this machine's GPU. Part worker: a correct "
                    "kernel (profiled), an out-of-bounds store, the correct one again, on "
                    "one Verifier. Part profile: three bundled tasks profiled (both "
                    "speedups, peak fraction, kernel list). Part corpus: tests/corpus's hostile candidates must fail, "
                    "its honest ones pass. Part evolve: an evolve job through a local stack whose "
                    "best candidate must beat eager PyTorch.",
        epilog="needs: an NVIDIA GPU, a CUDA build of torch and triton in this Python, the\n"
               "project's other dependencies; GPU memory: a few tensors of batch x dim float32\n"
               "(256 MiB each at the defaults) plus a 256 MiB L2-flush buffer.\n"
               "time: each verification compiles its kernel (seconds) and runs 3 trials and 20\n"
               "timed repeats; the evolve part verifies rounds x parallel candidates one after\n"
               "another on one device and is cancelled after --evolve-timeout seconds.\n"
               "exit status: 0 every expectation holds, 1 one does not, 2 no usable GPU here.")
    parser.add_argument("--parts", nargs="+",
                        choices=("worker", "profile", "corpus", "evolve"),
                        default=["worker", "profile", "corpus", "evolve"],
                        help="parts to run (default all four)")
    parser.add_argument("--device", default="0", help="CUDA device ordinal to use (default 0)")
    parser.add_argument("--arch", default="h200",
                        help="arch label of the worker and the requests, not a compile target "
                             "(default h200)")
    parser.add_argument("--batch", type=int, default=4096, help="batch_size (default 4096)")
    parser.add_argument("--dim", type=int, default=16384, help="dim (default 16384)")
    parser.add_argument("--trials", type=int, default=3, help="trials per candidate (default 3)")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="timeout_s of each verification, seconds (default 600)")
    parser.add_argument("--rounds", type=int, default=3, help="evolve max_rounds (default 3)")
    parser.add_argument("--parallel", type=int, default=4,
                        help="evolve parallel_num (default 4)")
    parser.add_argument("--islands", type=int, default=2, help="evolve num_islands (default 2)")
    parser.add_argument("--evolve-timeout", type=float, default=420.0,
                        help="seconds the evolve job may take before it is cancelled "
                             "(default 420)")
    parser.add_argument("--log-dir", help="where the stack's service logs go "
                                          "(default a new temp dir)")
    parser.add_argument("--record-out", help="write the evolve job's final record (JSON) here")
    args = parser.parse_args(argv)
    problem = cuda_problem()
    if problem is not None:
        print(f"gpu_check: cannot run here: {problem}", file=sys.stderr)
        return 2
    from services.common.logging import configure_logging

    configure_logging("gpu_check", "warning", "console")
    try:
        return run_checks(args)
    except Exception as exc:  # noqa: BLE001 - one clear line, then the traceback
        print(f"gpu_check: the check itself failed: {type(exc).__name__}: {exc}",
              file=sys.stderr)
        raise


if __name__ == "__main__":
    sys.exit(main())
