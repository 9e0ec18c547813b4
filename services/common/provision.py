"""Durable consumers of JOBS and VERIFY, created with the admin's rights only.

The generators share the durable pull consumers of the JOBS lanes (``generator``,
``generator-<tenant>-<priority>``), the workers of one backend/arch those of its
VERIFY lanes (``verify-<backend>-<arch>``, ``verify-<backend>-<arch>-<priority>-<tenant>``;
:mod:`services.common.lanes`). The services' NATS users may look these consumers up
and pull from them, but not create, update or delete them
(services/common/nats_auth.py): nats-server answers a create of an existing consumer
with another configuration by updating it (the ``action`` of the request body, which
no subject permission can see: ``$JS.API.CONSUMER.CREATE.<stream>.<consumer>[.<filter>]``
and ``$JS.API.CONSUMER.DURABLE.CREATE.<stream>.<consumer>`` both create *or update*,
nats-server ``server/jetstream_api.go``, ``jsConsumerCreateRequest``), so a right to
create a shared durable is a right to rewrite it (``max_deliver: 1``, a tiny ack wait).

So one admin-side provisioner creates them:

- ``aikg nats-setup`` (an operator, once): creates or brings up to date the streams,
  buckets and the default lanes' consumers (:func:`setup`); with ``--serve`` it stays
  and answers :data:`schemas.subjects.PROVISION_CONSUMER` requests (:class:`Provisioner`)
  for lanes that appear later (a new tenant, a new backend/arch). ``aikg up`` runs it
  as one of its services, with the per-run admin user.
- A service that finds a lane's consumer missing asks the provisioner
  (:func:`ensure_consumer`). The request names only the stream and the lane's subject;
  the provisioner derives the consumer's name and its whole configuration from its own
  settings, so a service can have a consumer made but never choose how it behaves. A
  consumer that exists is left as it is; a non-default lane gets one only while it
  holds messages (so a service cannot fill the server with idle consumers of made-up
  tenants).

Without an answering provisioner, a service on a server that requires no
authentication (a development server, every client its own admin) creates the
consumer itself; on a server that requires authentication it tries no create (its
user may create no consumer: services/common/nats_auth.py) and says to run ``aikg
nats-setup --serve``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

import nats.errors
import nats.js.errors
import structlog
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from schemas import subjects
from services.common.settings import Settings

log = structlog.get_logger("aikg.provision")

# JOBS consumers: a job is redelivered if its generator stops heartbeating for this
# long (so a crashed generator's job resumes elsewhere after ~10 s); the generator
# sends in_progress() every fifth of it (services/common/pull_loop.py). Deliveries
# before the generator dead-letters.
JOB_ACK_WAIT_S = 10.0
JOB_MAX_DELIVER = 5
# How long one provisioning request waits for the provisioner's answer, seconds.
REQUEST_TIMEOUT_S = 5.0
# How long a service's own create (no provisioner answered, a server without
# authentication) waits, seconds.
SELF_CREATE_TIMEOUT_S = 2.0
# The streams whose consumers are provisioned here.
CONSUMER_STREAMS = (subjects.STREAM_JOBS, subjects.STREAM_VERIFY)

HINT = ("no consumer provisioner answered and this NATS user may not create consumers: "
        "run `aikg nats-setup --serve` with the admin's credentials (`aikg up` runs it)")


class ProvisionError(RuntimeError):
    """The consumer could not be had: the request was refused or nobody could create it."""


def lane_config(subject: str, durable: str, *, ack_wait_s: float, max_deliver: int,
                max_ack_pending: int = 1000) -> ConsumerConfig:
    """The configuration of a lane's durable pull consumer (explicit acks, every
    message from the start, ``ack_wait_s`` seconds, ``max_deliver`` deliveries)."""
    return ConsumerConfig(durable_name=durable, filter_subject=subject,
                          ack_policy=AckPolicy.EXPLICIT, deliver_policy=DeliverPolicy.ALL,
                          ack_wait=ack_wait_s, max_deliver=max_deliver,
                          max_ack_pending=max_ack_pending)


def consumer_for(stream: str, subject: str, settings: Settings) -> ConsumerConfig:
    """The durable consumer of one lane: its name from the lane's subject, its
    configuration from ``settings`` (VERIFY: ``verify_ack_wait_s``, one delivery beyond
    ``verify_max_deliver`` so the last one dead-letters; JOBS: :data:`JOB_ACK_WAIT_S`,
    :data:`JOB_MAX_DELIVER` + 1).

    Raises:
        ValueError: ``stream`` is not JOBS or VERIFY, or ``subject`` is no lane of it.
    """
    if stream == subjects.STREAM_JOBS:
        lane = subjects.parse_lane(subjects.JOBS_SUBMIT, subject)
        if lane is None:
            raise ValueError(f"{subject!r} is no JOBS lane (jobs.submit[.<tenant>.<priority>])")
        return lane_config(subject, subjects.generator_consumer(*lane),
                           ack_wait_s=JOB_ACK_WAIT_S, max_deliver=JOB_MAX_DELIVER + 1)
    if stream == subjects.STREAM_VERIFY:
        parts = subject.split(".")
        if len(parts) not in (3, 5) or parts[0] != subjects.VERIFY_PREFIX:
            raise ValueError(f"{subject!r} is no VERIFY lane "
                             "(verify.<backend>.<arch>[.<tenant>.<priority>])")
        base = subjects.verify(parts[1], parts[2])
        lane = subjects.parse_lane(base, subject)
        if lane is None:
            raise ValueError(f"{subject!r} is no VERIFY lane (bad tenant or priority)")
        return lane_config(subject, subjects.verify_lane_consumer(parts[1], parts[2], *lane),
                           ack_wait_s=settings.verify_ack_wait_s,
                           max_deliver=settings.verify_max_deliver + 1)
    raise ValueError(f"stream {stream!r}: consumers are provisioned on JOBS and VERIFY only")


def _is_default_lane(stream: str, subject: str) -> bool:
    return subject == subjects.JOBS_SUBMIT if stream == subjects.STREAM_JOBS \
        else subject.count(".") == 2


async def _exists(js: JetStreamContext, stream: str, name: str) -> bool:
    try:
        await js.consumer_info(stream, name)
    except nats.js.errors.NotFoundError:
        return False
    return True


async def create_consumer(js: JetStreamContext, stream: str, subject: str, settings: Settings,
                          *, update: bool = False) -> str:
    """Create the lane's consumer (as the admin) unless it exists; with ``update`` an
    existing one is brought to the configuration of :func:`consumer_for`.

    Returns:
        The consumer's name.

    Raises:
        ValueError: not a lane (:func:`consumer_for`), or a non-default lane that holds
            no messages.
        nats.errors.Error: NATS refused (e.g. a change nats-server does not allow).
    """
    config = consumer_for(stream, subject, settings)
    name = config.durable_name
    assert name is not None
    if not update and await _exists(js, stream, name):
        return name
    if not update and not _is_default_lane(stream, subject):
        info = await js.stream_info(stream, subjects_filter=subject)
        if not (info.state.subjects or {}).get(subject):
            raise ValueError(f"lane {subject!r} holds no messages: its consumer is made when "
                             "it has some")
    await js.add_consumer(stream, config)
    log.info("consumer_provisioned", stream=stream, consumer=name, subject=subject,
             ack_wait_s=config.ack_wait, max_deliver=config.max_deliver)
    return name


class Provisioner:
    """Answer :data:`~schemas.subjects.PROVISION_CONSUMER` requests on an admin
    connection: ``{"stream": "VERIFY", "subject": "verify.cpu.x86_64.acme.high"}`` ->
    ``{"consumer": "verify-cpu-x86_64-high-acme"}`` or ``{"error": "..."}``.

    Args:
        nc / js: a connection with the admin's rights and its JetStream context.
        settings: the consumers' configuration (:func:`consumer_for`).
    """

    def __init__(self, nc: Any, js: JetStreamContext, settings: Settings) -> None:
        self.nc = nc
        self.js = js
        self.settings = settings
        self.sub: Any = None
        # One lane's create at a time: two asks for a new lane create it once.
        self.lock = asyncio.Lock()

    async def start(self) -> None:
        self.sub = await self.nc.subscribe(subjects.PROVISION_CONSUMER, cb=self._answer)

    async def stop(self) -> None:
        if self.sub is not None:
            with contextlib.suppress(Exception):
                await self.sub.unsubscribe()
            self.sub = None

    async def _answer(self, msg: Any) -> None:
        try:
            ask = json.loads(msg.data)
            stream, subject = ask["stream"], ask["subject"]
            if not isinstance(stream, str) or not isinstance(subject, str):
                raise ValueError("stream and subject must be strings")
            async with self.lock:
                answer = {"consumer": await create_consumer(self.js, stream, subject,
                                                            self.settings)}
        except (ValueError, KeyError, TypeError) as exc:
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        except Exception as exc:  # noqa: BLE001 - answer the asker, keep serving
            log.warning("provision_failed", error=f"{type(exc).__name__}: {exc}")
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        if msg.reply:
            with contextlib.suppress(Exception):
                await msg.respond(json.dumps(answer).encode())


async def ensure_consumer(js: JetStreamContext, nc: Any, stream: str, subject: str,
                          config: ConsumerConfig) -> str:
    """Make sure the durable consumer ``config.durable_name`` of lane ``subject`` exists:
    look it up, else ask the provisioner, else (nobody answers) create it with
    ``config`` when the server requires no authentication (its ``INFO`` has no
    ``auth_required``); a server that requires it gets no create from a service.

    Returns:
        The consumer's name.

    Raises:
        ProvisionError: the provisioner refused (its message says why), or nobody
            answered and this user may not create it (:data:`HINT`).
    """
    name = config.durable_name
    assert name is not None
    if await _exists(js, stream, name):
        return name
    ask = json.dumps({"stream": stream, "subject": subject}).encode()
    try:
        reply = await nc.request(subjects.PROVISION_CONSUMER, ask, timeout=REQUEST_TIMEOUT_S)
    except (nats.errors.NoRespondersError, nats.errors.TimeoutError, TimeoutError) as exc:
        if (getattr(nc, "_server_info", None) or {}).get("auth_required"):
            raise ProvisionError(f"consumer {name} on {stream}: {HINT}") from exc
        try:
            await js.add_consumer(stream, config, timeout=SELF_CREATE_TIMEOUT_S)
        except nats.js.errors.BadRequestError:
            # Created meanwhile (by another instance) with another configuration.
            if await _exists(js, stream, name):
                return name
            raise
        except (nats.errors.TimeoutError, TimeoutError) as exc:
            raise ProvisionError(f"consumer {name} on {stream}: {HINT}") from exc
        return name
    answer = json.loads(reply.data)
    if "error" in answer:
        raise ProvisionError(f"consumer {name} on {stream}: the provisioner refused: "
                             f"{answer['error']}")
    return str(answer["consumer"])


async def setup(js: JetStreamContext, settings: Settings,
                verify_lanes: list[tuple[str, str]]) -> list[str]:
    """What ``aikg nats-setup`` does once, as the admin: the streams and buckets (created,
    or updated to the settings), the ``generator`` consumer and the default consumer
    of each ``(backend, arch)`` of ``verify_lanes``, created or updated to
    :func:`consumer_for`'s configuration; existing lane consumers are updated too.

    Returns:
        The names of the consumers it made or updated.

    Raises:
        nats.errors.Error: NATS refused or did not answer.
    """
    from services.common.bus import ensure_buckets, ensure_streams

    await ensure_streams(js, settings)
    await ensure_buckets(js, settings)
    done = [await create_consumer(js, subjects.STREAM_JOBS, subjects.JOBS_SUBMIT, settings,
                                  update=True)]
    for backend, arch in verify_lanes:
        done.append(await create_consumer(js, subjects.STREAM_VERIFY,
                                          subjects.verify(backend, arch), settings, update=True))
    for stream in CONSUMER_STREAMS:
        for info in await js.consumers_info(stream):
            subject = info.config.filter_subject or ""
            if info.name in done or not info.config.durable_name:
                continue
            with contextlib.suppress(ValueError):
                if consumer_for(stream, subject, settings).durable_name == info.name:
                    done.append(await create_consumer(js, stream, subject, settings,
                                                      update=True))
    return done


def parse_verify_lanes(values: list[str]) -> list[tuple[str, str]]:
    """``["cpu/x86_64", "cuda/h200"]`` -> ``[("cpu", "x86_64"), ("cuda", "h200")]``.

    Raises:
        ValueError: an entry is not ``BACKEND/ARCH`` of two subject tokens.
    """
    out = []
    for value in values:
        backend, _, arch = value.partition("/")
        if not (subjects.is_token(backend) and subjects.is_token(arch)):
            raise ValueError(f"--verify {value!r}: expected BACKEND/ARCH, e.g. cpu/x86_64")
        out.append((backend, arch))
    return out


async def run_nats_setup(settings: Settings, verify_lanes: list[tuple[str, str]], *,
                         serve: bool, stop: asyncio.Event | None = None) -> list[str]:
    """``aikg nats-setup``: connect with the plain ``nats_user`` / ``nats_password`` (the
    admin's), run :func:`setup`, and with ``serve`` answer provisioning requests
    (:class:`Provisioner`) until ``stop`` is set (or SIGINT/SIGTERM).

    Returns:
        The consumers :func:`setup` made or updated.

    Raises:
        ConnectionError: NATS is unreachable or refused the credentials.
        PermissionError: the user may not do what setup does (not the admin); the
            message says which user to run it as.
    """
    from services.common.bus import connect_bus
    from services.common.runtime import install_signal_handlers

    bus = await connect_bus(settings, "aikg-nats-setup")
    try:
        try:
            done = await setup(bus.js, settings, verify_lanes)
        except (nats.errors.TimeoutError, TimeoutError, nats.js.errors.APIError) as exc:
            # A user without the admin's rights: the server drops its refused requests
            # (a permissions violation), so they time out.
            raise PermissionError(
                f"NATS user {settings.nats_user or '(none)'!r} could not set up the streams "
                f"and consumers ({type(exc).__name__}: {exc}): run aikg nats-setup as the "
                "admin user (AIKG_NATS_USER / AIKG_NATS_PASSWORD of the server's admin; "
                "aikg up writes them to nats-admin.env in its run directory)") from exc
        log.info("nats_setup_done", consumers=done)
        if serve:
            if stop is None:
                stop = asyncio.Event()
                install_signal_handlers(stop)
            provisioner = Provisioner(bus.nc, bus.js, settings)
            await provisioner.start()
            log.info("provisioner_serving", subject=subjects.PROVISION_CONSUMER)
            try:
                await stop.wait()
            finally:
                await provisioner.stop()
        return done
    finally:
        await bus.close()
