"""What the ``aikg`` commands share: their exit codes, consoles and options, the one
place where SDK errors become exit codes (:func:`sdk_errors`), and reading a task file
with its ``--shape`` overrides (checked by :mod:`services.common.task_source`), for
every command of :mod:`services.cli`.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from enum import IntEnum
from pathlib import Path
from typing import Annotated, Any, NoReturn

import msgspec
import typer
from rich.console import Console, RenderableType

from schemas import TERMINAL_STATUSES, JobRecord
from services.common.settings import Settings, load_setting, load_settings
from services.common.task_source import TaskError, check_task, parse_shape


class ExitCode(IntEnum):
    """Exit codes of the commands (the table in :mod:`services.cli`)."""

    OK = 0  # completed and passed; or the listing / cancel was done
    FAILED = 1  # failed, cancelled, or not passed
    USAGE = 2  # bad input or refused request
    UNREACHABLE = 3  # gateway unreachable or 5xx; event stream lost
    TIMEOUT = 4  # gave up waiting
    RUNNING = 5  # still pending or running
    NO_SANDBOX = 6  # `run`: the local sandbox cannot start here
    INTERRUPTED = 130  # Ctrl-C while waiting (the shell's code for SIGINT)


POLL_INTERVAL_S = 0.5
# While waiting on a job, a gateway that stays unreachable this long ends the wait
# (a restart of the gateway takes a few seconds; the job itself lives in NATS).
UNREACHABLE_GRACE_S = 30.0

out = Console(highlight=False)
err = Console(stderr=True, highlight=False)

GatewayOption = Annotated[str, typer.Option(
    "--gateway", envvar="AIKG_GATEWAY_URL", help="Gateway base URL.")]
TokenOption = Annotated[str | None, typer.Option(
    "--token", envvar="AIKG_API_TOKEN", show_default=False,
    help="Bearer token: the operator's (the gateway's AIKG_API_TOKEN) or a tenant's (one "
    "whose SHA-256 is in the gateway's AIKG_TENANTS_FILE).")]
JsonOption = Annotated[bool, typer.Option("--json", help="Print JSON instead of a rendering.")]
OutputOption = Annotated[Path | None, typer.Option(
    "--output", "-o", dir_okay=False, show_default=False, metavar="FILE",
    help="Write the kernel's source to FILE (plain text, exactly as verified); the "
    "terminal says where it went. Without it, when stdout is not a terminal, the "
    "kernel alone goes to stdout (`> kernel.py`) and the rest to stderr.")]
TaskFileArgument = Annotated[Path, typer.Argument(
    exists=True, dir_okay=False, readable=True, metavar="FILE",
    help="KernelBench task: Python defining class Model, get_inputs(), get_init_inputs().")]
OpNameOption = Annotated[str | None, typer.Option(help="Operator name; default the file stem.")]
ShapesOption = Annotated[list[str] | None, typer.Option(
    "--shape", metavar="NAME=VALUE",
    help="Rebind a module-level name of the task before get_inputs() (repeatable), "
    "e.g. --shape batch_size=16 or --shape 'input_shape=(64,)'. VALUE: a Python "
    "literal (int, float, True/False, tuple of ints, quoted string), else a string.")]


def say(message: str) -> None:
    """Print ``message`` plainly (no markup, no wrapping) on stderr."""
    err.print(message, markup=False, soft_wrap=True)


def fail(code: ExitCode, message: str) -> NoReturn:
    """Print ``message`` plainly on stderr and exit with ``code``."""
    say(message)
    raise typer.Exit(int(code))


def cli_settings(**overrides: Any) -> Settings:
    """:func:`load_settings` with ``overrides``; a bad ``AIKG_*`` value exits 2."""
    try:
        return load_settings(**overrides)
    except ValueError as exc:
        fail(ExitCode.USAGE, str(exc))


@contextlib.contextmanager
def sdk_errors(follow: str | None = None, goes_on: str = "the job goes on") -> Iterator[None]:
    """Turn the SDK's errors into the CLI's exit codes; every client command calls the
    SDK inside this block.

    ``AIKGConnectionError`` exits 3, ``AIKGHTTPError`` 2 (4xx: a refused request) or 3
    (5xx), ``TimeoutError`` (a wait that gave up) 4, Ctrl-C 130 when there is work to
    come back to. ``follow`` is the command that picks that work up again (``aikg
    status JOB_ID``); given, the messages say that ``goes_on`` and how to follow it.
    """
    from services.sdk.errors import AIKGConnectionError, AIKGHTTPError

    after = f"; {goes_on}: `{follow}`" if follow else ""
    try:
        yield
    except AIKGConnectionError as exc:
        if follow is None:
            fail(ExitCode.UNREACHABLE,
                 f"cannot reach the gateway at {exc.url}: {exc.reason}. Start it (`aikg up`) "
                 "or point --gateway / AIKG_GATEWAY_URL at it.")
        fail(ExitCode.UNREACHABLE, f"lost the gateway at {exc.url}: {exc.reason}{after}")
    except AIKGHTTPError as exc:
        fail(ExitCode.UNREACHABLE if exc.status_code >= 500 else ExitCode.USAGE,
             f"gateway refused ({exc.status_code}): {exc.detail}")
    except TimeoutError as exc:
        fail(ExitCode.TIMEOUT, f"{exc}{after}")
    except KeyboardInterrupt:
        if follow is None:
            raise
        fail(ExitCode.INTERRUPTED, f"stopped{after}")


def record_of(status: dict[str, Any]) -> JobRecord:
    """A job's status dict (from the SDK) as a :class:`JobRecord`; one the CLI cannot
    read exits 3."""
    try:
        return msgspec.convert(status, JobRecord)
    except msgspec.ValidationError as exc:
        fail(ExitCode.UNREACHABLE, f"the gateway sent a job record this CLI cannot read: {exc}")


def record_exit(record: JobRecord) -> ExitCode:
    """0 completed and passed, 1 ended otherwise, 5 still pending or running."""
    if record.status == "completed":
        return ExitCode.OK if record.result is not None and record.result.passed else ExitCode.FAILED
    if record.status in TERMINAL_STATUSES:
        return ExitCode.FAILED
    return ExitCode.RUNNING


def print_json(body: Any) -> None:
    """``body`` on stdout as one line of compact JSON, as the gateway sent it."""
    sys.stdout.write(msgspec.json.encode(body).decode() + "\n")
    sys.stdout.flush()


def show_record(status: dict[str, Any], as_json: bool, output: Path | None = None
                ) -> ExitCode:
    """Print a job's status dict (JSON, or rendered) and its kernel as
    :func:`show_with_kernel` says; return its exit code."""
    from services.cli.render import record_view

    record = record_of(status)
    result = record.result
    show_with_kernel(lambda kernel: record_view(record, kernel=kernel),
                     result.code if result else None, bool(result and result.passed),
                     output, status if as_json else None)
    return record_exit(record)


def kernel_source(code: str) -> str:
    """``code`` as ``-o FILE`` writes it and a pipe gets it: its exact text, ended by a
    newline."""
    return code if code.endswith("\n") else code + "\n"


def check_output(path: Path | None) -> None:
    """Before any work: ``-o FILE`` must be writable (its directory exists and may be
    written; the file, if there, may be written), else exit 2."""
    if path is None:
        return
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        fail(ExitCode.USAGE, f"-o {path}: the directory {parent} does not exist")
    if not os.access(path if path.exists() else parent, os.W_OK):
        fail(ExitCode.USAGE, f"-o {path}: not writable here")


def write_kernel(path: Path, code: str, passed: bool) -> None:
    """Write ``code`` (:func:`kernel_source`, UTF-8) to ``path`` and say so on stderr,
    with a warning when it did not pass verification; a file that cannot be written
    exits 2, the kernel then printed on stdout so that it is not lost."""
    try:
        path.write_bytes(kernel_source(code).encode("utf-8"))
    except OSError as exc:
        sys.stdout.write(kernel_source(code))
        fail(ExitCode.USAGE, f"cannot write the kernel to {path}: {exc.strerror or exc} "
             "(it is printed above)")
    lines = kernel_source(code).count("\n")
    say(f"kernel written to {path} ({lines} lines)" if passed else
        f"kernel written to {path} ({lines} lines); it did NOT pass verification: "
        "for inspection, not for use")


def show_with_kernel(view: Callable[[bool], RenderableType], code: str | None,
                     passed: bool, output: Path | None, json_body: Any = None) -> None:
    """Print a result that carries a kernel (``run``, ``submit --wait``, ``status``,
    ``demo``).

    ``view(with_kernel)`` renders the result, with or without the kernel's panel.
    With ``json_body`` (``--json``) that is printed. Else, on a terminal, the view
    (with the kernel unless ``output``); when stdout is not a terminal and there is no
    ``output``, the kernel's plain source alone goes to stdout (``aikg run t.py >
    kernel.py``) and the view without it to stderr. With ``output`` the kernel is
    written there (:func:`write_kernel`); a result without a kernel writes nothing
    and says so.
    """
    if json_body is not None:
        print_json(json_body)
    elif output is None and not out.is_terminal:
        err.print(view(False))
        if code:
            sys.stdout.write(kernel_source(code))
            sys.stdout.flush()
    else:
        out.print(view(output is None))
    if output is not None:
        if code:
            write_kernel(output, code, passed)
        else:
            say(f"no kernel (yet): nothing written to {output}")


def read_task(file: Path) -> str:
    """The task file's text; one that cannot be read exits 2."""
    try:
        return file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        fail(ExitCode.USAGE, f"cannot read task file {file}: {exc}")


def shape_overrides(file: Path, task_desc: str, shapes: list[str] | None) -> dict[str, Any]:
    """The ``--shape NAME=VALUE`` items as a dict (:func:`parse_shape`), the task and
    each name checked (:func:`~services.common.task_source.check_task`): a mistake in
    either exits 2 with the task source's message after the file's name."""
    try:
        overrides = dict(parse_shape(s) for s in shapes or [])
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="'--shape'") from None
    try:
        check_task(task_desc, overrides)
    except TaskError as exc:
        fail(ExitCode.USAGE, f"{file}: {exc}")
    return overrides


# Options and set-up shared by the local commands (``aikg run``, ``aikg verify``).
BackendOption = Annotated[str, typer.Option(help="cpu (Triton interpreter) | cuda | ascend.")]
ArchOption = Annotated[str | None, typer.Option(
    help="The GPU to check for: what the compile check compiles for (beside the other "
         "vendor's), the emulation answers as and the time model models (h100, h200, a100, "
         "4090, l4, l40s, mi300x, mi250 ...); default on cpu: this machine's CPU, checked "
         "for AIKG_WORKER_AOT_TARGET (h100).")]
DevicesOption = Annotated[str, typer.Option(
    help="Devices to verify on, comma-separated (GPU ordinals; on cpu, slots).")]
TrialsOption = Annotated[int, typer.Option(min=1, max=20, help="Correctness trials (seeds).")]
TimeoutOption = Annotated[float, typer.Option(
    help="Seconds the candidate's verification may take.")]


def local_inputs(file: Path, backend: str, devices: str,
                  shape: list[str] | None) -> tuple[str, list[str], dict[str, Any]]:
    """``run``/``verify``: the task's text, the device list and the shape overrides,
    each checked (bad input exits 2); logging set up for a local run."""
    from services.common.logging import configure_logging

    task_desc = read_task(file)
    overrides = shape_overrides(file, task_desc, shape)
    device_list = [d.strip() for d in devices.split(",") if d.strip()]
    if not device_list:
        fail(ExitCode.USAGE, "--devices is empty: give at least one, e.g. --devices 0")
    if backend not in ("cpu", "cuda", "ascend"):
        fail(ExitCode.USAGE, f"--backend must be cpu, cuda or ascend, not {backend!r}")
    configure_logging("run", load_setting("log_level", "warning"), "console")
    return task_desc, device_list, overrides


def run_locally(what: str, as_json: bool, work: Any, display: Any = None) -> Any:
    """Run the coroutine ``work`` with a status line on a terminal (or within
    ``display``, a context manager showing its progress: services/cli/phases.py);
    Ctrl-C exits 130, a ValueError 2, a sandbox that cannot start here 6."""
    import asyncio

    live = not as_json and err.is_terminal
    if display is None:
        display = err.status(what) if live else contextlib.nullcontext()
    try:
        with display:
            return asyncio.run(work)
    except KeyboardInterrupt:
        fail(ExitCode.INTERRUPTED, "stopped")
    except ValueError as exc:
        fail(ExitCode.USAGE, str(exc))
    except Exception as exc:
        # Imported only now: it imports torch, which a task the coder declines from its
        # source alone never needs (that refusal takes milliseconds, not seconds).
        from services.sandbox.pool import PoolBroken

        if not isinstance(exc, PoolBroken):
            raise
        fail(ExitCode.NO_SANDBOX, f"the local sandbox cannot start on this machine: {exc}")
