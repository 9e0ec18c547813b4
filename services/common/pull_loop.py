"""The one pull loop of the generator (jobs) and the worker (verify requests).

Both services take work the same way: while they have free capacity (job slots,
free devices), ask the tenant lanes for at most that many messages, in fair order
(:class:`~services.common.lanes.LanePull`: high priority first, tenants in turn,
lanes of tenants at their share left out or served last); while they have none,
wait until a slot is given back; when the default lane's consumer answers an error
status (deleted, JetStream gone), bind it again after a pause instead of spinning on
errors. What a service does with a message (run a job, verify a candidate, send
``in_progress``, nak on cancel, dead-letter) is its handler's, passed as ``take``.

Nothing is queued in memory: a message is asked for only when there is capacity to
start it at once, so a service that dies holds no more than it was running.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

import structlog

from services.common.lanes import LanePull

log = structlog.get_logger("aikg.pull_loop")

# Pause before binding the default lane's consumer again after it answered an error
# status, seconds: long enough not to spin on a JetStream that is restarting.
REBIND_PAUSE_S = 1.0


class PullLoop:
    """Ask ``lanes`` for work whenever there is capacity, until stopped.

    Args:
        lanes: the started lane pull of the service's stream.
        capacity: how many more messages could start now (free slots or devices).
        take: starts handling one message at once (it must take its slot before it
            returns, so the next ``capacity()`` counts it).
        freed: set by the service whenever a slot is given back (the loop clears it
            before it waits on it).
        rebind: binds the default lane's durable consumer again.
        exclude: ``tenant -> bool``: lanes of such tenants are not asked now.
        defer: ``tenant -> bool``: lanes of such tenants are asked only after every
            other lane came up empty.
        stopping: ``() -> bool``: stop asking (a drain), besides the ``stop`` event.
        idle_s: longest wait for a freed slot before capacity is looked at again,
            seconds.
    """

    def __init__(self, lanes: LanePull, *, capacity: Callable[[], int],
                 take: Callable[[Any], None], freed: asyncio.Event,
                 rebind: Callable[[], Awaitable[None]],
                 exclude: Callable[[str], bool] | None = None,
                 defer: Callable[[str], bool] | None = None,
                 stopping: Callable[[], bool] = lambda: False, idle_s: float = 1.0) -> None:
        self.lanes = lanes
        self.capacity = capacity
        self.take = take
        self.freed = freed
        self.rebind = rebind
        self.exclude = exclude
        self.defer = defer
        self.stopping = stopping
        self.idle_s = idle_s
        self.rebinds = 0

    async def run(self, stop: asyncio.Event) -> None:
        """Take work until ``stop`` is set or :attr:`stopping` says so."""
        while not stop.is_set() and not self.stopping():
            free = self.capacity()
            if free <= 0:
                # Woken by the release itself, so the next ask follows it at once.
                self.freed.clear()
                if self.capacity() <= 0:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self.freed.wait(), self.idle_s)
                continue
            await self.lanes.fetch_or_wait(free, self.take, exclude=self.exclude,
                                           defer=self.defer)
            if self.lanes.default_failed:
                # The consumer or JetStream is gone (409 Consumer Deleted, 503 No
                # Responders ...): bind it again rather than spin on errors.
                self.lanes.default_failed = False
                await asyncio.sleep(REBIND_PAUSE_S)
                try:
                    await self.rebind()
                    self.rebinds += 1
                except Exception as exc:  # noqa: BLE001 - tried again on the next error
                    log.warning("consumer_rebind_failed", stream=self.lanes.stream,
                                error=f"{type(exc).__name__}: {exc}")
