"""Sandbox entry: what a freshly forked child does before any task or candidate code.

:func:`enter_sandbox` runs first in every child the fork server forks (see
:mod:`services.worker._child` for what the child runs next); the isolation
primitives it applies (user switch, capabilities, Landlock, seccomp, environment
allowlist) are in :mod:`services.worker.isolation`.
"""

from __future__ import annotations

import ctypes
import faulthandler
import os
import resource
import signal
import sys
from pathlib import Path

from services.worker.wire import STDERR_FILE, STDOUT_FILE, ChildSpec, Hello

# Linux constants (include/uapi/linux/prctl.h, sched.h).
_PR_SET_PDEATHSIG = 1
_CLONE_NEWNET = 0x40000000

def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _prctl(option: int, arg: int) -> None:
    if _libc().prctl(option, ctypes.c_ulong(arg), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def _address_space() -> int:
    """This process's virtual memory size, bytes (VmSize in /proc/self/status)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def _set_limit(which: int, value: int, hard_extra: int = 0) -> None:
    _, hard = resource.getrlimit(which)
    if hard != resource.RLIM_INFINITY:
        value = min(value, hard - hard_extra)
    resource.setrlimit(which, (value, value + hard_extra))


def enter_sandbox(spec: ChildSpec) -> Hello:
    """Isolate this (freshly forked) process before any task or candidate code runs.

    Steps, in order: own session and process group (the parent kills the group); die
    with the fork server; a private network namespace (loopback only, down); the
    environment reduced to an allowlist (:func:`services.worker.isolation.allowed_environment`)
    plus ``spec.env``; chdir into the scratch directory; stdout/stderr to files there,
    stdin from /dev/null; resource limits; the switch to an unprivileged user with
    every capability dropped (:func:`services.worker.isolation.drop_privileges`);
    Landlock confining reads to the Python installation and system directories and
    writes to the scratch directory and Triton cache; a seccomp filter. Steps the
    machine does not permit are recorded in the returned :class:`Hello`'s ``notes``
    and skipped; a failed user switch is an error (the child then runs nothing).

    Returns:
        The Hello frame to send.

    Raises:
        OSError: the switch to ``spec.run_as`` failed part-way.
    """
    from services.worker import isolation

    notes: list[str] = []
    os.setsid()
    server = os.getppid()
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != server:
        os._exit(1)

    network_isolated = False
    if spec.isolate_network:
        if _libc().unshare(_CLONE_NEWNET) == 0:
            network_isolated = True
        else:
            notes.append(f"network not isolated: unshare(CLONE_NEWNET) failed: "
                         f"{os.strerror(ctypes.get_errno())}")

    kept = isolation.allowed_environment(os.environ, spec.env_allow)
    os.environ.clear()
    os.environ.update(kept)
    os.environ.update(spec.env)
    os.environ["HOME"] = spec.scratch_dir
    os.environ["TMPDIR"] = spec.scratch_dir
    os.chdir(spec.scratch_dir)

    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    for fd, name in ((1, STDOUT_FILE), (2, STDERR_FILE)):
        target = os.open(name, flags, 0o644)
        os.dup2(target, fd)
        os.close(target)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    faulthandler.enable(file=sys.stderr, all_threads=True)

    address_space = None
    _set_limit(resource.RLIMIT_CORE, 0)
    # Soft below hard: SIGXCPU (named in the crash message) before SIGKILL.
    _set_limit(resource.RLIMIT_CPU, spec.cpu_seconds, hard_extra=1)
    _set_limit(resource.RLIMIT_FSIZE, spec.file_size_bytes)
    _set_limit(resource.RLIMIT_NOFILE, spec.open_files)
    if spec.address_space_bytes is not None:
        address_space = _address_space() + spec.address_space_bytes
        _set_limit(resource.RLIMIT_AS, address_space)

    if spec.run_as is not None and os.geteuid() == 0:
        _set_limit(resource.RLIMIT_NPROC, spec.processes)
        isolation.drop_privileges(*spec.run_as)
    else:
        isolation.harden_process()

    landlock_abi = 0
    if spec.landlock:
        repo_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        write = [spec.scratch_dir]
        if os.environ.get("TRITON_CACHE_DIR"):
            write.append(os.environ["TRITON_CACHE_DIR"])
        try:
            landlock_abi = isolation.restrict_filesystem(
                isolation.python_paths(Path(repo_root)), write)
        except OSError as exc:
            notes.append(f"files not confined (Landlock): {exc.strerror or exc}")
    seccomp = False
    if spec.seccomp:
        try:
            isolation.restrict_syscalls()
            seccomp = True
        except OSError as exc:
            notes.append(f"syscalls not filtered (seccomp): {exc.strerror or exc}")
    os.umask(0o077)
    capabilities = 0
    for value in isolation.capability_sets().values():
        capabilities |= value
    return Hello(pid=os.getpid(), uid=os.getuid(), network_isolated=network_isolated,
                 address_space_bytes=address_space, notes=notes, capabilities=capabilities,
                 landlock_abi=landlock_abi, seccomp=seccomp)
