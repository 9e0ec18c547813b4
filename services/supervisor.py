"""The supervisor of the local stack (``aikg up``): a :class:`Supervisor` thread
restarts a service that dies, after a wait that doubles with each restart of that
service (tenacity's exponential wait from :data:`RESTART_FIRST_WAIT_S`, capped at
``up_restart_backoff_max_s``), says and counts each restart in
``aikg_service_restarts_total{service}`` (:data:`SUPERVISOR_REGISTRY`, what ``aikg up``
serves on its own ``/metrics``), and ends the stack only when a service dies more than
``up_restart_max`` times within ``up_restart_window_s``; with :func:`stop_children`,
which stops the services' process groups, and :func:`log_hint`, where a service's log
is and its last line. Used by :mod:`services.stack`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import tenacity
from prometheus_client import CollectorRegistry, Counter

# What `aikg up` serves on its own /metrics: only the supervisor's metrics (the
# services export theirs on their own ports).
SUPERVISOR_REGISTRY = CollectorRegistry()
RESTARTS = Counter(
    "aikg_service_restarts_total",
    "Services of the local stack (`aikg up`) restarted after they died, by service "
    "(nats, gateway, generator, worker).",
    ["service"], registry=SUPERVISOR_REGISTRY,
)
# First wait before a restart, seconds; it doubles with each restart in the window.
RESTART_FIRST_WAIT_S = 0.5


def say_line(message: str) -> None:
    """Default reporter of :func:`local_stack`: one plain line on stderr."""
    print(message, file=sys.stderr, flush=True)



def stop_children(children: dict[str, subprocess.Popen[bytes]], grace_s: float = 10.0) -> None:
    """SIGTERM each child's process group, wait up to ``grace_s``, then SIGKILL what is left."""
    for proc in children.values():
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for proc in children.values():
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(max(0.0, deadline - time.monotonic()))
    for proc in children.values():
        # The group may outlive its leader (a sandboxed candidate): kill it in any case.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()




def log_hint(logs: dict[str, Path], name: str) -> str:
    """``"; log: PATH"`` and the last line the service logged (e.g. the port in use)."""
    path = logs.get(name)
    if path is None:
        return ""
    where = f"; log: {path}"
    with contextlib.suppress(OSError):
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
        if lines:
            return f"{where}\n  {lines[-1][:500]}"
    return where


class Supervisor:
    """Restart the processes of a stack that die, with backoff, in a background thread.

    Args:
        procs: service name -> its running process (``nats``, ``gateway`` ...); kept
            up to date here.
        spawn: starts the named service again and returns its process; it may raise
            (e.g. :class:`RuntimeError`: NATS did not start), which counts as a death.
        logs: service name -> its log file, named in messages.
        restart_max / window_s: at most ``restart_max`` restarts of one service within
            ``window_s`` seconds; its next death sets :attr:`failure` and restarts
            nothing more (the caller stops the stack).
        backoff_max_s: the longest wait before a restart, seconds; the wait is
            ``RESTART_FIRST_WAIT_S`` doubled for each restart of the service within
            the window (``tenacity.wait_exponential``).
        say: reports each death and restart (one line each).
        poll_s: how often the processes are looked at, seconds.
    """

    def __init__(self, procs: dict[str, subprocess.Popen[Any]],
                 spawn: Callable[[str], subprocess.Popen[Any]], *, logs: dict[str, Path],
                 restart_max: int, window_s: float, backoff_max_s: float,
                 say: Callable[[str], None] = say_line, poll_s: float = 0.25) -> None:
        self.procs = dict(procs)
        self.spawn = spawn
        self.logs = logs
        self.restart_max = restart_max
        self.window_s = window_s
        self.say = say
        self.poll_s = poll_s
        self.wait = tenacity.wait_exponential(multiplier=RESTART_FIRST_WAIT_S,
                                              max=max(RESTART_FIRST_WAIT_S, backoff_max_s))
        # Set when a service died too often: "<name> exited with code N after ...".
        self.failure: str | None = None
        # Per service: monotonic times of its restarts (attempts included).
        self.restarts: dict[str, list[float]] = {}
        self._due: dict[str, float] = {}
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="aikg-supervisor", daemon=True)
        # A series per service from the start, at 0: rate() and increase() see the
        # first restart (a series that appears with 1 counts as no increase).
        for name in self.procs:
            RESTARTS.labels(service=name)

    def start(self) -> Supervisor:
        self._thread.start()
        return self

    def close(self) -> None:
        """Restart nothing from now on (returns once a restart under way is done)."""
        with self._lock:
            self._closed.set()

    def join(self, timeout_s: float = 10.0) -> None:
        """Wait for the thread to end (after :meth:`close`). Children that the thread
        started get SIGTERM when it ends (``die_with_parent``): stop them first."""
        self.close()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def backoff_s(self, restart_no: int) -> float:
        """The wait before the ``restart_no``-th restart (1-based) in the window, seconds."""
        state = tenacity.RetryCallState(None, None, (), {})  # type: ignore[arg-type]
        state.attempt_number = restart_no
        return float(self.wait(state))

    def _run(self) -> None:
        # The thread lives until closed even after a failure: what it started dies with it.
        while not self._closed.wait(self.poll_s):
            with self._lock:
                if not self._closed.is_set() and self.failure is None:
                    self.check(time.monotonic())

    def check(self, now: float) -> None:
        """One look at every process: schedule a restart of a dead one, start those due."""
        for name, proc in list(self.procs.items()):
            if name in self._due:
                if now >= self._due[name]:
                    self._restart(name, now)
            elif proc.poll() is not None:
                # A group outliving its leader (a sandboxed child) goes before a new one.
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
                self._schedule(name, f"{name} exited with code {proc.returncode}", now)
            if self.failure is not None:
                return

    def _recent(self, name: str, now: float) -> list[float]:
        times = [t for t in self.restarts.get(name, []) if now - t < self.window_s]
        self.restarts[name] = times
        return times

    def _schedule(self, name: str, what: str, now: float) -> None:
        recent = self._recent(name, now)
        if len(recent) >= self.restart_max:
            self.failure = (f"{what} after {len(recent)} restart{'s' if len(recent) != 1 else ''}"
                            f" in {self.window_s:.0f} s{log_hint(self.logs, name)}")
            self.say(f"{name} keeps dying; not restarting it again")
            return
        delay = self.backoff_s(len(recent) + 1)
        self._due[name] = now + delay
        log = f" (log: {self.logs[name]})" if name in self.logs else ""
        self.say(f"{what}{log}; restarting it in {delay:.1f} s (restart {len(recent) + 1} "
                 f"of at most {self.restart_max} in {self.window_s:.0f} s)")

    def _restart(self, name: str, now: float) -> None:
        del self._due[name]
        self.restarts.setdefault(name, []).append(now)
        try:
            proc = self.spawn(name)
        except Exception as exc:  # noqa: BLE001 - a failed start is one more death
            self._schedule(name, f"{name} did not start again ({exc})", now)
            return
        self.procs[name] = proc
        RESTARTS.labels(service=name).inc()
        self.say(f"{name} restarted (pid {proc.pid})")
