"""Binding the durable pull consumers shared by the generators and the workers.

What happens to a bound consumer's messages (in-progress beats, nak, dead-letters) is
:mod:`services.common.pull_loop`'s; the consumers' configuration is
:func:`services.common.provision.consumer_for`'s (built by
:func:`services.common.provision.lane_config`).
"""

from __future__ import annotations

import asyncio

import structlog
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig

from services.common.provision import ProvisionError, ensure_consumer, lane_config

log = structlog.get_logger("aikg.consumer")

# How long durable_pull keeps asking for a missing consumer, seconds.
PROVISION_WAIT_S = 30.0


async def ensure_durable(js: JetStreamContext, stream: str, subject: str,
                         config: ConsumerConfig, *, wait_s: float = PROVISION_WAIT_S) -> str:
    """Have the durable consumer ``config.durable_name`` of lane ``subject`` exist: a
    missing one is asked of the admin-side provisioner
    (:func:`services.common.provision.ensure_consumer`), whose configuration wins over
    ``config`` (which serves a server without permissions, where this process creates
    the consumer itself).

    Returns:
        The consumer's name.

    Raises:
        services.common.provision.ProvisionError: the consumer still could not be had
            after ``wait_s`` seconds of asking (once a second: the provisioner may be
            starting alongside).
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    while True:
        try:
            return await ensure_consumer(js, js._nc, stream, subject, config)
        except ProvisionError as exc:
            if loop.time() >= deadline:
                raise
            log.warning("consumer_unavailable", consumer=config.durable_name, error=str(exc))
            await asyncio.sleep(1.0)


async def durable_pull(js: JetStreamContext, *, stream: str, subject: str, durable: str,
                       ack_wait_s: float, max_deliver: int,
                       max_ack_pending: int = 1000,
                       wait_s: float = PROVISION_WAIT_S) -> JetStreamContext.PullSubscription:
    """Bind to a durable pull consumer shared by every instance, made first when
    missing (:func:`ensure_durable`, with :func:`~services.common.provision.lane_config`
    of these arguments).

    All processes that bind the same ``durable`` share its messages: each message
    goes to one of them (JetStream's queue semantics for pull consumers).

    Raises:
        services.common.provision.ProvisionError: see :func:`ensure_durable`.
    """
    config = lane_config(subject, durable, ack_wait_s=ack_wait_s, max_deliver=max_deliver,
                         max_ack_pending=max_ack_pending)
    await ensure_durable(js, stream, subject, config, wait_s=wait_s)
    return await js.pull_subscribe_bind(durable=durable, stream=stream)
