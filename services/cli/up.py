"""``aikg up`` and ``aikg demo``: the local stack of :mod:`services.stack` (embedded
NATS, gateway, generator and a worker as child processes), run until Ctrl-C or for one
job. Registered on the app by :mod:`services.cli`.
"""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path
from typing import Annotated

import typer

from services.cli.client import connect, wait_for_job
from services.cli.common import (
    ExitCode,
    OutputOption,
    check_output,
    cli_settings,
    err,
    fail,
    out,
    read_task,
    say,
    sdk_errors,
    shape_overrides,
    show_record,
)
from services.common.runtime import free_port, install_signal_handlers
from services.common.settings import GATEWAY_PORT, GATEWAY_URL
from services.stack import LocalStack, StackError, local_stack


def up(
    host: Annotated[str, typer.Option(help="Gateway address.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(envvar="AIKG_GATEWAY_PORT", help="Gateway port.")] = GATEWAY_PORT,
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
                if stack.gateway_url != GATEWAY_URL:
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


def demo(
    file: Annotated[Path, typer.Argument(
        exists=True, dir_okay=False, readable=True,
        help="KernelBench task to submit.")] = Path("tasks/relu.py"),
    shape: Annotated[list[str] | None, typer.Option(
        "--shape", metavar="NAME=VALUE", help="Shape override (repeatable), as for submit.")] = None,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for the job.")] = 600.0,
    ready_timeout: Annotated[float, typer.Option(
        help="Seconds to wait for the stack to come up.")] = 180.0,
    output: OutputOption = None,
) -> None:
    """Start a throw-away stack, submit FILE, print the verdict and kernel, stop the stack.

    This is `make run`: embedded NATS, gateway (on a free port), generator and one cpu
    worker, all stopped at the end. -o FILE writes the kernel to FILE. Exit code 0 when
    the kernel passed verification.
    """
    settings = cli_settings()
    task_desc = read_task(file)
    overrides = shape_overrides(file, task_desc, shape)
    check_output(output)
    port = free_port()
    err.print("starting AIKG (embedded NATS, gateway, generator, cpu worker) ...", markup=False)
    started = time.monotonic()
    try:
        with local_stack(settings, host="127.0.0.1", port=port, backend="cpu", arch=None,
                         devices="0", store_dir=None, log_dir=None, verbose=False,
                         ready_timeout=ready_timeout, say=_say_but_credentials) as stack:
            say(f"up in {time.monotonic() - started:.1f} s: {stack.describe()}")
            with connect(stack.gateway_url, settings.api_token) as client:
                with sdk_errors():
                    job_id = client.submit(file.stem, task_desc, backend="cpu",
                                           shape_overrides=overrides)["job_id"]
                err.print(f"submitted {file} as job {job_id}", markup=False)
                final = wait_for_job(client, job_id, timeout, out.is_terminal, follow=None)
            code = show_record(final, as_json=False, output=output)
    except StackError as exc:
        fail(ExitCode.FAILED, str(exc))
    if code == ExitCode.OK and stack.logs:
        # A throw-away stack that did its job leaves nothing behind; on failure the
        # logs stay for a look (their directory was printed at start).
        shutil.rmtree(next(iter(stack.logs.values())).parent, ignore_errors=True)
        err.print("logs removed: the job passed", markup=False)
    raise typer.Exit(int(code))


def _say_but_credentials(message: str) -> None:
    """:func:`say` for ``demo``, less the line naming the embedded NATS's admin
    credentials: its stack, and they, are gone when ``demo`` ends."""
    if not message.startswith("NATS admin credentials"):
        say(message)
