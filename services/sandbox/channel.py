"""The parent's end of one sandboxed child: :class:`ChildRun` (its pid, its frames, its
exit status, the kill of its process group, the removal of its scratch directory) and
the cleanups that outlive a cancelled caller (:func:`settle`).

Frames are read with the event loop (``await`` never blocks it) and decoded with the
child's role's decoder (:func:`services.sandbox.wire.frame_decoder`); with a
``frame_key`` in the spec every frame's tag is checked. A child is forked by the fork
server (:class:`services.sandbox.server.SandboxPool`), which reports its pid and, once
reaped, its wait status on the status socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import os
import shutil
import signal
import socket
from pathlib import Path
from typing import Any

from services.sandbox import wire
from services.sandbox.errors import ForgedFrame, PoolBroken, ProtocolError
from services.sandbox.wire import ChildSpec

_PID_BYTES = 8
# How long a parent waits for a child's exit status once its channel ended, seconds
# (its status explains the end: a signal, a limit).
EXIT_WAIT_S = 5.0

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
    stdout, cut_out = read_tail(scratch / wire.STDOUT_FILE, limit // 2)
    stderr, cut_err = read_tail(scratch / wire.STDERR_FILE, limit - len(stdout.encode()))
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
    tag is checked (see :func:`services.sandbox.wire.frame_tag`): bytes the candidate
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
        self._cleanup: asyncio.Future[None] | None = None
        self._closed = False
        self._key = spec.frame_key
        self._tag = b""
        self._header = b""
        self._send_lock = asyncio.Lock()

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
        """The next frame (:func:`services.sandbox.wire.frame_decoder` of the child's role), or None at end of stream.

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
            return wire.frame_decoder(self.spec.role).decode(payload)
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

    async def raw_any(self) -> bytearray | None:
        """The next raw frame, of whatever length up to ``max_frame_bytes`` (None at end
        of stream).

        Raises:
            ProtocolError: it is larger than ``max_frame_bytes``.
        """
        size = await self._length()
        if size is None:
            return None
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
        tag = await self._recv_exactly(self._result, wire.TAG_BYTES)
        if tag is None:
            return False
        want = wire.frame_tag(self._key, self._tag, self._header, payload)
        if not hmac.compare_digest(bytes(tag), want):
            raise ForgedFrame("a frame on the result channel was not written by the harness")
        self._tag = want
        return True

    async def _length(self) -> int | None:
        header = await self._recv_exactly(self._result, wire.HEADER.size)
        if header is None:
            return None
        self._header = bytes(header)
        (size,) = wire.HEADER.unpack(header)
        if size > self.max_frame_bytes:
            raise ProtocolError(f"the child sent a {size}-byte frame "
                                f"(limit {self.max_frame_bytes} bytes)")
        return size

    async def send(self, command: Any, raws: list[Any] = ()) -> None:
        """Send a command (:func:`services.sandbox.wire.command_decoder`) and the raw frames it
        announces to the child, in one piece.

        Raises:
            ConnectionError: the child closed its end (it exited or died).
        """
        loop = asyncio.get_running_loop()
        payload = wire.encode_frame(command)
        async with self._send_lock:
            await loop.sock_sendall(self._result, wire.HEADER.pack(len(payload)) + payload)
            for raw in raws:
                data = memoryview(raw).cast("B") if not isinstance(raw, bytes) else raw
                await loop.sock_sendall(self._result, wire.HEADER.pack(len(data)))
                if len(data):
                    await loop.sock_sendall(self._result, data)

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
        """Kill the group, wait (briefly) for the exit status, remove the scratch directory.

        Runs to its end even when the caller is cancelled meanwhile (a failed candidate
        cancels the ghost replay running beside it): the caller sees the cancellation,
        the cleanup still happens.
        """
        if self._closed:
            return
        self._closed = True
        self._cleanup = asyncio.ensure_future(self._close())
        keep(self._cleanup)
        await asyncio.shield(self._cleanup)

    async def _close(self) -> None:
        self.kill()
        await self.wait(5.0)
        if self._exit_task is not None and not self._exit_task.done():
            self._exit_task.cancel()
        self._result.close()
        self._status.close()
        await asyncio.to_thread(shutil.rmtree, self.scratch, True)


# Cleanups that run on after their caller was cancelled: ChildRun.close()'s, forks
# abandoned mid-way and the children they start (see settle()).
_abandoned: set[asyncio.Future] = set()


def background(coro: Any) -> None:
    """Run ``coro`` to its end even though its caller is gone (a reference is kept)."""
    keep(asyncio.ensure_future(coro))


def keep(future: asyncio.Future) -> None:
    """Hold ``future`` (a cleanup) until it is done, so that :func:`settle` waits for it."""
    _abandoned.add(future)
    future.add_done_callback(_abandoned.discard)


async def settle(timeout_s: float = 10.0) -> bool:
    """Wait until every child cleanup that outlived its cancelled caller has ended
    (children killed, scratch directories removed), at most ``timeout_s`` seconds.

    A verifier that cancels children (a failed candidate's side checks) calls it
    before answering, so no scratch directory of that verification is left behind
    when the verdict is out.

    Returns:
        True when none is left running.
    """
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        pending = {f for f in _abandoned if not f.done()}
        remaining = deadline - asyncio.get_running_loop().time()
        if not pending or remaining <= 0:
            return not pending
        # A fork finishing in its thread starts its child's cleanup from a callback:
        # look again once these are done.
        await asyncio.wait(pending, timeout=remaining)


async def abandon(run: ChildRun, starting: asyncio.Future | None = None) -> None:
    """Kill and clean up a child nobody waits for any more (``starting``: its
    :meth:`ChildRun.start` already under way)."""
    with contextlib.suppress(Exception):
        if starting is not None:
            await starting
        elif run.pid is None:
            await run.start()
    await run.close()


def abandon_when_forked(scratch_dir: str, forking: asyncio.Future) -> None:
    if forking.cancelled() or forking.exception() is not None:
        shutil.rmtree(scratch_dir, ignore_errors=True)
        return
    background(abandon(forking.result()))
