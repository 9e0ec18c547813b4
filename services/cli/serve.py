"""The service commands of ``aikg``: ``gateway``, ``worker``, ``generator`` and
``nats-setup``, each running one service of the system in this process.

They read their configuration from ``AIKG_*`` environment variables
(services/common/settings.py); flags override them. Registered on the app by
:mod:`services.cli`.
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

import typer

from services.cli.common import ExitCode, cli_settings, fail
from services.common.settings import GATEWAY_PORT, Settings


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


def gateway(
    host: Annotated[str | None, typer.Option(envvar="AIKG_GATEWAY_HOST",
                                             help="Address to listen on.")] = None,
    port: Annotated[int | None, typer.Option(envvar="AIKG_GATEWAY_PORT",
                                             help=f"Port to listen on (default {GATEWAY_PORT}).")] = None,
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

