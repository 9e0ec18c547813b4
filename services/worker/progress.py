"""A verification's phases as they happen: what they are called, and their job events.

The procedure's :class:`~services.worker.procedure.state.PhaseClock` reports each phase
as it starts and ends (a :class:`~schemas.events.VerifyPhase`) to an observer, a
:data:`PhaseObserver` given to :meth:`Verifier.verify
<services.worker.verifier.Verifier.verify>`: the local ``aikg run`` / ``aikg verify``
show them on the terminal (services/cli/local.py), and a worker publishes them on
the job's events subject through :class:`PhaseEvents`, at most one every
:data:`MIN_INTERVAL_S` seconds per request, the newest phase replacing one still
waiting, the last one always sent.

Phase events are shown, never trusted: any service may publish on a job's events
subject (docs/security.md), and a verdict is only the signed
:class:`~schemas.events.VerifyResult`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Literal

import structlog

from schemas.events import VerifyPhase
from services.common.runtime import cancel_and_wait

log = structlog.get_logger("aikg.worker.progress")

# What an observer of a verification's phases is: called, in the verification's event
# loop, with each phase as it starts and ends; it must not block (a display update, a
# report handed to PhaseEvents).
PhaseObserver = Callable[[VerifyPhase], None]

# At most one phase event per request this often, seconds: "a few a second" is what a
# person can read on a status line, and an evolve job's dozens of verifications stay
# a few hundred events.
MIN_INTERVAL_S = 0.25
# How long closing waits for the last phase events to be published before the verdict
# goes out without them, seconds (a JOB_EVENTS stream without a leader makes each
# publish retry for up to services.common.jobs.EVENT_RETRY_S).
CLOSE_WAIT_S = 2.0

# Each phase in words (names: schemas.events.VERIFY_PHASES, and "lowering": the
# built-in coder's, before a local `aikg run` verifies).
LABELS = {
    "lowering": "lowering",
    "static": "static checks",
    "sandbox_start": "sandbox start",
    "reference_start": "reference",
    "candidate_start": "candidate start",
    "dry_run": "size choice",
    "trials": "trials",
    "checks": "checks",
    "profile": "profile",
    "verdict": "verdict",
}


def label(name: str, step: str = "", trial: int | None = None,
          trials: int | None = None) -> str:
    """Phase ``name`` (a step of it, trial ``trial`` of ``trials``) in words:
    ``reference``, ``trial 2 of 3``, ``compile check``."""
    if trial is not None:
        return f"trial {trial} of {trials}" if trials else f"trial {trial}"
    return step or LABELS.get(name, name.replace("_", " "))


def phase(name: str, state: Literal["started", "ended"] = "started",
          seconds: float | None = None) -> VerifyPhase:
    """A report of phase ``name`` that no :class:`PhaseClock
    <services.worker.procedure.state.PhaseClock>` times: the lowering and the sandbox
    start of local mode (services/sdk/task.py, services/sdk/local_worker.py)."""
    return VerifyPhase(name=name, label=label(name), state=state,
                       seconds=None if seconds is None else round(seconds, 3))


class PhaseEvents:
    """Publishes one verification's phases through ``send`` (a job event each), rate
    limited and coalescing: a phase that started within :data:`MIN_INTERVAL_S` of the
    last one sent waits, and a newer one replaces it; ``ended`` reports are left out
    but for the very last report, which closing always sends. Use as an async context
    manager (its task runs in the running event loop); :meth:`report` is the
    :data:`PhaseObserver`.

    Args:
        send: publishes one phase; its errors are logged, never raised (a phase event
            must not fail a verification).
        min_interval_s: seconds between two sends at least.
        close_wait_s: how long :meth:`close` waits for the last sends.

    Attributes:
        sent: the phases sent, in order.
    """

    def __init__(self, send: Callable[[VerifyPhase], Awaitable[None]], *,
                 min_interval_s: float = MIN_INTERVAL_S,
                 close_wait_s: float = CLOSE_WAIT_S) -> None:
        self._send = send
        self._interval = min_interval_s
        self._close_wait = close_wait_s
        self._pending: VerifyPhase | None = None
        self._final: VerifyPhase | None = None
        self._sent_at: float | None = None
        self._wake = asyncio.Event()
        self._closing = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.sent: list[VerifyPhase] = []

    async def __aenter__(self) -> PhaseEvents:
        self._task = asyncio.create_task(self._pump())
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def report(self, phase: VerifyPhase) -> None:
        """Take ``phase`` (the observer): a started one is sent at the next free slot
        unless a newer one replaces it first; an ended one only if nothing follows it."""
        if phase.state == "ended":
            self._final = phase
            return
        self._final = None
        self._pending = phase
        self._wake.set()

    async def close(self) -> None:
        """Send what is still waiting (the last report among it) at once and stop;
        after :data:`CLOSE_WAIT_S` seconds the sends under way are cancelled."""
        if self._task is None:
            return
        self._closing.set()
        self._wake.set()
        task, self._task = self._task, None
        done, _ = await asyncio.wait({task}, timeout=self._close_wait)
        if not done:
            log.warning("phase_events_dropped", waited_s=self._close_wait)
        await cancel_and_wait(task)

    async def _pump(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            if self._sent_at is not None and not self._closing.is_set():
                delay = self._sent_at + self._interval - loop.time()
                if delay > 0:
                    # Cut short by close: the last phase goes out at once.
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(delay):
                            await self._closing.wait()
            self._wake.clear()
            phase, self._pending = self._pending, None
            if phase is not None:
                self._sent_at = loop.time()
                await self._deliver(phase)
            if self._closing.is_set() and self._pending is None:
                final, self._final = self._final, None
                if final is not None:
                    await self._deliver(final)
                return

    async def _deliver(self, phase: VerifyPhase) -> None:
        try:
            await self._send(phase)
        except Exception as exc:  # noqa: BLE001 - a phase event must not fail a verification
            log.warning("phase_event_failed", phase=phase.name, error=str(exc))
            return
        self.sent.append(phase)
