"""A verification's phases while a person waits: ``aikg run`` / ``aikg verify`` on this
machine (:class:`LocalPhases`) and ``aikg submit --wait`` through a gateway
(:class:`JobPhases`).

The phases are :class:`~schemas.events.VerifyPhase` reports (services/worker/progress.py):
told in-process by the local verifier, or read as ``verify_phase`` events of the job
through the SDK's wait. They are what a verification says it is doing; the verdict
shown at the end is the result's.
"""

from __future__ import annotations

import time
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.text import Text

from schemas.events import VerifyPhase

# Phases told by the local run itself, that overlap each other and the verification's
# own: the built-in coder's lowering runs while the sandbox starts.
_BESIDE = ("lowering", "sandbox_start")


class LocalPhases:
    """The phases of a local run on ``console`` (stderr) as they happen: on a terminal,
    one transient status line (spinner, ``what``, the phase, time elapsed); otherwise
    one plain line per phase started (``[  3.1 s] trial 2 of 3``); in ``--json`` mode
    nothing. A context manager, and the ``on_phase`` observer of
    :class:`~services.sdk.local_worker.LocalWorker` and :class:`~services.sdk.task.Task`.
    """

    def __init__(self, what: str, as_json: bool, console: Console) -> None:
        self.what = what
        self.console = console
        self.mode = "off" if as_json else "live" if console.is_terminal else "plain"
        self.started = time.monotonic()
        self.current = ""
        self.beside: dict[str, str] = {}
        self.shown: list[str] = []
        self._bar: Progress | None = None
        self._task: Any = None

    def __enter__(self) -> LocalPhases:
        self.started = time.monotonic()
        if self.mode == "live":
            self._bar = Progress(SpinnerColumn(), TextColumn("{task.description}"),
                                 TimeElapsedColumn(), console=self.console, transient=True)
            self._task = self._bar.add_task(self.what, total=None)
            self._bar.start()
        elif self.mode == "plain":
            self.console.print(self.what, markup=False, highlight=False, soft_wrap=True)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def __call__(self, phase: VerifyPhase) -> None:
        if self.mode == "off":
            return
        if phase.name in _BESIDE:
            if phase.state == "ended":
                self.beside.pop(phase.name, None)
                self._redraw()
                return
            self.beside[phase.name] = phase.label
        elif phase.state == "started":
            self.beside.clear()  # the verification runs: the lowering and start are over
            self.current = phase.label
        else:
            return
        self.shown.append(phase.label)
        if self.mode == "plain":
            self.console.print(f"[{time.monotonic() - self.started:6.1f} s] {phase.label}",
                               markup=False, highlight=False, soft_wrap=True)
        self._redraw()

    def _redraw(self) -> None:
        if self._bar is not None:
            doing = " + ".join(self.beside.values()) or self.current
            what = self.what.removesuffix(" ...")
            self._bar.update(self._task, description=f"{what}: {doing}" if doing
                             else self.what)


class JobPhases:
    """``aikg submit --wait`` on a terminal: the job's progress line
    (:func:`services.cli.render.live_view`) with, under it, the phase of the
    verification under way (``c1: trial 2 of 3``) from the job's ``verify_phase``
    events, until that candidate's verdict. ``update`` is given the status line's
    ``update`` (a rich Status)."""

    def __init__(self, update: Any) -> None:
        self.update = update
        self.view: RenderableType | None = None
        self.phase = ""

    def status(self, view: RenderableType) -> None:
        """A new view of the job's record."""
        self.view = view
        self._show()

    def event(self, event: dict[str, Any]) -> None:
        """One job event (a dict of :class:`~schemas.events.JobEvent`)."""
        kind = event.get("event")
        if kind == "verify_phase":
            who = event.get("candidate_id") or ""
            self.phase = f"{who}: {event.get('message', '')}" if who else event.get("message", "")
        elif kind in ("verify_result", "completed", "failed", "cancelled"):
            self.phase = ""
        else:
            return
        self._show()

    def _show(self) -> None:
        if self.view is None:
            return
        if not self.phase:
            self.update(self.view)
            return
        self.update(Group(self.view, Text(f"verifying {self.phase}", style="cyan")))
