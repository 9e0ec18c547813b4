"""Prometheus metrics endpoint of a worker or generator process.

Metric names follow Prometheus conventions: ``aikg_`` prefix, base units (seconds,
bytes), ``_total`` counters, histograms for latencies, and never an id as a label.
The gateway serves ``/metrics`` on its HTTP port instead.

``AIKG_METRICS_HOST`` sets the address the endpoint binds (default ``127.0.0.1``);
in a container it must be ``0.0.0.0`` so Prometheus can reach it
(deploy/docker-compose.yml sets it).
"""

from __future__ import annotations

import os

from prometheus_client import REGISTRY, CollectorRegistry, start_http_server

# Read here rather than from Settings so one variable covers every service entry point.
METRICS_HOST_ENV = "AIKG_METRICS_HOST"
DEFAULT_METRICS_HOST = "127.0.0.1"


def metrics_host() -> str:
    """The address ``/metrics`` binds: ``$AIKG_METRICS_HOST``, else ``127.0.0.1``."""
    return os.environ.get(METRICS_HOST_ENV, "").strip() or DEFAULT_METRICS_HOST


def start_metrics_server(port: int, host: str | None = None,
                         registry: CollectorRegistry = REGISTRY) -> int | None:
    """Serve ``/metrics`` of ``registry`` (the default one) in a background thread.

    Args:
        port: TCP port; 0 picks a free one; -1 serves nothing.
        host: address to bind; None reads ``AIKG_METRICS_HOST`` (default loopback;
            ``0.0.0.0`` in a container).
        registry: the metrics served (``aikg up`` serves only its own).

    Returns:
        The port served, or None when disabled.

    Raises:
        OSError: the address cannot be bound (port in use, unknown host).
    """
    if port < 0:
        return None
    host = host or metrics_host()
    # Port 0 is bound by the server itself (no pick-then-bind race); it says which
    # port the OS gave it.
    server, _ = start_http_server(port, addr=host, registry=registry)
    return server.server_port
