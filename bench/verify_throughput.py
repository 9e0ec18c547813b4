"""Verifications per minute of a tiny task: the worker's warm pool vs a cold process each.

``python -m bench.verify_throughput`` (or ``make bench``). The task is
``tasks/relu.py`` at 16 x 1024 float32 on the ``cpu`` backend (Triton's interpreter);
the candidate is the built-in coder's kernel for it (its ``cpu`` launch parameters,
``launch_defaults``). Two ways to verify it, run
interleaved in one process so both see the same machine load:

* **warm pool**: :class:`services.worker.verifier.Verifier`, as a worker runs it: a
  fork server that imported torch and triton once forks a sandboxed child per
  candidate and another per reference run. Measured with the reference outputs
  cached (a job's later candidates for the same task) and, separately, computed
  every time (a new task: each request's task source differs by a comment).
* **cold process**: one fresh ``python`` per candidate that imports torch and triton,
  execs the task and the candidate, runs both for the same seeds and compares, as
  AIKG's HTTP workers and KernelBench's evaluation scripts do.

Both do three trials (seeds 1000-1002) per candidate. The warm pool's one-off start
(the fork server's imports) is printed but not counted: a worker pays it once.
Exit status 1 when a verification does not pass (the numbers would be meaningless).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import add_number_options

ROOT = Path(__file__).resolve().parent.parent
TASK_PATH = ROOT / "tasks" / "relu.py"
SHAPES = {"batch_size": 16, "dim": 1024}
TRIALS = 3

# What a cold evaluation does: a fresh interpreter imports torch and triton, runs the
# reference and the candidate for each seed, and compares. argv: task, candidate,
# shape overrides (JSON), trials.
COLD_SCRIPT = r'''
import json
import sys

import torch
import triton  # noqa: F401  (the candidate imports it too; counted either way)

task_path, candidate_path, overrides, trials = sys.argv[1:5]
task = {"__name__": "task"}
exec(compile(open(task_path).read(), task_path, "exec"), task)
task.update(json.loads(overrides))
candidate = {"__name__": "candidate"}
exec(compile(open(candidate_path).read(), candidate_path, "exec"), candidate)
passed = True
for seed in range(1000, 1000 + int(trials)):
    torch.manual_seed(seed)
    init = task["get_init_inputs"]()
    torch.manual_seed(seed)
    model = task["Model"](*init)
    torch.manual_seed(seed)
    model_new = candidate["ModelNew"](*init)
    torch.manual_seed(seed)
    inputs = task["get_inputs"]()
    with torch.no_grad():
        expected = model(*[x.clone() for x in inputs])
        got = model_new(*[x.clone() for x in inputs])
    passed = passed and got.shape == expected.shape and torch.allclose(
        got, expected, atol=1e-5, rtol=1e-5)
print("PASS" if passed else "FAIL")
'''


def per_minute(count: int, seconds: float) -> float:
    return 60.0 * count / seconds if seconds > 0 else float("inf")


class Cold:
    """One fresh ``python`` per candidate."""

    def __init__(self, workdir: Path, task: str, candidate: str,
                 shapes: dict[str, int] | None = None, trials: int = TRIALS) -> None:
        self.shapes = dict(SHAPES if shapes is None else shapes)
        self.trials = trials
        self.script = workdir / "cold_verify.py"
        self.script.write_text(COLD_SCRIPT)
        self.task = workdir / "task.py"
        self.task.write_text(task)
        self.candidate = workdir / "candidate.py"
        self.candidate.write_text(candidate)
        # The cpu backend's settings: Triton in its interpreter, read at import.
        self.env = {**os.environ, "TRITON_INTERPRET": "1"}
        self.seconds = 0.0
        self.count = 0
        self.failures = 0

    def run_one(self) -> None:
        started = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, str(self.script), str(self.task), str(self.candidate),
             json.dumps(self.shapes), str(self.trials)],
            env=self.env, capture_output=True, text=True, timeout=300)
        self.seconds += time.perf_counter() - started
        self.count += 1
        if proc.returncode != 0 or proc.stdout.strip() != "PASS":
            self.failures += 1
            print(f"cold run failed (exit {proc.returncode}): "
                  f"{(proc.stdout + proc.stderr)[-2000:]}", file=sys.stderr)


class Warm:
    """The worker's Verifier: one fork server, a sandboxed child per run."""

    def __init__(self, workdir: Path, task: str, candidate: str) -> None:
        from services.worker.verifier import Verifier

        self.verifier = Verifier("cpu", worker_id="bench", scratch_root=workdir / "verifier",
                                 memory_limit_bytes=1 << 30)
        self.task = task
        self.candidate = candidate
        self.seconds = {True: 0.0, False: 0.0}
        self.count = {True: 0, False: 0}
        self.failures = 0
        self.start_s = 0.0
        self._n = 0

    def start(self) -> None:
        started = time.perf_counter()
        self.verifier.start()
        self.start_s = time.perf_counter() - started

    async def run_one(self, cached: bool) -> None:
        from services.common.verify_client import build_request

        self._n += 1
        # A different source is a different task to the reference cache.
        task = self.task if cached else f"{self.task}\n# bench variant {self._n}\n"
        request = build_request(
            request_id=f"bench-{self._n}", job_id="bench", candidate_id=f"c{self._n}",
            op_name="relu", task_desc=task, code=self.candidate, backend="cpu",
            arch="bench", shape_overrides=dict(SHAPES), trials=TRIALS, timeout_s=300.0)
        started = time.perf_counter()
        result = await self.verifier.verify(request, device="0")
        self.seconds[cached] += time.perf_counter() - started
        self.count[cached] += 1
        if not result.passed:
            self.failures += 1
            print(f"warm run failed: {result.stage}: {result.error}", file=sys.stderr)

    def close(self) -> None:
        self.verifier.close()


async def bench(warm_n: int, uncached_n: int, cold_n: int) -> int:
    from services.generator.coders.base import launch_defaults
    from services.generator.lowering import lower_task

    task = TASK_PATH.read_text()
    candidate = lower_task(task, SHAPES, **launch_defaults("cpu"))
    with tempfile.TemporaryDirectory(prefix="aikg-bench-") as tmp:
        workdir = Path(tmp)
        warm = Warm(workdir, task, candidate)
        cold = Cold(workdir, task, candidate)
        print(f"task {TASK_PATH.relative_to(ROOT)} with {SHAPES}, cpu backend (Triton "
              f"interpreter), {TRIALS} trials per candidate; {os.cpu_count()} CPUs")
        warm.start()
        print(f"warm pool start (once per worker, not counted): {warm.start_s:.2f} s")
        try:
            # The first run fills the reference cache; it is not counted.
            await warm.run_one(cached=True)
            warm.seconds[True] = 0.0
            warm.count[True] = 0
            # Interleaved, so that both face the same load on a shared machine.
            rounds = max(warm_n, uncached_n, cold_n)
            for i in range(rounds):
                if i < cold_n:
                    await asyncio.to_thread(cold.run_one)
                for _ in range(_share(i, warm_n, rounds)):
                    await warm.run_one(cached=True)
                for _ in range(_share(i, uncached_n, rounds)):
                    await warm.run_one(cached=False)
        finally:
            warm.close()

    rows = [
        ("warm pool, reference cached", warm.count[True], warm.seconds[True]),
        ("warm pool, reference computed", warm.count[False], warm.seconds[False]),
        ("cold python per candidate", cold.count, cold.seconds),
    ]
    print()
    print(f"{'':32} {'runs':>5} {'s/run':>8} {'per min':>9}")
    for name, count, seconds in rows:
        if count:
            print(f"{name:32} {count:5d} {seconds / count:8.3f} "
                  f"{per_minute(count, seconds):9.1f}")
    if cold.count and cold.seconds:
        cold_rate = per_minute(cold.count, cold.seconds)
        for name, count, seconds in rows[:2]:
            if count:
                print(f"ratio {name} / cold: {per_minute(count, seconds) / cold_rate:.1f}x")
    if warm.failures or cold.failures:
        print(f"FAILED verifications: warm {warm.failures}, cold {cold.failures}",
              file=sys.stderr)
        return 1
    return 0


def _share(i: int, total: int, rounds: int) -> int:
    """How many of ``total`` runs go in round ``i`` of ``rounds`` (spread evenly)."""
    return (total * (i + 1)) // rounds - (total * i) // rounds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.verify_throughput",
        description="Verifications per minute of tasks/relu.py (16 x 1024) on the cpu "
                    "backend: the worker's warm pool vs one fresh python per candidate.")
    add_number_options(parser, (
        ("--warm", int, 20, "warm-pool verifications with the reference cached"),
        ("--uncached", int, 10, "warm-pool verifications computing the reference"),
        ("--cold", int, 5, "cold-process verifications"),
    ))
    args = parser.parse_args(argv)
    if min(args.warm, args.uncached, args.cold) < 0 or args.cold == 0:
        parser.error("counts must be >= 0, and --cold >= 1 (the ratio needs it)")
    from services.common.logging import configure_logging

    configure_logging("bench", "warning", "console")
    return asyncio.run(bench(args.warm, args.uncached, args.cold))


if __name__ == "__main__":
    sys.exit(main())
