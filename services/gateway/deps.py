"""What the gateway's ``/api/v1`` routes are given: the bus, the job store, the queue view
and the caller's tenant, as Litestar dependencies (``Provide``,
https://docs.litestar.dev/2/usage/dependency-injection.html).

A route names what it needs as a parameter (``bus: Bus``, ``store: CheckedJobStore``,
``queue: QueueView | None``) and :data:`DEPENDENCIES`, registered on the ``/api/v1``
router, builds it per request from the app's state; ``tenant: Tenant``
(:func:`provide_tenant`) is given to the submit route alone, since ``GET /api/v1/jobs``
has a ``tenant`` query parameter of its own. The bus is checked
here, once: while NATS is not connected (startup) or reconnecting the request is
answered 503 (:class:`~services.gateway.errors.NatsUnavailable`) before the route runs.
Litestar resolves dependencies before it validates query parameters and bodies, so
while NATS is down a malformed request is answered 503 too, not 400.
"""

from __future__ import annotations

from litestar import Request
from litestar.datastructures import State
from litestar.di import NamedDependency, Provide

from schemas import JobRecord, subjects
from services.common.bus import Bus, JobNotFound
from services.common.jobs import CheckedJobStore
from services.common.tenants import Tenant, TenantTable
from services.gateway.errors import NatsUnavailable, unknown_job
from services.gateway.queue import QueueView


def provide_bus(state: State) -> Bus:
    """The app's bus (``state.bus``).

    Raises:
        NatsUnavailable: not connected yet, or lost the connection and reconnecting
            (answered 503 now rather than after a request timeout).
    """
    bus: Bus | None = state.get("bus")
    if bus is None:
        raise NatsUnavailable("gateway is not connected to NATS yet; retry")
    if not bus.nc.is_connected:
        raise NatsUnavailable("gateway lost its NATS connection and is reconnecting; "
                              "retry shortly")
    return bus


def provide_store(bus: NamedDependency[Bus]) -> CheckedJobStore:
    """The ``jobs`` bucket as a store whose reads raise ``JobRecordCorrupt`` for records
    that do not decode (answered 500 naming the job, services/gateway/errors.py)."""
    return CheckedJobStore(bus.jobs)


def provide_queue(state: State) -> QueueView | None:
    """The app's queue view (queue positions and start estimates), None before startup."""
    return state.get("queue")


def provide_tenant(request: Request, state: State) -> Tenant:
    """The tenant the auth guard found for this request (``default`` without auth)."""
    table: TenantTable = state.get("tenants")
    return table.get(_caller(request))


def provide_viewer(request: Request) -> str | None:
    """Whose jobs the caller may see: None for the operator (the ``default`` tenant:
    ``AIKG_API_TOKEN``, or no auth at all), which sees every job; else the caller's
    own tenant name. A tenant's token reads, follows, cancels and exports only its
    own tenant's jobs; another tenant's job is answered as if it did not exist."""
    name = _caller(request)
    return None if name == subjects.DEFAULT_TENANT else name


def _caller(request: Request) -> str:
    """The tenant name the auth guard recorded (``default`` without auth)."""
    return request.scope.get("aikg_tenant") or subjects.DEFAULT_TENANT  # type: ignore[typeddict-item]


async def load_record(store: CheckedJobStore, job_id: str,
                      viewer: str | None = None) -> JobRecord:
    """The job's record, when ``viewer`` may see it (:func:`provide_viewer`).

    Raises:
        NotFoundException: no record, an id no job can have (not one NATS subject
            token), or another tenant's job for a tenant ``viewer``; answered 404.
        JobRecordCorrupt: the record does not decode; answered 500 naming the job and
            the fault.
    """
    if not subjects.is_token(job_id):
        raise unknown_job(job_id)
    try:
        record, _ = await store.get(job_id)
    except JobNotFound as exc:
        raise unknown_job(job_id) from exc
    if viewer is not None and record.tenant != viewer:
        raise unknown_job(job_id)
    return record


DEPENDENCIES = {
    "bus": Provide(provide_bus, sync_to_thread=False),
    "store": Provide(provide_store, sync_to_thread=False),
    "queue": Provide(provide_queue, sync_to_thread=False),
    "viewer": Provide(provide_viewer, sync_to_thread=False),
}
