"""The service's speed figures, side by side in one run, on the ``cpu`` backend.

``python -m bench.speed`` prints:

* **(a) burst throughput through the bus**: ``--burst`` one-trial verify requests of
  ``tasks/relu.py`` at ``--rows`` x 4096 (64 x 4096 unless told) published at once on
  ``verify.cpu.<arch>`` to one ``aikg worker`` process with one device (an embedded
  nats-server), first publish to last verdict; beside it one cold ``python`` per
  candidate doing the same check (:class:`bench.verify_throughput.Cold`, one trial),
  and the ratio.
* **(b) one three-trial verification, sequential**: ``--seq`` calls each through
  :class:`~services.sdk.workers.RemoteWorker` (to that worker) and
  :class:`~services.sdk.workers.LocalWorker` (in this process), interleaved; p50 and
  p95 of each and the difference of the p50s (what the bus costs).
* **(c) small-job latency**: submit to verdict of ``tasks/relu.py`` as single jobs on
  an idle ``aikg up`` (:func:`bench.job_latency.measure`), p50 of ``--jobs``.
* **(d) what the checks cost**: ``--checks`` three-trial verifications in this process
  (a :class:`~services.worker.verifier.Verifier`, no bus) with every check, and beside
  them without the GPU compile check, against the candidate's own three forward calls
  in a warm process (three times the median of its own run).

Each part also prints the median of every verification phase the worker reported
(``VerifyResult.phases``) when it reports them. The load average is printed at the
start and the end: the figures mean little on a machine that is busy elsewhere.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import add_number_options, stop_process
from bench.job_latency import measure as job_latencies
from bench.job_latency import p95
from bench.verify_throughput import Cold

ROOT = Path(__file__).resolve().parent.parent
TASK_PATH = ROOT / "tasks" / "relu.py"
ROWS, DIM = 64, 4096  # the relu input's default rows (--rows) and its width
ARCH = "bench"


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def phase_medians(results: list[Any]) -> str:
    """``name median_s`` of each phase the results carry, in first-seen order."""
    spans: dict[str, list[float]] = {}
    for r in results:
        for name, seconds in (getattr(r, "phases", None) or {}).items():
            spans.setdefault(name, []).append(seconds)
    if not spans:
        return "(no phases reported)"
    return ", ".join(f"{k} {statistics.median(v):.3f}" for k, v in spans.items())


@contextlib.contextmanager
def nats_and_worker(workdir: Path):
    """An embedded nats-server and one ``aikg worker`` process (cpu, device 0); yields
    the NATS URL once the worker's heartbeat is in the ``workers`` bucket."""
    from services.common.embedded import EmbeddedNatsServer

    server = EmbeddedNatsServer(workdir / "nats")
    server.start()
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIKG_")}
    env.update(PYTHONPATH=str(ROOT), AIKG_NATS_URL=server.url, AIKG_WORKER_ARCH=ARCH,
               AIKG_WORKER_ID="bench-worker", AIKG_METRICS_PORT="-1", AIKG_LOG_LEVEL="warning")
    log = (workdir / "worker.log").open("wb")
    proc = subprocess.Popen([sys.executable, "-m", "services.cli", "worker", "--backend", "cpu",
                             "--devices", "0"], cwd=ROOT, env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        asyncio.run(_wait_worker(server.url, proc, workdir / "worker.log"))
        yield server.url
    finally:
        stop_process(proc, 60)
        log.close()
        server.stop()


async def _wait_worker(url: str, proc: subprocess.Popen, log: Path) -> None:
    import nats

    nc = await nats.connect(url)
    try:
        from services.common.bus import bucket_entries

        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"the worker exited; see {log}")
            with contextlib.suppress(Exception):
                if await bucket_entries(nc.jetstream(), "workers"):
                    return
            await asyncio.sleep(0.2)
        raise RuntimeError(f"no worker heartbeat in 300 s; see {log}")
    finally:
        await nc.close()


async def burst(url: str, task: str, code: str, n: int, shapes: dict[str, int]
                ) -> tuple[float, list[Any]]:
    """Seconds from the first publish of ``n`` one-trial requests to the last verdict."""
    from services.sdk.workers import RemoteWorker

    remote = RemoteWorker(url, backend="cpu", arch=ARCH)
    try:
        await remote.verify(task, code, "relu", shape_overrides=shapes, trials=1)  # warm-up
        started = time.perf_counter()
        results = await asyncio.gather(*(
            remote.verify(task, code, "relu", shape_overrides=shapes, trials=1)
            for _ in range(n)))
        elapsed = time.perf_counter() - started
    finally:
        await remote.close()
    failed = [r for r in results if not r.passed]
    if failed:
        raise RuntimeError(f"burst verification failed: {failed[0].stage}: {failed[0].error}")
    return elapsed, results


async def sequential(url: str, task: str, code: str, n: int, shapes: dict[str, int]
                     ) -> dict[str, tuple[list[float], list[Any]]]:
    """``n`` three-trial verifications one at a time through each worker, interleaved."""
    from services.sdk.workers import LocalWorker, RemoteWorker

    remote = RemoteWorker(url, backend="cpu", arch=ARCH)
    local = LocalWorker([0], backend="cpu", arch=ARCH)
    await local.start()
    out: dict[str, tuple[list[float], list[Any]]] = {"RemoteWorker": ([], []),
                                                     "LocalWorker": ([], [])}
    try:
        for worker in (remote, local):  # warm-up: each worker's reference cache
            await worker.verify(task, code, "relu", shape_overrides=shapes, trials=3)
        for _ in range(n):
            for name, worker in (("RemoteWorker", remote), ("LocalWorker", local)):
                started = time.perf_counter()
                result = await worker.verify(task, code, "relu", shape_overrides=shapes,
                                             trials=3)
                out[name][0].append(time.perf_counter() - started)
                out[name][1].append(result)
                if not result.passed:
                    raise RuntimeError(f"{name} verification failed: {result.stage}: "
                                       f"{result.error}")
    finally:
        await remote.close()
        await local.close()
    return out


_OWN_RUN = """
import importlib.util, statistics, sys, time, torch
spec = importlib.util.spec_from_file_location("candidate", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
model, x = module.ModelNew(), torch.randn(int(sys.argv[2]), int(sys.argv[3]))
model(x)
times = []
for _ in range(5):
    started = time.perf_counter()
    model(x)
    times.append(time.perf_counter() - started)
print(statistics.median(times))
"""


def own_run(workdir: Path, code: str, rows: int) -> float:
    """Seconds of one warm ``ModelNew.forward`` of ``code`` on the ``rows`` x 4096 input in
    Triton's interpreter, outside any sandbox: the floor under one trial's time."""
    path = workdir / "own_run_candidate.py"
    path.write_text(code)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", _OWN_RUN, str(path), str(rows), str(DIM)],
                         env=env, check=True, capture_output=True, text=True, timeout=300)
    return float(out.stdout.split()[-1])


async def checks(task: str, code: str, n: int, shapes: dict[str, int]
                 ) -> dict[str, tuple[list[float], list[Any]]]:
    """``n`` three-trial verifications in this process, one at a time, with every check
    and then without the GPU compile check (``aot_target="none"``), interleaved."""
    from services.common.verify_client import build_request
    from services.worker.verifier import Verifier

    verifiers = {"every check": Verifier("cpu", worker_id="bench-checks",
                                         memory_limit_bytes=1 << 30),
                 "no compile check": Verifier("cpu", worker_id="bench-nocompile",
                                              memory_limit_bytes=1 << 30, aot_target="none")}
    out: dict[str, tuple[list[float], list[Any]]] = {k: ([], []) for k in verifiers}
    try:
        for v in verifiers.values():
            await asyncio.to_thread(v.start)
        for i in range(n + 1):  # the first round warms up (compile cache)
            for name, v in verifiers.items():
                request = build_request(request_id=f"checks-{name[:2]}-{i}", job_id="bench",
                                        candidate_id="c", op_name="relu", task_desc=task,
                                        code=code, backend="cpu", arch=ARCH,
                                        shape_overrides=shapes, trials=3)
                started = time.perf_counter()
                result = await v.verify(request, device="0")
                if not result.passed:
                    raise RuntimeError(f"{name}: {result.stage}: {result.error}")
                if i:
                    out[name][0].append(time.perf_counter() - started)
                    out[name][1].append(result)
    finally:
        for v in verifiers.values():
            v.close()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.speed",
                                     description=__doc__.split("\n\n")[0])
    add_number_options(parser, (
        ("--burst", int, 20, "one-trial requests in the burst"),
        ("--cold", int, 3, "cold-process verifications"),
        ("--seq", int, 20, "sequential three-trial verifications per worker"),
        ("--jobs", int, 10, "small jobs"),
        ("--checks", int, 10, "in-process three-trial verifications for (d)"),
    ))
    parser.add_argument("--rows", type=int, default=ROWS,
                        help=f"rows of the relu input, each {DIM} wide (default {ROWS})")
    parser.add_argument("--parts", nargs="+", default=["a", "b", "c", "d"],
                        choices=["a", "b", "c", "d"])
    parser.add_argument("--block-size", type=int, default=None,
                        help="block_size of the candidate for (a) and (b) (default: what the "
                             "built-in coder uses on cpu, services.generator.coders.base."
                             "CPU_BLOCK_SIZE; 1024 is its GPU default)")
    args = parser.parse_args(argv)
    from services.common.logging import configure_logging
    from services.generator.coders.base import launch_defaults
    from services.generator.lowering import lower_task

    configure_logging("bench", "warning", "console")
    task = TASK_PATH.read_text()
    params = launch_defaults("cpu")
    if args.block_size is not None:
        params["block_size"] = args.block_size
    shapes = {"batch_size": args.rows, "dim": DIM}  # tasks/relu.py's size names
    code = lower_task(task, shapes, **params)
    print(f"{os.cpu_count()} CPUs; load average at start {load()}")
    lines: list[str] = []
    # figure -> (value, target, whether it is met)
    met: dict[str, tuple[str, str, bool]] = {}
    with tempfile.TemporaryDirectory(prefix="aikg-speed-") as tmp:
        workdir = Path(tmp)
        if {"a", "b", "d"} & set(args.parts):
            own = own_run(workdir, code, args.rows)
            lines.append(f"candidate: built-in coder, block_size {params['block_size']}; its own "
                         f"forward at {args.rows} x {DIM}, interpreted in one warm process: "
                         f"{own:.3f} s (median of 5)")
            print(lines[-1], flush=True)
        if {"a", "b"} & set(args.parts):
            with nats_and_worker(workdir) as url:
                if "a" in args.parts:
                    elapsed, results = asyncio.run(burst(url, task, code, args.burst, shapes))
                    per = elapsed / args.burst
                    cold = Cold(workdir, task, code, shapes=shapes, trials=1)
                    for _ in range(args.cold):
                        cold.run_one()
                    cold_per = cold.seconds / cold.count
                    met["(a) ratio to one cold python per candidate"] = (
                        f"{cold_per / per:.1f}x", ">= 10x", cold_per / per >= 10)
                    lines += [
                        f"(a) burst of {args.burst} one-trial verifications through the bus: "
                        f"{per:.3f} s each ({60 / per:.0f}/min); cold python per candidate: "
                        f"{cold_per:.3f} s each; ratio {cold_per / per:.1f}x",
                        f"    worker phases (median s): {phase_medians(results)}"]
                    print(lines[-2], flush=True)
                if "b" in args.parts:
                    seq = asyncio.run(sequential(url, task, code, args.seq, shapes))
                    p50 = {}
                    for name, (times, results) in seq.items():
                        p50[name] = statistics.median(times)
                        lines += [f"(b) {name:<12} three trials, sequential: p50 "
                                  f"{p50[name]:.3f} s, p95 {p95(times):.3f} s",
                                  f"    phases (median s): {phase_medians(results)}"]
                    bus_ms = (p50['RemoteWorker'] - p50['LocalWorker']) * 1000
                    lines.append("(b) bus overhead (RemoteWorker p50 - LocalWorker p50): "
                                 f"{bus_ms:+.0f} ms")
                    met["(b) RemoteWorker three-trial p50"] = (
                        f"{p50['RemoteWorker']:.3f} s", "<= 0.6 s", p50["RemoteWorker"] <= 0.6)
                    met["(b) bus overhead"] = (f"{bus_ms:+.0f} ms", "<= 20 ms", bus_ms <= 20)
                    print("\n".join(lines[-5:]), flush=True)
        if "d" in args.parts:
            runs = asyncio.run(checks(task, code, args.checks, shapes))
            p50 = {name: statistics.median(times) for name, (times, _) in runs.items()}
            ratio = p50["every check"] / (3 * own)
            for name, (times, results) in runs.items():
                lines += [f"(d) {name:<16} three-trial verification in this process: p50 "
                          f"{p50[name]:.3f} s, p95 {p95(times):.3f} s",
                          f"    phases (median s): {phase_medians(results)}"]
            lines.append(f"(d) the candidate's own three calls: {3 * own:.3f} s; every check "
                         f"costs {ratio:.2f}x that, the compile check (cached) "
                         f"{(p50['every check'] - p50['no compile check']) * 1000:+.0f} ms")
            met["(d) three-trial verification / the candidate's own three calls"] = (
                f"{ratio:.2f}x", "<= 1.5x", ratio <= 1.5)
            print("\n".join(lines[-5:]), flush=True)
        if "c" in args.parts:
            job_phases: dict[str, list[float]] = {}
            times = job_latencies(ROOT, workdir, task, args.jobs, job_phases)
            met["(c) small job p50"] = (f"{statistics.median(times):.3f} s", "<= 1.5 s",
                                        statistics.median(times) <= 1.5)
            lines += [f"(c) small job (tasks/relu.py, builtin coder, idle aikg up), submit "
                      f"to verdict: p50 {statistics.median(times):.3f} s, p95 "
                      f"{p95(times):.3f} s over {len(times)}",
                      "    job phases (median s): " + (", ".join(
                          f"{k} {statistics.median(v):.3f}" for k, v in job_phases.items())
                          or "(none reported)")]
            print("\n".join(lines[-2:]), flush=True)
    print(f"\nload average at end {load()}")
    print("\nsummary (the figures above, together):")
    print("\n".join(lines))
    print(f"\ntargets (for a 2-core machine with nothing else running; (b) from {args.seq} "
          "sequential verifications per worker):")
    for name, (value, target, ok) in met.items():
        print(f"  {name}: {value} (target {target}): {'met' if ok else 'missed'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
