"""The fault matrix on a real local stack: what a crash of each part costs in jobs.

Starts ``aikg up`` (embedded NATS with a JetStream store in a directory of its own,
gateway, generator, one cpu worker: separate processes, supervised) and, for each
fault, runs the same workload: ``--clients`` threads submit ``--jobs`` small relu jobs
in all (one candidate each, ``init_code`` given, really verified), half of them
before the fault and half after; the fault comes once a quarter of the jobs have
ended. Faults:

- ``worker``: SIGKILL the worker (``aikg up`` starts it again);
- ``generator``: SIGKILL the generator (likewise);
- ``nats``: SIGKILL the nats-server (``aikg up`` starts it again on its port and store);
- ``restart``: SIGTERM ``aikg up`` and start it again on the same store.

Submissions that fail while a part is down are retried with the same ``job_id``
(idempotent at the gateway). Per fault it prints: jobs accepted, completed, failed,
lost (accepted but not ended within ``--timeout`` s, or unknown to the gateway),
duplicated verifications (a request the worker finished more than once, from its
log), restarts ``aikg up`` counted (``aikg_service_restarts_total``), recovery (from
the fault to the end of the first job that started after it: the stack takes new
work again) and the phase's wall time.

    python -m bench.fleet_faults                    # 200 jobs from 4 clients per fault
    python -m bench.fleet_faults --quick            # 12 jobs from 2 clients per fault
    python -m bench.fleet_faults --faults worker nats --jobs 40

Measured figures, never a gate: exit status 0, or 2 when the stack does not come up.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from services.common.runtime import descendants, free_port
from tests.helpers import RELU_KERNEL, RELU_TASK

ROOT = Path(__file__).resolve().parents[1]
FAULTS = ("worker", "generator", "nats", "restart")
TERMINAL = ("completed", "failed", "cancelled")
POLL_S = 0.5


@dataclass
class Phase:
    """One fault's run: what was accepted, how it ended, when the fault came."""

    fault: str
    accepted: set[str] = field(default_factory=set)
    # job id -> (status, start time, end time) of the jobs that ended
    ended: dict[str, tuple[str, dt.datetime | None, dt.datetime | None]] = field(
        default_factory=dict)
    fault_at: float | None = None  # time.time() of the fault
    started: float = field(default_factory=time.monotonic)
    wall_s: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)


class Stack:
    """``aikg up`` as a child process on fixed ports and a store directory of its own."""

    def __init__(self, workdir: Path, ready_timeout_s: float) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.metrics_port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.ready_timeout_s = ready_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None
        self.restarts_before_stop = 0.0
        self.starts = 0

    def start(self) -> None:
        """Start ``aikg up`` and wait for its ready line.

        Raises:
            RuntimeError: it exited or was not up within the ready timeout.
        """
        env = {k: v for k, v in os.environ.items() if not k.startswith("AIKG_")}
        env.update({"AIKG_UP_METRICS_PORT": str(self.metrics_port),
                    "AIKG_UP_RUN_DIR": str(self.workdir / "run"),
                    "AIKG_GENERATOR_CONCURRENCY": "4"})
        self.starts += 1
        log = self.workdir / f"up-{self.starts}.log"
        with log.open("wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "services.cli", "up", "--port", str(self.port),
                 "--store-dir", str(self.workdir / "store"), "--log-dir",
                 str(self.workdir / "logs")],
                cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + self.ready_timeout_s
        while b"AIKG is up" not in log.read_bytes():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"aikg up did not come up; see {log}")
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.restarts_before_stop += self.restarts()
        os.kill(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(90)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def pid_of(self, part: str) -> int:
        """The pid of ``part`` (``worker``, ``generator``, ``nats``) under ``aikg up``.

        Raises:
            LookupError: no such process runs now.
        """
        assert self.proc is not None
        for pid in descendants(self.proc.pid):
            cmd = cmdline(pid)
            if part == "nats" and cmd and Path(cmd[0]).name == "nats-server":
                return pid
            if cmd[1:4] == ["-m", "services.cli", part]:
                return pid
        raise LookupError(f"no {part} process under aikg up")

    def restarts(self) -> float:
        """``aikg_service_restarts_total`` summed over services, from this ``aikg up``."""
        with contextlib.suppress(httpx.HTTPError):
            text = httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).text
            return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                       if line.startswith("aikg_service_restarts_total{"))
        return 0.0


def cmdline(pid: int) -> list[str]:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    return []


def submit(client: httpx.Client, phase: Phase, job_id: str, deadline: float) -> None:
    """Submit one job, retrying (same ``job_id``) while the stack is down."""
    body = {"op_name": f"faults_{phase.fault}", "task_desc": RELU_TASK,
            "init_code": RELU_KERNEL, "backend": "cpu", "job_id": job_id,
            "max_attempts": 1, "trials": 1}
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            r = client.post("/api/v1/jobs/submit", json=body)
            if r.status_code == 200:
                with phase.lock:
                    phase.accepted.add(job_id)
                return
        time.sleep(0.25)


def poll(client: httpx.Client, phase: Phase) -> None:
    """Record the phase's jobs that have ended (one listing of its operator)."""
    offset = 0
    while True:
        try:
            page = client.get("/api/v1/jobs", params={"op_name": f"faults_{phase.fault}",
                                                      "limit": 500, "offset": offset}).json()
        except (httpx.HTTPError, ValueError):
            return
        for job in page.get("jobs", []):
            if job.get("status") in TERMINAL:
                start, end = (dt.datetime.fromisoformat(job[k]) if job.get(k) else None
                              for k in ("start_time", "end_time"))
                with phase.lock:
                    phase.ended[job["job_id"]] = (job["status"], start, end)
        offset += 500
        if offset >= page.get("total", 0):
            return


def verified_twice(log_dir: Path) -> Counter:
    """Request ids the worker finished more than once, from its JSON log."""
    seen: Counter = Counter()
    with contextlib.suppress(OSError):
        for line in (log_dir / "worker.log").read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                event = json.loads(line)
                if event.get("event") == "verify_finished" and event.get("request_id"):
                    seen[event["request_id"]] += 1
    return Counter({k: v for k, v in seen.items() if v > 1})


def inject(stack: Stack, fault: str) -> None:
    if fault == "restart":
        stack.stop()
        stack.start()
    else:
        os.kill(stack.pid_of(fault), signal.SIGKILL)


def run_phase(stack: Stack, fault: str, jobs: int, clients: int, timeout_s: float) -> Phase:
    """One fault under the workload; returns what happened to its jobs."""
    phase = Phase(fault)
    deadline = time.monotonic() + timeout_s
    ids = [f"{fault}-{time.time_ns() % 10**9}-{i:04d}" for i in range(jobs)]
    first, second = ids[: jobs // 2], ids[jobs // 2:]
    faulted = threading.Event()

    def client_run(n: int) -> None:
        with httpx.Client(base_url=stack.url, timeout=10) as client:
            for job_id in first[n::clients]:
                submit(client, phase, job_id, deadline)
            faulted.wait(timeout_s)
            for job_id in second[n::clients]:
                submit(client, phase, job_id, deadline)

    threads = [threading.Thread(target=client_run, args=(n,), daemon=True)
               for n in range(clients)]
    for t in threads:
        t.start()
    with httpx.Client(base_url=stack.url, timeout=10) as watcher:
        while time.monotonic() < deadline:
            poll(watcher, phase)
            if not faulted.is_set() and len(phase.ended) >= max(1, jobs // 4):
                phase.fault_at = time.time()
                inject(stack, fault)
                faulted.set()
            if faulted.is_set() and not any(t.is_alive() for t in threads) \
                    and phase.accepted <= set(phase.ended):
                break
            time.sleep(POLL_S)
    faulted.set()
    for t in threads:
        t.join(5)
    phase.wall_s = time.monotonic() - phase.started
    return phase


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=200, help="jobs per fault (default 200)")
    parser.add_argument("--clients", type=int, default=4, help="submitting clients (default 4)")
    parser.add_argument("--faults", nargs="+", choices=FAULTS, default=list(FAULTS),
                        help="faults to run, in order (default: all)")
    parser.add_argument("--quick", action="store_true",
                        help="a short run: 12 jobs from 2 clients per fault")
    parser.add_argument("--timeout", type=float, default=900.0,
                        help="seconds a fault's jobs may take to end (default 900)")
    parser.add_argument("--ready-timeout", type=float, default=240.0,
                        help="seconds aikg up may take to come up (default 240)")
    parser.add_argument("--keep", type=Path, default=None,
                        help="keep the store and logs in this directory")
    args = parser.parse_args(argv)
    if args.quick:
        args.jobs, args.clients = 12, 2
    if args.jobs < 2 or args.clients < 1:
        parser.error("--jobs must be at least 2 and --clients at least 1")
    with contextlib.ExitStack() as cleanup:
        workdir = args.keep or Path(cleanup.enter_context(
            tempfile.TemporaryDirectory(prefix="aikg-faults-")))
        workdir.mkdir(parents=True, exist_ok=True)
        stack = Stack(workdir, args.ready_timeout)
        try:
            stack.start()
        except RuntimeError as exc:
            print(exc, file=sys.stderr)
            return 2
        rows = []
        try:
            for fault in args.faults:
                print(f"fault {fault}: {args.jobs} jobs from {args.clients} clients ...",
                      flush=True)
                dup_before = verified_twice(workdir / "logs")
                restarts_before = stack.restarts_before_stop + stack.restarts()
                try:
                    phase = run_phase(stack, fault, args.jobs, args.clients, args.timeout)
                except RuntimeError as exc:  # a restart that did not come up
                    print(f"fault {fault}: {exc}", file=sys.stderr)
                    return 2
                dups = verified_twice(workdir / "logs") - dup_before
                # Recovered: a job that started after the fault has ended.
                after = [end for _, start, end in phase.ended.values()
                         if start is not None and end is not None and phase.fault_at
                         is not None and start.timestamp() > phase.fault_at]
                statuses = Counter(status for status, _, _ in phase.ended.values())
                rows.append({
                    "fault": fault, "accepted": len(phase.accepted),
                    "completed": statuses["completed"],
                    "failed": statuses["failed"] + statuses["cancelled"],
                    "lost": len(phase.accepted - set(phase.ended)),
                    "dup": sum(v - 1 for v in dups.values()),
                    "restarts": stack.restarts_before_stop + stack.restarts() - restarts_before,
                    "recovery": (min(after).timestamp() - phase.fault_at) if after else None,
                    "wall": phase.wall_s})
        finally:
            stack.stop()
    print(f"\n{args.jobs} jobs from {args.clients} clients per fault "
          f"(half before the fault, half after)")
    print(f"{'fault':<10}{'accepted':>9}{'completed':>10}{'failed':>7}{'lost':>5}"
          f"{'dup verifies':>13}{'restarts':>9}{'recovery s':>11}{'phase s':>9}")
    for r in rows:
        recovery = f"{r['recovery']:.1f}" if r["recovery"] is not None else "-"
        print(f"{r['fault']:<10}{r['accepted']:>9}{r['completed']:>10}{r['failed']:>7}"
              f"{r['lost']:>5}{r['dup']:>13}{r['restarts']:>9.0f}{recovery:>11}"
              f"{r['wall']:>9.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
