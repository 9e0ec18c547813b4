"""Process and task helpers shared by the services: signal handling, cancelling a task
so that it stays cancelled, retries with backoff (tenacity), a free local port,
reading processes from ``/proc`` (state, start time, descendants; the local stack's
supervisor, the tests and benches that look for strays), and per-process directories
that the next start removes once their owner is gone (:func:`remove_stale_dirs`)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import stat
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol, TypeVar

from tenacity import AsyncRetrying, RetryCallState, stop_after_attempt, wait_exponential

T = TypeVar("T")


class _Flag(Protocol):
    def set(self) -> None: ...

    def is_set(self) -> bool: ...


# The signals that stop a long-running service (``kill``, Ctrl-C).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def install_signal_handlers(stop: _Flag, abandon: _Flag | None = None, *,
                            logger: Any = None, hint: str = "") -> Callable[[], None]:
    """The one SIGINT/SIGTERM handling of every long-running service (``aikg gateway``,
    ``generator``, ``worker``, ``nats-setup --serve``, the ``aikg up`` supervisor): the
    first signal sets ``stop`` (a graceful drain); with ``abandon``, the next one sets
    it (give up what is still running), else it sets ``stop`` again.

    ``stop`` / ``abandon`` are :class:`asyncio.Event` (called with a running loop: the
    loop's own signal handling, so the event is set in the loop's thread) or
    :class:`threading.Event` (no running loop: :func:`signal.signal`).

    Args:
        logger: a structlog logger; each signal is logged (``stopping`` /
            ``abandoning``, with the signal's name and ``hint``).
        hint: what the first signal does and what another one would, for the log.

    Returns:
        A function that puts the previous handlers back. Nothing is installed (and
        the function does nothing) outside the main thread: tests run services as
        tasks and stop them with ``stop``.
    """
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def on_signal(sig: int) -> None:
        name = signal.Signals(sig).name
        if abandon is not None and stop.is_set():
            if logger is not None:
                logger.warning("abandoning", signal=name)
            abandon.set()
            return
        if logger is not None:
            logger.info("stopping", signal=name, **({"hint": hint} if hint else {}))
        stop.set()

    previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    try:
        loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
    except RuntimeError:
        loop = None
    for sig in STOP_SIGNALS:
        if loop is not None:
            loop.add_signal_handler(sig, on_signal, sig)
        else:
            signal.signal(sig, lambda signum, _frame: on_signal(signum))

    def restore() -> None:
        for sig, handler in previous.items():
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                if loop is not None:
                    loop.remove_signal_handler(sig)
                signal.signal(sig, handler)

    return restore


# How often a cancellation is repeated while the task has not ended, seconds.
_RECANCEL_S = 0.1


async def cancel_and_wait(*tasks: asyncio.Future) -> None:
    """Cancel ``tasks`` and wait until each has ended, cancelling again while one runs on.

    A single ``cancel()`` is not enough on Python 3.11: ``asyncio.wait_for`` drops a
    cancellation that arrives in the same loop iteration as the awaited future's
    result (CPython gh-86296, fixed in 3.12 by rewriting ``wait_for``), and nats-py's
    requests (KV reads and writes, JetStream publishes) await through it. A polling
    loop whose cancel was dropped would run on, and whoever awaits it would wait
    forever: a generator's job stuck after its verdict, a worker's lease renewer
    holding a device. Exceptions of the tasks are swallowed (they were cancelled);
    a cancellation of the caller propagates.
    """
    pending = {t for t in tasks if not t.done()}
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=_RECANCEL_S)
    for task in tasks:
        if task.done() and not task.cancelled():
            task.exception()  # retrieved, so asyncio does not log it as never retrieved


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that was free a moment ago (the OS picked it).

    Another process may take it before the caller binds it: use it only where the
    port must be known before the server starts (a child process's command line),
    never where the server can bind port 0 itself and say which port it got.
    """
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


async def retry_async(call: Callable[[], Awaitable[T]], *, attempts: int, first_wait_s: float,
                      logger: Any, event: str, **fields: Any) -> T:
    """``await call()`` up to ``attempts`` times, waiting ``first_wait_s`` seconds after
    the first failure and twice as long after each next one (tenacity's exponential
    wait); each failure before the last is logged as ``event`` with ``attempt``,
    ``error`` and ``fields``.

    Only ``Exception`` is retried: a cancellation (during a call or a wait) ends it at
    once.

    Returns:
        What ``call()`` returned.

    Raises:
        ValueError: ``attempts`` below 1.
        Exception: the last attempt's exception, unchanged.
    """
    if attempts < 1:
        raise ValueError(f"attempts must be at least 1, not {attempts}")

    def log_failure(state: RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome is not None else None
        logger.warning(event, attempt=state.attempt_number,
                       error=f"{type(exc).__name__}: {exc}", **fields)

    retrying = AsyncRetrying(stop=stop_after_attempt(attempts),
                             wait=wait_exponential(multiplier=first_wait_s, exp_base=2,
                                                   min=first_wait_s),
                             before_sleep=log_failure, reraise=True)

    async def attempt() -> T:
        # A coroutine function: tenacity calls anything else (a lambda returning a
        # coroutine) as a plain function and would return its coroutine un-awaited.
        return await call()

    return await retrying(attempt)


def proc_stat(pid: int | str) -> list[bytes] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (the state first,
    then the parent pid ...; see proc(5)), or None when the process is gone. One read,
    so a process that ends between two looks is simply gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name is in parentheses and may itself hold spaces or ")".
    fields = stat[stat.rfind(b")") + 2:].split()
    return fields or None


def process_state(pid: int) -> str | None:
    """The one-letter state of ``pid`` (``R``, ``S``, ``Z`` ...), None when it is gone."""
    fields = proc_stat(pid)
    return None if fields is None else fields[0].decode()


def running(pids: set[int]) -> set[int]:
    """Those of ``pids`` that still run (gone, zombie and dead ones left out)."""
    return {pid for pid in pids if process_state(pid) not in (None, "Z", "X")}


def descendants(root: int) -> set[int]:
    """Every process below ``root`` that still runs (children, theirs, ...), from one
    pass over ``/proc``; zombies left out."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        fields = proc_stat(entry) if entry.isdigit() else None
        if fields is not None and len(fields) > 1 and fields[0] not in (b"Z", b"X"):
            parents[int(entry)] = int(fields[1])
    found: set[int] = set()
    frontier = {root}
    while frontier:
        frontier = {pid for pid, ppid in parents.items() if ppid in frontier} - found
        found |= frontier
    return found


# In a per-process directory: "<pid> <start time>" of the process that owns it (start
# time: /proc/<pid>/stat field 22, clock ticks after boot), so that a reused pid is not
# taken for the owner. Written by :func:`claim_owner`, read by :func:`remove_stale_dirs`.
OWNER_FILE = "owner"


def process_start(pid: int) -> str | None:
    """When ``pid`` started (``/proc/<pid>/stat`` field 22, clock ticks after boot);
    None when it is gone or a zombie. Where /proc is missing: ``""`` while it exists."""
    if not Path("/proc/self/stat").exists():
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return ""
    fields = proc_stat(pid)
    if fields is None or fields[0] in (b"Z", b"X"):
        return None
    return fields[19].decode()


def claim_owner(path: Path) -> None:
    """Mark the directory ``path`` as this process's (:data:`OWNER_FILE`).

    Raises:
        OSError: ``path`` cannot be written.
    """
    (path / OWNER_FILE).write_text(f"{os.getpid()} {process_start(os.getpid()) or ''}\n")


def remove_stale_dirs(base: Path, pattern: str, pid_of: Callable[[str], int | None], *,
                      need_owner: bool = False) -> list[Path]:
    """Remove this user's directories under ``base`` matching the glob ``pattern`` whose
    owning process is gone: the pid ``pid_of(name)`` reads from the directory's name no
    longer runs, or runs but started at another time than its :data:`OWNER_FILE` says
    (the pid was reused). Names ``pid_of`` gives None for, symbolic links, other users'
    directories and, with ``need_owner``, directories without an owner file are kept.

    Returns:
        The directories removed.
    """
    removed = []
    for path in base.glob(pattern):
        pid = pid_of(path.name)
        if pid is None:
            continue
        try:
            info = path.lstat()  # a symbolic link is S_ISLNK, not a directory
        except OSError:
            continue
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
            continue
        try:
            owner = (path / OWNER_FILE).read_text().split()
        except OSError:
            if need_owner:
                continue
            owner = []
        started = process_start(pid)
        if started and len(owner) > 1 and owner[0] == str(pid) and owner[1] != started:
            started = None  # the pid now belongs to another process
        if started is None:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed
