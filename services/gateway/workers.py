"""``/api/v1/workers``: the live workers, with their load and the device leases they hold.

``GET /api/v1/workers/status`` keeps the name of the HTTP AIKG service the gateway
replaces (docs/compatibility.md); ``GET /api/v1/workers`` is the same listing. The rows
come from the ``workers`` and ``leases`` buckets (services/gateway/views.py).
"""

from __future__ import annotations

from litestar import Router, get
from litestar.di import NamedDependency

from services.common.bus import Bus
from services.gateway.views import WorkerList, list_workers


@get(["/status", "/"], summary="Live workers")
async def workers_status(bus: NamedDependency[Bus],
                         viewer: NamedDependency[str | None]) -> WorkerList:
    """Workers whose heartbeat is live: backend, arch, devices, capacity, in-flight,
    load (in_flight / capacity) and the device leases each holds; a tenant's token
    sees only the leases of its own jobs, the operator's every lease."""
    return await list_workers(bus, viewer)


# Workers: ``/api/v1/workers`` (the ``/api/v1`` router adds the prefix).
workers_router = Router(path="/workers", route_handlers=[workers_status])
