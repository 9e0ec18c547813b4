"""Waiting for a job to end: the one policy (:class:`JobWait`) that
:meth:`AIKGClient.wait_for_completion <services.sdk.client.AIKGClient.wait_for_completion>`
and its asyncio twin drive, the job's events read beside the status polls
(:class:`EventFeed`, :func:`follow_events`: the verification's phases as they happen),
and the progress display they show on a terminal (:class:`Progress`). The CLI (``aikg
submit --wait``, ``aikg demo``) and the tests wait through those methods; nothing else
polls a job's status."""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from services.sdk.errors import AIKGConnectionError

TERMINAL = frozenset({"completed", "failed", "cancelled"})


class JobWait:
    """The one "wait for a job to end" policy, without I/O: when to stop, when to give
    up, how long to sleep. :meth:`AIKGClient.wait_for_completion` and its asyncio twin
    drive it with their own request and sleep (the CLI and the tests call those).

    Args:
        job_id: the job waited on (for messages).
        timeout: seconds to wait at most, from now.
        poll_interval: seconds between status requests.
        unreachable_grace_s: how long the gateway may stay unreachable before the wait
            ends (a gateway restart takes a few seconds; the job itself lives in NATS);
            0 ends it at the first failed request.
        watchers: called with each status dict received.
        clock: seconds, monotonic (:func:`time.monotonic` or the event loop's time).
        event_watchers: called with each job event received (a JobEvent dict, as
            :meth:`AIKGClient.stream_events` yields it).
    """

    def __init__(self, job_id: str, timeout: float, poll_interval: float,
                 unreachable_grace_s: float, watchers: list[Any], clock: Any,
                 event_watchers: list[Any] | None = None) -> None:
        self.job_id = job_id
        self.timeout = timeout
        self.poll_interval = poll_interval
        self.grace = unreachable_grace_s
        self.watchers = [w for w in watchers if w is not None]
        self.event_watchers = [w for w in event_watchers or [] if w is not None]
        self.clock = clock
        self.deadline = clock() + timeout
        self.last_ok = clock()
        self.last_status: str | None = None

    def ended(self, status: dict[str, Any]) -> bool:
        """Note a status dict; True when the job has ended (``status["status"]`` terminal)."""
        self.last_ok = self.clock()
        self.last_status = status.get("status")
        for watcher in self.watchers:
            watcher(status)
        return self.last_status in TERMINAL

    def seen(self, event: dict[str, Any]) -> None:
        """Note a job event: each event watcher is called with it."""
        for watcher in self.event_watchers:
            watcher(event)

    def lost(self, exc: AIKGConnectionError) -> None:
        """A status request failed: raise once the gateway has been gone past the grace.

        Raises:
            AIKGConnectionError: ``exc`` itself without a grace, else one saying how long
                the gateway has been gone.
        """
        if self.grace <= 0:
            raise exc
        if self.clock() - self.last_ok > self.grace:
            raise AIKGConnectionError(
                f"lost the gateway at {exc.url} for {self.grace:.0f} s ({exc.reason}); "
                f"job {self.job_id} goes on", exc.url,
                f"{exc.reason}, for {self.grace:.0f} s") from exc

    def pause(self) -> float:
        """Seconds to sleep before the next request.

        Raises:
            TimeoutError: ``timeout`` has passed; the job goes on.
        """
        left = self.deadline - self.clock()
        if left <= 0:
            raise TimeoutError(f"job {self.job_id} did not finish within {self.timeout:g} s "
                               f"(status {self.last_status}); it goes on")
        return min(self.poll_interval, left)


class EventFeed:
    """A job's events read beside the status polls of a blocking wait: a daemon thread
    follows ``stream`` (:meth:`AIKGClient.stream_events` of the job) and hands each
    event to the waiting thread, which takes them in :meth:`during` instead of
    sleeping. Events are a view (the status poll decides when the job has ended): a
    stream that fails or is refused ends the feed and the wait goes on polling.

    Args:
        stream: opens the job's event iterator; None: no feed (:meth:`during` sleeps).
    """

    def __init__(self, stream: Callable[[], Iterator[dict[str, Any]]] | None) -> None:
        self._stream = stream
        self._events: queue.SimpleQueue[dict[str, Any]] = queue.SimpleQueue()
        self._stop = threading.Event()

    def __enter__(self) -> EventFeed:
        if self._stream is not None:
            threading.Thread(target=self._follow, name="aikg-job-events", daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        # The thread ends at its next event or keepalive (~15 s), or with the stream.
        self._stop.set()

    def during(self, seconds: float) -> Iterator[dict[str, Any]]:
        """The events that arrive in the next ``seconds``, each as it comes; returns
        once they have passed."""
        if self._stream is None:
            time.sleep(seconds)
            return
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            try:
                yield self._events.get(timeout=left)
            except queue.Empty:
                return

    def _follow(self) -> None:
        assert self._stream is not None
        with contextlib.suppress(Exception):
            events = self._stream()
            try:
                for event in events:
                    if self._stop.is_set():
                        return
                    self._events.put(event)
            finally:
                close = getattr(events, "close", None)
                if close is not None:
                    close()


async def follow_events(events: AsyncIterator[dict[str, Any]],
                        seen: Callable[[dict[str, Any]], None]) -> None:
    """Hand each of a job's ``events`` (:meth:`AsyncAIKGClient.stream_events`) to
    ``seen`` until the stream ends; run as a task beside the status polls of an
    asyncio wait, which cancels it. A stream that fails ends quietly (events are a
    view: the status poll decides when the job has ended)."""
    with contextlib.suppress(Exception):
        async for event in events:
            seen(event)


class Progress:
    """A rich progress display on stderr while waiting: status, phase, candidates, the
    phase of the verification under way (from the job's events), elapsed."""

    def __init__(self, job_id: str, enabled: bool) -> None:
        self.job_id = job_id
        self.text = f"{job_id} submitted"
        self.phase = ""
        self.bar = None
        if enabled:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                Progress,
                SpinnerColumn,
                TextColumn,
                TimeElapsedColumn,
            )

            self.bar = Progress(SpinnerColumn(), TextColumn("{task.description}"),
                                BarColumn(), TimeElapsedColumn(),
                                console=Console(stderr=True), transient=True)
            self.task = self.bar.add_task(f"{job_id} submitted", total=None)

    def __enter__(self) -> Progress:
        if self.bar is not None:
            self.bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.stop()

    def update(self, status: dict[str, Any]) -> None:
        """Show a new status dict."""
        if self.bar is None:
            return
        p = status.get("progress") or {}
        text = f"{self.job_id} {status.get('status')} · {p.get('phase', '')}"
        if p.get("candidates_generated"):
            text += (f" · candidates {p['candidates_generated']} generated, "
                     f"{p.get('candidates_verified', 0)} verified")
        self.text = text
        self._show()

    def event(self, event: dict[str, Any]) -> None:
        """Show the verification's phase from a job event (``verify_phase``) until its
        candidate's verdict."""
        kind = event.get("event")
        if kind == "verify_phase":
            self.phase = f"{event.get('candidate_id') or ''} {event.get('message', '')}".strip()
        elif kind in ("verify_result", *TERMINAL):
            self.phase = ""
        else:
            return
        self._show()

    def _show(self) -> None:
        if self.bar is None:
            return
        text = f"{self.text} · verifying {self.phase}" if self.phase else self.text
        self.bar.update(self.task, description=text)
