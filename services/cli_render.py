"""How ``aikg submit --wait`` and ``aikg status`` show a job: progress line, record, kernel.

Kept apart from the command definitions so the same rendering serves both commands
(and any later one, such as an event tail).
"""

from __future__ import annotations

import datetime as dt

from rich.console import Console, Group, RenderableType
from rich.markup import escape
from rich.panel import Panel
from rich.syntax import Syntax
from rich.table import Table
from rich.text import Text

from schemas import JobRecord, VerifyResult

_STATUS_STYLE = {
    "pending": "yellow",
    "running": "cyan",
    "completed": "green",
    "failed": "red",
    "cancelled": "magenta",
}


def progress_line(record: JobRecord) -> str:
    """One line (rich markup) for the live display: status, phase, message, candidate counts."""
    p = record.progress
    parts = [f"{escape(record.job_id)} [bold]{record.status}[/]", escape(p.phase)]
    if p.message:
        parts.append(escape(p.message))
    if p.candidates_generated:
        parts.append(
            f"candidates: {p.candidates_generated} generated, {p.candidates_verified} verified, "
            f"{p.candidates_passed} passed"
        )
    if record.job_type == "evolve" and p.max_rounds > 1:
        parts.append(f"round {p.round}/{p.max_rounds}")
    return " · ".join(parts)


def _time(value: dt.datetime | None) -> str:
    return value.isoformat(timespec="seconds") if value else "-"


def _fmt_float(value: float | None, unit: str = "") -> str:
    return "-" if value is None else f"{value:.4g}{unit}"


def verdict_table(v: VerifyResult) -> Table:
    """The worker's verdict on the chosen candidate, one fact per row."""
    t = Table.grid(padding=(0, 2))
    t.add_column(style="bold")
    t.add_column()
    t.add_row("passed", Text("yes", style="green") if v.passed else Text("no", style="red"))
    if v.stage:
        t.add_row("stage", v.stage)
    if v.error:
        t.add_row("error", Text(v.error))
    t.add_row("max_abs_error", _fmt_float(v.max_abs_error))
    if v.max_rel_error is not None:
        t.add_row("max_rel_error", _fmt_float(v.max_rel_error))
    if v.atol is not None or v.rtol is not None:
        t.add_row("atol / rtol", f"{_fmt_float(v.atol)} / {_fmt_float(v.rtol)}")
    if v.trials:
        t.add_row("trials", str(v.trials))
    t.add_row("worker", f"{v.worker_id} (device {v.device})")
    t.add_row("duration", f"{v.duration_s:.2f} s")
    if v.interpreted:
        t.add_row("timing", "Triton interpreter on CPU: correctness only, no speedup")
    else:
        t.add_row("speedup", _fmt_float(v.speedup, "x"))
        if v.base_time_us is not None or v.gen_time_us is not None:
            t.add_row("time (reference / kernel)",
                      f"{_fmt_float(v.base_time_us, ' us')} / {_fmt_float(v.gen_time_us, ' us')}")
    return t


def record_view(record: JobRecord) -> RenderableType:
    """The whole job for a terminal: summary, error, verdict, and the kernel source."""
    style = _STATUS_STYLE.get(record.status, "")
    head = Table.grid(padding=(0, 2))
    head.add_column(style="bold")
    head.add_column()
    head.add_row("job", record.job_id)
    head.add_row("status", Text(record.status, style=style))
    head.add_row("op", record.op_name)
    head.add_row("backend / arch", f"{record.backend} / {record.arch or '-'}")
    head.add_row("job type / workflow", f"{record.job_type} / {record.request.workflow}")
    head.add_row("submitted", _time(record.submit_time))
    if record.start_time:
        head.add_row("started", _time(record.start_time))
    if record.end_time:
        head.add_row("finished", _time(record.end_time))
    if record.status not in ("completed", "failed", "cancelled"):
        head.add_row("progress", Text.from_markup(progress_line(record)))
    if record.error:
        head.add_row("error", Text(record.error, style="red"))
    parts: list[RenderableType] = [head]
    result = record.result
    if result is not None:
        summary = f"attempts {result.attempts}"
        if result.coder:
            summary += f", coder {result.coder}"
        if result.candidate_id:
            summary += f", candidate {result.candidate_id}"
        head.add_row("result", f"{'passed' if result.passed else 'not passed'} ({summary})")
        if result.verdict is not None:
            parts.append(Panel(verdict_table(result.verdict), title="verdict", title_align="left"))
        if result.code:
            parts.append(Panel(Syntax(result.code, "python", line_numbers=True, word_wrap=True),
                               title="kernel", title_align="left"))
    return Group(*parts)


def print_record(console: Console, record: JobRecord) -> None:
    """Print :func:`record_view` of ``record`` on ``console``."""
    console.print(record_view(record))
