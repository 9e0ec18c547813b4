"""The gateway: AIKG's HTTP API (Litestar), in front of NATS; this module builds the app
and serves it.

The routes live by resource, one Litestar ``Router`` each under the ``/api/v1`` router
(https://docs.litestar.dev/2/usage/routing/overview.html):
services/gateway/jobs.py (``/api/v1/jobs``: submit, list, status, cancel, events,
kernel), batches.py (``/api/v1/verify/batch``: batch verification), workers.py
(``/api/v1/workers``), kernels.py (``/api/v1/kernels``); the probes
and metrics (``/healthz``, ``/readyz``, ``/metrics``) in health.py. The router gives its
routes the bus, the job store and the queue view as dependencies (deps.py); errors,
including NATS trouble answered 503, are turned into JSON by exception handlers
registered here by class (errors.py). The gateway holds no state of its own, so any
number of them can run (a batch's follower task only hurries its record along; any
read of the batch does the same).

Errors are JSON ``{"status_code": ..., "detail": "<what was wrong and what to do>", ...}``;
extra keys (``live``, ``errors``) add what a client needs to act on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import os
import socket
from collections.abc import AsyncIterator, Iterator

import structlog
import uvicorn
from litestar import Litestar, Router
from litestar.connection import ASGIConnection
from litestar.datastructures import State
from litestar.exceptions import NotAuthorizedException
from litestar.handlers.base import BaseRouteHandler
from litestar.openapi import OpenAPIConfig
from litestar.types import Guard, Message, Scope
from prometheus_client import Counter

from services.common.bus import Bus, connect_bus
from services.common.queue_metrics import run_queue_metrics
from services.common.runtime import cancel_and_wait, install_signal_handlers
from services.common.settings import Settings
from services.common.tenants import TenantTable, load_tenants
from services.gateway.batch_follow import stop_followers
from services.gateway.batches import verify_router
from services.gateway.deps import DEPENDENCIES
from services.gateway.errors import EXCEPTION_HANDLERS, REQUEST_MAX_BODY_BYTES
from services.gateway.health import PROBE_HANDLERS
from services.gateway.jobs import jobs_router
from services.gateway.kernels import kernels_router
from services.gateway.queue import QueueView
from services.gateway.queuing import stop_requeues
from services.gateway.workers import workers_router

log = structlog.get_logger("aikg.gateway")

# On shutdown, open requests (event streams never end by themselves) get this long,
# seconds, before they are cancelled.
SHUTDOWN_GRACE_S = 5.0

# Routes anyone may call, also when AIKG_API_TOKEN is set: probes carry no credentials.
PUBLIC_PATHS = frozenset({"/healthz", "/readyz"})

REQUESTS = Counter(
    "aikg_gateway_requests_total",
    "HTTP requests answered by the gateway, by route template, method and status code.",
    ["route", "method", "status"],
)


# --- cross-cutting -----------------------------------------------------------------


def _token_matches(header: str, expected: bytes) -> bool:
    """Whether an ``Authorization`` header value equals ``expected``, in time that does
    not depend on where they differ (:func:`hmac.compare_digest`, Python's documented
    defence against timing attacks on secrets). Header values arrive latin-1 decoded
    (ASGI), so any text encodes; a wrong length is refused like a wrong byte."""
    return hmac.compare_digest(header.encode("utf-8", "surrogateescape"), expected)


def _auth_guard(tenants: TenantTable) -> Guard:
    """A guard that wants ``Authorization: Bearer <token>`` of some tenant outside
    :data:`PUBLIC_PATHS`, and records that tenant for the route (``aikg_tenant`` in the
    ASGI scope).

    The token is compared by its SHA-256 against every tenant's, in constant time
    (:meth:`~services.common.tenants.TenantTable.authenticate`): a wrong token of any
    length gets 401 after the same work.
    """

    async def guard(connection: ASGIConnection, _: BaseRouteHandler) -> None:
        if connection.scope["path"] in PUBLIC_PATHS:
            return
        tenant = tenants.authenticate(connection.headers.get("authorization", ""))
        if tenant is None:
            raise NotAuthorizedException(
                detail="missing or wrong API token: send `Authorization: Bearer <token>` "
                "(the gateway's AIKG_API_TOKEN, or a tenant's token from AIKG_TENANTS_FILE)"
            )
        connection.scope["aikg_tenant"] = tenant.name  # type: ignore[typeddict-unknown-key]

    return guard


async def _count_response(message: Message, scope: Scope) -> None:
    """Count each response by route template (never the raw path: it holds ids)."""
    if message["type"] == "http.response.start":
        route = scope.get("path_template") or "unmatched"
        REQUESTS.labels(route=route, method=scope.get("method", ""),
                        status=str(message["status"])).inc()


def api_router() -> Router:
    """``/api/v1``: one router per resource, given the bus, job store and queue view as
    dependencies (services/gateway/deps.py)."""
    return Router(path="/api/v1", route_handlers=[jobs_router, verify_router, workers_router,
                                                  kernels_router],
                  dependencies=DEPENDENCIES)


def create_app(settings: Settings, bus: Bus | None = None) -> Litestar:
    """Build the gateway's Litestar app.

    Args:
        settings: ``api_token`` and ``tenants_file`` turn on bearer auth (all routes but
            ``/healthz`` and ``/readyz``) and name the tenants and their limits;
            ``nats_url`` is used when ``bus`` is None.
        bus: an open bus to use (the caller closes it); None connects one at startup
            and closes it at shutdown.

    Raises:
        ValueError: the tenants file or limits are unusable (the message says why).

    Returns:
        The app; OpenAPI is served under ``/schema`` (``/schema/openapi.json``).
    """

    tenants = load_tenants(settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        own = None if bus is not None else await connect_bus(settings, "gateway",
                                                             role="gateway")
        used = bus if own is None else own
        app.state.bus = used
        app.state.queue = QueueView(used)
        try:
            yield
        finally:
            await stop_followers(app.state)
            await stop_requeues(app.state)
            if own is not None:
                app.state.bus = None
                app.state.queue = None
                await own.close()

    return Litestar(
        route_handlers=[api_router(), *PROBE_HANDLERS],
        lifespan=[lifespan],
        guards=[_auth_guard(tenants)] if tenants.auth else [],
        exception_handlers=EXCEPTION_HANDLERS,
        before_send=[_count_response],
        request_max_body_size=REQUEST_MAX_BODY_BYTES,
        openapi_config=OpenAPIConfig(title="AIKG gateway", version="1",
                                     description="Submit, list, follow and cancel jobs; "
                                     "read their kernels; verify batches of candidates; "
                                     "list workers."),
        state=State({"bus": bus, "queue": QueueView(bus) if bus is not None else None,
                     "tenants": tenants, "tenant_locks": {}, "batch_followers": set(),
                     "requeues": set()}),
        logging_config=None,
    )


def openapi_document() -> str:
    """The gateway's OpenAPI document (what ``/schema/openapi.json`` serves under the
    default settings) as indented JSON with sorted keys and a final newline: what
    ``aikg schema`` writes to ``schemas/json/openapi.json``, where a test keeps the
    committed copy equal to it, so that a change to the HTTP API shows in review."""
    from services.common.settings import load_settings

    schema = create_app(load_settings(env={})).openapi_schema.to_schema()
    return json.dumps(schema, indent=2, sort_keys=True) + "\n"


class _Server(uvicorn.Server):
    """uvicorn without its own signal capture: :func:`serve_gateway` owns shutdown."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (IPv4 or IPv6 by the address).

    Bound here rather than by uvicorn, whose bind failure is a ``sys.exit`` inside a task.

    Raises:
        OSError: the address is in use or cannot be bound; the message names it.
    """
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    try:
        return socket.create_server((host, port), family=family, backlog=2048)
    except OSError as exc:
        reason = os.strerror(exc.errno) if exc.errno else str(exc)
        raise OSError(f"gateway cannot listen on {host}:{port}: {reason}") from exc


async def serve_gateway(settings: Settings, stop: asyncio.Event | None = None) -> None:
    """Serve the gateway on ``settings.gateway_host:gateway_port`` until told to stop.

    Binds the port and connects to NATS first, so a port in use or a wrong URL fails
    here with its message; then serves until ``stop`` is set or, when running in the
    main thread, the process gets SIGINT/SIGTERM; then finishes open requests and
    closes the connection.

    Raises:
        OSError: the port cannot be bound.
        ConnectionError: NATS is not reachable at ``settings.nats_url``.
    """
    stop = stop or asyncio.Event()
    sock = _listen(settings.gateway_host, settings.gateway_port)
    try:
        bus = await connect_bus(settings, "gateway", role="gateway")
    except BaseException:
        sock.close()
        raise
    app = create_app(settings, bus)
    server = _Server(uvicorn.Config(app, log_config=None,
                                    access_log=False, lifespan="on",
                                    timeout_graceful_shutdown=SHUTDOWN_GRACE_S))
    restore_signals = install_signal_handlers(stop, logger=log)
    serving = asyncio.create_task(server.serve(sockets=[sock]), name="gateway-uvicorn")
    queue_metrics = asyncio.create_task(run_queue_metrics(bus), name="gateway-queue-metrics")
    # Throughput samples for the estimated start times, also while nobody asks.
    sampler = asyncio.create_task(app.state.queue.run_sampler(), name="gateway-queue-sampler")
    stopping = asyncio.create_task(stop.wait(), name="gateway-stop")
    host, port = sock.getsockname()[:2]
    log.info("gateway_listening", url=f"http://{host}:{port}", nats_url=settings.nats_url,
             auth=bool(settings.api_token or settings.tenants_file))
    try:
        await asyncio.wait({serving, stopping}, return_when=asyncio.FIRST_COMPLETED)
        server.should_exit = True
        # uvicorn bounds open connections by its grace, not the app's own shutdown.
        await asyncio.wait({serving}, timeout=SHUTDOWN_GRACE_S + 1)
        if serving.done():
            await serving
    finally:
        stopping.cancel()
        await cancel_and_wait(queue_metrics, sampler)
        if not serving.done():
            # Cancelled while uvicorn was still shutting down: give it its grace once
            # more, bounded, then cancel it, so a stuck request cannot keep the gateway
            # (and whoever awaits it) from stopping.
            server.should_exit = True
            await asyncio.wait({serving}, timeout=SHUTDOWN_GRACE_S + 1)
            # uvicorn's second Ctrl+C: its shutdown loops stop waiting for connections.
            server.force_exit = True
            await asyncio.wait({serving}, timeout=1.0)
            await cancel_and_wait(serving)
        restore_signals()
        sock.close()
        await bus.close()
        log.info("gateway_stopped")
