"""``aikg up`` and ``aikg demo``: the local stack of :mod:`services.stack` (embedded
NATS, gateway, generator and a worker as child processes), run until Ctrl-C or for one
job. Registered on the app by :mod:`services.cli`.
"""

from __future__ import annotations

import os
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
    metrics_port_base: Annotated[int | None, typer.Option(
        metavar="N",
        help="Fixed /metrics ports: the generator's on N, the worker's on N+1 (printed, "
        "kept across restarts). Default: a free port each, not printed.")] = None,
    prometheus_targets: Annotated[Path | None, typer.Option(
        metavar="FILE", dir_okay=False,
        help="Once up, write every /metrics (gateway, supervisor, generator, worker) to "
        "FILE as a Prometheus file_sd target list with a `service` label; removed at "
        "stop. Without --metrics-port-base the generator and worker get free ports, "
        "listed there.")] = None,
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

    For Prometheus (deploy/docker-compose.local.yml): --metrics-port-base gives the
    generator and the worker fixed /metrics ports, --prometheus-targets writes every
    /metrics endpoint to a file_sd target file.
    """
    from services.common.metrics import start_metrics_server
    from services.stack import metrics_ports
    from services.supervisor import SUPERVISOR_REGISTRY

    settings = cli_settings(up_metrics_port=metrics_port)
    try:
        service_ports = metrics_ports(metrics_port_base, fixed=prometheus_targets is not None)
    except ValueError as exc:
        fail(ExitCode.USAGE, f"aikg up: --metrics-port-base: {exc}")
    if taken := {port, settings.up_metrics_port} & set(service_ports.values()):
        fail(ExitCode.USAGE, f"aikg up: --metrics-port-base {metrics_port_base} gives port "
             f"{min(taken)} to a service, but the gateway or the supervisor has it")
    if prometheus_targets is not None:
        # Found out now, not once the stack is up.
        folder = prometheus_targets.parent
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            fail(ExitCode.USAGE, f"aikg up: --prometheus-targets: cannot create {folder}: {exc}")
        if not os.access(folder, os.W_OK):
            fail(ExitCode.USAGE, f"aikg up: --prometheus-targets: {folder} is not writable")
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
    targets: Path | None = None

    restore_signals = install_signal_handlers(stopping)
    code = ExitCode.OK
    try:
        with local_stack(settings, host=host, port=port, backend=backend, arch=arch,
                         devices=devices, store_dir=store_dir, log_dir=log_dir,
                         verbose=verbose, ready_timeout=ready_timeout,
                         stopping=stopping, nats_auth=nats_auth, say=say,
                         metrics_ports=service_ports) as stack:
            if not stopping.is_set():
                out.print(f"AIKG is up: {stack.describe()}. Ctrl-C stops it.",
                          markup=False, soft_wrap=True)
                if stack.gateway_url != GATEWAY_URL:
                    out.print(f"point client commands at it: export AIKG_GATEWAY_URL="
                              f"{stack.gateway_url}", markup=False, soft_wrap=True)
                targets = _report_metrics(stack, served, service_ports, prometheus_targets)
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
        if targets is not None:
            targets.unlink(missing_ok=True)
        if logged := [p for p in stack.logs.values() if p.exists()] if stack else []:
            say(f"service logs kept in {logged[0].parent}")
    raise typer.Exit(int(code))


def _report_metrics(stack: LocalStack, supervisor_port: int | None,
                    service_ports: dict[str, int], targets: Path | None) -> Path | None:
    """Print every known /metrics endpoint when the generator's and worker's are fixed,
    and write them to ``targets`` (a Prometheus file_sd list) when given.

    Returns:
        ``targets`` once written (the caller removes it at stop), else None.
    """
    from services.stack import metrics_target, write_prometheus_targets

    if not service_ports:
        return None
    endpoints = dict(stack.metrics)
    if supervisor_port is not None:
        endpoints = {"gateway": endpoints.pop("gateway"),
                     "supervisor": metrics_target(supervisor_port), **endpoints}
    say("metrics: " + ", ".join(f"{name} http://{where}/metrics"
                                for name, where in endpoints.items()))
    if targets is None:
        return None
    try:
        write_prometheus_targets(targets, endpoints)
    except OSError as exc:
        say(f"cannot write the Prometheus targets to {targets}: {exc}")
        return None
    say(f"Prometheus targets (file_sd): {targets}")
    return targets


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
