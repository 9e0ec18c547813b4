"""The edit-verify loop, side by side in one run, on the ``cpu`` backend: what a user
waits for between saving a kernel and reading its verdict, with no stack started.

``python -m bench.verify_loop`` prints, each a fresh ``aikg`` process as a user runs it
(``tasks/relu.py`` and a hand-written relu kernel, ``--trials`` trials):

* **(a) a first and a second ``aikg verify``**: each starts its own sandbox (the fork
  server imports torch and triton, the probe runs), then verifies;
* **(b) ``aikg verify --watch``**: the first verdict, then ``--saves`` saves of the
  kernel (its modification time touched), each timed from the save to the verdict on
  stdout; the median, and the ratio of (a)'s second verify to it;
* **(c) a refusal the static check decides** (``torch.relu`` in ``forward``): the way
  ``aikg verify`` answered it before (a fresh ``python`` with the CLI imported that
  calls ``LocalWorker.verify``, which starts the sandbox before the check) beside
  ``aikg verify`` now (the verdict from the source, no sandbox, no torch), and the
  ratio;
* **(d) a refusal that needs the task's code run** (``aikg run`` of a task whose Model
  holds a constant tensor, which the built-in coder declines only once torch.export
  has traced it in the sandboxed lowering): the whole ``aikg run``, and in a fresh
  ``python`` where its time goes: the lowering sandbox's start (its fork server
  imports torch and lowers a small task once) and the lowering child.

Beside the wall time of each fresh process, the CPU seconds it and its children used
(the fork servers, the sandboxed children): on a busy machine the wall times stretch,
the CPU seconds much less. The load average is printed at the start and the end.
Never gates CI (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TASK = ROOT / "tasks" / "relu.py"
_SCRIPT = Path(sys.executable).parent / "aikg"
AIKG = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "services.cli"]

# A hand-written relu kernel that passes: the corpus's (tests/corpus/honest/).
KERNEL = (ROOT / "tests" / "corpus" / "honest" / "elementwise_relu.py").read_text()
# The same kernel with torch doing the work in forward: the static check's S007.
REFUSED = KERNEL.replace("        x = x.contiguous()\n",
                         "        x = torch.relu(x).contiguous()\n")

# A task the built-in coder declines only after tracing it: a constant tensor in forward.
CONSTANT_TASK = '''\
import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, x):
        return x + torch.tensor([1.0, 2.0]).sum()


def get_inputs():
    return [torch.randn(2, 4, 16)]


def get_init_inputs():
    return []
'''

# How `aikg verify` answered before the early refusal: the CLI's imports, then
# LocalWorker.verify, which starts the sandbox and only then runs the static check.
OLD_VERIFY = '''\
import asyncio, sys
import services.cli  # noqa: F401 - the CLI's own imports, as `aikg verify` pays them
from services.sdk import LocalWorker

async def main():
    worker = LocalWorker(["0"], backend="cpu", client_command="aikg verify")
    try:
        result = await worker.verify(open(sys.argv[1]).read(), open(sys.argv[2]).read(),
                                     "relu", trials=int(sys.argv[3]))
    finally:
        await worker.close()
    print(result.stage)

asyncio.run(main())
'''

# Where `aikg run`'s refusal of CONSTANT_TASK spends its time: the SDK's lowering
# sandbox (services/sdk/task.py), started, then one lowering child.
LOWERING_SPLIT = '''\
import asyncio, sys, time
from services.generator.coders.base import launch_defaults, lowering_sandbox
from services.generator.coders.lowering_role import lower_in_sandbox
from services.generator.lowering.errors import LoweringError

started = time.monotonic()
sandbox = lowering_sandbox("bench-loop")
sandbox.start()
ready = time.monotonic()
try:
    asyncio.run(lower_in_sandbox(sandbox, open(sys.argv[1]).read(), {},
                                 launch_defaults("cpu"), timeout_s=60))
    declined = False
except LoweringError:
    declined = True
finally:
    sandbox.close()
print(f"{ready - started:.3f} {time.monotonic() - ready:.3f} {declined}")
'''


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def children_cpu() -> float:
    """CPU seconds (user + system) of this process's waited-for children so far."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def timed(args: list[str], env: dict[str, str], expect: int) -> tuple[float, float]:
    """Run ``args``; seconds from start to exit, and the CPU seconds it and its
    children (the fork servers, the sandboxed children) used. A wrong exit code is an
    error."""
    cpu = children_cpu()
    started = time.monotonic()
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    seconds = time.monotonic() - started
    if proc.returncode != expect:
        raise SystemExit(f"{' '.join(args)} exited {proc.returncode}, not {expect}:\n"
                         f"{(proc.stdout + proc.stderr)[-3000:]}")
    return seconds, children_cpu() - cpu


def shown(figure: tuple[float, float]) -> str:
    """``wall (CPU s)`` of a :func:`timed` figure."""
    return f"{figure[0]:.2f}  ({figure[1]:.2f} CPU-s)"


def watch_loop(kernel: Path, env: dict[str, str], saves: int, trials: int
               ) -> tuple[float, list[float]]:
    """``aikg verify --watch``: seconds to the first verdict, and from each save of
    ``kernel`` to its verdict."""
    proc = subprocess.Popen(
        [*AIKG, "verify", str(TASK), str(kernel), "--watch", "--json", "--trials",
         str(trials), "--max-runs", str(saves + 1)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    guard = threading.Timer(600, proc.kill)
    guard.start()
    try:
        started = time.monotonic()
        if not proc.stdout.readline():
            raise SystemExit(f"--watch gave no verdict: {proc.stderr.read()[-3000:]}")
        first = time.monotonic() - started
        again = []
        for _ in range(saves):
            saved = time.monotonic()
            os.utime(kernel)
            if not proc.stdout.readline():
                raise SystemExit(f"--watch ended early: {proc.stderr.read()[-3000:]}")
            again.append(time.monotonic() - saved)
        proc.wait(60)
        return first, again
    finally:
        guard.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.verify_loop",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--saves", type=int, default=5,
                        help="saves of the kernel under --watch (default 5)")
    parser.add_argument("--trials", type=int, default=3,
                        help="correctness trials per verification (default 3)")
    parser.add_argument("--no-run", action="store_true",
                        help="leave out (d), the aikg run refusal")
    args = parser.parse_args(argv)

    print(f"load average at start: {load()}  ({os.cpu_count()} cores)")
    with tempfile.TemporaryDirectory(prefix="aikg-bench-loop-") as tmp:
        work = Path(tmp)
        scratch = work / "tmp"
        scratch.mkdir()
        env = {k: v for k, v in os.environ.items() if not k.startswith("AIKG_")}
        env.update(TMPDIR=str(scratch), PYTHONPATH=str(ROOT))
        kernel, refused, task = work / "kernel.py", work / "refused.py", work / "const.py"
        kernel.write_text(KERNEL)
        refused.write_text(REFUSED)
        task.write_text(CONSTANT_TASK)
        verify = [*AIKG, "verify", str(TASK), str(kernel), "--json", "--trials",
                  str(args.trials)]

        first = timed(verify, env, 0)
        second = timed(verify, env, 0)
        watch_first, saves = watch_loop(kernel, env, args.saves, args.trials)
        resave = statistics.median(saves)
        before = timed([sys.executable, "-c", OLD_VERIFY, str(TASK), str(refused),
                        str(args.trials)], env, 0)
        now = timed([*AIKG, "verify", str(TASK), str(refused), "--json"], env, 1)

        rows = [
            ("(a) first aikg verify, s", shown(first)),
            ("(a) second aikg verify, s", shown(second)),
            ("(b) aikg verify --watch, first verdict, s", f"{watch_first:.2f}"),
            (f"(b) --watch, save to verdict, median of {len(saves)}, s",
             f"{resave:.2f}  (each: {', '.join(f'{s:.2f}' for s in saves)})"),
            ("(b) second aikg verify / --watch re-verify", f"{second[0] / resave:.1f}x"),
            ("(c) static refusal before (sandbox started first), s", shown(before)),
            ("(c) static refusal now (from the source), s", shown(now)),
            ("(c) before / now", f"{before[0] / now[0]:.1f}x"),
        ]
        if not args.no_run:
            run = timed([*AIKG, "run", str(task), "--json"], env, 1)
            split = subprocess.run([sys.executable, "-c", LOWERING_SPLIT, str(task)],
                                   cwd=ROOT, env=env, capture_output=True, text=True,
                                   timeout=600)
            start_s, lower_s, declined = split.stdout.split()[-3:]
            if declined != "True":
                raise SystemExit(f"the lowering did not decline: {split.stdout[-2000:]}")
            rows += [
                ("(d) aikg run, lowering refusal, s", shown(run)),
                ("(d)   lowering sandbox start (fresh python), s", f"{float(start_s):.2f}"),
                ("(d)   the lowering child, s", f"{float(lower_s):.2f}"),
            ]
        width = max(len(name) for name, _ in rows)
        for name, value in rows:
            print(f"{name:<{width}}  {value}")
        left = sorted(p.name for p in scratch.iterdir() if not p.name.startswith("torchinductor_"))
        if left:
            print(f"left in the scratch directory: {', '.join(left)}")
    print(f"load average at end: {load()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
