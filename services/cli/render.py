"""How ``aikg`` shows things: a job's progress line, record and kernel (``submit --wait``,
``status``), job and worker tables (``list``, ``workers``), event lines (``events``) and
a local verdict (``run``).

Kept apart from the command definitions so one rendering serves every command.
"""

from __future__ import annotations

import datetime as dt
import os
from collections.abc import Iterable

import msgspec
from rich.console import Console, Group, RenderableType
from rich.markup import escape
from rich.panel import Panel
from rich.syntax import Syntax
from rich.table import Table
from rich.text import Text

from schemas import EvolveCandidate, JobRecord, VerifyResult
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
        # progress.round counts from 1, as the generator's messages do.
        parts.append(f"round {max(p.round, 1)}/{p.max_rounds}")
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


def short_ids(ids: Iterable[str]) -> tuple[dict[str, str], str]:
    """Short names for candidate ids, one line each in a table: the ids without the
    prefix they all share up to a ``-`` (an evolve job's ``<job_id>-c<n>`` become
    ``c<n>``), else the shortest ends (8 characters or more) that stay unique, after an
    ellipsis. Returns ``{id: short name}`` and the prefix left out ('' when none)."""
    unique = sorted(set(ids))
    if not unique:
        return {}, ""
    cut = os.path.commonprefix(unique).rfind("-") + 1
    if cut and all(len(i) > cut for i in unique):
        return {i: i[cut:] for i in unique}, unique[0][:cut]
    longest = max(len(i) for i in unique)
    for k in range(min(8, longest), longest + 1):
        ends = {i: i[-k:] for i in unique}
        if len(set(ends.values())) == len(unique):
            return {i: e if e == i else "…" + e for i, e in ends.items()}, ""
    return {i: i for i in unique}, ""


def param_changes(c: EvolveCandidate, parent: EvolveCandidate | None,
                  defaults: dict[str, int]) -> str:
    """The launch parameters in which ``c`` differs from its parent
    (``block_size 1024->256``), or, for a seed, from the built-in coder's defaults
    (``num_warps=8``); ``-`` when none (no parameters: an LLM's candidate)."""
    if not c.params:
        return "-"
    if parent is not None:
        base = {**defaults, **parent.params}
        changed = [f"{k} {base.get(k, '?')}->{v}" for k, v in c.params.items()
                   if base.get(k) != v]
        return ", ".join(changed) or "as parent"
    changed = [f"{k}={v}" for k, v in c.params.items() if defaults.get(k) != v]
    return ", ".join(changed) or "defaults"


def _evolve_defaults() -> dict[str, int]:
    """The built-in coder's default launch parameters, what a seed's are shown against
    (services/generator/mutators.py, ``DEFAULT_PARAMS``)."""
    from services.generator.mutators import DEFAULT_PARAMS

    return DEFAULT_PARAMS


def _candidates_view(title: str, rows: list[EvolveCandidate], every: list[EvolveCandidate],
                     fitness: str, ranked: bool) -> Table:
    """One row per candidate of ``rows`` (``every``: the job's candidates, for their
    parents): short id, round, island, parent, result, time and speedup (modeled on
    cpu: a model of a GPU, not a measurement), and the parameters that differ from its
    parent's or the defaults."""
    by_id = {c.candidate_id: c for c in every}
    names, prefix = short_ids([c.candidate_id for c in every + rows]
                              + [c.parent_id for c in every + rows if c.parent_id])
    modeled = fitness != "speedup"
    defaults = _evolve_defaults()
    caption = []
    if prefix:
        caption.append(f"ids after {prefix}")
    if modeled:
        caption.append("time and speedup modeled from the counted traffic (a model of a "
                       "GPU, not a measurement)")
    t = Table(title=title, title_justify="left", box=None, header_style="bold",
              pad_edge=False, caption="; ".join(caption) or None, caption_justify="left")
    coders = len({c.coder for c in rows}) > 1
    columns = ["rank"] if ranked else []
    columns += ["id", "round", "island", "parent", *(["coder"] if coders else []),
                "result", "time", "speedup"]
    for name in columns:
        t.add_column(name, no_wrap=True,
                     justify="right" if name in ("rank", "round", "island", "time",
                                                 "speedup") else "left")
    t.add_column("params", overflow="fold")
    for rank, c in enumerate(rows, 1):
        if c.passed is None:
            result = Text("verifying", style="yellow")
        elif c.passed:
            result = Text("passed", style="green")
        else:
            result = Text(c.stage or "failed", style="red")
        if c.duplicate_of:
            result.append(f" = {names.get(c.duplicate_of, c.duplicate_of)}")
        time_us, speedup = ((c.modeled_time_us, c.modeled_speedup) if modeled
                            else (c.gen_time_us, c.speedup))
        parent = by_id.get(c.parent_id) if c.parent_id else None
        t.add_row(*([str(rank)] if ranked else []), names[c.candidate_id], str(c.round + 1),
                  str(c.island), names.get(c.parent_id, "-") if c.parent_id else "-",
                  *([c.coder] if coders else []), result,
                  f"{time_us:.2f} us" if time_us else "-",
                  f"{speedup:.2f}x" if speedup else "-",
                  param_changes(c, parent, defaults))
    return t


# Candidates an evolve job's table lists at most (``--json`` has them all).
CANDIDATE_ROWS = 40


def candidates_table(record: JobRecord) -> Table | None:
    """Every candidate of an evolve job (the first ``CANDIDATE_ROWS``), in the order
    they were generated: see :func:`_candidates_view`. None before the first."""
    summary = record.evolve
    if summary is None or not summary.candidates:
        return None
    shown = summary.candidates[:CANDIDATE_ROWS]
    more = len(summary.candidates) - len(shown)
    title = "candidates" + (f" (first {len(shown)}; {more} more in --json)" if more else "")
    return _candidates_view(title, shown, summary.candidates, summary.fitness, ranked=False)


def best_table(record: JobRecord) -> Table | None:
    """The best candidates of a finished evolve job, best first (as the generator
    ranked them): see :func:`_candidates_view`."""
    if record.result is None or not record.result.best:
        return None
    summary = record.evolve
    every = summary.candidates if summary is not None else []
    fitness = summary.fitness if summary is not None else "speedup"
    return _candidates_view("best candidates", record.result.best, every, fitness,
                            ranked=True)


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
                         if v.stage == "unchecked" else
                         Text("yes, at the sizes checked; wrong at other sizes (shape "
                              "generic: no)", style="yellow") if v.shape_generic is False
                         else Text("yes", style="green"))
              if v.passed else Text("no", style="red"))
    if v.stage:
        t.add_row("stage", v.stage)
    if v.error:
        t.add_row("error", Text(v.error))
    t.add_row("max_abs_error", _fmt_float(v.max_abs_error))
    if v.max_rel_error is not None:
        t.add_row("max_rel_error", _fmt_float(v.max_rel_error))
    if v.rel_l2_error is not None:
        bound = _rel_l2_bound(v)
        t.add_row("rel_l2_error", _fmt_float(v.rel_l2_error) + (
            f" (bound {_fmt_float(bound)}: {REL_L2_FACTOR:g} x rtol)" if bound else ""))
    if v.atol is not None or v.rtol is not None:
        # The rule, so that a max_rel_error above rtol (an element near 0) reads right.
        t.add_row("atol / rtol", f"{_fmt_float(v.atol)} / {_fmt_float(v.rtol)} (each element: "
                  "|out - ref| <= atol + rtol * |ref|)")
    if v.passed and (why := passed_by(v)):
        t.add_row("passed by", why)
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
    t.add_row("worker", v.worker_id + (f" (device {v.device})" if v.device else ""))
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


# The relative L2 bound of a floating output is this multiple of its rtol: the
# worker's REL_L2_FACTOR (services/worker/tolerances.py; that module imports torch, which
# the client commands do without; tests/unit/test_cli_render.py keeps the two equal).
REL_L2_FACTOR = 5.0


def _rel_l2_bound(v: VerifyResult) -> float | None:
    """The relative L2 bound the worker held ``v``'s outputs to (unitless), or None
    where none applies (no rtol: exact outputs)."""
    return REL_L2_FACTOR * v.rtol if v.rtol else None


def passed_by(v: VerifyResult) -> str:
    """One line saying which figures decided a pass (docs/verification.md, step 5):
    every element within ``atol + rtol * |ref|``, and the relative L2 error within its
    bound. A ``max_rel_error`` above rtol, which alarms on its own, is explained: it
    occurs only where ``|ref|`` is small, where atol decides. '' when the verdict has
    no tolerance to speak of (a failure, or an older worker's verdict)."""
    if not v.passed or v.rtol is None:
        return ""
    if not v.rtol and not v.atol:
        return "exact match (integer or bool outputs)"
    mr, rtol = v.max_rel_error, v.rtol
    if mr is None or mr <= rtol:
        line = "every element within rtol" + (
            f" (max rel {_fmt_float(mr)} <= {_fmt_float(rtol)})" if mr is not None else "")
    else:
        line = (f"max rel {_fmt_float(mr)} > rtol {_fmt_float(rtol)} only where |ref| is "
                "small (atol decides there)")
    bound = _rel_l2_bound(v)
    if v.rel_l2_error is not None and bound:
        if v.rel_l2_error <= bound:
            line += f"; rel-L2 {_fmt_float(v.rel_l2_error)} <= {_fmt_float(bound)}"
        else:
            line += (f"; rel-L2 {_fmt_float(v.rel_l2_error)} within the float64 recheck's "
                     "widened bound (notes)")
    return line


def verdict_panel(v: VerifyResult, title: str = "verdict") -> Panel:
    """:func:`verdict_table` in a panel titled ``title``: how ``aikg verify`` shows a
    verdict, local or through ``--gateway``."""
    return Panel(verdict_table(v), title=title, title_align="left")


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


def record_view(record: JobRecord, kernel: bool = True) -> RenderableType:
    """The whole job for a terminal: summary, error, verdict, an evolve job's
    candidates, and (``kernel``) the kernel source."""
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
        for table in (evolve_table(record), candidates_table(record), best_table(record)):
            if table is not None:
                parts.append(table)
        if result.code and kernel:
            parts.append(kernel_panel(result.code))
    return Group(*parts)


def kernel_panel(code: str) -> Panel:
    """The kernel's source for a terminal, with line numbers; its subtitle says how to
    have it as a file."""
    return Panel(Syntax(code, "python", line_numbers=True, word_wrap=True),
                 title="kernel", title_align="left",
                 subtitle="-o FILE writes it to a file", subtitle_align="right")


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
        # The device list as a list: "[0]" is device 0, where a bare "0" read as a count.
        t.add_row(w["worker_id"], f"{w['backend']}/{w['arch']}",
                  "[" + ", ".join(w.get("devices") or []) + "]",
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


def local_result_view(op_name: str, passed: bool, info: dict,
                      kernel: bool = True) -> RenderableType:
    """``aikg run``: the verdict on the kernel written here, and (``kernel``) the kernel."""
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
    if info.get("code") and kernel:
        parts.append(kernel_panel(info["code"]))
    return Group(*parts)
