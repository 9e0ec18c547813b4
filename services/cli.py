"""``aikg``: run the services, submit and follow jobs, or verify a kernel locally.

Service commands (``gateway``, ``generator``, ``worker``, ``up``) read their
configuration from ``AIKG_*`` environment variables (services/common/settings.py);
flags override them. Client commands (``submit``, ``status``, ``list``, ``cancel``,
``events``, ``workers``, ``export``: services/cli_export.py) talk to the gateway over HTTP; ``run`` needs neither NATS
nor a network. They exit with:

====  =====================================================================
code  meaning
====  =====================================================================
0     the job completed and its kernel passed verification (``submit
      --wait``, ``status``, ``events``, ``run``); ``list``, ``workers``
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

import ast
import asyncio
import contextlib
import json
import os
import shutil
import signal
import sys
import threading
import time
from enum import IntEnum
from pathlib import Path
from typing import Annotated, Any, NoReturn
from urllib.parse import quote

import httpx
import msgspec
import typer
from rich.console import Console

from schemas import TERMINAL_STATUSES, JobRecord
from services.common.runtime import free_port
from services.common.settings import Settings, load_settings
from services.stack import LocalStack, StackError, local_stack


class ExitCode(IntEnum):
    """Exit codes of the client commands (module docstring)."""

    OK = 0  # completed and passed; or the listing / cancel was done
    FAILED = 1  # failed, cancelled, or not passed
    USAGE = 2  # bad input or refused request
    UNREACHABLE = 3  # gateway unreachable or 5xx; event stream lost
    TIMEOUT = 4  # gave up waiting
    RUNNING = 5  # still pending or running
    NO_SANDBOX = 6  # `run`: the local sandbox cannot start here
    INTERRUPTED = 130  # Ctrl-C while waiting (the shell's code for SIGINT)


DEFAULT_GATEWAY_URL = "http://127.0.0.1:8000"
POLL_INTERVAL_S = 0.5
# While waiting on a job, a gateway that stays unreachable this long ends the wait
# (a restart of the gateway takes a few seconds; the job itself lives in NATS).
UNREACHABLE_GRACE_S = 30.0

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

out = Console(highlight=False)
err = Console(stderr=True, highlight=False)


def _say(message: str) -> None:
    """Print ``message`` plainly (no markup, no wrapping) on stderr."""
    err.print(message, markup=False, soft_wrap=True)


def _fail(code: ExitCode, message: str) -> NoReturn:
    """Print ``message`` plainly on stderr and exit with ``code``."""
    _say(message)
    raise typer.Exit(int(code))


def _settings(**overrides: Any) -> Settings:
    try:
        return load_settings(**overrides)
    except ValueError as exc:
        _fail(ExitCode.USAGE, str(exc))


def _run_service(service: str, settings: Settings, main: Any) -> None:
    """Configure logging for ``service`` and run its coroutine until it ends.

    A NATS connection failure exits 3 with the URL; Ctrl-C exits 0 (the services
    shut down on SIGINT/SIGTERM by themselves).
    """
    from services.common.logging import configure_logging

    if not settings.nats_url:
        _fail(ExitCode.USAGE, f"AIKG_NATS_URL is not set: point it at a NATS server "
              f"(e.g. nats://127.0.0.1:4222), or run `aikg up` to start everything "
              f"with an embedded one. ({service})")
    configure_logging(service, settings.log_level, settings.log_format)
    try:
        asyncio.run(main)
    except ConnectionError as exc:
        _fail(ExitCode.UNREACHABLE, f"{service}: {exc}")
    except ValueError as exc:
        # Bad configuration found at start (device names, worker id ...).
        _fail(ExitCode.USAGE, f"{service}: {exc}")
    except RuntimeError as exc:
        # e.g. the worker's sandbox cannot start on this machine (PoolBroken).
        _fail(ExitCode.NO_SANDBOX, f"{service} could not start: {exc}")
    except KeyboardInterrupt:
        pass


# --- services ------------------------------------------------------------------------


@app.command()
def gateway(
    host: Annotated[str | None, typer.Option(envvar="AIKG_GATEWAY_HOST",
                                             help="Address to listen on.")] = None,
    port: Annotated[int | None, typer.Option(envvar="AIKG_GATEWAY_PORT",
                                             help="Port to listen on (default 8000).")] = None,
) -> None:
    """Serve the HTTP API (job submission and status, worker listing, /metrics).

    Needs AIKG_NATS_URL. AIKG_API_TOKEN turns on bearer-token auth for every route
    but /healthz and /readyz.
    """
    from services.gateway.app import serve_gateway

    settings = _settings(gateway_host=host, gateway_port=port)
    try:
        _run_service("gateway", settings, serve_gateway(settings))
    except OSError as exc:
        _fail(ExitCode.FAILED, f"gateway: {exc}")


@app.command()
def worker(
    backend: Annotated[str | None, typer.Option(envvar="AIKG_WORKER_BACKEND",
                                                help="cpu | cuda | ascend (default cpu).")] = None,
    arch: Annotated[str | None, typer.Option(
        envvar="AIKG_WORKER_ARCH",
        help="Arch offered (x86_64, h200, a100, ascend910b4); default: this machine's CPU.")] = None,
    devices: Annotated[str | None, typer.Option(
        envvar="AIKG_WORKER_DEVICES",
        help="Devices, comma-separated (GPU ordinals; on cpu, one slot each). Default 0.")] = None,
    metrics_port: Annotated[int | None, typer.Option(
        envvar="AIKG_METRICS_PORT", help="Prometheus /metrics port; 0 free port, -1 off.")] = None,
) -> None:
    """Verify and profile candidates on this machine's devices (pulls `verify.<backend>.<arch>`).

    Needs AIKG_NATS_URL.
    """
    from services.worker.service import run_worker

    settings = _settings(worker_backend=backend, worker_arch=arch, worker_devices=devices,
                         metrics_port=metrics_port)
    _run_service("worker", settings, run_worker(settings))


@app.command()
def generator(
    metrics_port: Annotated[int | None, typer.Option(
        envvar="AIKG_METRICS_PORT", help="Prometheus /metrics port; 0 free port, -1 off.")] = None,
) -> None:
    """Run jobs: pull jobs.submit, write candidate kernels, send them to workers.

    Needs AIKG_NATS_URL; the LLM coder reads its own settings (see the generator docs).
    """
    from services.generator.service import run_generator

    settings = _settings(metrics_port=metrics_port)
    _run_service("generator", settings, run_generator(settings))


@app.command()
def up(
    host: Annotated[str, typer.Option(help="Gateway address.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(envvar="AIKG_GATEWAY_PORT", help="Gateway port.")] = 8000,
    backend: Annotated[str, typer.Option(envvar="AIKG_WORKER_BACKEND",
                                         help="Worker backend: cpu | cuda | ascend.")] = "cpu",
    arch: Annotated[str | None, typer.Option(envvar="AIKG_WORKER_ARCH",
                                             help="Worker arch; default this machine's CPU.")] = None,
    devices: Annotated[str, typer.Option(envvar="AIKG_WORKER_DEVICES",
                                         help="Worker devices, comma-separated.")] = "0",
    store_dir: Annotated[Path | None, typer.Option(
        envvar="AIKG_NATS_STORE_DIR",
        help="JetStream store of the embedded NATS server; default a temp dir removed on exit.")] = None,
    log_dir: Annotated[Path | None, typer.Option(
        help="Where the services' JSON logs go (gateway.log, generator.log, worker.log); "
        "default a new temp dir.")] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v",
                                          help="Services log to this terminal instead.")] = False,
    ready_timeout: Annotated[float, typer.Option(
        help="Seconds to wait for the gateway and a worker to come up.")] = 180.0,
    nats_auth: Annotated[bool, typer.Option(
        help="Embedded NATS: per-run credentials, one user per service with only its "
        "subjects, no anonymous client. --no-nats-auth lets any local client in.")] = True,
) -> None:
    """Run the full stack here until Ctrl-C: NATS, gateway, generator and a worker.

    NATS is an embedded nats-server unless AIKG_NATS_URL is set. It refuses clients
    without credentials: each service gets its own per-run user, and the admin's (for
    the `nats` CLI) are written to a 0600 file whose path is printed. Each service is
    a child process in its own process group; Ctrl-C or SIGTERM stops them all. Exits
    1 when a service dies or does not come up in time (its log is named).
    """
    settings = _settings()
    stopping = threading.Event()
    stack: LocalStack | None = None

    def on_signal(_sig: int, _frame: Any) -> None:
        stopping.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    code = ExitCode.OK
    try:
        with local_stack(settings, host=host, port=port, backend=backend, arch=arch,
                         devices=devices, store_dir=store_dir, log_dir=log_dir,
                         verbose=verbose, ready_timeout=ready_timeout,
                         stopping=stopping, nats_auth=nats_auth, say=_say) as stack:
            if not stopping.is_set():
                out.print(f"AIKG is up: {stack.describe()}. Ctrl-C stops it.",
                          markup=False, soft_wrap=True)
                if stack.gateway_url != DEFAULT_GATEWAY_URL:
                    out.print(f"point client commands at it: export AIKG_GATEWAY_URL="
                              f"{stack.gateway_url}", markup=False, soft_wrap=True)
            while not stopping.wait(0.5):
                if (dead := stack.dead_child()) is not None:
                    _say(f"stopping AIKG: {dead}")
                    code = ExitCode.FAILED
                    break
    except StackError as exc:
        _say(str(exc))
        code = ExitCode.FAILED
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if logged := [p for p in stack.logs.values() if p.exists()] if stack else []:
            err.print(f"service logs kept in {logged[0].parent}", markup=False, soft_wrap=True)
    raise typer.Exit(int(code))


@app.command()
def demo(
    file: Annotated[Path, typer.Argument(
        exists=True, dir_okay=False, readable=True,
        help="KernelBench task to submit.")] = Path("tasks/relu.py"),
    shape: Annotated[list[str] | None, typer.Option(
        "--shape", metavar="NAME=VALUE", help="Shape override (repeatable), as for submit.")] = None,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for the job.")] = 600.0,
    ready_timeout: Annotated[float, typer.Option(
        help="Seconds to wait for the stack to come up.")] = 180.0,
) -> None:
    """Start a throw-away stack, submit FILE, print the verdict and kernel, stop the stack.

    This is `make run`: embedded NATS, gateway (on a free port), generator and one cpu
    worker, all stopped at the end. Exit code 0 when the kernel passed verification.
    """
    settings = _settings()
    try:
        task_desc = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        _fail(ExitCode.USAGE, f"cannot read task file {file}: {exc}")
    body = {"op_name": file.stem, "task_desc": task_desc, "backend": "cpu",
            "shape_overrides": dict(parse_shape(s) for s in shape or [])}
    port = free_port()
    err.print("starting AIKG (embedded NATS, gateway, generator, cpu worker) ...", markup=False)
    started = time.monotonic()
    try:
        with local_stack(settings, host="127.0.0.1", port=port, backend="cpu", arch=None,
                         devices="0", store_dir=None, log_dir=None, verbose=False,
                         ready_timeout=ready_timeout, say=_say) as stack:
            err.print(f"up in {time.monotonic() - started:.1f} s: {stack.describe()}", markup=False,
                      soft_wrap=True)
            with _client(stack.gateway_url, settings.api_token or None) as client:
                accepted = _request(client, "POST", "/api/v1/jobs/submit", json=body).json()
                job_id = accepted["job_id"]
                err.print(f"submitted {file} as job {job_id}", markup=False)
                final = _wait(client, job_id, timeout, out.is_terminal)
            record = _decode_record(final)
            _show(record, final.content, as_json=False)
            code = _record_exit(record)
    except StackError as exc:
        _fail(ExitCode.FAILED, str(exc))
    if code == ExitCode.OK and stack.logs:
        # A throw-away stack that did its job leaves nothing behind; on failure the
        # logs stay for a look (their directory was printed at start).
        shutil.rmtree(next(iter(stack.logs.values())).parent, ignore_errors=True)
        err.print("logs removed: the job passed", markup=False)
    raise typer.Exit(int(code))


# --- client --------------------------------------------------------------------------

GatewayOption = Annotated[str, typer.Option(
    "--gateway", envvar="AIKG_GATEWAY_URL", help="Gateway base URL.")]
TokenOption = Annotated[str | None, typer.Option(
    "--token", envvar="AIKG_API_TOKEN", show_default=False,
    help="Bearer token, when the gateway has AIKG_API_TOKEN set.")]
JsonOption = Annotated[bool, typer.Option("--json", help="Print JSON instead of a rendering.")]


def _client(gateway_url: str, token: str | None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.Client(base_url=gateway_url.rstrip("/"), headers=headers, timeout=30.0)


def _detail(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text.strip() or response.reason_phrase
    if isinstance(body, dict) and "detail" in body:
        return str(body["detail"])
    return json.dumps(body)


def _request(client: httpx.Client, method: str, path: str, **kwargs: Any) -> httpx.Response:
    """One gateway call; transport errors exit 3, 4xx exit 2, 5xx exit 3."""
    try:
        response = client.request(method, path, **kwargs)
    except httpx.TransportError as exc:
        _fail(ExitCode.UNREACHABLE,
              f"cannot reach the gateway at {client.base_url}: {exc or exc.__class__.__name__}. "
              "Start it (`aikg up`) or point --gateway / AIKG_GATEWAY_URL at it.")
    if response.status_code >= 400:
        code = ExitCode.UNREACHABLE if response.status_code >= 500 else ExitCode.USAGE
        _fail(code, f"gateway refused ({response.status_code}): {_detail(response)}")
    return response


def _decode_record(response: httpx.Response) -> JobRecord:
    try:
        return msgspec.json.decode(response.content, type=JobRecord)
    except msgspec.DecodeError as exc:
        _fail(ExitCode.UNREACHABLE, f"the gateway sent a job record this CLI cannot read: {exc}")


def _record_exit(record: JobRecord) -> ExitCode:
    if record.status == "completed":
        return ExitCode.OK if record.result is not None and record.result.passed else ExitCode.FAILED
    if record.status in TERMINAL_STATUSES:
        return ExitCode.FAILED
    return ExitCode.RUNNING


def _show(record: JobRecord, raw: bytes, as_json: bool) -> None:
    if as_json:
        sys.stdout.write(raw.decode() + "\n")
        sys.stdout.flush()
    else:
        from services.cli_render import print_record

        print_record(out, record)


ShapeOverride = int | float | bool | str | tuple[int, ...]


def parse_shape(item: str) -> tuple[str, ShapeOverride]:
    """``NAME=VALUE`` -> ``(NAME, VALUE)``.

    VALUE is read as a Python literal (:func:`ast.literal_eval`): an int (``16``), a
    float (``1e-5``), a bool (``True``; ``true``/``false`` also accepted), a quoted
    string, or a tuple or list of ints (``(64,)``, ``[8, 8]``), returned as a tuple;
    text that is not a literal is kept as a string (``mode=fast``). These are the
    values a job's ``shape_overrides`` carries (``schemas.events.ShapeValue``).

    Raises:
        typer.BadParameter: no ``=``, an empty name, or a literal of another kind
            (a tuple of floats, a dict, None, ...).
    """
    name, sep, text = item.partition("=")
    name = name.strip()
    if not sep or not name:
        raise typer.BadParameter(f"{item!r}: expected NAME=VALUE, e.g. batch_size=16")
    text = text.strip()
    if text.lower() in ("true", "false"):
        return name, text.lower() == "true"
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return name, text  # not a Python literal: a bare word such as mode=fast
    if isinstance(value, int | float | bool | str):
        return name, value
    if isinstance(value, tuple | list) and all(
            isinstance(v, int) and not isinstance(v, bool) for v in value):
        return name, tuple(value)
    raise typer.BadParameter(
        f"{item!r}: VALUE must be an int, a float, true/false, a string or a tuple of "
        f"ints such as (64,), not {type(value).__name__} {text}")


def task_module_names(task_desc: str) -> list[str]:
    """Names a task's module binds by assignment at top level, in source order.

    Found with :mod:`ast`, without running the task (whose code is not trusted here):
    targets of ``=``, ``+=`` and annotated assignments, also inside top-level ``if``,
    ``try``, ``for`` and ``with`` blocks, never inside functions or classes.

    Raises:
        SyntaxError: the task is not valid Python.
    """
    names: dict[str, None] = {}

    def targets(node: ast.AST) -> None:
        if isinstance(node, ast.Name):
            names[node.id] = None
        elif isinstance(node, ast.Tuple | ast.List):
            for element in node.elts:
                targets(element)
        elif isinstance(node, ast.Starred):
            targets(node.value)

    def visit(body: list[ast.stmt]) -> None:
        for stmt in body:
            if isinstance(stmt, ast.Assign):
                for target in stmt.targets:
                    targets(target)
            elif isinstance(stmt, ast.AugAssign | ast.AnnAssign):
                targets(stmt.target)
            elif isinstance(stmt, ast.For | ast.AsyncFor):
                targets(stmt.target)
            elif isinstance(stmt, ast.With | ast.AsyncWith):
                for withitem in stmt.items:
                    if withitem.optional_vars is not None:
                        targets(withitem.optional_vars)
            for field_name in ("body", "orelse", "finalbody"):
                if not isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                    visit(getattr(stmt, field_name, []) or [])
            for handler in getattr(stmt, "handlers", []):
                visit(handler.body)

    visit(ast.parse(task_desc).body)
    return list(names)


def _check_shape_names(file: Path, task_desc: str, overrides: dict[str, Any]) -> None:
    """Exit 2 when an override names something the task does not define at top level."""
    if not overrides:
        return
    try:
        defined = task_module_names(task_desc)
    except SyntaxError as exc:
        _fail(ExitCode.USAGE, f"{file}: not valid Python (line {exc.lineno}: {exc.msg})")
    unknown = [name for name in overrides if name not in defined]
    if unknown:
        _fail(ExitCode.USAGE,
              f"--shape {', '.join(unknown)}: {file} defines no such module-level name; "
              f"it defines: {', '.join(defined) or '(none)'}")


def _wait(client: httpx.Client, job_id: str, timeout_s: float, live: bool) -> httpx.Response:
    """Poll the job's status until it ends; the last response. Exits 4 on timeout."""
    from services.cli_render import live_view

    deadline = time.monotonic() + timeout_s
    last_ok = time.monotonic()
    display = out.status(f"{job_id} submitted", spinner="dots") if live else contextlib.nullcontext()
    with display as spinner:
        while True:
            try:
                response = client.get(f"/api/v1/jobs/{quote(job_id, safe='')}/status")
            except httpx.TransportError as exc:
                if time.monotonic() - last_ok > UNREACHABLE_GRACE_S:
                    _fail(ExitCode.UNREACHABLE,
                          f"lost the gateway at {client.base_url} for {UNREACHABLE_GRACE_S:.0f} s "
                          f"({exc or exc.__class__.__name__}); the job goes on: "
                          f"`aikg status {job_id}`")
                response = None
            if response is not None:
                if response.status_code >= 400:
                    code = ExitCode.UNREACHABLE if response.status_code >= 500 else ExitCode.USAGE
                    _fail(code, f"gateway refused ({response.status_code}): {_detail(response)}")
                last_ok = time.monotonic()
                record = _decode_record(response)
                if record.status in TERMINAL_STATUSES:
                    return response
                if spinner is not None:
                    spinner.update(live_view(record))
            if time.monotonic() > deadline:
                _fail(ExitCode.TIMEOUT, f"job {job_id} did not finish within {timeout_s:g} s; it "
                      f"goes on: `aikg status {job_id}`")
            time.sleep(POLL_INTERVAL_S)


@app.command()
def submit(
    file: Annotated[Path, typer.Argument(
        exists=True, dir_okay=False, readable=True, metavar="FILE",
        help="KernelBench task: Python defining class Model, get_inputs(), get_init_inputs().")],
    op_name: Annotated[str | None, typer.Option(help="Operator name; default the file stem.")] = None,
    backend: Annotated[str, typer.Option(help="cpu | cuda | ascend.")] = "cpu",
    arch: Annotated[str | None, typer.Option(
        help="Arch (x86_64, h200, a100, ...); default: any with a live worker.")] = None,
    dsl: Annotated[str, typer.Option(help="triton (triton_cuda / triton_ascend accepted).")] = "triton",
    workflow: Annotated[str, typer.Option(
        help="coder_only_workflow | default_workflow.")] = "coder_only_workflow",
    job_type: Annotated[str, typer.Option(help="single | evolve.")] = "single",
    coder: Annotated[str | None, typer.Option(
        help="builtin | llm; default the LLM coder when configured, else builtin.")] = None,
    shape: Annotated[list[str] | None, typer.Option(
        "--shape", metavar="NAME=VALUE",
        help="Rebind a module-level name of the task before get_inputs() (repeatable), "
        "e.g. --shape batch_size=16 or --shape 'input_shape=(64,)'. VALUE: a Python "
        "literal (int, float, True/False, tuple of ints, quoted string), else a string.")] = None,
    max_rounds: Annotated[int | None, typer.Option(
        help="Evolve rounds; default 1.", show_default=False)] = None,
    parallel_num: Annotated[int | None, typer.Option(
        help="Candidates per evolve round; default 1.", show_default=False)] = None,
    num_islands: Annotated[int | None, typer.Option(
        help="Evolve islands (separate populations); default 1.", show_default=False)] = None,
    migration_interval: Annotated[int | None, typer.Option(
        help="Rounds between migrations of the best candidates to the next island; "
        "default 2.", show_default=False)] = None,
    elite_size: Annotated[int | None, typer.Option(
        help="Best candidates kept in the elite archive across islands; default 5.",
        show_default=False)] = None,
    parent_selection_prob: Annotated[float | None, typer.Option(
        help="Chance that an evolve parent is the island's best rather than a random "
        "passed candidate; default 0.5.", show_default=False)] = None,
    max_attempts: Annotated[int | None, typer.Option(
        help="Candidates a single job may try, repairs included; default 3.",
        show_default=False)] = None,
    job_id: Annotated[str | None, typer.Option(
        help="Client-chosen job id (letters, digits, _ and -); resubmitting the same job "
        "with it is idempotent.")] = None,
    priority: Annotated[str | None, typer.Option(
        help="low | normal | high: order among waiting jobs (high lanes are served "
        "first); the tenant's max_priority bounds it. Default normal.",
        show_default=False)] = None,
    wait: Annotated[bool, typer.Option("--wait", help="Follow the job until it ends.")] = False,
    timeout: Annotated[float, typer.Option(help="Seconds --wait waits at most.")] = 1800.0,
    as_json: JsonOption = False,
    gateway_url: GatewayOption = DEFAULT_GATEWAY_URL,
    token: TokenOption = None,
) -> None:
    """Submit a task file as a job: print its id, or with --wait follow it to the verdict.

    Reads AIKG_GATEWAY_URL and AIKG_API_TOKEN. Exit codes: 0 completed and passed,
    1 failed/cancelled/not passed, 2 bad input or refused (400/401/409/413),
    3 gateway unreachable, 4 --wait timed out, 130 Ctrl-C while waiting.
    """
    try:
        task_desc = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        _fail(ExitCode.USAGE, f"cannot read task file {file}: {exc}")
    overrides = dict(parse_shape(s) for s in shape or [])
    _check_shape_names(file, task_desc, overrides)
    body: dict[str, Any] = {
        "op_name": op_name or file.stem,
        "task_desc": task_desc,
        "job_type": job_type,
        "backend": backend,
        "dsl": dsl,
        "workflow": workflow,
        "shape_overrides": overrides,
    }
    optional = {"arch": arch, "coder": coder, "job_id": job_id, "max_rounds": max_rounds,
                "parallel_num": parallel_num, "num_islands": num_islands,
                "migration_interval": migration_interval, "elite_size": elite_size,
                "parent_selection_prob": parent_selection_prob, "max_attempts": max_attempts,
                "priority": priority}
    body.update({k: v for k, v in optional.items() if v is not None})
    with _client(gateway_url, token) as client:
        response = _request(client, "POST", "/api/v1/jobs/submit", json=body)
        accepted = response.json()
        new_id = accepted["job_id"]
        if not wait:
            if as_json:
                sys.stdout.write(json.dumps(accepted) + "\n")
            else:
                out.print(new_id, markup=False)
                err.print(f"follow it: aikg status {new_id} | aikg events {new_id}",
                          markup=False, soft_wrap=True)
            return
        live = not as_json and out.is_terminal
        if live:
            err.print(f"submitted {new_id} to {accepted.get('backend')}/{accepted.get('arch')}",
                      markup=False)
        try:
            final = _wait(client, new_id, timeout, live)
        except KeyboardInterrupt:
            _fail(ExitCode.INTERRUPTED,
                  f"stopped waiting; the job goes on: `aikg status {new_id}`")
    record = _decode_record(final)
    _show(record, final.content, as_json)
    raise typer.Exit(int(_record_exit(record)))


@app.command()
def status(
    job_id: Annotated[str, typer.Argument(help="Job id printed by `aikg submit`.")],
    as_json: JsonOption = False,
    gateway_url: GatewayOption = DEFAULT_GATEWAY_URL,
    token: TokenOption = None,
) -> None:
    """Print a job's record: status, progress, verdict and kernel.

    Reads AIKG_GATEWAY_URL and AIKG_API_TOKEN. Exit codes: 0 completed and passed,
    1 failed/cancelled/not passed, 2 unknown job, 3 gateway unreachable,
    5 still pending or running.
    """
    with _client(gateway_url, token) as client:
        response = _request(client, "GET", f"/api/v1/jobs/{quote(job_id, safe='')}/status")
    record = _decode_record(response)
    _show(record, response.content, as_json)
    raise typer.Exit(int(_record_exit(record)))


@app.command("list")
def list_jobs(
    status_filter: Annotated[str | None, typer.Option(
        "--status", help="Only jobs with this status: pending, running, completed, failed, "
        "cancelled, or corrupt (records that do not decode).")] = None,
    op_name: Annotated[str | None, typer.Option(help="Only jobs of this operator.")] = None,
    limit: Annotated[int, typer.Option(min=1, max=500, help="Jobs to show.")] = 20,
    offset: Annotated[int, typer.Option(min=0, help="Newest jobs to skip.")] = 0,
    as_json: JsonOption = False,
    gateway_url: GatewayOption = DEFAULT_GATEWAY_URL,
    token: TokenOption = None,
) -> None:
    """List jobs, newest first: id, status, op, backend/arch, submitted, result.

    Exit codes: 0 listed (also when none match), 2 bad option, 3 gateway unreachable.
    """
    params: dict[str, Any] = {"limit": limit, "offset": offset}
    if status_filter:
        params["status"] = status_filter
    if op_name:
        params["op_name"] = op_name
    with _client(gateway_url, token) as client:
        response = _request(client, "GET", "/api/v1/jobs", params=params)
    page = response.json()
    if as_json:
        sys.stdout.write(response.text + "\n")
        return
    from services.cli_render import jobs_table

    if not page["jobs"]:
        out.print("no jobs" + (" match" if status_filter or op_name else " yet"), markup=False)
        return
    out.print(jobs_table(page, out.width))
    shown = len(page["jobs"])
    if page["total"] > offset + shown:
        err.print(f"{shown} of {page['total']} jobs; more with --offset {offset + shown}",
                  markup=False)


@app.command()
def cancel(
    job_id: Annotated[str, typer.Argument(help="Job id printed by `aikg submit`.")],
    as_json: JsonOption = False,
    gateway_url: GatewayOption = DEFAULT_GATEWAY_URL,
    token: TokenOption = None,
) -> None:
    """Cancel a job: the generator stops it, workers skip its pending candidates.

    Exit codes: 0 cancelled, or had already ended (the message says how), 2 unknown
    job, 3 gateway unreachable.
    """
    with _client(gateway_url, token) as client:
        response = _request(client, "POST", f"/api/v1/jobs/{quote(job_id, safe='')}/cancel")
    record = response.json()
    if as_json:
        sys.stdout.write(response.text + "\n")
    elif record["status"] == "cancelled":
        out.print(f"{job_id} cancelled", markup=False)
    else:
        out.print(f"{job_id} had already ended: {record['status']}", markup=False)


@app.command()
def events(
    job_id: Annotated[str, typer.Argument(help="Job id printed by `aikg submit`.")],
    as_json: Annotated[bool, typer.Option(
        "--json", help="One JSON event per line (JobEvent fields plus `seq`).")] = False,
    gateway_url: GatewayOption = DEFAULT_GATEWAY_URL,
    token: TokenOption = None,
) -> None:
    """Print a job's events, one line each: its history, then live until it ends.

    Exit codes: 0 the job completed, 1 it failed or was cancelled, 2 unknown job,
    3 gateway unreachable or the stream broke, 130 Ctrl-C (the job goes on).
    """
    from httpx_sse import connect_sse

    from services.cli_render import event_line

    last: str | None = None
    path = f"/api/v1/jobs/{quote(job_id, safe='')}/events"
    try:
        with _client(gateway_url, token) as client, connect_sse(
                client, "GET", path, timeout=httpx.Timeout(10.0, read=60.0)) as source:
            if source.response.status_code >= 400:
                source.response.read()
                code = (ExitCode.UNREACHABLE if source.response.status_code >= 500
                        else ExitCode.USAGE)
                _fail(code, f"gateway refused ({source.response.status_code}): "
                      f"{_detail(source.response)}")
            for sse in source.iter_sse():
                if not sse.data:  # a keepalive comment
                    continue
                event = json.loads(sse.data)
                event["seq"] = int(sse.id) if sse.id else None
                last = event.get("event")
                if as_json:
                    sys.stdout.write(json.dumps(event) + "\n")
                    sys.stdout.flush()
                else:
                    out.print(event_line(event), soft_wrap=True)
    except httpx.TransportError as exc:
        _fail(ExitCode.UNREACHABLE, f"lost the gateway at {gateway_url}: "
              f"{exc or exc.__class__.__name__}; the job goes on: `aikg events {job_id}`")
    except KeyboardInterrupt:
        _fail(ExitCode.INTERRUPTED, f"stopped following; the job goes on: `aikg status {job_id}`")
    if last == "completed":
        raise typer.Exit(int(ExitCode.OK))
    if last in TERMINAL_STATUSES:
        raise typer.Exit(int(ExitCode.FAILED))
    _fail(ExitCode.UNREACHABLE, f"the event stream ended before the job did; follow it again: "
          f"`aikg events {job_id}`")


@app.command()
def workers(
    as_json: JsonOption = False,
    gateway_url: GatewayOption = DEFAULT_GATEWAY_URL,
    token: TokenOption = None,
) -> None:
    """List live workers: backend/arch, devices, load (in-flight/capacity), leases held.

    Exit codes: 0 listed (also when none is live), 3 gateway unreachable.
    """
    with _client(gateway_url, token) as client:
        response = _request(client, "GET", "/api/v1/workers")
    if as_json:
        sys.stdout.write(response.text + "\n")
        return
    listing = response.json()
    if not listing.get("workers"):
        out.print("no live workers: start one with `aikg worker` (or `aikg up`)", markup=False)
        return
    from services.cli_render import workers_table

    out.print(workers_table(listing))


async def _run_local(task_desc: str, op_name: str, backend: str, arch: str | None,
                     devices: list[str], shape_overrides: dict[str, Any], trials: int,
                     timeout_s: float) -> tuple[str, bool, dict[str, Any]]:
    from services.sdk import LocalWorker, Task, WorkerManager

    manager = WorkerManager()
    worker = LocalWorker(devices, backend=backend, arch=arch)
    manager.add(worker, backend, worker.arch, len(devices))
    try:
        return await Task(op_name, task_desc, task_id=f"run-{os.getpid()}", backend=backend,
                          arch=worker.arch, shape_overrides=shape_overrides, trials=trials,
                          timeout_s=timeout_s, worker_manager=manager).run()
    finally:
        await worker.close()


@app.command()
def run(
    file: Annotated[Path, typer.Argument(
        exists=True, dir_okay=False, readable=True, metavar="FILE",
        help="KernelBench task: Python defining class Model, get_inputs(), get_init_inputs().")],
    op_name: Annotated[str | None, typer.Option(help="Operator name; default the file stem.")] = None,
    backend: Annotated[str, typer.Option(help="cpu (Triton interpreter) | cuda | ascend.")] = "cpu",
    arch: Annotated[str | None, typer.Option(help="Arch reported; default this machine's CPU.")] = None,
    devices: Annotated[str, typer.Option(
        help="Devices to verify on, comma-separated (GPU ordinals; on cpu, slots).")] = "0",
    shape: Annotated[list[str] | None, typer.Option(
        "--shape", metavar="NAME=VALUE",
        help="Rebind a module-level name of the task before get_inputs() (repeatable), "
        "e.g. --shape batch_size=16 or --shape 'input_shape=(64,)'. VALUE: a Python "
        "literal (int, float, True/False, tuple of ints, quoted string), else a string.")] = None,
    trials: Annotated[int, typer.Option(min=1, max=20, help="Correctness trials (seeds).")] = 3,
    timeout: Annotated[float, typer.Option(
        help="Seconds the candidate's verification may take.")] = 300.0,
    as_json: JsonOption = False,
) -> None:
    """Write a kernel for FILE with the built-in coder and verify it on this machine.

    Local mode: no NATS, no gateway, no network. The task's code and the candidate run
    only in sandboxed child processes (README, "Security model"). Prints the verdict and the kernel.
    Exit codes: 0 passed, 1 not passed or no kernel for this task, 2 bad input, 6 the
    sandbox cannot start here, 130 Ctrl-C.
    """
    from services.common.logging import configure_logging
    from services.common.records import TaskError, check_task_source

    try:
        task_desc = file.read_text(encoding="utf-8")
        check_task_source(task_desc)
    except (OSError, UnicodeDecodeError) as exc:
        _fail(ExitCode.USAGE, f"cannot read task file {file}: {exc}")
    except (TaskError, ValueError) as exc:
        _fail(ExitCode.USAGE, f"{file}: {exc}")
    device_list = [d.strip() for d in devices.split(",") if d.strip()]
    if not device_list:
        _fail(ExitCode.USAGE, "--devices is empty: give at least one, e.g. --devices 0")
    if backend not in ("cpu", "cuda", "ascend"):
        _fail(ExitCode.USAGE, f"--backend must be cpu, cuda or ascend, not {backend!r}")
    overrides = dict(parse_shape(s) for s in shape or [])
    _check_shape_names(file, task_desc, overrides)
    configure_logging("run", os.environ.get("AIKG_LOG_LEVEL", "warning"), "console")
    from services.worker.sandbox import PoolBroken  # imports torch: after the checks

    live = not as_json and err.is_terminal
    display = (err.status(f"writing and verifying a kernel for {file} on {backend} ...")
               if live else contextlib.nullcontext())
    try:
        with display:
            op, passed, info = asyncio.run(_run_local(
                task_desc, op_name or file.stem, backend, arch, device_list, overrides,
                trials, timeout))
    except KeyboardInterrupt:
        _fail(ExitCode.INTERRUPTED, "stopped")
    except ValueError as exc:
        _fail(ExitCode.USAGE, str(exc))
    except PoolBroken as exc:
        _fail(ExitCode.NO_SANDBOX, f"the local sandbox cannot start on this machine: {exc}")
    if as_json:
        sys.stdout.write(json.dumps({"op_name": op, **info}) + "\n")
    else:
        from services.cli_render import local_result_view

        out.print(local_result_view(op, passed, info))
    raise typer.Exit(int(ExitCode.OK if passed else ExitCode.FAILED))


@app.command()
def schema(
    out_dir: Annotated[Path | None, typer.Option(
        "--out", help="Directory to write; default schemas/json of this checkout.")] = None,
) -> None:
    """Write the JSON Schema of every wire record (JobSubmit, JobRecord, JobEvent,
    VerifyRequest, VerifyResult, WorkerInfo) as `<Record>.json`, for non-Python clients."""
    from schemas.export import JSON_DIR, export_json_schemas

    for path in export_json_schemas(out_dir or JSON_DIR):
        out.print(str(path), markup=False, soft_wrap=True)


def _register_export() -> None:
    # Its own module: this one is long enough.
    from services.cli_export import export

    app.command("export")(export)


_register_export()


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


if __name__ == "__main__":
    main()
