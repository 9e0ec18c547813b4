"""``aikg export``: the verified kernels, with their tasks, verdicts, timings and
provenance, as JSON Lines or Parquet (wired into :mod:`services.cli`).

The rows come from the gateway (``GET /api/v1/kernels``, through
:class:`~services.sdk.client.AIKGClient`); the file writing is
:func:`services.sdk.export.export_kernels`. Exit codes as the other client commands:
0 written (also when no kernel matched), 2 bad input or a refused request, 3 the
gateway is unreachable or answered 5xx.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from services.cli.common import ExitCode, GatewayOption, err, fail, sdk_errors
from services.common.settings import GATEWAY_URL


def export(
    out: Annotated[Path, typer.Argument(
        help="File to write: NAME.jsonl (JSON Lines) or NAME.parquet (Parquet).",
        dir_okay=False)],
    passed: Annotated[bool, typer.Option(
        "--passed/--all", help="Only kernels that passed verification (default), or "
        "every job's final kernel.")] = True,
    op_name: Annotated[str | None, typer.Option(help="Only kernels of this operator.")] = None,
    backend: Annotated[str | None, typer.Option(help="Only kernels verified on this "
                                                "backend.")] = None,
    arch: Annotated[str | None, typer.Option(help="Only kernels verified on this arch.")] = None,
    cursor: Annotated[str | None, typer.Option(
        help="Start after this cursor (printed by an earlier export); writes a fresh file.")
    ] = None,
    resume: Annotated[bool, typer.Option(
        "--resume", help="Add the kernels of jobs that ended since the last export to "
        "OUT, from the cursor kept in OUT.cursor.")] = False,
    page_size: Annotated[int, typer.Option(min=1, max=500, help="Rows per request.")] = 200,
    gateway_url: GatewayOption = GATEWAY_URL,
    token: Annotated[str | None, typer.Option(
        "--token", envvar="AIKG_API_TOKEN", show_default=False,
        help="Bearer token, when the gateway has AIKG_API_TOKEN set.")] = None,
) -> None:
    """Write the verified kernels with their tasks, verdicts, timings, arch and
    provenance (job, candidate, coder, model, worker) to OUT, one row per job.

    The cursor after the last row is kept in OUT.cursor and printed on stderr;
    `--resume` adds what ended since. Exit codes: 0 written, 2 bad input or refused, 3 unreachable.
    """
    from services.cli.client import connect
    from services.sdk.export import export_kernels

    try:
        with connect(gateway_url, token) as client, sdk_errors(
                follow=f"aikg export {out} --resume",
                goes_on=f"rows written so far stay in {out}"):
            summary = export_kernels(client, out, passed=True if passed else None,
                                     op_name=op_name, backend=backend, arch=arch,
                                     cursor=cursor, resume=resume, page_size=page_size)
    except ValueError as exc:
        fail(ExitCode.USAGE, str(exc))
    except OSError as exc:
        fail(ExitCode.USAGE, f"cannot write {out}: {exc.strerror or exc}")
    err.print(f"{summary.rows} kernel(s) written to {summary.path} ({summary.format}); "
              f"resume with `aikg export {out} --resume`", markup=False, soft_wrap=True)
    if summary.cursor:
        err.print(f"cursor (kept in {out}.cursor; --cursor starts after it): {summary.cursor}",
                  markup=False, soft_wrap=True)
