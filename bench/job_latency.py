"""Small-job latency, submit to verdict, on an idle local stack: this checkout beside another.

Starts ``aikg up`` (gateway, generator, one cpu worker, an embedded NATS server) from a
baseline git revision and from this checkout, one after the other, sends the same
small task to each as single jobs (built-in coder, one at a time, after one warm-up
job), and prints the p50 and p95 of submit-to-terminal time side by side with their
ratio. The default baseline is the last revision whose generator ran the built-in
coder's lowering unsandboxed, in a persistent process pool: the ratio is what the
sandboxed lowering (a fresh confined child per task) costs a user. Each job's task
source carries its own trailing comment, so neither stack reuses an earlier job's
lowering or reference outputs: every job pays the whole path.

    python -m bench.job_latency                       # 10 jobs of tasks/relu.py each
    python -m bench.job_latency --baseline HEAD~5 --jobs 20 --task tasks/gelu.py

The baseline runs from ``git archive`` of that revision in a temporary directory with
this interpreter; its own dependencies must be installed (the default baseline needs
``pebble``). Exit status 0, or 2 when a stack does not come up.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from services.common.runtime import free_port

ROOT = Path(__file__).resolve().parents[1]
# The last revision before the built-in coder's lowering moved into the sandbox.
DEFAULT_BASELINE = "bea7ec8"
POLL_S = 0.02


def export_revision(revision: str, into: Path) -> Path:
    """``git archive`` of ``revision`` unpacked under ``into``.

    Raises:
        subprocess.CalledProcessError: git does not know the revision.
    """
    archive = into / "baseline.tar"
    subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", "-o", str(archive),
                    revision], check=True, capture_output=True)
    target = into / "baseline"
    target.mkdir()
    with tarfile.open(archive) as tar:
        tar.extractall(target, filter="data")
    return target


@contextlib.contextmanager
def stack(checkout: Path, workdir: Path, ready_timeout_s: float = 180.0) -> Iterator[str]:
    """``aikg up`` of ``checkout`` until the block ends; yields the gateway URL once a
    worker is live.

    Raises:
        RuntimeError: the stack exited or no worker came up in ``ready_timeout_s``.
    """
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIKG_")}
    env["PYTHONPATH"] = str(checkout)
    log = (workdir / f"up-{checkout.name}.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "up", "--port", str(port), "--backend", "cpu",
         "--store-dir", str(workdir / f"nats-{checkout.name}"),
         # in the workdir, removed with it (by default a stack keeps its logs in /tmp)
         "--log-dir", str(workdir / f"logs-{checkout.name}")],
        cwd=checkout, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ready_timeout_s
        with httpx.Client(base_url=url, timeout=5) as client:
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"aikg up of {checkout} exited with {proc.returncode}; "
                                       f"see {log.name}")
                with contextlib.suppress(httpx.HTTPError):
                    if client.get("/api/v1/workers").json().get("workers"):
                        break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"no worker of {checkout} in {ready_timeout_s:.0f} s")
                time.sleep(0.2)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def job_seconds(client: httpx.Client, task: str, arch: str,
                phases: dict[str, list[float]] | None = None) -> float:
    """Seconds from submit to a terminal status for one single job; the job record's
    ``phases`` (where the stack reports them) are appended to ``phases``.

    Raises:
        RuntimeError: the job did not complete.
    """
    started = time.perf_counter()
    resp = client.post("/api/v1/jobs/submit", json={
        "op_name": "bench", "task_desc": task, "backend": "cpu", "arch": arch})
    resp.raise_for_status()
    job_id = resp.json()["job_id"]
    while True:
        record = client.get(f"/api/v1/jobs/{job_id}/status").json()
        if record.get("status") in ("completed", "failed", "cancelled"):
            break
        time.sleep(POLL_S)
    elapsed = time.perf_counter() - started
    if record["status"] != "completed":
        raise RuntimeError(f"job {job_id} ended {record['status']}: {record.get('error')}")
    for name, seconds in (record.get("phases") or {}).items():
        if phases is not None:
            phases.setdefault(name, []).append(seconds)
    return elapsed


def measure(checkout: Path, workdir: Path, task: str, jobs: int,
            phases: dict[str, list[float]]) -> list[float]:
    with stack(checkout, workdir) as url, httpx.Client(base_url=url, timeout=30) as client:
        arch = client.get("/api/v1/workers").json()["workers"][0]["arch"]
        job_seconds(client, task + "\n# warm-up\n", arch)
        return [job_seconds(client, f"{task}\n# job {i} of {time.time_ns()}\n", arch, phases)
                for i in range(jobs)]


def p95(values: list[float]) -> float:
    return statistics.quantiles(values, n=20)[-1] if len(values) > 1 else values[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", default=DEFAULT_BASELINE,
                        help="git revision to compare with (default: %(default)s, the last "
                        "one with unsandboxed lowering)")
    parser.add_argument("--jobs", type=int, default=10, help="jobs per stack (default 10)")
    parser.add_argument("--task", type=Path, default=ROOT / "tasks" / "relu.py",
                        help="KernelBench-format task file (default tasks/relu.py)")
    args = parser.parse_args(argv)
    task = args.task.read_text()
    with tempfile.TemporaryDirectory(prefix="aikg-bench-") as tmp:
        workdir = Path(tmp)
        try:
            baseline = export_revision(args.baseline, workdir)
        except subprocess.CalledProcessError as exc:
            print(f"cannot export {args.baseline}: {exc.stderr.decode().strip()}",
                  file=sys.stderr)
            return 2
        results = {}
        phases: dict[str, dict[str, list[float]]] = {}
        for name, checkout in ((f"baseline {args.baseline}", baseline), ("this checkout", ROOT)):
            print(f"measuring {name}: {args.jobs} jobs of {args.task.name} ...", flush=True)
            try:
                results[name] = measure(checkout, workdir, task, args.jobs,
                                        phases.setdefault(name, {}))
            except RuntimeError as exc:
                print(f"{name}: {exc}", file=sys.stderr)
                return 2
    print(f"\n{'stack':<22} {'p50 s':>8} {'p95 s':>8}")
    for name, values in results.items():
        print(f"{name:<22} {statistics.median(values):>8.3f} {p95(values):>8.3f}")
    (base, now) = (statistics.median(v) for v in results.values())
    print(f"\nthis checkout / baseline (p50): {now / base:.2f}x")
    for name, by_phase in phases.items():
        if by_phase:
            print(f"\n{name}, median seconds per job phase (the job record's phases):")
            for phase, values in by_phase.items():
                print(f"  {phase:<14} {statistics.median(values):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
