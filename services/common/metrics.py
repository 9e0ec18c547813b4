"""Prometheus metrics endpoint of a worker or generator process.

Metric names follow Prometheus conventions: ``aikg_`` prefix, base units (seconds,
bytes), ``_total`` counters, histograms for latencies, and never an id as a label.
The gateway serves ``/metrics`` on its HTTP port instead.
"""

from __future__ import annotations

import socket

from prometheus_client import start_http_server


def start_metrics_server(port: int, host: str = "127.0.0.1") -> int | None:
    """Serve ``/metrics`` of the default registry in a background thread.

    Args:
        port: TCP port; 0 picks a free one; -1 serves nothing.
        host: address to bind (loopback by default; ``0.0.0.0`` in a container).

    Returns:
        The port served, or None when disabled.
    """
    if port < 0:
        return None
    if port == 0:
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
    start_http_server(port, addr=host)
    return port
