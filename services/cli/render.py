"""How ``aikg`` shows things: a job's progress line, record and kernel (``submit --wait``,
``status``), job and worker tables (``list``, ``workers``), event lines (``events``) and
a local verdict (``run``).

Kept apart from the command definitions so one rendering serves every command.
"""

from __future__ import annotations

import datetime as dt

import msgspec
from rich.console import Console, Group, RenderableType
from rich.markup import escape
from rich.panel import Panel
from rich.syntax import Syntax
from rich.table import Table
from rich.text import Text

from schemas import JobRecord, VerifyResult
from schemas.events import CompileFact

_STATUS_STYLE = {
    "pending": "yellow",
    "running": "cyan",
    "completed": "green",
    "failed": "red",
    "cancelled": "magenta",
    # A record in the jobs bucket that does not decode (GET /api/v1/jobs lists it so).
    "corrupt": "bold red",
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


def evolve_table(record: JobRecord) -> Table | None:
    """Per-island view of an evolve job: round, candidates, passed, and the best fitness:
    speedup, or on the ``cpu`` backend the best modeled time of the counted traffic
    (``modeled_time`` fitness; a model, said so) or ``n/a (cpu)`` (``correctness``).

    None for other jobs or before the first candidate.
    """
    summary = record.evolve
    if summary is None or not summary.candidates:
        return None
    correctness = summary.fitness == "correctness"
    modeled = summary.fitness == "modeled_time"
    t = Table(title=f"evolve: round {summary.round + 1}/{summary.rounds}, "
              f"{len(summary.migrations)} migration(s), {len(summary.elites)} elite(s)",
              title_justify="left")
    for column in ("island", "round", "candidates", "verified", "passed",
                   "best modeled time" if modeled else "best speedup"):
        t.add_column(column, justify="right")
    by_id = {c.candidate_id: c for c in summary.candidates}
    for island, members in enumerate(summary.islands):
        own = [c for c in summary.candidates if c.island == island]
        pool = [by_id[i] for i in members if i in by_id]
        done = [c for c in own if c.passed is not None]
        speeds = [c.speedup for c in pool if c.passed and c.speedup]
        times = [c.modeled_time_us for c in pool if c.passed and c.modeled_time_us]
        if modeled:
            best = f"{min(times):.2f} us (model)" if times else "-"
        else:
            best = "n/a (cpu)" if correctness else (f"{max(speeds):.2f}x" if speeds else "-")
        t.add_row(str(island), str(max((c.round for c in own), default=0) + 1), str(len(own)),
                  str(len(done)), str(sum(bool(c.passed) for c in done)), best)
    return t


def live_view(record: JobRecord) -> RenderableType:
    """What ``submit --wait`` shows while a job runs: the progress line, plus the
    per-island table for an evolve job."""
    line = Text.from_markup(progress_line(record))
    table = evolve_table(record)
    return line if table is None else Group(line, table)


def best_table(record: JobRecord) -> Table | None:
    """The best candidates of a finished evolve job."""
    if record.result is None or not record.result.best:
        return None
    t = Table(title="best candidates", title_justify="left")
    for column in ("rank", "candidate", "round", "island", "parent", "coder", "speedup"):
        # Ids share the job id as prefix: fold them rather than cut the telling end.
        t.add_column(column, overflow="fold")
    for rank, c in enumerate(record.result.best, 1):
        t.add_row(str(rank), c.candidate_id, str(c.round + 1), str(c.island),
                  c.parent_id or "-", c.coder,
                  f"{c.speedup:.2f}x" if c.speedup else "n/a")
    return t


def _time(value: dt.datetime | None) -> str:
    return value.isoformat(timespec="seconds") if value else "-"


def _fmt_float(value: float | None, unit: str = "") -> str:
    return "-" if value is None else f"{value:.4g}{unit}"


def verdict_table(v: VerifyResult) -> Table:
    """The worker's verdict on the chosen candidate, one fact per row."""
    t = Table.grid(padding=(0, 2))
    t.add_column(style="bold")
    t.add_column()
    t.add_row("passed", (Text("yes, on a partial check (allow_unchecked)", style="yellow")
                         if v.stage == "unchecked" else Text("yes", style="green"))
              if v.passed else Text("no", style="red"))
    if v.stage:
        t.add_row("stage", v.stage)
    if v.error:
        t.add_row("error", Text(v.error))
    t.add_row("max_abs_error", _fmt_float(v.max_abs_error))
    if v.max_rel_error is not None:
        t.add_row("max_rel_error", _fmt_float(v.max_rel_error))
    if v.atol is not None or v.rtol is not None:
        # The rule, so that a max_rel_error above rtol (an element near 0) reads right.
        t.add_row("atol / rtol", f"{_fmt_float(v.atol)} / {_fmt_float(v.rtol)} (each element: "
                  "|out - ref| <= atol + rtol * |ref|)")
    if v.trials:
        t.add_row("trials", str(v.trials))
    if v.sizes_checked:
        t.add_row("sizes checked", "; ".join(
            ", ".join(f"{k}={val}" for k, val in sizes.items()) or "the task's own"
            for sizes in v.sizes_checked))
    if v.shape_generic is not None or v.passed:
        t.add_row("shape generic", _shape_generic(v))
    for what in v.unchecked:
        t.add_row("unchecked", Text(what, style="yellow"))
    for line in _compile_lines(v):
        t.add_row("GPU compile", line)
    t.add_row("worker", f"{v.worker_id} (device {v.device})")
    t.add_row("duration", f"{v.duration_s:.2f} s")
    traffic = v.traffic
    if traffic is not None and traffic.traffic_ratio is not None:
        plural = "" if traffic.launches == 1 else "es"
        t.add_row("traffic (counted)",
                  f"{traffic.bytes_moved:,} bytes moved, {traffic.bytes_min:,} minimal: ratio "
                  f"{traffic.traffic_ratio:.2f} over {traffic.launches} launch{plural}")
        if traffic.modeled_time_us is not None:
            ratio = (f", speedup {traffic.modeled_speedup:.2f}x over eager (above 1: faster)"
                     if traffic.modeled_speedup is not None else "")
            t.add_row("modeled time", f"{traffic.modeled_time_us:.2f} us on "
                      f"{traffic.model_arch or 'h100'}{ratio} (a model, not a measurement)")
    if v.interpreted:
        t.add_row("timing", "Triton interpreter on CPU: correctness only, no speedup")
    else:
        t.add_row("speedup", _fmt_float(v.speedup, "x"))
        if v.base_time_us is not None or v.gen_time_us is not None:
            t.add_row("time (reference / kernel)",
                      f"{_fmt_float(v.base_time_us, ' us')} / {_fmt_float(v.gen_time_us, ' us')}")
    return t


# Rows of compiler facts shown in a verdict panel at most (``--json`` has them all).
COMPILE_ROWS = 6


def _compile_lines(v: VerifyResult) -> list[Text]:
    """One line per kernel and target of ``v.compile_facts`` (the specialisation with
    the most registers of each; a spill or a failure in red): registers, spills, shared
    memory and occupancy, as the GPU compiler reported them (no GPU needed)."""
    worst: dict[tuple[str, str], CompileFact] = {}
    for f in v.compile_facts:
        key = (f.kernel, f.target)
        if key not in worst or (not f.ok, f.spill_bytes, f.registers) > (
                not worst[key].ok, worst[key].spill_bytes, worst[key].registers):
            worst[key] = f
    lines = []
    for (kernel, target), f in list(worst.items())[:COMPILE_ROWS]:
        where = f"{kernel} on {target} ({f.arch})"
        if not f.ok:
            lines.append(Text(f"{where}: {f.error or 'does not compile'}", style="red"))
            continue
        text = (f"{where}: {f.registers} registers, {f.spill_bytes} B spilled, "
                f"{f.shared_bytes:,} B shared, {f.occupancy_warps}/{f.max_warps} warps "
                f"resident ({f.limiter or 'warps'} bound)")
        lines.append(Text(text, style="red" if f.spill_bytes else ""))
    if len(worst) > COMPILE_ROWS:
        lines.append(Text(f"... {len(worst) - COMPILE_ROWS} more (--json: compile_facts)"))
    return lines


def _shape_generic(v: VerifyResult) -> Text:
    """``yes``; ``no``, with the note saying where and why; or ``not checked``."""
    if v.shape_generic:
        return Text("yes")
    if v.shape_generic is None:
        why = next((n.split(": ", 1)[1] for n in v.notes
                    if n.startswith("shape generality not checked: ")), "")
        return Text("not checked" + (f" ({why})" if why else ""))
    note = next((n for n in v.notes if n.startswith("shape generality: ")), "")
    return Text("no: " + (note.removeprefix("shape generality: ") or "wrong at "
                          + ", ".join(f"{k}={val}" for k, val in v.shape_generic_sizes.items())),
                style="yellow")


def queue_text(position: int, eta: dt.datetime | str | None) -> str:
    """``position 3 in the queue, starts ~12:04:31 UTC`` (the time when the gateway
    estimated one; ``eta`` a datetime or its RFC 3339 text)."""
    text = f"position {position} in the queue"
    if eta:
        if isinstance(eta, str):
            eta = dt.datetime.fromisoformat(eta)
        text += f", starts ~{eta.astimezone(dt.UTC):%H:%M:%S} UTC"
    return text


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
    if record.tenant != "default" or record.priority != "normal":
        head.add_row("tenant / priority", f"{record.tenant} / {record.priority}")
    if record.queue_position is not None:
        head.add_row("queue", queue_text(record.queue_position, record.estimated_start_time))
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
        for table in (evolve_table(record), best_table(record)):
            if table is not None:
                parts.append(table)
        if result.code:
            parts.append(Panel(Syntax(result.code, "python", line_numbers=True, word_wrap=True),
                               title="kernel", title_align="left"))
    return Group(*parts)


def print_record(console: Console, record: JobRecord) -> None:
    """Print :func:`record_view` of ``record`` on ``console``."""
    console.print(record_view(record))


def _short_time(value: str | None) -> str:
    """``2025-01-02T03:04:05.678+00:00`` -> ``2025-01-02 03:04:05`` (UTC, as sent)."""
    if not value:
        return "-"
    return value.replace("T", " ")[:19]


def _clip(text: str, limit: int) -> str:
    """The first line of ``text``, cut to ``limit`` characters at a word, with an ellipsis
    when anything was left out."""
    first = text.strip().split("\n", 1)[0]
    if len(first) <= limit and first == text.strip():
        return first
    cut = first[:limit]
    if len(first) > limit and " " in cut:
        cut = cut.rsplit(" ", 1)[0]
    return cut.rstrip(" ,;:") + " …"


# Below this terminal width `aikg list` leaves out backend/arch and submit time (both
# in `aikg status`): with a whole job id (36 characters) there is no room for them.
NARROW_LIST_WIDTH = 110


def jobs_table(page: dict, width: int = 200) -> Table:
    """``aikg list``: one row per job summary of a ``GET /api/v1/jobs`` page.

    Job ids and statuses stay whole on one line (ids are copied into ``aikg status``);
    on a terminal narrower than ``NARROW_LIST_WIDTH`` columns the backend/arch and
    submit-time columns are left out, and the result folds.
    """
    wide = width >= NARROW_LIST_WIDTH
    t = Table(box=None, header_style="bold", pad_edge=False, caption_justify="left",
              caption=None if wide else "narrow terminal: backend/arch and submit time left "
              "out; `aikg status JOB_ID` shows everything")
    jobs = page.get("jobs", [])
    t.add_column("job", no_wrap=True, min_width=max((len(j["job_id"]) for j in jobs), default=3))
    t.add_column("status", no_wrap=True, min_width=9)
    t.add_column("op", overflow="fold")
    if wide:
        t.add_column("backend/arch", overflow="fold")
        t.add_column("submitted (UTC)", no_wrap=True)
    t.add_column("result", overflow="fold")
    for j in jobs:
        if j.get("passed") is True:
            outcome = "passed" + (f" ({j['speedup']:.2f}x)" if j.get("speedup") else "")
        elif j.get("error"):
            outcome = j["error"]
        elif j.get("queue_position") is not None:
            outcome = queue_text(j["queue_position"], j.get("estimated_start_time"))
        else:
            outcome = j.get("message") or j.get("phase") or ""
        where = ([f"{j['backend']}/{j.get('arch') or '-'}", _short_time(j.get("submit_time"))]
                 if wide else [])
        t.add_row(j["job_id"], Text(j["status"], style=_STATUS_STYLE.get(j["status"], "")),
                  j["op_name"], *where, Text(_clip(outcome, 160 if wide else 60)))
    return t


def workers_table(listing: dict) -> Table:
    """``aikg workers``: worker, backend/arch, devices, load (in-flight/capacity), leases,
    and its sandbox: ``full`` when every isolation mechanism is in force, else which are
    missing (``aikg workers --json`` has the notes saying why)."""
    t = Table(box=None, header_style="bold", pad_edge=False)
    for name in ("worker", "backend/arch", "devices", "load", "leases", "sandbox", "status",
                 "host"):
        t.add_column(name, overflow="fold")
    for w in listing.get("workers", []):
        leases = ", ".join(f"{le.get('device')}:{le.get('job_id') or '-'}"
                           for le in w.get("leases") or []) or "-"
        t.add_row(w["worker_id"], f"{w['backend']}/{w['arch']}", ",".join(w.get("devices", [])),
                  f"{w.get('in_flight', 0)}/{w.get('capacity', 0)}", leases,
                  sandbox_cell(w.get("sandbox") or []), w.get("status", ""), w.get("host", ""))
    return t


_SANDBOX_GAPS = {"no user switch": "user switch", "network reachable": "network isolation",
                 "no landlock": "landlock", "no seccomp": "seccomp"}


def sandbox_cell(phrases: list[str]) -> Text:
    """``full`` (green) when every isolation mechanism is in force, else ``missing: ...``
    (yellow); ``?`` for a worker that did not say (an older version)."""
    if not phrases:
        return Text("?")
    missing = [_SANDBOX_GAPS.get(p) or ("capabilities" if p.startswith("capabilities ") else "")
               for p in phrases]
    missing = [m for m in missing if m]
    if not missing:
        return Text("full", style="green")
    return Text("missing: " + ", ".join(missing), style="yellow")


def event_line(event: dict) -> Text:
    """``aikg events``: one line per job event: time, kind, candidate, verdict, message."""
    kind = event.get("event", "?")
    style = _STATUS_STYLE.get(kind, "cyan" if kind.startswith("verify") else "")
    line = Text(_short_time(event.get("time"))[11:] + "  ")
    line.append(f"{kind:<20}", style=style)
    if event.get("candidate_id"):
        line.append(f" {event['candidate_id']}")
    verdict = event.get("verdict")
    if verdict:
        if verdict.get("passed"):
            line.append(" passed", style="green")
            if verdict.get("speedup") is not None:
                line.append(f" {verdict['speedup']:.2f}x (kernel {verdict.get('gen_time_us', 0):.1f} us, "
                            f"eager {verdict.get('base_time_us', 0):.1f} us)")
        else:
            line.append(f" failed at {verdict.get('stage')}", style="red")
    message = event.get("message")
    if message:
        line.append(f"  {message}")
    return line


def local_result_view(op_name: str, passed: bool, info: dict) -> RenderableType:
    """``aikg run``: the verdict on the kernel written here, and the kernel."""
    head = Table.grid(padding=(0, 2))
    head.add_column(style="bold")
    head.add_column()
    head.add_row("op", op_name)
    head.add_row("backend / arch", f"{info.get('backend')} / {info.get('arch') or '-'}")
    head.add_row("result", Text("passed", style="green") if passed
                 else Text("not passed", style="red"))
    head.add_row("attempts", f"{info.get('attempts', 0)}"
                 + (f" (coder {info['coder']})" if info.get("coder") else ""))
    if info.get("error"):
        head.add_row("error", Text(info["error"], style="red"))
    parts: list[RenderableType] = [head]
    if info.get("verdict"):
        verdict = msgspec.convert(info["verdict"], VerifyResult)
        parts.append(Panel(verdict_table(verdict), title="verdict", title_align="left"))
    if info.get("code"):
        parts.append(Panel(Syntax(info["code"], "python", line_numbers=True, word_wrap=True),
                           title="kernel", title_align="left"))
    return Group(*parts)
