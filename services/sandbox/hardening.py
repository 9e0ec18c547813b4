"""Sandbox entry: what a freshly forked child does before any task or candidate code.

:func:`enter_sandbox` runs first in every child the fork server forks (see
:mod:`services.sandbox.child` for what the child runs next); the isolation
primitives it applies (user switch, capabilities, Landlock, seccomp, environment
allowlist) are in :mod:`services.sandbox.isolation`.
"""

from __future__ import annotations

import ctypes
import faulthandler
import os
import resource
import signal
import sys
import tempfile
from pathlib import Path

from services.sandbox.wire import STDERR_FILE, STDOUT_FILE, WORK_DIR, ChildSpec, Hello

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

    Steps, in order: in the PID namespace of its own the fork server made for it, its
    own ``/proc`` (:func:`services.sandbox.isolation.own_proc`, as root); own session and
    process group (the parent kills the group); die with the fork server; a private
    network namespace (loopback only, down); the environment reduced to an allowlist
    (:func:`services.sandbox.isolation.allowed_environment`) plus ``spec.env``;
    stdout/stderr to files in the scratch directory, stdin from /dev/null; the work
    directory a tmpfs of ``spec.scratch_bytes`` (HOME, TMPDIR, cwd; on cpu also the
    Triton cache); resource limits; the switch to an unprivileged user with
    every capability dropped (:func:`services.sandbox.isolation.drop_privileges`);
    Landlock confining reads to the Python installation, system directories and the
    scratch directory, and writes to the work directory and Triton cache; a seccomp
    filter. Steps the
    machine does not permit are recorded in the returned :class:`Hello`'s ``notes``
    and skipped; a failed user switch is an error (the child then runs nothing).

    Returns:
        The Hello frame to send.

    Raises:
        OSError: the switch to ``spec.run_as`` failed part-way.
    """
    from services.sandbox import isolation

    notes: list[str] = []
    server = os.getppid()
    # The fork server forked this process as process 1 of its own PID namespace
    # (services.sandbox.isolation.fork_in_own_pid_namespace) where the machine permits.
    pid_namespace = os.getpid() == 1
    if pid_namespace:
        problem = isolation.own_proc()
        if problem:
            notes.append(problem)
    elif spec.pid_namespace:
        notes.append("no PID namespace: the fork server could not create one (it needs root)")
    os.setsid()
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if not pid_namespace and os.getppid() != server:
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
    os.chdir(spec.scratch_dir)
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    for fd, name in ((1, STDOUT_FILE), (2, STDERR_FILE)):
        target = os.open(name, flags, 0o644)
        os.dup2(target, fd)
        os.close(target)
    # Everything but stdout and stderr (files the worker reads after) is written in
    # the work directory: a tmpfs of spec.scratch_bytes where the machine permits.
    work = os.path.join(spec.scratch_dir, WORK_DIR)
    os.makedirs(work, exist_ok=True)
    scratch_bytes = None
    if spec.scratch_bytes is not None and pid_namespace:
        problem = isolation.scratch_filesystem(work, spec.scratch_bytes, spec.run_as)
        if problem:
            notes.append(problem)
        else:
            scratch_bytes = spec.scratch_bytes
    elif spec.scratch_bytes is not None:
        notes.append("scratch size not limited: no private mount namespace")
    if spec.run_as is not None and os.geteuid() == 0:
        os.chown(work, *spec.run_as)
    if spec.backend == "cpu":
        # The interpreter compiles nothing: no Triton cache shared with other children.
        os.environ["TRITON_CACHE_DIR"] = os.path.join(work, "triton-cache")
    os.environ["HOME"] = work
    os.environ["TMPDIR"] = work
    # The fork server may have cached /tmp as tempfile's directory.
    tempfile.tempdir = None
    os.chdir(work)
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
        write = [work]
        cache = os.environ.get("TRITON_CACHE_DIR", "")
        if cache and not cache.startswith(work + os.sep):
            write.append(cache)
        try:
            landlock_abi = isolation.restrict_filesystem(
                [*isolation.python_paths(Path(repo_root)), spec.scratch_dir], write)
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
                 landlock_abi=landlock_abi, seccomp=seccomp, pid_namespace=pid_namespace,
                 scratch_bytes=scratch_bytes)
