"""cancel_and_wait ends a task whose cancellation asyncio.wait_for dropped; retry_async
retries with a doubling wait, logs each failure and re-raises the last one; the one
SIGINT/SIGTERM handler sets stop, then abandon, and puts the previous handlers back; a
sandbox's default scratch root left by a process that is gone is removed by the next
start, and only such a root."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from services.common.runtime import (
    OWNER_FILE,
    cancel_and_wait,
    claim_owner,
    install_signal_handlers,
    retry_async,
)
from services.sandbox.pool import remove_stale_scratch_roots


async def poller(futures: list[asyncio.Future]) -> None:
    """A polling loop like a cancel watcher: each round awaits a reply through wait_for
    (as nats-py's requests do)."""
    while True:
        fut = asyncio.get_running_loop().create_future()
        futures.append(fut)
        await asyncio.wait_for(fut, 10)


async def test_a_cancel_that_races_a_reply_is_repeated_until_the_task_ends() -> None:
    futures: list[asyncio.Future] = []
    task = asyncio.create_task(poller(futures))
    await asyncio.sleep(0)
    # The reply and the cancel land in the same loop iteration.
    futures[-1].set_result("reply")
    task.cancel()
    await asyncio.sleep(0.05)
    if sys.version_info < (3, 12):
        # CPython gh-86296: 3.11's wait_for returned the reply and dropped the cancel,
        # so the loop runs on: a plain `await task` would wait forever.
        assert not task.done() and len(futures) == 2
    futures[-1].set_result("another reply")
    await asyncio.wait_for(cancel_and_wait(task), 5)
    assert task.cancelled()


async def test_tasks_that_end_or_fail_are_awaited_quietly() -> None:
    async def fails() -> None:
        raise RuntimeError("boom")

    failing = asyncio.create_task(fails())
    sleeping = asyncio.create_task(asyncio.sleep(60))
    await asyncio.sleep(0)
    await asyncio.wait_for(cancel_and_wait(failing, sleeping), 5)
    assert sleeping.cancelled() and isinstance(failing.exception(), RuntimeError)
    await cancel_and_wait()  # nothing to do


async def test_the_callers_own_cancellation_propagates() -> None:
    stubborn_futures: list[asyncio.Future] = []
    stubborn = asyncio.create_task(poller(stubborn_futures))
    await asyncio.sleep(0)
    waiter = asyncio.create_task(cancel_and_wait(stubborn))
    await asyncio.sleep(0)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    await cancel_and_wait(stubborn)
    assert stubborn.done()


class Recorder:
    """A logger that keeps its warnings."""

    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def warning(self, event: str, **fields: Any) -> None:
        self.events.append((event, fields))


async def test_retry_async_retries_with_a_doubling_wait_then_returns() -> None:
    calls: list[float] = []

    async def flaky() -> str:
        calls.append(time.monotonic())
        if len(calls) < 3:
            raise ConnectionError(f"down {len(calls)}")
        return "published"

    log = Recorder()
    # A lambda returning a coroutine, as the services pass their publishes.
    assert await retry_async(lambda: flaky(), attempts=4, first_wait_s=0.05, logger=log,
                             event="publish_retry", subject="s") == "published"
    assert len(calls) == 3
    waits = [b - a for a, b in zip(calls, calls[1:], strict=False)]
    assert waits[0] >= 0.05 and waits[1] >= 0.1, waits
    assert [(e, f["attempt"], f["error"], f["subject"]) for e, f in log.events] == [
        ("publish_retry", 1, "ConnectionError: down 1", "s"),
        ("publish_retry", 2, "ConnectionError: down 2", "s")]


async def test_retry_async_reraises_the_last_failure() -> None:
    calls = 0

    async def down() -> None:
        nonlocal calls
        calls += 1
        raise ConnectionError(f"down {calls}")

    log = Recorder()
    with pytest.raises(ConnectionError, match="down 3"):
        await retry_async(down, attempts=3, first_wait_s=0.01, logger=log, event="e")
    assert calls == 3 and len(log.events) == 2


async def test_retry_async_refuses_fewer_than_one_attempt() -> None:
    async def never() -> None:
        raise AssertionError("called")

    with pytest.raises(ValueError, match="at least 1"):
        await retry_async(never, attempts=0, first_wait_s=0.01, logger=Recorder(), event="e")


async def test_signals_set_stop_then_abandon_and_the_old_handlers_come_back() -> None:
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    stop, abandon = asyncio.Event(), asyncio.Event()
    restore = install_signal_handlers(stop, abandon)
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        await asyncio.wait_for(stop.wait(), 10)
        assert not abandon.is_set()
        os.kill(os.getpid(), signal.SIGINT)
        await asyncio.wait_for(abandon.wait(), 10)
    finally:
        restore()
    assert {sig: signal.getsignal(sig) for sig in before} == before


def test_signals_without_a_loop_set_a_threading_event() -> None:
    before = signal.getsignal(signal.SIGTERM)
    stopping = threading.Event()
    restore = install_signal_handlers(stopping)
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        assert stopping.wait(10)
    finally:
        restore()
    assert signal.getsignal(signal.SIGTERM) == before


def test_scratch_roots_of_processes_that_are_gone_are_removed(tmp_path: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()

    def root(name: str, pid: int, owner: str | None) -> Path:
        path = tmp_path / f"aikg-{name}-{pid}-{os.urandom(4).hex()}"
        (path / "runs" / "a-candidate-0").mkdir(parents=True)
        (path / "triton-cache").mkdir()
        if owner is not None:
            (path / OWNER_FILE).write_text(owner)
        return path

    stale = root("worker-vm", dead.pid, f"{dead.pid} 12345\n")
    reused = root("generator", os.getppid(), f"{os.getppid()} 1\n")  # another start time
    live = tmp_path / f"aikg-worker-{os.getpid()}-{os.urandom(4).hex()}"
    live.mkdir()
    claim_owner(live)
    unowned = root("old-version", dead.pid, None)  # no owner file: not ours to judge
    other = tmp_path / f"aikg-up-{dead.pid}-notahex"  # not a scratch root's name
    other.mkdir()
    (other / OWNER_FILE).write_text(f"{dead.pid} 1\n")
    link = tmp_path / f"aikg-link-{dead.pid}-{os.urandom(4).hex()}"
    link.symlink_to(stale)
    # Another user's root is not this process's to remove, whatever its owner file says
    # (made only where this test may give a directory away: as root).
    foreign = root("nobody", dead.pid, f"{dead.pid} 12345\n") if os.geteuid() == 0 else None
    if foreign is not None:
        os.chown(foreign, 65534, 65534)

    removed = remove_stale_scratch_roots(tmp_path)

    assert sorted(removed) == sorted([stale, reused])
    assert not stale.exists() and not reused.exists()
    assert live.exists() and unowned.exists() and other.exists() and link.is_symlink()
    assert foreign is None or foreign.exists()
    assert (live / OWNER_FILE).read_text().split()[0] == str(os.getpid())
    assert remove_stale_scratch_roots(tmp_path) == []
