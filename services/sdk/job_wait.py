"""Waiting for a job to end: the one policy (:class:`JobWait`) that
:meth:`AIKGClient.wait_for_completion <services.sdk.client.AIKGClient.wait_for_completion>`
and its asyncio twin drive, and the progress display they show on a terminal
(:class:`Progress`). The CLI (``aikg submit --wait``, ``aikg demo``) and the tests wait
through those methods; nothing else polls a job's status."""

from __future__ import annotations

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
    """

    def __init__(self, job_id: str, timeout: float, poll_interval: float,
                 unreachable_grace_s: float, watchers: list[Any], clock: Any) -> None:
        self.job_id = job_id
        self.timeout = timeout
        self.poll_interval = poll_interval
        self.grace = unreachable_grace_s
        self.watchers = [w for w in watchers if w is not None]
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


class Progress:
    """A rich progress display on stderr while waiting: status, phase, candidates, elapsed."""

    def __init__(self, job_id: str, enabled: bool) -> None:
        self.job_id = job_id
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
        if self.bar is None:
            return
        p = status.get("progress") or {}
        text = f"{self.job_id} {status.get('status')} · {p.get('phase', '')}"
        if p.get("candidates_generated"):
            text += (f" · candidates {p['candidates_generated']} generated, "
                     f"{p.get('candidates_verified', 0)} verified")
        self.bar.update(self.task, description=text)
