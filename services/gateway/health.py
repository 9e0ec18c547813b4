"""Probes and metrics, outside ``/api/v1``: ``/healthz``, ``/readyz``, ``/metrics``.

They take no bearer token even when the API wants one (``PUBLIC_PATHS`` in
services/gateway/app.py: probes carry no credentials), and read the bus from the app's
state themselves rather than through the ``bus`` dependency, since a missing or
reconnecting bus is what ``/readyz`` reports, not an error.
"""

from __future__ import annotations

import asyncio

import msgspec
from litestar import MediaType, Response, get
from litestar.datastructures import State
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from schemas import subjects
from services.common.bus import Bus

# Seconds /readyz waits for each stream's info, so that a probe is answered in bounded
# time also while a stream has no leader.
STREAM_CHECK_S = 2.0


class Health(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Probe answer; ``reason`` says why the gateway is not ready."""

    status: str
    reason: str = ""


@get("/healthz", summary="Liveness", include_in_schema=True)
async def healthz() -> Health:
    """Always 200 while the process serves HTTP."""
    return Health(status="ok")


@get("/readyz", summary="Readiness")
async def readyz(state: State) -> Response[Health]:
    """200 when NATS is connected and every stream exists; 503 with the reason otherwise."""
    bus: Bus | None = state.get("bus")
    reason = ""
    if bus is None:
        reason = "not connected to NATS yet"
    elif not bus.nc.is_connected:
        reason = f"NATS connection is {'closed' if bus.nc.is_closed else 'down (reconnecting)'}"
    else:
        for name in (subjects.STREAM_JOBS, subjects.STREAM_JOB_EVENTS, subjects.STREAM_VERIFY,
                     subjects.STREAM_RESULTS, subjects.STREAM_DLQ):
            try:
                await asyncio.wait_for(bus.js.stream_info(name), timeout=STREAM_CHECK_S)
            except Exception as exc:  # noqa: BLE001 - any failure means not ready
                reason = f"stream {name} unavailable: {exc.__class__.__name__} {exc}".strip()
                break
    if reason:
        return Response(Health(status="unavailable", reason=reason), status_code=503)
    return Response(Health(status="ok"), status_code=200)


@get("/metrics", summary="Prometheus metrics", media_type=MediaType.TEXT)
async def metrics() -> Response[bytes]:
    """The process's default Prometheus registry, text exposition format."""
    return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)


PROBE_HANDLERS = [healthz, readyz, metrics]
