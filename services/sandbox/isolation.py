"""The kernel mechanisms that confine untrusted code: what a sandboxed child may see and do.

Everything this service runs on behalf of a user is untrusted: the task's own module
code (``Model``, ``get_inputs``), the built-in coder's ``torch.export`` of it, and every
candidate. Each runs in a child forked from a warm fork server
(:mod:`services.sandbox.forkserver`) and, before any of that code runs, the child calls
the steps here, in order (see :func:`services.sandbox.hardening.enter_sandbox`):

1. :func:`allowed_environment`: the environment is an allowlist (what Python, torch,
   Triton, CUDA and the BLAS libraries read), never a denylist of secret-looking names.
2. :func:`drop_privileges`: switch to an unprivileged user, clear supplementary groups,
   empty every capability set (bounding, ambient, permitted, effective, inheritable;
   capabilities(7)), set ``no_new_privs`` and make the process non-dumpable (so a
   sibling child of the same user cannot ptrace it or read its ``/proc/<pid>/mem``,
   ``environ`` or ``fd/``; proc(5), "PR_SET_DUMPABLE").
3. :func:`restrict_filesystem`: a Landlock ruleset (landlock(7)) that allows reading the
   Python installation, the system libraries, ``/proc``, ``/sys`` and the device nodes,
   and writing only the child's own scratch directory and Triton cache. Other jobs'
   scratch directories, the worker's files, the NATS store and anything else are out of
   reach whatever their permission bits.
4. :func:`restrict_syscalls`: a seccomp filter (seccomp(2), through libseccomp) that
   refuses ptrace, cross-process memory access, namespace and mount changes, kernel
   keyrings, BPF, module loading and the like with EPERM.

:func:`private_mounts` runs once in the fork server (as root): in a private mount
namespace, a directory the sandbox user may not traverse but that holds the Python
installation (``/root`` when Python lives in ``/root/.pyenv``) is covered by an empty
tmpfs into which only the needed paths are bind-mounted back. The rest of it (the
worker user's home, keys, history) is hidden from every child.

Each step records what the machine did not permit in a list of notes instead of
failing; :class:`services.sandbox.pool.Sandbox` reports them and can refuse to run
without a mechanism (``require``).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import stat
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

# Environment variables a sandboxed child keeps (exact names, then prefixes). Python
# and locale: PATH, LANG, LC_*, TZ, PYTHONPATH (an uninstalled checkout), PYTHONHASHSEED;
# CUDA and the NVIDIA container runtime: CUDA_*, NVIDIA_*, LD_LIBRARY_PATH; Triton's
# knobs: TRITON_*; thread pools of the BLAS/OpenMP libraries torch links:
# OMP_*, KMP_*, MKL_*, OPENBLAS_* (OPENBLAS_CORETYPE keeps some CPUs from crashing);
# glibc's MALLOC_ARENA_MAX; Ascend's runtime: ASCEND_*.
ENV_ALLOW_NAMES = frozenset({
    "PATH", "LANG", "LANGUAGE", "TZ", "PYTHONPATH", "PYTHONHASHSEED", "LD_LIBRARY_PATH",
    "MALLOC_ARENA_MAX", "CUDA_HOME", "CUDA_PATH",
})
ENV_ALLOW_PREFIXES = ("LC_", "CUDA_", "NVIDIA_", "TRITON_", "OMP_", "KMP_", "MKL_",
                      "OPENBLAS_", "ASCEND_")
# Substrings that mark a name as a secret even when a prefix above allows it
# (``TRITON_API_TOKEN``): the allowlist is the rule, this a second guard.
SECRET_SUBSTRINGS = ("KEY", "TOKEN", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL", "AUTH")

# Linux constants: include/uapi/linux/prctl.h, sched.h, mount.h, capability.h.
_PR_CAPBSET_DROP = 24
_PR_SET_DUMPABLE = 4
_PR_SET_NO_NEW_PRIVS = 38
_PR_CAP_AMBIENT = 47
_PR_CAP_AMBIENT_CLEAR_ALL = 4
_CLONE_NEWNS = 0x00020000
_MS_RDONLY = 1
_MS_NOSUID = 2
_MS_NODEV = 4
_MS_BIND = 4096
_MS_REC = 16384
_MS_PRIVATE = 1 << 18
_MS_REMOUNT = 32
_LINUX_CAPABILITY_VERSION_3 = 0x20080522

# Read-only system locations every child may read and execute from (when they exist).
_SYSTEM_DIRS = ("/usr", "/lib", "/lib64", "/lib32", "/libx32", "/bin", "/sbin", "/etc",
                "/opt", "/usr/local/nvidia", "/usr/local/cuda")
# Syscalls refused (EPERM) in a child. None is needed to run a task, export it or run a
# Triton kernel; each lets code reach past its process or change what confines it.
BLOCKED_SYSCALLS = (
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd",
    "mount", "umount2", "pivot_root", "chroot", "move_mount", "open_tree", "fsopen",
    "fsmount", "fsconfig", "unshare", "setns", "bpf", "keyctl", "add_key", "request_key",
    "init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load",
    "reboot", "swapon", "swapoff", "syslog", "acct", "quotactl", "userfaultfd",
    "open_by_handle_at", "name_to_handle_at", "lookup_dcookie", "perf_event_open",
    "iopl", "ioperm", "settimeofday", "clock_settime", "adjtimex",
)
# clone() flags that create namespaces (sched.h): refused, so a child cannot build a
# user namespace in which it holds capabilities again. clone3() passes its flags in
# memory a filter cannot read, so it answers ENOSYS and glibc falls back to clone().
_CLONE_NAMESPACE_FLAGS = (0x00000080, 0x00020000, 0x02000000, 0x04000000, 0x08000000,
                          0x10000000, 0x20000000, 0x40000000)


def is_secret(name: str) -> bool:
    """True for a variable name that looks like a secret (``*KEY*``, ``*TOKEN*`` ...)."""
    upper = name.upper()
    return any(s in upper for s in SECRET_SUBSTRINGS)


def env_allowed(name: str, extra: Iterable[str] = ()) -> bool:
    """Whether a sandboxed child keeps the variable ``name`` (see :data:`ENV_ALLOW_NAMES`).

    ``extra``: names or ``PREFIX*`` patterns an operator added (setting
    ``sandbox_env_allow``). ``AIKG_*`` variables (settings, credentials) never pass.
    """
    if name.startswith("AIKG_") or is_secret(name):
        return False
    if name in ENV_ALLOW_NAMES or name.startswith(ENV_ALLOW_PREFIXES):
        return True
    for pattern in extra:
        if name == pattern or (pattern.endswith("*") and name.startswith(pattern[:-1])):
            return True
    return False


def allowed_environment(environ: Mapping[str, str], extra: Iterable[str] = ()) -> dict[str, str]:
    """The part of ``environ`` a sandboxed child may see (see :func:`env_allowed`)."""
    extra = tuple(extra)
    return {k: v for k, v in environ.items() if env_allowed(k, extra)}


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


# ---------------------------------------------------------------- mounts (fork server)


def _blocked_ancestor(path: Path) -> Path | None:
    """The topmost ancestor of ``path`` that others may not traverse (mode without o+x)."""
    for parent in reversed(path.parents):
        if parent == Path("/"):
            continue
        try:
            mode = parent.stat().st_mode
        except OSError:
            return None
        if not mode & stat.S_IXOTH:
            return parent
    return None


def _minimal(paths: Iterable[Path]) -> list[Path]:
    """``paths`` without those inside another one of them."""
    out: list[Path] = []
    for p in sorted(set(paths), key=lambda q: len(q.parts)):
        if not any(p == q or q in p.parents for q in out):
            out.append(p)
    return out


def private_mounts(visible: Iterable[str | Path]) -> list[str]:
    """Give this process (and its future children) a private mount namespace in which
    every path in ``visible`` can be reached by an unprivileged user.

    For each ancestor that others may not traverse (``/root`` is 0700), the ancestor is
    covered by an empty read-only tmpfs (mode 0755) and only the ``visible`` paths under
    it are bind-mounted back, at the same paths. Must run as root, before any child is
    forked. Nothing is changed outside this process's namespace.

    Returns:
        Notes on what could not be done (an empty list when everything worked).
    """
    libc = _libc()
    wanted = [Path(os.path.realpath(p)) for p in visible if os.path.exists(p)]
    groups: dict[Path, list[Path]] = {}
    for path in wanted:
        blocked = _blocked_ancestor(path)
        if blocked is not None:
            groups.setdefault(blocked, []).append(path)
    if not groups:
        return []
    if libc.unshare(_CLONE_NEWNS) != 0:
        return [f"the Python installation stays unreachable for the sandbox user: "
                f"unshare(CLONE_NEWNS) failed: {os.strerror(ctypes.get_errno())}"]
    notes: list[str] = []
    try:
        _check(libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None), "mount --make-rprivate /")
        for ancestor, paths in groups.items():
            keep = _minimal(paths)
            # Hold each kept path open (O_PATH) across the cover: /proc/self/fd/N names it
            # after the tmpfs hides its original location.
            fds = [os.open(p, os.O_PATH) for p in keep]
            try:
                _check(libc.mount(b"tmpfs", str(ancestor).encode(), b"tmpfs",
                                  _MS_NOSUID | _MS_NODEV, b"mode=0755,size=64k"),
                       f"mount tmpfs on {ancestor}")
                for path, fd in zip(keep, fds, strict=True):
                    if os.path.isdir(f"/proc/self/fd/{fd}"):
                        os.makedirs(path, mode=0o755, exist_ok=True)
                    else:
                        os.makedirs(path.parent, mode=0o755, exist_ok=True)
                        Path(path).touch()
                    _check(libc.mount(f"/proc/self/fd/{fd}".encode(), str(path).encode(), None,
                                      _MS_BIND | _MS_REC, None), f"bind {path}")
                # The skeleton itself read-only: nothing can be planted in it.
                _check(libc.mount(b"none", str(ancestor).encode(), None,
                                  _MS_BIND | _MS_REMOUNT | _MS_RDONLY | _MS_NOSUID | _MS_NODEV, None),
                       f"remount {ancestor} read-only")
            finally:
                for fd in fds:
                    os.close(fd)
    except OSError as exc:
        notes.append(f"private mounts incomplete: {exc}")
    return notes


# ---------------------------------------------------------------- namespaces (child)

_CLONE_NEWPID = 0x20000000
_MS_NOEXEC = 8


_SETNS_PID = _CLONE_NEWPID


def fork_in_own_pid_namespace(own_namespace: int) -> int:
    """``os.fork()``, the child being process 1 of a new PID namespace
    (pid_namespaces(7): whatever it starts dies when it ends). Run by the fork server
    (root): ``unshare(CLONE_NEWPID)`` puts its next child in a new namespace, then
    ``setns`` back to ``own_namespace`` (an fd of ``/proc/self/ns/pid``), so the next
    fork may have one of its own.

    Raises:
        OSError: the machine refused (not root, no namespaces); nothing was forked.
    """
    libc = _libc()
    _check(libc.unshare(_CLONE_NEWPID), "unshare(CLONE_NEWPID)")
    pid = os.fork()
    if pid:
        _check(libc.setns(own_namespace, _SETNS_PID), "setns back to the server's PID namespace")
    return pid


def own_proc() -> str | None:
    """In a child that is process 1 of its own PID namespace: a private mount namespace
    with a ``/proc`` of that namespace, so ``/proc`` shows no process outside it. Must
    run as root, before privileges are dropped.

    Returns:
        None when it worked, else why not.
    """
    libc = _libc()
    try:
        _check(libc.unshare(_CLONE_NEWNS), "unshare(CLONE_NEWNS)")
        _check(libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None),
               "mount --make-rprivate /")
        _check(libc.mount(b"proc", b"/proc", b"proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC,
                          None), "mount proc")
    except OSError as exc:
        return f"PID namespace without its own /proc: {exc}"
    return None


def scratch_filesystem(path: str, size_bytes: int, owner: tuple[int, int] | None) -> str | None:
    """Mount a tmpfs of ``size_bytes`` at ``path`` (owned by ``owner``, mode 0700): all
    the child may write. Needs the private mount namespace of :func:`own_proc`.

    Returns:
        None when it worked, else why not.
    """
    options = f"size={size_bytes},mode=0700"
    if owner is not None:
        options += f",uid={owner[0]},gid={owner[1]}"
    try:
        _check(_libc().mount(b"tmpfs", path.encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV,
                             options.encode()), f"mount tmpfs on {path}")
    except OSError as exc:
        return f"scratch size not limited: {exc}"
    return None


# ---------------------------------------------------------------- privileges (child)


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                ("inheritable", ctypes.c_uint32)]


def _last_cap() -> int:
    try:
        return int(Path("/proc/sys/kernel/cap_last_cap").read_text())
    except (OSError, ValueError):
        return 40


def drop_privileges(uid: int, gid: int) -> None:
    """Become ``uid``/``gid`` with no capability, no supplementary group, no way back.

    Order matters: the bounding set can only be shrunk while CAP_SETPCAP is held (before
    the user switch); setresuid away from root clears the permitted and effective sets
    (capabilities(7), "Effect of user ID changes on capabilities"); the inheritable set
    is cleared explicitly and the ambient set emptied. ``no_new_privs`` keeps set-uid
    programs and file capabilities from giving anything back.

    Raises:
        OSError: a step failed (the child must not run untrusted code then).
    """
    libc = _libc()
    for cap in range(_last_cap() + 1):
        if libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 and ctypes.get_errno() != errno.EINVAL:
            _check(-1, f"drop capability {cap} from the bounding set")
    _check(libc.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0), "clear ambient capabilities")
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    header = _CapHeader(_LINUX_CAPABILITY_VERSION_3, 0)
    data = (_CapData * 2)(_CapData(0, 0, 0), _CapData(0, 0, 0))
    _check(libc.capset(ctypes.byref(header), data), "capset")
    _check(libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    harden_process()


def harden_process() -> None:
    """Non-dumpable: no core file, and no other process of this user may ptrace this one
    or read its ``/proc/<pid>/{mem,environ,fd}`` (ptrace access mode checks, proc(5))."""
    _check(_libc().prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0), "PR_SET_DUMPABLE")


def capability_sets() -> dict[str, int]:
    """This process's capability sets from ``/proc/self/status`` (``CapEff`` ... as ints)."""
    caps = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("Cap"):
                name, value = line.split(":", 1)
                caps[name] = int(value.strip(), 16)
    return caps


# ---------------------------------------------------------------- Landlock (child)


def _landlock():
    import landlock  # noqa: PLC0415 - optional at import time of the fork server
    from landlock.plumbing import FSAccess, landlock_abi_version

    return landlock, FSAccess, landlock_abi_version


def python_paths(repo_root: Path) -> list[Path]:
    """Directories the interpreter imports from: its prefixes and ``sys.path``.

    ``repo_root`` itself (an uninstalled checkout on ``sys.path``) is narrowed to its
    ``services`` and ``schemas`` packages, so that the rest of the checkout (logs, a
    local NATS store, credentials) stays out of reach.
    """
    repo_root = repo_root.resolve()
    paths = {Path(p).resolve() for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    for entry in sys.path:
        if not entry or not os.path.isdir(entry):
            continue
        path = Path(entry).resolve()
        if path == repo_root or path in repo_root.parents:
            paths.update({repo_root / "services", repo_root / "schemas"})
        else:
            paths.add(path)
    return sorted(p for p in paths if p.exists())


def restrict_filesystem(read: Iterable[str | Path], write: Iterable[str | Path]) -> int:
    """Confine this process (and what it starts) with Landlock.

    Args:
        read: paths that may be read, listed and executed (directories apply to all
            beneath them); ``/proc``, ``/sys`` and the system directories are added.
        write: paths that may also be written, created and removed (the scratch
            directory, the Triton cache).

    Returns:
        The Landlock ABI version in force.

    Raises:
        OSError: Landlock is not available (kernel without it, or disabled), or a rule
            could not be added.
    """
    try:
        landlock, fs, abi_version = _landlock()
        abi = abi_version()
    except ImportError as exc:
        raise OSError(errno.ENOSYS, f"the landlock package is missing: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - the library raises its own error types
        raise OSError(errno.ENOSYS, f"Landlock is not available: {exc}") from None
    file_read = fs.READ_FILE | fs.EXECUTE
    dir_read = file_read | fs.READ_DIR
    dev = fs.READ_FILE | fs.WRITE_FILE
    if abi >= 5:
        dev |= fs.IOCTL_DEV
    try:
        ruleset = landlock.Ruleset()

        def allow(path: str | Path, dir_rights, file_rights) -> None:
            try:
                st = os.stat(path)
            except OSError:
                return
            ruleset.allow(str(path), rules=dir_rights if stat.S_ISDIR(st.st_mode) else file_rights)

        for path in (*_SYSTEM_DIRS, *read):
            allow(path, dir_read, file_read)
        allow("/proc", fs.READ_FILE | fs.READ_DIR, fs.READ_FILE)
        allow("/sys", fs.READ_FILE | fs.READ_DIR, fs.READ_FILE)
        # Device nodes: their own modes still apply (no capability is left), so only
        # world-accessible ones (null, zero, urandom, the GPU nodes) open; creating
        # anything in /dev (or /dev/shm) is not granted.
        allow("/dev", fs.READ_DIR | dev, dev)
        for path in write:
            allow(path, fs.all(), fs.all_file())
        ruleset.apply()
    except OSError:
        raise
    except Exception as exc:  # noqa: BLE001 - landlock.LandlockError and friends
        raise OSError(errno.EPERM, f"Landlock: {exc}") from None
    return abi


# ---------------------------------------------------------------- seccomp (child)


def restrict_syscalls() -> int:
    """Refuse :data:`BLOCKED_SYSCALLS` (EPERM) in this process and its descendants.

    Returns:
        How many of them this architecture has (and so are now refused).

    Raises:
        OSError: libseccomp is missing or the filter could not be loaded.
    """
    try:
        import pyseccomp as seccomp  # noqa: PLC0415
    except (ImportError, OSError, RuntimeError) as exc:  # RuntimeError: no libseccomp
        raise OSError(errno.ENOSYS, f"libseccomp is not available: {exc}") from None
    try:
        flt = seccomp.SyscallFilter(defaction=seccomp.ALLOW)
        count = 0
        for name in BLOCKED_SYSCALLS:
            with contextlib.suppress(Exception):  # not on this architecture
                flt.add_rule(seccomp.ERRNO(errno.EPERM), name)
                count += 1
        for flag in _CLONE_NAMESPACE_FLAGS:
            flt.add_rule(seccomp.ERRNO(errno.EPERM), "clone",
                         seccomp.Arg(0, seccomp.MASKED_EQ, flag, flag))
        with contextlib.suppress(Exception):
            flt.add_rule(seccomp.ERRNO(errno.ENOSYS), "clone3")
        flt.load()
    except OSError:
        raise
    except Exception as exc:  # noqa: BLE001 - pyseccomp raises RuntimeError and others
        raise OSError(errno.EPERM, f"seccomp: {exc}") from None
    return count
