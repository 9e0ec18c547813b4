"""The fork server from its parent's side: :class:`SandboxPool` starts
:mod:`services.sandbox.forkserver` as a fresh interpreter that imports torch and
triton once; every job is a process forked from it (~10 ms) instead of a fresh
``python`` (~1.8 s of imports).

We run our own fork server rather than ``multiprocessing``'s forkserver context because
that one is a process-wide singleton that cannot be stopped, re-imports the parent's
``__main__`` in every child, and gives no say over what the child does before the job
starts; here each :class:`~services.sandbox.pool.Sandbox` owns its server and
:func:`services.sandbox.hardening.enter_sandbox` isolates the child first.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Mapping
from pathlib import Path

from services.sandbox import forkserver as _forkserver
from services.sandbox import isolation, wire
from services.sandbox.channel import ChildRun
from services.sandbox.errors import PoolBroken
from services.sandbox.wire import ChildSpec

_REPO_ROOT = Path(__file__).resolve().parents[2]
# glibc reserves 64 MiB of address space per malloc arena (up to 8 per core); a
# few arenas keep RLIMIT_AS meaningful on many-core machines.
_MALLOC_ARENA_MAX = "4"


def clean_environment(environ: Mapping[str, str], extra: tuple[str, ...] = ()) -> dict[str, str]:
    """The allowlisted part of ``environ`` (see :func:`services.sandbox.isolation.env_allowed`)."""
    return isolation.allowed_environment(environ, extra)


class SandboxPool:
    """A fork server with torch and triton imported, forking one child per job.

    Args:
        env: environment of the server (and so of its children before their own
            allowlist); only allowlisted variables are kept. Default: this process's.
        start_timeout_s: how long :meth:`start` waits for the imports, seconds.
        orphan_cleanup: a directory the server removes when this process dies without
            closing the pool (SIGKILL, OOM kill): a dead worker's scratch root.
        visible: paths children must reach after the user switch (the scratch root);
            when set and this process is root, the server builds a private mount
            namespace for them (:func:`services.sandbox.isolation.private_mounts`).
        preload: more modules the server imports before forking.
        env_allow: more variable names (or ``PREFIX*``) to keep.
    """

    def __init__(self, env: Mapping[str, str] | None = None, start_timeout_s: float = 300.0,
                 orphan_cleanup: str | Path | None = None,
                 visible: list[str | Path] | None = None, preload: list[str] | None = None,
                 env_allow: tuple[str, ...] = ()):
        self.orphan_cleanup = orphan_cleanup
        self.options = {"orphan_cleanup": str(orphan_cleanup) if orphan_cleanup else None,
                        "private_mounts": visible is not None,
                        "visible": [str(p) for p in visible or ()],
                        "preload": list(preload or ())}
        base = clean_environment(os.environ if env is None else env, env_allow)
        base.setdefault("MALLOC_ARENA_MAX", _MALLOC_ARENA_MAX)
        self.env = base
        self.start_timeout_s = start_timeout_s
        self._proc: subprocess.Popen[bytes] | None = None
        self._abort = threading.Event()
        self._control: socket.socket | None = None
        self._lock = threading.Lock()
        self.restarts = 0

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> None:
        """Start the server and wait until it has imported torch and triton.

        Raises:
            PoolBroken: it exited or did not get ready within ``start_timeout_s``.
        """
        with self._lock:
            self._start_locked()

    def _start_locked(self) -> None:
        try:
            self._start_server()
        finally:
            self._abort.clear()

    def _start_server(self) -> None:
        self._stop_locked()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "services.sandbox.forkserver", str(theirs.fileno()),
                 json.dumps(self.options)],
                pass_fds=[theirs.fileno()], env=self.env, cwd=_REPO_ROOT,
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True)
        finally:
            theirs.close()
        if self._abort.is_set():
            self._kill_starting()
        ours.settimeout(self.start_timeout_s)
        try:
            ready = ours.recv(16)
        except OSError:
            ready = b""
        if ready != b"ready":
            ours.close()
            self._stop_locked()
            if self._abort.is_set():
                raise PoolBroken("the sandbox server's start was aborted")
            raise PoolBroken("the sandbox server failed to start (see the worker's stderr)")
        ours.settimeout(None)
        self._control = ours

    def abort_start(self) -> None:
        """Stop a :meth:`start` under way (or about to run) in another thread: its server
        is killed before it gets ready, and that start raises PoolBroken at once instead
        of blocking for the imports. A server already started is left alone. For a
        caller that no longer needs the pool it asked for."""
        self._abort.set()
        if self._control is None:
            self._kill_starting()

    def _kill_starting(self) -> None:
        proc = self._proc
        if proc is not None and proc.poll() is None:
            # start_new_session: the server leads its own process group
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)

    def _stop_locked(self) -> None:
        if self._control is not None:
            # Closed on purpose: the server must not take it for this process's death.
            with contextlib.suppress(OSError):
                self._control.send(_forkserver.BYE)
            self._control.close()
            self._control = None
        if self._proc is not None:
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None

    def close(self) -> None:
        """Stop the server; it kills every child's process group first."""
        with self._lock:
            self._stop_locked()

    def spawn(self, spec: ChildSpec, max_frame_bytes: int) -> ChildRun:
        """Fork a child for ``spec``, restarting a dead server once.

        Blocks for the restart (seconds) when the server died; call it from a thread.

        Args:
            spec: the job; ``spec.scratch_dir`` must exist.
            max_frame_bytes: largest frame accepted from this child, bytes.

        Raises:
            PoolBroken: the pool was never started, or the server could not be restarted.
        """
        payload = wire.encode_spec(spec)
        with self._lock:
            if self._proc is None:
                raise PoolBroken("the sandbox pool is not started")
            for attempt in range(2):
                if self._control is None or not self.alive:
                    self.restarts += 1
                    self._start_locked()
                result_ours, result_theirs = socket.socketpair()
                status_ours, status_theirs = socket.socketpair()
                try:
                    socket.send_fds(self._control, [payload],
                                    [result_theirs.fileno(), status_theirs.fileno()])
                except OSError:
                    result_ours.close()
                    status_ours.close()
                    self._control.close()
                    self._control = None
                    if attempt:
                        raise PoolBroken("the sandbox server is not accepting jobs") from None
                    continue
                finally:
                    result_theirs.close()
                    status_theirs.close()
                result_ours.setblocking(False)
                status_ours.setblocking(False)
                return ChildRun(spec, result_ours, status_ours, max_frame_bytes)
        raise PoolBroken("the sandbox server is not accepting jobs")
