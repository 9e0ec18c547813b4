"""Warm process pool for sandboxed runs: the worker (parent) side.

:class:`SandboxPool` starts :mod:`services.sandbox.forkserver` as a fresh
interpreter that imports torch and triton once; every job is a process forked from
it (~10 ms) instead of a fresh ``python`` (~1.8 s of imports). We run our own
fork server rather than ``multiprocessing``'s forkserver context because that one
is a process-wide singleton that cannot be stopped, re-imports the worker's
``__main__`` in every child, and gives no say over what the child does before the
job starts; here each :class:`~services.worker.verifier.Verifier` owns its server
and :func:`services.sandbox.hardening.enter_sandbox` isolates the child first.

:class:`ChildRun` is one child: its pid, its frames (read with the event loop, so
``await`` never blocks it), its exit status, and the kill of its process group.

Why one module: the fork server's client, the child's framed channel, the probe and
the lowering run share one process-lifecycle contract (spawn, tag check, kill of the
group, scratch removal) that is audited as a unit.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import json
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from services.common.runtime import claim_owner, remove_stale_dirs
from services.sandbox import forkserver as _forkserver
from services.sandbox import isolation, wire
from services.sandbox.roles import runner_of
from services.sandbox.wire import ChildSpec

_REPO_ROOT = Path(__file__).resolve().parents[2]
log = structlog.get_logger("aikg.sandbox")
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


def clean_environment(environ: Mapping[str, str], extra: tuple[str, ...] = ()) -> dict[str, str]:
    """The allowlisted part of ``environ`` (see :func:`services.sandbox.isolation.env_allowed`)."""
    return isolation.allowed_environment(environ, extra)


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
        """The next frame (see :data:`services.sandbox.wire.Frame`), or None at end of stream.

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
            return wire.FRAME_DECODER.decode(payload)
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
        """Send a command (:data:`services.sandbox.wire.Command`) and the raw frames it
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
        _keep(self._cleanup)
        await asyncio.shield(self._cleanup)

    async def _close(self) -> None:
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


# ---------------------------------------------------------------- the sandbox


# Isolation mechanisms a Sandbox can be told to require (setting ``sandbox_require``).
MECHANISMS = ("user", "capabilities", "network", "landlock", "seccomp", "pid", "scratch")
_PROBE_TIMEOUT_S = 120.0
_EXIT_WAIT_S = 5.0


class SandboxRefused(PoolBroken):
    """A mechanism the operator required (``sandbox_require``) is not available here."""


def safe_name(text: str) -> str:
    """``text`` reduced to a short file-name-safe token."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", text)[:64] or "x"


# A default scratch root's name: aikg-<name>-<pid of its owner>-<8 hex digits>.
_SCRATCH_ROOT_NAME = re.compile(r"aikg-.+-(\d+)-[0-9a-f]{8}")


def remove_stale_scratch_roots(base: Path) -> list[Path]:
    """Remove the default scratch roots under ``base`` (``aikg-<name>-<pid>-<hex>``, with
    an owner file) whose process is gone. A process killed with its fork server (SIGKILL
    of a whole ``aikg up``, an OOM kill of the process group) leaves its root behind:
    run directories, a Triton cache. Each start of a default root removes those (see
    :func:`services.common.runtime.remove_stale_dirs`).

    Returns:
        The directories removed.
    """
    def pid_of(name: str) -> int | None:
        match = _SCRATCH_ROOT_NAME.fullmatch(name)
        return int(match.group(1)) if match else None

    return remove_stale_dirs(base, "aikg-*-*-*", pid_of, need_owner=True)


@dataclass
class Isolation:
    """What the sandbox probe found: the confinement every child of a :class:`Sandbox` gets.

    ``run_as``: (uid, gid) children switch to, or None when they keep this process's
    user; ``capabilities``: capability bits a child still holds (0: none);
    ``landlock_abi``: 0 when files are not confined; ``notes``: each step the machine
    did not permit, in words.
    """

    run_as: tuple[int, int] | None = None
    network_isolated: bool = False
    capabilities: int = 0
    landlock_abi: int = 0
    seccomp: bool = False
    pid_namespace: bool = False
    scratch_bytes: int | None = None
    notes: list[str] = field(default_factory=list)

    def in_force(self) -> dict[str, bool]:
        """Each of :data:`MECHANISMS` -> whether children have it."""
        return {"user": self.run_as is not None and self.run_as[0] != 0,
                "capabilities": self.capabilities == 0,
                "network": self.network_isolated,
                "landlock": self.landlock_abi > 0,
                "seccomp": self.seccomp,
                "pid": self.pid_namespace,
                "scratch": self.scratch_bytes is not None}

    def check(self, require: tuple[str, ...] | list[str]) -> None:
        """Raise when a mechanism in ``require`` is not in force.

        Raises:
            SandboxRefused: naming the missing mechanisms and the probe's notes.
        """
        missing = [m for m, on in self.in_force().items() if m in require and not on]
        if missing:
            raise SandboxRefused(
                f"the sandbox lacks {', '.join(missing)}, which the setting sandbox_require "
                f"asks for: {'; '.join(self.notes) or 'the probe gave no reason'}")

    def summary(self) -> list[str]:
        """One short phrase per mechanism, e.g. ``user 65534``, ``no landlock``."""
        on = self.in_force()
        words = {"user": f"user {self.run_as[0]}" if on["user"] else "no user switch",
                 "capabilities": "no capabilities" if on["capabilities"]
                 else f"capabilities {self.capabilities:#x}",
                 "network": "no network" if on["network"] else "network reachable",
                 "landlock": f"landlock v{self.landlock_abi}" if on["landlock"] else "no landlock",
                 "seccomp": "seccomp" if on["seccomp"] else "no seccomp",
                 "pid": "own pid namespace" if on["pid"] else "no pid namespace",
                 "scratch": f"scratch tmpfs {(self.scratch_bytes or 0) >> 20} MiB"
                 if on["scratch"] else "scratch unbounded"}
        return [words[m] for m in MECHANISMS]


class Sandbox:
    """The one way this service runs untrusted code: a warm fork server, the probe of
    what confinement this machine permits, scratch directories and child specs.

    The worker's :class:`~services.worker.verifier.Verifier` runs references and
    candidates in it; the generator and the SDK run the built-in coder's lowering of a
    task in it (:meth:`lower`). Every child is a fresh process (no state carried from
    one job to the next) confined as :func:`services.sandbox.hardening.enter_sandbox` says.

    Args:
        backend: ``cpu`` (Triton interpreter), ``cuda`` or ``ascend``: the device the
            children use (the probe launches a Triton kernel on it).
        name: names the default scratch root, ``<tmp>/aikg-<name>-<pid>-<random>`` (created at start).
        scratch_root: where run directories and per-device Triton caches live; a
            default one is removed on :meth:`close` (and by the fork server when this
            process dies; by the next start of a default root under the same directory
            when the fork server died too, :func:`remove_stale_scratch_roots`).
        require: mechanisms (:data:`MECHANISMS`) without which :meth:`start` refuses.
        env_allow: more environment variable names (or ``PREFIX*``) children keep.
        preload: more modules the fork server imports once.

    Raises:
        ValueError: ``backend`` or a name in ``require`` is unknown.
    """

    def __init__(self, backend: str, *, name: str, scratch_root: str | Path | None = None,
                 require: tuple[str, ...] | list[str] = (), env_allow: tuple[str, ...] = (),
                 preload: tuple[str, ...] = (),
                 scratch_bytes: int | None = 256 << 20) -> None:
        if backend not in ("cpu", "cuda", "ascend"):
            raise ValueError(f"backend must be cpu, cuda or ascend, not {backend!r}")
        unknown = sorted(set(require) - set(MECHANISMS))
        if unknown:
            raise ValueError(f"unknown sandbox mechanism(s) {', '.join(unknown)}; "
                             f"choose from {', '.join(MECHANISMS)}")
        self.backend = backend
        self.require = tuple(require)
        self.env_allow = tuple(env_allow)
        self.scratch_bytes = scratch_bytes
        self.own_scratch = scratch_root is None
        # The default root is this process's own (a fresh directory): two sandboxes of
        # the same name on one machine (two ``aikg run``, two test sessions) must not
        # remove each other's run directories when one of them closes.
        self.scratch_root = Path(scratch_root) if scratch_root is not None else (
            Path(os.environ.get("TMPDIR", "/tmp"))
            / f"aikg-{safe_name(name)}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        self.isolation = Isolation()
        # Triton decides at import time whether its standard library (tl.sigmoid,
        # tl.softmax ...) is interpreted, so the fork server must import it with
        # TRITON_INTERPRET already set on the cpu backend; a child's later switch only
        # covers kernels the candidate defines itself (a compile child switches back,
        # services.worker.aot.compile_mode).
        server_env = dict(os.environ)
        # Triton 3.9's default (FP fusion on: a * b + c may become one FMA), set
        # explicitly: Triton 3.10 turns it off, which would change results under the
        # same verdict, and 3.9 warns once in every process where it is unset. A value
        # the user set stands.
        server_env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
        if backend == "cpu":
            server_env["TRITON_INTERPRET"] = "1"
        else:
            server_env.pop("TRITON_INTERPRET", None)
        if backend == "cpu":
            # A child runs on one core's worth (threads are refused once it holds
            # inputs); BLAS pools sized for the machine would try to start threads.
            # One thread whatever the environment says: the interpreter's tl.dot calls
            # BLAS (services.sandbox.interpreter).
            for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
                server_env[name] = "1"
        self.pool = SandboxPool(
            env=server_env, env_allow=self.env_allow, preload=list(preload),
            # A SIGKILLed owner cannot remove its own scratch root; its fork server does.
            orphan_cleanup=self.scratch_root if self.own_scratch else None,
            visible=[self.scratch_root])
        self.started = False
        self._start_lock = threading.Lock()

    # ------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Start the fork server and probe the sandbox (blocks for seconds). Idempotent.

        Raises:
            PoolBroken: the server did not start, or no sandboxed child could run.
            SandboxRefused: a required mechanism is not available.
        """
        with self._start_lock:
            if self.started:
                return
            self.scratch_root.mkdir(parents=True, exist_ok=True)
            os.chmod(self.scratch_root, 0o711)
            if self.own_scratch:
                claim_owner(self.scratch_root)
                removed = remove_stale_scratch_roots(self.scratch_root.parent)
                if removed:
                    log.info("sandbox.stale_scratch_removed", count=len(removed),
                             paths=[str(p) for p in removed])
            for sub in ("runs", "triton-cache"):
                (self.scratch_root / sub).mkdir(exist_ok=True)
                os.chmod(self.scratch_root / sub, 0o711)
            self.pool.start()
            try:
                self.isolation = self._probe()
                self.isolation.check(self.require)
            except BaseException:
                self.pool.close()
                raise
            self.started = True

    def abort_start(self) -> None:
        """Make a :meth:`start` under way in another thread fail fast (PoolBroken) if its
        fork server is not ready yet (:meth:`SandboxPool.abort_start`)."""
        if not self.started:
            self.pool.abort_start()

    def close(self) -> None:
        """Stop the fork server (it kills every child's process group); remove a default
        scratch root."""
        with self._start_lock:
            self.pool.close()
            self.started = False
            if self.own_scratch:
                shutil.rmtree(self.scratch_root, ignore_errors=True)

    def _probe(self) -> Isolation:
        """Run probe children: as user ``nobody`` first (when root), else as this user."""
        notes: list[str] = []
        choices: list[tuple[int, int] | None] = [None]
        if os.geteuid() == 0:
            try:
                nobody = pwd.getpwnam("nobody")
                choices.insert(0, (nobody.pw_uid, nobody.pw_gid))
            except KeyError:
                notes.append("children run as root: no user 'nobody'")
        failure = ""
        for run_as in choices:
            hello, failure = _in_thread(self._probe_once(run_as))
            if hello is not None:
                return Isolation(run_as=run_as, network_isolated=hello.network_isolated,
                                 capabilities=hello.capabilities,
                                 landlock_abi=hello.landlock_abi, seccomp=hello.seccomp,
                                 pid_namespace=hello.pid_namespace,
                                 scratch_bytes=hello.scratch_bytes,
                                 notes=notes + hello.notes)
            notes.append(f"children keep this process's user: switching to uid {run_as[0]} "
                         f"failed: {failure}" if run_as else failure)
        raise PoolBroken(f"no sandboxed child could run: {failure}")

    async def _probe_once(self, run_as: tuple[int, int] | None) -> tuple[wire.Hello | None, str]:
        scratch = self.scratch("probe", "probe", run_as)
        # No device restriction: the probe checks that some device is usable at all.
        env = {k: v for k, v in self.child_env("probe", run_as).items()
               if k not in ("CUDA_VISIBLE_DEVICES", "ASCEND_RT_VISIBLE_DEVICES")}
        spec = ChildSpec(role="probe", scratch_dir=str(scratch), backend=self.backend,
                         env=env, run_as=run_as, env_allow=list(self.env_allow),
                         scratch_bytes=self.scratch_bytes)
        run = await self.spawn(spec, 1 << 20)
        hello = None
        try:
            async with asyncio.timeout(_PROBE_TIMEOUT_S):
                while True:
                    frame = await run.frame()
                    if isinstance(frame, wire.Hello):
                        hello = frame
                    elif isinstance(frame, wire.Failure):
                        return None, frame.message
                    elif isinstance(frame, wire.Done):
                        return hello, ""
                    elif frame is None:
                        status = await run.wait(_EXIT_WAIT_S)
                        return None, f"the probe child {describe_exit(status)}: " + \
                            run.output(4096)
        finally:
            await run.close()

    # ------------------------------------------------------------ children

    def scratch(self, label: str, role: str, run_as: tuple[int, int] | None = None) -> Path:
        """A fresh scratch directory (mode 0700, owned by the sandbox user) for one child."""
        path = self.scratch_root / "runs" / f"{safe_name(label)}-{role}-{uuid.uuid4().hex[:8]}"
        path.mkdir(mode=0o700)
        run_as = run_as if run_as is not None else self.isolation.run_as
        if run_as is not None:
            os.chown(path, *run_as)
        return path

    def child_env(self, device: str, run_as: tuple[int, int] | None = None) -> dict[str, str]:
        """Variables set in a child for ``device``: its Triton cache, its one visible device."""
        run_as = run_as if run_as is not None else self.isolation.run_as
        cache = self.scratch_root / "triton-cache" / safe_name(device)
        if not cache.exists():
            cache.mkdir(mode=0o700, parents=True, exist_ok=True)
            if run_as is not None:
                os.chown(cache, *run_as)
        env = {"TRITON_CACHE_DIR": str(cache)}
        if self.backend == "cuda":
            env["CUDA_VISIBLE_DEVICES"] = device
        elif self.backend == "ascend":
            env["ASCEND_RT_VISIBLE_DEVICES"] = device
        else:
            env["TRITON_INTERPRET"] = "1"
        return env

    def spec(self, role: str, scratch: Path, device: str, **fields: Any) -> ChildSpec:
        """A ChildSpec for ``role`` with this sandbox's user, environment and isolation,
        and the role's registered runner (:func:`services.sandbox.roles.runner_of`).

        Raises:
            KeyError: nobody registered ``role``.
        """
        fields.setdefault("scratch_bytes", self.scratch_bytes)
        fields.setdefault("runner", runner_of(role))
        return ChildSpec(role=role, scratch_dir=str(scratch), backend=self.backend,
                         env=self.child_env(device), run_as=self.isolation.run_as,
                         isolate_network=True, env_allow=list(self.env_allow), **fields)

    async def spawn(self, spec: ChildSpec, max_frame_bytes: int) -> ChildRun:
        """Fork a child for ``spec`` and wait for its pid.

        A caller cancelled meanwhile (a job cancelled, a worker stopping) leaves nothing
        behind: the child forked for it is killed and its scratch directory removed.

        Raises:
            PoolBroken: the fork server is gone and could not be restarted (the
                scratch directory is removed).
        """
        forking = asyncio.ensure_future(asyncio.to_thread(self.pool.spawn, spec, max_frame_bytes))
        try:
            run = await asyncio.shield(forking)
        except asyncio.CancelledError:
            # The fork goes on in its thread: reap what it starts.
            forking.add_done_callback(functools.partial(_abandon_when_forked, spec.scratch_dir))
            _keep(forking)
            raise
        except BaseException:
            shutil.rmtree(spec.scratch_dir, ignore_errors=True)
            raise
        starting = asyncio.ensure_future(run.start())
        try:
            await asyncio.shield(starting)
        except PoolBroken:
            await run.close()
            raise
        except asyncio.CancelledError:
            # The start goes on: the cleanup waits for it (a second reader of the
            # status socket would leave this one pending when the socket closes).
            _background(_abandon(run, starting))
            raise
        return run


# Cleanups that run on after their caller was cancelled: ChildRun.close()'s, forks
# abandoned mid-way and the children they start (see settle()).
_abandoned: set[asyncio.Future] = set()


def _background(coro: Any) -> None:
    """Run ``coro`` to its end even though its caller is gone (a reference is kept)."""
    _keep(asyncio.ensure_future(coro))


def _keep(future: asyncio.Future) -> None:
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


async def _abandon(run: ChildRun, starting: asyncio.Future | None = None) -> None:
    """Kill and clean up a child nobody waits for any more (``starting``: its
    :meth:`ChildRun.start` already under way)."""
    with contextlib.suppress(Exception):
        if starting is not None:
            await starting
        elif run.pid is None:
            await run.start()
    await run.close()


def _abandon_when_forked(scratch_dir: str, forking: asyncio.Future) -> None:
    if forking.cancelled() or forking.exception() is not None:
        shutil.rmtree(scratch_dir, ignore_errors=True)
        return
    _background(_abandon(forking.result()))


def _in_thread(coro: Any) -> Any:
    """Run ``coro`` on a fresh event loop in its own thread (callable from sync code
    that may itself be running inside an event loop); its exception becomes
    ``(None, "Type: message")``."""
    box: dict[str, Any] = {}

    def runner() -> None:
        try:
            box["value"] = asyncio.run(coro)
        except BaseException as exc:  # noqa: BLE001 - reported to the caller
            box["value"] = (None, f"{type(exc).__name__}: {exc}")

    thread = threading.Thread(target=runner, name="aikg-sandbox-probe")
    thread.start()
    thread.join()
    return box["value"]
