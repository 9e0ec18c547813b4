"""Warm process pool for sandboxed runs: the worker (parent) side.

:class:`SandboxPool` starts :mod:`services.worker._forkserver` as a fresh
interpreter that imports torch and triton once; every job is a process forked from
it (~10 ms) instead of a fresh ``python`` (~1.8 s of imports). We run our own
fork server rather than ``multiprocessing``'s forkserver context because that one
is a process-wide singleton that cannot be stopped, re-imports the worker's
``__main__`` in every child, and gives no say over what the child does before the
job starts; here each :class:`~services.worker.verifier.Verifier` owns its server
and :func:`services.worker._child.enter_sandbox` isolates the child first.

:class:`ChildRun` is one child: its pid, its frames (read with the event loop, so
``await`` never blocks it), its exit status, and the kill of its process group.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from services.worker import _child, _forkserver
from services.worker._child import ChildSpec, is_secret

_REPO_ROOT = Path(__file__).resolve().parents[2]
_PID_BYTES = 8
# glibc reserves 64 MiB of address space per malloc arena (up to 8 per core); a
# few arenas keep RLIMIT_AS meaningful on many-core machines.
_MALLOC_ARENA_MAX = "4"

_SIGNAL_REASONS = {
    signal.SIGSEGV: "segmentation fault: a bad memory access",
    signal.SIGBUS: "bus error: a bad memory access",
    signal.SIGKILL: "killed: out of memory, or killed by the worker",
    signal.SIGXCPU: "CPU time limit exceeded",
    signal.SIGXFSZ: "file size limit exceeded: too much output or too large a file",
    signal.SIGABRT: "aborted",
    signal.SIGFPE: "arithmetic error",
    signal.SIGILL: "illegal instruction",
}


class PoolBroken(RuntimeError):
    """The fork server is gone and could not be restarted."""


class ProtocolError(RuntimeError):
    """A child sent something that is not a well-formed frame, or too much of it."""


class ForgedFrame(ProtocolError):
    """A frame's tag does not match: someone but the harness wrote on the result socket."""


def describe_exit(status: int | None) -> str:
    """Human-readable wait status: ``killed by signal SIGSEGV (segmentation fault ...)``."""
    if status is None:
        return "exit status unknown (the sandbox server went away)"
    if os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        try:
            sig = signal.Signals(number)
        except ValueError:
            return f"killed by signal {number}"
        reason = _SIGNAL_REASONS.get(sig)
        return f"killed by signal {sig.name}" + (f" ({reason})" if reason else "")
    if os.WIFEXITED(status):
        return f"exited with code {os.WEXITSTATUS(status)}"
    return f"wait status {status}"


def clean_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` without secrets (see :func:`services.worker._child.is_secret`)."""
    return {k: v for k, v in environ.items() if not is_secret(k)}


def read_tail(path: Path, limit: int) -> tuple[str, int]:
    """The last ``limit`` bytes of ``path`` as text, and how many bytes were cut."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            f.seek(max(0, size - limit))
            data = f.read(limit)
    except OSError:
        return "", 0
    return data.decode("utf-8", errors="replace"), max(0, size - limit)


def captured_output(scratch: Path, limit: int) -> str:
    """The child's stdout and stderr, each section cut to its tail, ``limit`` bytes in all."""
    parts = []
    stdout, cut_out = read_tail(scratch / _child.STDOUT_FILE, limit // 2)
    stderr, cut_err = read_tail(scratch / _child.STDERR_FILE, limit - len(stdout.encode()))
    for name, text, cut in (("stdout", stdout, cut_out), ("stderr", stderr, cut_err)):
        if text:
            note = f" (first {cut} bytes cut)" if cut else ""
            parts.append(f"--- {name}{note} ---\n{text}")
    return "\n".join(parts)


class ChildRun:
    """One sandboxed child, from fork to reaped.

    Read its frames with :meth:`frame` / :meth:`raw` in order; :meth:`close` kills
    its process group (also any descendants still in it), waits for the exit status
    and removes the scratch directory. When ``spec.frame_key`` is set every frame's
    tag is checked (see :func:`services.worker._child.frame_tag`): bytes the candidate
    wrote on the socket's file descriptor raise :class:`ForgedFrame`.
    """

    def __init__(self, spec: ChildSpec, result: socket.socket, status: socket.socket,
                 max_frame_bytes: int) -> None:
        self.spec = spec
        self.scratch = Path(spec.scratch_dir)
        self.pid: int | None = None
        self.exit_status: int | None = None
        self.max_frame_bytes = max_frame_bytes
        self._result = result
        self._status = status
        self._exit_task: asyncio.Task[int | None] | None = None
        self._closed = False
        self._key = spec.frame_key
        self._tag = b""
        self._header = b""

    async def _recv_exactly(self, sock: socket.socket, n: int) -> bytearray | None:
        loop = asyncio.get_running_loop()
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            k = await loop.sock_recv_into(sock, view[got:])
            if k == 0:
                return None
            got += k
        return buf

    async def start(self) -> int:
        """Wait for the fork server to report the child's pid.

        Raises:
            PoolBroken: the server closed the status socket instead.
        """
        data = await self._recv_exactly(self._status, _PID_BYTES)
        if data is None:
            raise PoolBroken("the sandbox server did not start the child")
        self.pid = int.from_bytes(data, "big", signed=True)
        self._exit_task = asyncio.ensure_future(self._read_exit())
        return self.pid

    async def _read_exit(self) -> int | None:
        data = await self._recv_exactly(self._status, _PID_BYTES)
        if data is not None:
            self.exit_status = int.from_bytes(data, "big", signed=True)
        return self.exit_status

    async def frame(self) -> Any | None:
        """The next frame (see :data:`services.worker._child.Frame`), or None at end of stream.

        Raises:
            ProtocolError: the frame is larger than ``max_frame_bytes`` or malformed.
        """
        size = await self._length()
        if size is None:
            return None
        payload = await self._recv_exactly(self._result, size)
        if payload is None or not await self._check_tag(payload):
            return None
        try:
            return _child.FRAME_DECODER.decode(payload)
        except Exception as exc:
            raise ProtocolError(f"malformed frame from the child: {exc}") from None

    async def raw(self, expected: int) -> bytearray | None:
        """The next raw frame, which must hold exactly ``expected`` bytes (None at end of stream).

        Raises:
            ProtocolError: its length is not ``expected``.
        """
        size = await self._length()
        if size is None:
            return None
        if size != expected:
            raise ProtocolError(f"the child sent {size} bytes for a tensor of {expected} bytes")
        data = bytearray() if size == 0 else await self._recv_exactly(self._result, size)
        if data is None or not await self._check_tag(data):
            return None
        return data

    async def _check_tag(self, payload: bytearray) -> bool:
        """Read and check the frame's tag (no-op without a key); False at end of stream.

        Raises:
            ForgedFrame: the tag does not match the harness's chain.
        """
        if not self._key:
            return True
        tag = await self._recv_exactly(self._result, _child.TAG_BYTES)
        if tag is None:
            return False
        want = _child.frame_tag(self._key, self._tag, self._header, payload)
        if not hmac.compare_digest(bytes(tag), want):
            raise ForgedFrame("a frame on the result channel was not written by the harness")
        self._tag = want
        return True

    async def _length(self) -> int | None:
        header = await self._recv_exactly(self._result, _child.HEADER.size)
        if header is None:
            return None
        self._header = bytes(header)
        (size,) = _child.HEADER.unpack(header)
        if size > self.max_frame_bytes:
            raise ProtocolError(f"the child sent a {size}-byte frame "
                                f"(limit {self.max_frame_bytes} bytes)")
        return size

    def kill(self) -> None:
        """SIGKILL the child's process group (the child and what it started)."""
        if self.pid is None or self.exit_status is not None:
            return
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except OSError:
            # Not yet its own group leader (killed within its first milliseconds).
            with contextlib.suppress(OSError):
                os.kill(self.pid, signal.SIGKILL)

    async def wait(self, timeout: float) -> int | None:
        """The raw wait status once the child is reaped (None: not within ``timeout`` s)."""
        if self._exit_task is None:
            return None
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._exit_task), timeout)
        return self.exit_status

    def output(self, limit: int) -> str:
        """Captured stdout/stderr, at most ``limit`` bytes (see :func:`captured_output`)."""
        return captured_output(self.scratch, limit)

    async def close(self) -> None:
        """Kill the group, wait (briefly) for the exit status, remove the scratch directory."""
        if self._closed:
            return
        self._closed = True
        self.kill()
        await self.wait(5.0)
        if self._exit_task is not None and not self._exit_task.done():
            self._exit_task.cancel()
        self._result.close()
        self._status.close()
        await asyncio.to_thread(shutil.rmtree, self.scratch, True)


class SandboxPool:
    """A fork server with torch and triton imported, forking one child per job.

    Args:
        env: environment of the server (and so of its children before their own
            scrub); secrets are removed from it. Default: this process's.
        start_timeout_s: how long :meth:`start` waits for the imports, seconds.
        orphan_cleanup: a directory the server removes when this process dies without
            closing the pool (SIGKILL, OOM kill): a dead worker's scratch root.
    """

    def __init__(self, env: Mapping[str, str] | None = None, start_timeout_s: float = 300.0,
                 orphan_cleanup: str | Path | None = None):
        self.orphan_cleanup = orphan_cleanup
        base = clean_environment(os.environ if env is None else env)
        base.setdefault("MALLOC_ARENA_MAX", _MALLOC_ARENA_MAX)
        self.env = base
        self.start_timeout_s = start_timeout_s
        self._proc: subprocess.Popen[bytes] | None = None
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
        self._stop_locked()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "services.worker._forkserver", str(theirs.fileno()),
                 *([str(self.orphan_cleanup)] if self.orphan_cleanup is not None else [])],
                pass_fds=[theirs.fileno()], env=self.env, cwd=_REPO_ROOT,
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True)
        finally:
            theirs.close()
        ours.settimeout(self.start_timeout_s)
        try:
            ready = ours.recv(16)
        except OSError:
            ready = b""
        if ready != b"ready":
            ours.close()
            self._stop_locked()
            raise PoolBroken("the sandbox server failed to start (see the worker's stderr)")
        ours.settimeout(None)
        self._control = ours

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
        payload = _child.encode_spec(spec)
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
