"""Process-level helpers for service entry points."""

from __future__ import annotations

import asyncio
import contextlib
import signal


def install_signal_handlers(stop: asyncio.Event) -> None:
    """Set ``stop`` on SIGINT or SIGTERM so a service shuts down cleanly.

    Does nothing outside the main thread (tests run services as tasks).
    """
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(sig, stop.set)
