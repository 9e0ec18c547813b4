"""``aikg``: run the services, submit and follow jobs, or verify a kernel locally.

This package is the ``aikg`` command; this module makes the Typer app and registers
every command, in the order ``--help`` lists them. The commands live by concern:

- :mod:`services.cli.serve`: the services (``gateway``, ``worker``, ``generator``,
  ``nats-setup``), configured from ``AIKG_*`` environment variables
  (services/common/settings.py), flags overriding them;
- :mod:`services.cli.up`: ``up`` and ``demo``, the local stack of :mod:`services.stack`;
- :mod:`services.cli.client`: the gateway's clients (``submit``, ``status``, ``kernel``, ``list``,
  ``cancel``, ``events``, ``workers``) through the SDK's ``AIKGClient``, and
  :mod:`services.cli.export` (``export``);
- :mod:`services.cli.local`: ``run`` and ``verify``, on this machine with neither NATS
  nor a network (``verify`` of several kernels: :mod:`services.cli.batch`);
- :mod:`services.cli.render`: how everything is shown; :mod:`services.cli.common`:
  exit codes, options, and the one place SDK errors become exit codes.

The commands exit with:
====  =====================================================================
code  meaning
====  =====================================================================
0     the job completed and its kernel passed verification (``submit
      --wait``, ``status``, ``events``, ``run``; ``verify``: every kernel
      passed); ``list``, ``workers``
      and ``cancel`` did what was asked (``cancel`` of a job that had
      already ended included: it prints how it ended)
1     the job failed or was cancelled, or its kernel did not pass; ``run``:
      the built-in coder could not write a kernel for the task
2     bad input: a missing file, a bad option, or the gateway refused the
      request (400, 401, 404 unknown job, 409 no live worker, 413 too large)
3     the gateway is unreachable (or answered 5xx), or ``events`` lost the
      stream before the job ended
4     ``submit --wait`` timed out; the job goes on (``aikg status JOB_ID``)
5     ``status``: the job is still pending or running
6     ``run``: the local sandbox cannot start on this machine
130   Ctrl-C while ``submit --wait`` or ``events`` was waiting; the job goes
      on (``run``: the local run stops)
====  =====================================================================
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from services.cli import client, export, local, serve, up
from services.cli.common import out

HELP_OPTION_NAMES = ["-h", "--help"]

app = typer.Typer(
    name="aikg",
    context_settings={"help_option_names": HELP_OPTION_NAMES},
    help=(
        "AIKG: turn a PyTorch reference operator (KernelBench task) into a verified Triton "
        "kernel. Services exchange events over NATS; `aikg up` runs all of them on this "
        "machine; `aikg run TASK.py` writes and verifies a kernel right here, with no "
        "services at all.\n\n"
        "Exit codes: 0 passed / done, 1 failed or not passed, 2 bad input or refused "
        "request, 3 gateway unreachable, 4 wait timed out, 5 still running, 6 no local "
        "sandbox, 130 Ctrl-C.\n\n"
        "Environment: AIKG_NATS_URL (NATS server URLs, comma-separated), AIKG_GATEWAY_URL "
        "(where the client commands reach the gateway), AIKG_API_TOKEN (bearer token of the "
        "gateway), AIKG_LOG_LEVEL, AIKG_LOG_FORMAT (json|console); every Settings field "
        "has an `AIKG_<FIELD>` variable (services/common/settings.py)."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",
)


def schema(
    out_dir: Annotated[Path | None, typer.Option(
        "--out", help="Directory to write; default schemas/json of this checkout.")] = None,
) -> None:
    """Write the JSON Schema of every wire record (JobSubmit, JobRecord, JobEvent,
    VerifyRequest, VerifyResult, WorkerInfo) as `<Record>.json`, and the gateway's
    OpenAPI document as `openapi.json`, for non-Python clients."""
    from schemas.export import JSON_DIR, export_json_schemas
    from services.gateway.app import openapi_document

    target = out_dir or JSON_DIR
    paths = export_json_schemas(target)
    openapi = target / "openapi.json"
    openapi.write_text(openapi_document(), encoding="utf-8")
    for path in [*paths, openapi]:
        out.print(str(path), markup=False, soft_wrap=True)


# Every command, in the order `--help` lists them.
app.command()(serve.gateway)
app.command()(serve.worker)
app.command()(serve.generator)
app.command("nats-setup")(serve.nats_setup)
app.command()(up.up)
app.command()(up.demo)
app.command()(client.submit)
app.command()(client.status)
app.command()(client.kernel)
app.command("list")(client.list_jobs)
app.command()(client.cancel)
app.command()(client.events)
app.command()(client.workers)
app.command()(local.run)
app.command()(local.verify)
app.command()(schema)
app.command("export")(export.export)


def _flags_without_metavar(command: Any) -> Any:
    """Blank the metavar of every flag (``--wait``, ``--help``), recursively.

    typer's rich help prints each option's type, so flags, which take no value,
    would read ``--wait <bool>``, as if they wanted one.
    """
    # The help option is made on first use and cached; make it now, with the app's names.
    help_option = command.get_help_option(
        typer.Context(command, help_option_names=HELP_OPTION_NAMES))
    for param in [*command.params, help_option]:
        if getattr(param, "is_flag", False):
            param.metavar = ""
    for sub in getattr(command, "commands", {}).values():
        _flags_without_metavar(sub)
    return command


def main() -> None:
    """Console script ``aikg``."""
    _flags_without_metavar(typer.main.get_command(app))()
