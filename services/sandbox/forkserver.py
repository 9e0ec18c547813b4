"""The warm fork server: ``python -m services.sandbox.forkserver <control fd>``.

Started by :class:`services.sandbox.pool.SandboxPool` as a fresh interpreter (so
nothing of the worker's state, threads or CUDA context is inherited). It imports
torch and triton once, then forks one child per job; a forked child starts in
milliseconds with everything imported.

Protocol on the control socket (AF_UNIX, SOCK_SEQPACKET, one message per job): the
payload is a msgpack :class:`~services.sandbox.wire.ChildSpec` and the message
carries two file descriptors (SCM_RIGHTS): the child's result socket and a status
socket. On the status socket the server writes the child's pid (8 bytes, signed,
big-endian) right after the fork, then its raw wait status (same encoding) once it
has been reaped, and closes it.

The server is a child subreaper: processes a candidate forks and orphans are
re-parented here and killed. When a child is reaped its whole process group is
killed too. When the control socket closes (the worker exited or closed the pool),
every child's group is killed and the server exits. A pool closed on purpose sends
``BYE`` first; a control socket that closes without it means the worker died
(SIGKILL, OOM kill), and the server then removes the directory named ``orphan_cleanup``
in its optional second argument, a JSON object (the dead worker's scratch root: run
directories, Triton caches). The same object may ask for ``private_mounts`` (run as
root: a private mount namespace in which the sandbox user can reach the interpreter and
the ``visible`` paths, see :func:`services.sandbox.isolation.private_mounts`) and
``preload``, more modules to import before the first fork (and ``module:function``
warm-ups to call once).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import importlib
import json
import os
import selectors
import shutil
import signal
import socket
import struct
import sys
from pathlib import Path

_PID = struct.Struct("!q")
_PR_SET_CHILD_SUBREAPER = 36
READY = b"ready"
BYE = b"bye"


def _preload(extra: list[str]) -> None:
    """Import what every child needs, so a fork starts warm.

    Only imports: no tensor is created here, so no OpenMP or CUDA state exists to be
    broken by the fork. Saves ~1.8 s (torch, triton) per child, and ~1.6 s more per
    reference child (the input-size estimate on fake tensors needs torch._dynamo).
    """
    import numpy  # noqa: F401
    import sympy  # noqa: F401
    import torch  # noqa: F401
    import torch._dynamo  # noqa: F401  (FakeTensorMode's first use imports it: 1.6 s)
    import torch._subclasses.fake_tensor  # noqa: F401
    import triton  # noqa: F401
    import triton.compiler.errors  # noqa: F401
    import triton.language  # noqa: F401
    import triton.runtime.interpreter  # noqa: F401

    if os.environ.get("TRITON_INTERPRET") == "1":
        from services.sandbox import interpreter

        interpreter.install()  # GPU numerics: every interpreted child forks from here
    import services.sandbox.child  # noqa: F401
    import services.sandbox.guard  # noqa: F401
    import services.sandbox.isolation  # noqa: F401

    # What a candidate's first Triton launch imports: without these every candidate
    # child (and its ghost replay and second size) paid ~0.2 s importing gluon
    # (measured: 0.2 of a 0.47 s first launch of a 64 x 4096 relu on the interpreter).
    for name in ("triton.compiler.code_generator", "triton.language.extra.libdevice",
                 "triton.experimental.gluon"):
        with contextlib.suppress(ImportError):
            importlib.import_module(name)

    # The sandbox's own libraries (each child applies them before any job code runs).
    for name in ("landlock", "landlock.plumbing", "pyseccomp"):
        with contextlib.suppress(ImportError, OSError):
            importlib.import_module(name)

    # A preload only saves the children time (they import what they need anyway), so a
    # module this installation lacks (another torch version) is skipped, not fatal.
    for name in extra:
        if ":" in name:
            continue
        try:
            importlib.import_module(name)
        except ImportError as exc:
            print(f"preload: skipped {name}: {exc}", file=sys.stderr, flush=True)
    # ``module:function`` entries are warm-ups: trusted code of ours (never a task's)
    # run once so that every child starts with their lazy state built (torch.export's
    # first call costs ~0.5 s). They must leave no thread behind (fork keeps one).
    for name in extra:
        if ":" not in name:
            continue
        module, _, function = name.partition(":")
        try:
            getattr(importlib.import_module(module), function)()
        except Exception as exc:  # noqa: BLE001 - a warm-up only saves time
            print(f"preload: warm-up {name} failed: {exc}", file=sys.stderr, flush=True)


def _kill_group(pid: int) -> None:
    with contextlib.suppress(OSError):
        os.killpg(pid, signal.SIGKILL)


def _kill_orphans(me: int, children: dict[int, socket.socket]) -> None:
    """SIGKILL processes re-parented to this subreaper (a candidate's escaped descendants)."""
    from services.common.runtime import proc_stat

    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in children:
            continue
        fields = proc_stat(entry)
        if fields is not None and len(fields) > 1 and int(fields[1]) == me:
            with contextlib.suppress(OSError):
                os.kill(int(entry), signal.SIGKILL)


def _fork(spec: object, own_namespace: int) -> int:
    """Fork a job's child: process 1 of a PID namespace of its own when it asks for one
    and this server may make one (root), else a plain fork."""
    if getattr(spec, "pid_namespace", False) and own_namespace >= 0:
        from services.sandbox import isolation

        try:
            return isolation.fork_in_own_pid_namespace(own_namespace)
        except OSError:
            pass
    return os.fork()


def serve(control: socket.socket) -> bool:
    """Fork a child per control message until the control socket closes.

    Returns:
        True when the worker said ``BYE`` before closing it.
    """
    from services.sandbox import child as _child
    from services.sandbox import wire

    me = os.getpid()
    own_namespace = os.open("/proc/self/ns/pid", os.O_RDONLY) if os.geteuid() == 0 else -1
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    children: dict[int, socket.socket] = {}
    told_bye = False
    selector = selectors.DefaultSelector()
    selector.register(control, selectors.EVENT_READ)
    selector.register(wake_r, selectors.EVENT_READ)
    control.sendall(READY)

    def reap() -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            _kill_group(pid)
            status_sock = children.pop(pid, None)
            if status_sock is not None:
                with contextlib.suppress(OSError):
                    status_sock.sendall(_PID.pack(status))
                status_sock.close()
            _kill_orphans(me, children)

    while True:
        for key, _ in selector.select():
            if key.fileobj == wake_r:
                with contextlib.suppress(BlockingIOError):
                    while os.read(wake_r, 4096):
                        pass
                reap()
                continue
            try:
                message, fds, _, _ = socket.recv_fds(control, 1 << 20, 2)
            except InterruptedError:
                continue
            except OSError:
                message, fds = b"", []
            if not message:
                for pid in list(children):
                    _kill_group(pid)
                    with contextlib.suppress(OSError):
                        os.kill(pid, signal.SIGKILL)
                _kill_orphans(me, {})
                return told_bye
            if message == BYE and not fds:
                told_bye = True
                continue
            if len(fds) != 2:
                for fd in fds:
                    os.close(fd)
                continue
            result_fd, status_fd = fds
            spec = wire.SPEC_DECODER.decode(message)
            pid = _fork(spec, own_namespace)
            if pid == 0:
                # The child keeps only its result socket (and stdio).
                if own_namespace >= 0:
                    os.close(own_namespace)
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                selector.close()
                control.close()
                os.close(wake_r)
                os.close(wake_w)
                os.close(status_fd)
                for other in children.values():
                    other.close()
                _child.main(spec, result_fd)
            os.close(result_fd)
            status_sock = socket.socket(fileno=status_fd)
            status_sock.setblocking(True)
            with contextlib.suppress(OSError):
                status_sock.sendall(_PID.pack(pid))
            children[pid] = status_sock


def main() -> None:
    control = socket.socket(fileno=int(sys.argv[1]))
    control.setblocking(True)
    options = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    orphan_cleanup = options.get("orphan_cleanup")
    notes: list[str] = []
    if options.get("private_mounts") and os.geteuid() == 0:
        from services.sandbox import isolation

        # What children must still reach once they are an unprivileged user: the
        # interpreter and its packages, the scratch root.
        notes = isolation.private_mounts(
            [*map(str, isolation.python_paths(Path(__file__).resolve().parents[2])),
             *options.get("visible", [])])
    _preload(options.get("preload", []))
    # What is imported now lives as long as the server: out of the collector's sight,
    # a child's collections do not touch (and so copy) the pages torch's objects sit on.
    gc.freeze()
    if notes:
        print("\n".join(notes), file=sys.stderr, flush=True)
    if not serve(control) and orphan_cleanup:
        shutil.rmtree(orphan_cleanup, ignore_errors=True)
    # Skip interpreter teardown: unloading torch costs ~1.7 s of CPU on every worker
    # exit, and there is nothing left to flush.
    os._exit(0)


if __name__ == "__main__":
    main()
