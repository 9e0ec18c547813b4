"""``aikg``: run the services, submit and follow jobs, or verify a kernel locally.

This module holds the Typer app and registers every command. Service commands
(``gateway``, ``generator``, ``worker``, ``nats-setup``, ``up``, ``demo``) are here and read their
configuration from ``AIKG_*`` environment variables (services/common/settings.py);
flags override them; ``up`` and ``demo`` run the local stack of
:mod:`services.stack`. Client commands (``submit``, ``status``, ``list``, ``cancel``,
``events``, ``workers``: :mod:`services.cli_client`; ``export``:
:mod:`services.cli_export`) talk to the gateway through the SDK's ``AIKGClient``;
``run`` needs neither NATS nor a network. They exit with:

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

import asyncio
import json
import os
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Annotated, Any

import msgspec
import typer

from services import cli_client, cli_export
from services.cli_common import (
    DEFAULT_GATEWAY_URL,
    ArchOption,
    BackendOption,
    DevicesOption,
    ExitCode,
    JsonOption,
    OpNameOption,
    ShapesOption,
    TaskFileArgument,
    TimeoutOption,
    TokenOption,
    TrialsOption,
    cli_settings,
    err,
    fail,
    local_inputs,
    out,
    parse_shape,
    read_task,
    run_locally,
    say,
    sdk_errors,
    show_record,
)
from services.common.records import task_module_names
from services.common.runtime import free_port, install_signal_handlers
from services.common.settings import Settings
from services.stack import LocalStack, StackError, local_stack

# Imported from here by tests and benches before these modules existed.
__all__ = ["ExitCode", "LocalStack", "StackError", "app", "local_stack", "main", "parse_shape",
           "task_module_names"]

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


def _run_service(service: str, settings: Settings, main: Any) -> None:
    """Configure logging for ``service`` and run its coroutine until it ends.

    A NATS connection failure exits 3 with the URL; Ctrl-C exits 0 (the services
    shut down on SIGINT/SIGTERM by themselves).
    """
    from services.common.logging import configure_logging

    if not settings.nats_url:
        fail(ExitCode.USAGE, f"AIKG_NATS_URL is not set: point it at a NATS server "
             f"(e.g. nats://127.0.0.1:4222), or run `aikg up` to start everything "
             f"with an embedded one. ({service})")
    configure_logging(service, settings.log_level, settings.log_format)
    try:
        asyncio.run(main)
    except PermissionError as exc:
        # The NATS user lacks a right the command needs (nats-setup as a non-admin).
        fail(ExitCode.USAGE, f"{service}: {exc}")
    except ConnectionError as exc:
        fail(ExitCode.UNREACHABLE, f"{service}: {exc}")
    except ValueError as exc:
        # Bad configuration found at start (device names, worker id ...).
        fail(ExitCode.USAGE, f"{service}: {exc}")
    except RuntimeError as exc:
        # e.g. the worker's sandbox cannot start on this machine (PoolBroken).
        fail(ExitCode.NO_SANDBOX, f"{service} could not start: {exc}")
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

    settings = cli_settings(gateway_host=host, gateway_port=port)
    try:
        _run_service("gateway", settings, serve_gateway(settings))
    except OSError as exc:
        fail(ExitCode.FAILED, f"gateway: {exc}")


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

    settings = cli_settings(worker_backend=backend, worker_arch=arch, worker_devices=devices,
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

    settings = cli_settings(metrics_port=metrics_port)
    _run_service("generator", settings, run_generator(settings))


@app.command("nats-setup")
def nats_setup(
    verify: Annotated[list[str] | None, typer.Option(
        "--verify", metavar="BACKEND/ARCH",
        help="Also make the default verify consumer of this backend/arch now "
             "(e.g. cpu/x86_64); repeat for each. Others are made when a worker asks.")] = None,
    serve: Annotated[bool, typer.Option(
        "--serve/--once",
        help="Stay and make the consumers of lanes that appear later (a new tenant, "
             "priority or backend/arch), as the services ask; --once sets up and exits.")] = True,
) -> None:
    """Provision JetStream as the NATS admin: streams, buckets and the durable consumers
    of JOBS and VERIFY, which no service may create or change.

    The gateway, generator and workers connect with least-privilege users
    (deploy/nats/auth.conf): they may bind and pull their shared durable consumers
    (`generator`, `generator-<tenant>-<priority>`, `verify-<backend>-<arch>[-<priority>-<tenant>]`)
    but not create, update or delete them; a worker that could create one could
    rewrite it (max_deliver, ack wait) for every worker. This command, run once with
    the admin's credentials (AIKG_NATS_USER=admin, AIKG_NATS_PASSWORD), creates the
    streams and buckets, creates or updates the `generator` consumer and each
    --verify default consumer to the settings (AIKG_VERIFY_ACK_WAIT_S,
    AIKG_VERIFY_MAX_DELIVER), and updates the lane consumers that exist. With
    --serve (the default) it then answers the services' requests on
    `aikg.provision.consumer` for lanes that appear later: it names and configures
    each consumer itself, and makes one for a tenant lane only while the lane holds
    messages. `aikg up` runs it for you. Needs AIKG_NATS_URL.
    """
    from services.common.provision import parse_verify_lanes, run_nats_setup

    settings = cli_settings()
    try:
        lanes = parse_verify_lanes(verify or [])
    except ValueError as exc:
        fail(ExitCode.USAGE, str(exc))
    _run_service("nats-setup", settings, run_nats_setup(settings, lanes, serve=serve))


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
    metrics_port: Annotated[int | None, typer.Option(
        envvar="AIKG_UP_METRICS_PORT",
        help="Port of this supervisor's Prometheus /metrics (aikg_service_restarts_total); "
        "0 a free port (printed), -1 off.")] = None,
) -> None:
    """Run the full stack here until Ctrl-C: NATS, gateway, generator and a worker.

    NATS is an embedded nats-server unless AIKG_NATS_URL is set. It refuses clients
    without credentials: each service gets its own per-run user, and the admin's (for
    the `nats` CLI) are written to a 0600 file whose path is printed. Each service is
    a child process in its own process group; Ctrl-C or SIGTERM stops them all. A
    service (or the embedded NATS) that dies once the stack is up is restarted, after
    a wait that doubles with each restart; exits 1 when a service dies more than
    AIKG_UP_RESTART_MAX times within AIKG_UP_RESTART_WINDOW_S, dies before the stack
    is up, or the stack does not come up in time (its log is named).
    """
    from services.common.metrics import start_metrics_server
    from services.stack import SUPERVISOR_REGISTRY

    settings = cli_settings(up_metrics_port=metrics_port)
    try:
        served = start_metrics_server(settings.up_metrics_port, registry=SUPERVISOR_REGISTRY)
    except OSError as exc:
        fail(ExitCode.USAGE, f"aikg up: cannot serve /metrics on port "
             f"{settings.up_metrics_port}: {exc}")
    if served is not None:
        from services.common.metrics import metrics_host

        say(f"supervisor metrics: http://{metrics_host()}:{served}/metrics")
    stopping = threading.Event()
    stack: LocalStack | None = None

    restore_signals = install_signal_handlers(stopping)
    code = ExitCode.OK
    try:
        with local_stack(settings, host=host, port=port, backend=backend, arch=arch,
                         devices=devices, store_dir=store_dir, log_dir=log_dir,
                         verbose=verbose, ready_timeout=ready_timeout,
                         stopping=stopping, nats_auth=nats_auth, say=say) as stack:
            if not stopping.is_set():
                out.print(f"AIKG is up: {stack.describe()}. Ctrl-C stops it.",
                          markup=False, soft_wrap=True)
                if stack.gateway_url != DEFAULT_GATEWAY_URL:
                    out.print(f"point client commands at it: export AIKG_GATEWAY_URL="
                              f"{stack.gateway_url}", markup=False, soft_wrap=True)
            while not stopping.wait(0.5):
                if (dead := stack.dead_child()) is not None:
                    say(f"stopping AIKG: {dead}")
                    code = ExitCode.FAILED
                    break
    except StackError as exc:
        say(str(exc))
        code = ExitCode.FAILED
    finally:
        restore_signals()
        if logged := [p for p in stack.logs.values() if p.exists()] if stack else []:
            say(f"service logs kept in {logged[0].parent}")
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
    settings = cli_settings()
    task_desc = read_task(file)
    overrides = dict(parse_shape(s) for s in shape or [])
    port = free_port()
    err.print("starting AIKG (embedded NATS, gateway, generator, cpu worker) ...", markup=False)
    started = time.monotonic()
    try:
        with local_stack(settings, host="127.0.0.1", port=port, backend="cpu", arch=None,
                         devices="0", store_dir=None, log_dir=None, verbose=False,
                         ready_timeout=ready_timeout, say=say) as stack:
            say(f"up in {time.monotonic() - started:.1f} s: {stack.describe()}")
            with cli_client.connect(stack.gateway_url, settings.api_token) as client:
                with sdk_errors():
                    job_id = client.submit(file.stem, task_desc, backend="cpu",
                                           shape_overrides=overrides)["job_id"]
                err.print(f"submitted {file} as job {job_id}", markup=False)
                final = cli_client.wait_for_job(client, job_id, timeout, out.is_terminal,
                                                follow=None)
            code = show_record(final, as_json=False)
    except StackError as exc:
        fail(ExitCode.FAILED, str(exc))
    if code == ExitCode.OK and stack.logs:
        # A throw-away stack that did its job leaves nothing behind; on failure the
        # logs stay for a look (their directory was printed at start).
        shutil.rmtree(next(iter(stack.logs.values())).parent, ignore_errors=True)
        err.print("logs removed: the job passed", markup=False)
    raise typer.Exit(int(code))


# The gateway's clients (services/cli_client.py), in the order `--help` lists them.
app.command()(cli_client.submit)
app.command()(cli_client.status)
app.command("list")(cli_client.list_jobs)
app.command()(cli_client.cancel)
app.command()(cli_client.events)
app.command()(cli_client.workers)


async def _run_local(task_desc: str, op_name: str, backend: str, arch: str | None,
                     devices: list[str], shape_overrides: dict[str, Any], trials: int,
                     timeout_s: float) -> tuple[str, bool, dict[str, Any]]:
    from services.sdk import LocalWorker, Task, WorkerManager

    manager = WorkerManager()
    worker = LocalWorker(devices, backend=backend, arch=arch, client_command="aikg run")
    manager.add(worker, backend, worker.arch, len(devices))
    try:
        return await Task(op_name, task_desc, task_id=f"run-{os.getpid()}", backend=backend,
                          arch=worker.arch, shape_overrides=shape_overrides, trials=trials,
                          timeout_s=timeout_s, worker_manager=manager).run()
    finally:
        await worker.close()


@app.command()
def run(
    file: TaskFileArgument,
    op_name: OpNameOption = None,
    backend: BackendOption = "cpu",
    arch: ArchOption = None,
    devices: DevicesOption = "0",
    shape: ShapesOption = None,
    trials: TrialsOption = 3,
    timeout: TimeoutOption = 300.0,
    as_json: JsonOption = False,
) -> None:
    """Write a kernel for FILE with the built-in coder and verify it on this machine.

    Local mode: no NATS, no gateway, no network. The task's code and the candidate run
    only in sandboxed child processes (README, "Security model"). Prints the verdict and the kernel.
    Exit codes: 0 passed, 1 not passed or no kernel for this task, 2 bad input, 6 the
    sandbox cannot start here, 130 Ctrl-C.
    """
    task_desc, device_list, overrides = local_inputs(file, backend, devices, shape)
    op, passed, info = run_locally(
        f"writing and verifying a kernel for {file} on {backend} ...", as_json,
        _run_local(task_desc, op_name or file.stem, backend, arch, device_list, overrides,
                   trials, timeout))
    if as_json:
        sys.stdout.write(json.dumps({"op_name": op, **info}) + "\n")
    else:
        from services.cli_render import local_result_view

        out.print(local_result_view(op, passed, info))
    raise typer.Exit(int(ExitCode.OK if passed else ExitCode.FAILED))


async def _verify_local(task_desc: str, code: str, op_name: str, backend: str,
                        arch: str | None, devices: list[str], shape_overrides: dict[str, Any],
                        trials: int, timeout_s: float, allow_unchecked: bool = False) -> Any:
    from services.sdk import LocalWorker

    worker = LocalWorker(devices, backend=backend, arch=arch, client_command="aikg verify")
    try:
        return await worker.verify(task_desc, code, op_name, shape_overrides=shape_overrides,
                                   trials=trials, timeout_s=timeout_s,
                                   allow_unchecked=allow_unchecked)
    finally:
        await worker.close()


@app.command()
def verify(
    file: TaskFileArgument,
    kernels: Annotated[list[Path], typer.Argument(
        exists=True, dir_okay=False, readable=True, metavar="KERNEL...",
        help="Your candidates: Python defining class ModelNew (Triton kernels launched "
             "from forward); more than one is a batch.")],
    op_name: OpNameOption = None,
    backend: BackendOption = "cpu",
    arch: ArchOption = None,
    devices: DevicesOption = "0",
    shape: ShapesOption = None,
    trials: TrialsOption = 3,
    timeout: TimeoutOption = 300.0,
    gateway_url: Annotated[str | None, typer.Option(
        "--gateway", show_default=False,
        help="Verify on the AIKG workers behind this gateway (one batch verification) "
             "instead of on this machine.")] = None,
    token: TokenOption = None,
    as_json: JsonOption = False,
    allow_unchecked: Annotated[bool, typer.Option(
        "--allow-unchecked",
        help="Accept a partial check: pass even where what the task's own sizes launch "
             "was not checked (the verdict then says so, stage 'unchecked').")] = False,
) -> None:
    """Verify KERNEL (your own ModelNew) against FILE's Model on this machine.

    The same checks a worker runs (docs/verification.md), in the same sandbox; no
    NATS, no network. Prints the verdict: the stage and message of a failure, errors,
    sizes checked. With several kernels (a batch), identical ones are verified once,
    progress goes to stderr and a table of verdicts to stdout; with --gateway the
    batch runs on the gateway's workers. Exit codes: 0 passed (every kernel), 1 not
    passed, 2 bad input, 3 gateway unreachable, 6 the sandbox cannot start here, 130
    Ctrl-C.
    """
    if len(kernels) > 1 or gateway_url:
        _verify_batch(file, kernels, op_name or file.stem, backend, arch, devices, shape,
                      trials, timeout, gateway_url, token, as_json, allow_unchecked)
    task_desc, device_list, overrides = local_inputs(file, backend, devices, shape)
    kernel = kernels[0]
    code = read_task(kernel)
    result = run_locally(
        f"verifying {kernel} against {file} on {backend} ...", as_json,
        _verify_local(task_desc, code, op_name or file.stem, backend, arch, device_list,
                      overrides, trials, timeout, allow_unchecked))
    if as_json:
        sys.stdout.write(json.dumps(msgspec.to_builtins(result)) + "\n")
    else:
        from rich.panel import Panel

        from services.cli_render import verdict_table

        out.print(Panel(verdict_table(result), title=f"verdict: {kernel}", title_align="left"))
    raise typer.Exit(int(ExitCode.OK if result.passed else ExitCode.FAILED))


def _verify_batch(file: Path, kernels: list[Path], op_name: str, backend: str,
                  arch: str | None, devices: str, shape: list[str] | None, trials: int,
                  timeout: float, gateway_url: str | None, token: str | None,
                  as_json: bool, allow_unchecked: bool = False) -> None:
    """``aikg verify`` of several kernels, or of any through ``--gateway``
    (:mod:`services.cli_batch`); exits with the batch's code."""
    from services import cli_batch

    task_desc, device_list, overrides = local_inputs(file, backend, devices, shape)
    codes = [read_task(k) for k in kernels]
    names = [str(k) for k in kernels]
    live = not as_json and err.is_terminal
    where = f"the workers of {gateway_url}" if gateway_url else backend
    what = f"verifying {len(kernels)} kernels against {file} on {where}"
    with cli_batch.progress(len(kernels), what, live) as tick:
        if gateway_url:
            try:
                verdicts = cli_batch.gateway_batch(
                    gateway_url, token, task_desc=task_desc, codes=codes, names=names,
                    op_name=op_name, backend=backend, arch=arch, shape_overrides=overrides,
                    trials=trials, timeout_s=timeout, tick=tick,
                    allow_unchecked=allow_unchecked)
            except KeyboardInterrupt:
                fail(ExitCode.INTERRUPTED, "stopped; the batch was cancelled")
        else:
            verdicts = run_locally(what, True, cli_batch.verify_locally(
                task_desc, codes, names, op_name, backend=backend, arch=arch,
                devices=device_list, shape_overrides=overrides, trials=trials,
                timeout_s=timeout, tick=tick, allow_unchecked=allow_unchecked))
    raise typer.Exit(int(cli_batch.report(names, verdicts, as_json)))


@app.command()
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


app.command("export")(cli_export.export)


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
