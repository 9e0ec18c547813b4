"""``aikg verify TASK K1.py K2.py ...``: verify many kernels of one task, with a
progress display and a table of verdicts.

Two ways, chosen by ``--gateway``:

- **local** (no ``--gateway``): the SDK's ``LocalWorker`` in this process, as ``aikg
  verify`` of one kernel; identical kernels (same normalised AST,
  :func:`services.common.records.normalised_hash`) are verified once, the others run
  at most one per device at a time (``--devices``);
- **gateway** (``--gateway URL``): one batch verification
  (``POST /api/v1/verify/batch``, services/gateway/batches.py) through ``AIKGClient``,
  its verdicts read from the batch's event stream as they land; Ctrl-C cancels it.

Progress goes to stderr: a rich progress bar on a terminal, else one line per verdict
(``[3/45] k3.py: passed``). Then the table, 80 columns wide at the least, with the
errors below it (or, with ``--json``, a JSON list of ``{"kernel", "verdict"}`` in the
order of the arguments) goes to stdout; one kernel through ``--gateway`` is shown as
a local ``aikg verify`` shows its verdict.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from schemas import VerifyResult
from services.cli.common import ExitCode, err, out, sdk_errors
from services.common.records import normalised_hash

# Longest error text shown below the table per kernel, characters (the JSON output
# keeps all of it).
ERROR_CELL_CHARS = 300


@contextlib.contextmanager
def progress(total: int, what: str, live: bool) -> Iterator[Callable[[str, dict], None]]:
    """A callable ``tick(kernel name, verdict dict)`` that advances the display by one
    verdict: a rich progress bar when ``live``, else a line on stderr per verdict."""
    done = 0
    if not live:
        def line(name: str, verdict: dict) -> None:
            nonlocal done
            done += 1
            state = "passed" if verdict.get("passed") else f"failed ({verdict.get('stage')})"
            err.print(f"[{done}/{total}] {name}: {state}", markup=False, soft_wrap=True)

        yield line
        return
    bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TextColumn("[green]{task.fields[passed]} passed"), TimeElapsedColumn(),
                   console=err, transient=True)
    with bar:
        task = bar.add_task(what, total=total, passed=0)
        passed = 0

        def tick(name: str, verdict: dict) -> None:
            nonlocal passed
            passed += bool(verdict.get("passed"))
            bar.update(task, advance=1, passed=passed)

        yield tick


def verdicts_table(names: list[str], verdicts: list[dict | None]) -> Table:
    """One row per kernel, in argument order: passed, stage, the kernel whose verdict
    it reuses, duration, speedup ("-" without one, e.g. on cpu, where Triton is
    interpreted). Fits 80 columns: the kernel's name folds before the passed and stage
    columns give way, and errors are not in it (:func:`error_lines` lists them below);
    a "same as" column only when a verdict was reused."""
    table = Table(title="verdicts", title_justify="left")
    table.add_column("#", no_wrap=True, justify="right")
    table.add_column("kernel", overflow="fold", min_width=8)
    table.add_column("passed", no_wrap=True)
    table.add_column("stage", no_wrap=True)
    reused = any(v and v.get("duplicate_of") is not None for v in verdicts)
    if reused:
        table.add_column("same as", overflow="fold")
    table.add_column("duration", no_wrap=True, justify="right")
    table.add_column("speedup", no_wrap=True, justify="right")
    for i, (name, v) in enumerate(zip(names, verdicts, strict=True)):
        if v is None:
            table.add_row(str(i), name, Text("-", style="yellow"), "cancelled",
                          *([""] if reused else []), "", "")
            continue
        dup = v.get("duplicate_of")
        speedup = v.get("speedup")
        table.add_row(
            str(i), name,
            Text("yes", style="green") if v.get("passed") else Text("no", style="red"),
            v.get("stage") or "", *([names[dup] if dup is not None else ""] if reused else []),
            f"{v.get('duration_s') or 0:.2f} s",
            f"{speedup:.2f}x" if speedup else "-")
    return table


def error_lines(names: list[str], verdicts: list[dict | None]) -> list[str]:
    """``#3 k3.py: <error>`` for each kernel whose verdict has an error (its first
    ``ERROR_CELL_CHARS`` characters; ``--json`` has all of it), printed below the table
    where they wrap at the terminal's width."""
    lines = []
    for i, (name, v) in enumerate(zip(names, verdicts, strict=True)):
        error = (v or {}).get("error")
        if error and (v or {}).get("duplicate_of") is None:
            text = " ".join(error.split())
            if len(text) > ERROR_CELL_CHARS:
                text = text[:ERROR_CELL_CHARS].rstrip() + " …"
            lines.append(f"#{i} {name}: {text}")
    return lines


def _summary(result: Any, index: int, duplicate_of: int | None) -> dict:
    """A local VerifyResult as the gateway's BatchVerdict dict has it (plus ``log``)."""
    body = msgspec.to_builtins(result)
    return {"index": index, "duplicate_of": duplicate_of, **body}


async def verify_locally(task_desc: str, codes: list[str], names: list[str], op_name: str, *,
                         backend: str, arch: str | None, devices: list[str],
                         shape_overrides: dict[str, Any], trials: int, timeout_s: float,
                         tick: Callable[[str, dict], None],
                         allow_unchecked: bool = False) -> list[dict]:
    """Verify ``codes`` with a ``LocalWorker`` on ``devices``, identical ones once;
    one verdict dict per code, in order. ``tick`` is called as each lands."""
    from services.sdk import LocalWorker

    first: dict[str, int] = {}
    original = [first.setdefault(normalised_hash(code), i) for i, code in enumerate(codes)]
    verdicts: list[dict | None] = [None] * len(codes)
    worker = LocalWorker(devices, backend=backend, arch=arch, client_command="aikg verify")

    async def one(index: int) -> None:
        result = await worker.verify(task_desc, codes[index], op_name,
                                     shape_overrides=shape_overrides, trials=trials,
                                     timeout_s=timeout_s, allow_unchecked=allow_unchecked)
        for i, source in enumerate(original):
            if source == index:
                verdicts[i] = _summary(result, i, None if i == index else index)
                tick(names[i], verdicts[i])

    try:
        await asyncio.gather(*(one(i) for i in sorted(set(original))))
    finally:
        await worker.close()
    return [v for v in verdicts if v is not None]


def verify_through_gateway(client: Any, task_desc: str, codes: list[str], names: list[str],
                           op_name: str, *, backend: str, arch: str | None,
                           shape_overrides: dict[str, Any], trials: int, timeout_s: float,
                           tick: Callable[[str, dict], None],
                           allow_unchecked: bool = False) -> list[dict | None]:
    """One batch verification through the gateway; one verdict dict per code (None:
    cancelled before it started). Ctrl-C cancels the batch, then re-raises."""
    answer = client.submit_batch(op_name, task_desc, codes, backend=backend, arch=arch,
                                 shape_overrides=shape_overrides or None, trials=trials,
                                 timeout_s=timeout_s, allow_unchecked=allow_unchecked or None)
    batch_id = answer["batch_id"]
    err.print(f"batch {batch_id}: {answer['candidates']} kernels, {answer['unique']} to "
              f"verify on {answer['backend']}/{answer['arch']}", markup=False, soft_wrap=True)
    try:
        for verdict in client.stream_batch_verdicts(batch_id):
            if verdict:
                tick(names[verdict["index"]], verdict)
    except KeyboardInterrupt:
        with contextlib.suppress(Exception):
            client.cancel_batch(batch_id)
            err.print(f"batch {batch_id} cancelled", markup=False)
        raise
    record = client.get_batch(batch_id)
    verdicts: list[dict | None] = [None] * len(codes)
    for verdict in record["verdicts"]:
        verdicts[verdict["index"]] = verdict
    return verdicts


def report(names: list[str], verdicts: list[dict | None], as_json: bool) -> ExitCode:
    """Print the verdicts (table or JSON); OK when every kernel passed, else FAILED."""
    if as_json:
        rows = [{"kernel": name, "verdict": v} for name, v in zip(names, verdicts, strict=True)]
        out.print(json.dumps(rows), markup=False, soft_wrap=True, highlight=False)
    elif len(names) == 1 and verdicts[0] is not None:
        # One kernel (through --gateway): the verdict as a local `aikg verify` shows it.
        from services.cli.render import verdict_panel

        out.print(verdict_panel(as_verify_result(verdicts[0]), f"verdict: {names[0]}"))
    else:
        shown = [Path(name).name for name in names]
        if len(set(shown)) < len(shown):  # file names alike: show the paths given
            shown = names
        out.print(verdicts_table(shown, verdicts))
        errors = error_lines(shown, verdicts)
        if errors:
            out.print("errors:", markup=False)
            for line in errors:
                out.print(line, markup=False)
        passed = sum(bool(v and v.get("passed")) for v in verdicts)
        out.print(f"{passed} of {len(names)} kernels passed", markup=False)
    return ExitCode.OK if all(v and v.get("passed") for v in verdicts) else ExitCode.FAILED


def as_verify_result(verdict: dict) -> VerifyResult:
    """A verdict dict as a :class:`VerifyResult` for :func:`~services.cli.render.verdict_table`:
    a local verdict has every field; a gateway's batch verdict (``BatchVerdict``) is a
    summary of one, whose missing fields keep their defaults (not shown)."""
    body = {"job_id": "", "device": "", "request_id": "", "candidate_id": "",
            "worker_id": "", **verdict}
    return msgspec.convert(body, VerifyResult, strict=False)


def gateway_batch(gateway_url: str, token: str | None, **kwargs: Any) -> list[dict | None]:
    """:func:`verify_through_gateway` with the CLI's client and its exit codes."""
    from services.cli.client import connect

    with connect(gateway_url, token) as client, sdk_errors():
        return verify_through_gateway(client, **kwargs)

