"""A worker's control endpoints: a ``nats micro`` service (``nats micro ls`` lists it)
with ``status`` and ``drain`` on ``aikg.worker.<worker_id>.{status,drain}``.

``status`` answers the worker's :class:`~schemas.WorkerInfo` plus the leases it holds;
``drain`` stops it taking new requests, lets the in-flight ones finish, then stops it.
A message the server relayed there (:func:`relayed_by_server`) is ignored, unanswered
(an answer to a pulled message's ack subject would ack it), logged and counted.
"""

from __future__ import annotations

import contextlib
from typing import Any, Protocol

import msgspec
from nats import micro
from nats.aio.client import Client
from nats.js import JetStreamContext
from prometheus_client import Counter

import services
from schemas import WorkerInfo, encode, subjects
from services.common.bus import bucket_entries

RELAYED_CONTROL = Counter(
    "aikg_worker_relayed_control_requests_total",
    "Messages on this worker's control endpoints ignored because the server relayed them "
    "(a JetStream delivery: its reply subject a $JS. ack subject, or relay headers), by "
    "endpoint: a pull or direct get whose asker named the endpoint as its reply subject.",
    ["endpoint"],
)


class Controlled(Protocol):
    """What the control endpoints read and set of a worker
    (:class:`services.worker.service.Worker`)."""

    worker_id: str
    backend: str
    arch: str
    draining: bool

    @property
    def in_flight(self) -> int: ...

    def info(self) -> WorkerInfo: ...


def relayed_by_server(reply: str | None, headers: dict[str, str] | None) -> bool:
    """Whether a message arrived as the server's relay of a stream message rather than as
    a client's request: its reply subject is a JetStream subject (``$JS.ACK...`` of a
    pulled message) or its headers carry a direct get's ``Nats-Stream``/``Nats-Subject``.
    nats-server delivers those to any reply subject a puller names, unchecked."""
    return (reply or "").startswith("$JS.") or \
        any(h in (headers or {}) for h in ("Nats-Stream", "Nats-Subject"))


def _semver(version: str) -> str:
    """``nats micro`` wants semantic versions; ``0.1.0.dev1`` -> ``0.1.0``."""
    parts = (version.split(".") + ["0", "0"])[:3]
    return ".".join(p if p.isdigit() else "0" for p in parts)


async def leases_held(js: JetStreamContext, worker_id: str) -> list[dict[str, Any]]:
    """Worker ``worker_id``'s entries of the ``leases`` bucket (none when it cannot be
    read)."""
    out = []
    with contextlib.suppress(Exception):
        entries = await bucket_entries(js, subjects.BUCKET_LEASES)
        for key, entry in sorted(entries.items()):
            if key.startswith(f"{worker_id}."):
                with contextlib.suppress(Exception):
                    out.append(msgspec.json.decode(entry.value or b""))
    return out


async def control_service(nc: Client, js: JetStreamContext, worker: Controlled,
                          logger: Any) -> micro.Service:
    """Add ``worker``'s control service (see the module doc) on ``nc``; ``logger``
    (structlog, the worker's ids bound) records the drains and the relayed messages.

    Raises:
        nats.errors.Error: the service could not be added.
    """
    service = await micro.add_service(
        nc, name="aikg-worker", version=_semver(services.__version__),
        description=f"AIKG worker {worker.backend}/{worker.arch}",
        metadata={"worker_id": worker.worker_id, "backend": worker.backend,
                  "arch": worker.arch},
    )
    prefix = subjects.worker_service(worker.worker_id)

    def relayed(req: micro.Request, endpoint: str) -> bool:
        reply = req._msg.reply
        if not relayed_by_server(reply, req.headers):
            return False
        RELAYED_CONTROL.labels(endpoint=endpoint).inc()
        logger.warning("relayed_control_request_ignored", endpoint=endpoint,
                       reply=reply[:80], headers=sorted(req.headers or {}))
        return True

    async def status(req: micro.Request) -> None:
        if relayed(req, "status"):
            return
        body = msgspec.structs.asdict(worker.info())
        body["leases"] = await leases_held(js, worker.worker_id)
        await req.respond(encode(body))

    async def drain(req: micro.Request) -> None:
        if relayed(req, "drain"):
            return
        worker.draining = True
        logger.info("worker_draining", in_flight=worker.in_flight)
        await req.respond(encode({"worker_id": worker.worker_id, "status": "draining",
                                  "in_flight": worker.in_flight}))

    await service.add_endpoint(name="status", subject=f"{prefix}.status", handler=status)
    await service.add_endpoint(name="drain", subject=f"{prefix}.drain", handler=drain)
    return service
