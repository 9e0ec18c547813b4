"""Process-level helpers for service entry points."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket


def install_signal_handlers(stop: asyncio.Event) -> None:
    """Set ``stop`` on SIGINT or SIGTERM so a service shuts down cleanly.

    Does nothing outside the main thread (tests run services as tasks).
    """
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(sig, stop.set)


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
