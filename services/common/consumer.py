"""Pull-consumer helpers shared by the generator and the workers.

Facts that shape this module (docs/architecture.md, "NATS behaviour the code relies
on"): ``fetch()`` on an empty consumer may
raise ``nats.errors.TimeoutError``, a bare ``asyncio.TimeoutError``, or return ``[]``;
messages that hit max_deliver stay in a work-queue stream, so dead-lettering is the
consumer's job.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

import nats.errors
import nats.js.errors
import structlog
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from schemas import subjects
from services.common.provision import ProvisionError, ensure_consumer
from services.common.runtime import cancel_and_wait, retry_async

log = structlog.get_logger("aikg.consumer")

# How long durable_pull keeps asking for a missing consumer, seconds.
PROVISION_WAIT_S = 30.0


async def fetch_some(psub: JetStreamContext.PullSubscription, batch: int,
                     timeout: float) -> list[Msg]:
    """Up to ``batch`` messages, or ``[]`` after ``timeout`` seconds with none."""
    try:
        return await psub.fetch(batch=batch, timeout=timeout)
    except (TimeoutError, nats.errors.TimeoutError):
        return []
    except (nats.js.errors.ServiceUnavailableError, nats.errors.NoRespondersError) as exc:
        # A cluster node died and the consumer has no leader until the election ends
        # (a few seconds): the pull is answered 503. Wait a little and pull again.
        log.warning("fetch_unavailable", error=type(exc).__name__)
        await asyncio.sleep(min(timeout, 1.0))
        return []


async def durable_pull(js: JetStreamContext, *, stream: str, subject: str, durable: str,
                       ack_wait_s: float, max_deliver: int,
                       max_ack_pending: int = 1000,
                       wait_s: float = PROVISION_WAIT_S) -> JetStreamContext.PullSubscription:
    """Bind to a durable pull consumer shared by every instance; a missing one is asked
    of the admin-side provisioner (:func:`services.common.provision.ensure_consumer`),
    whose configuration wins over the arguments here (they serve a server without
    permissions, where this process creates the consumer itself).

    All processes that bind the same ``durable`` share its messages: each message
    goes to one of them (JetStream's queue semantics for pull consumers).

    Raises:
        services.common.provision.ProvisionError: the consumer still could not be had
            after ``wait_s`` seconds of asking (once a second: the provisioner may be
            starting alongside).
    """
    config = ConsumerConfig(
        durable_name=durable,
        filter_subject=subject,
        ack_policy=AckPolicy.EXPLICIT,
        deliver_policy=DeliverPolicy.ALL,
        ack_wait=ack_wait_s,
        max_deliver=max_deliver,
        max_ack_pending=max_ack_pending,
    )
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    while True:
        try:
            await ensure_consumer(js, js._nc, stream, subject, config)
            break
        except ProvisionError as exc:
            if loop.time() >= deadline:
                raise
            log.warning("consumer_unavailable", consumer=durable, error=str(exc))
            await asyncio.sleep(1.0)
    return await js.pull_subscribe_bind(durable=durable, stream=stream)


def deliveries(msg: Msg) -> int:
    """How many times JetStream has delivered ``msg`` (1 on the first delivery)."""
    try:
        return int(msg.metadata.num_delivered)
    except Exception:  # noqa: BLE001 - a core NATS message has no metadata
        return 1


async def dead_letter(js: JetStreamContext, msg: Msg, reason: str, *, attempts: int = 3) -> bool:
    """Copy ``msg`` to ``dlq.<subject>`` with the reason in headers, then ack the original.

    Headers: ``Aikg-Dlq-Reason``, ``Aikg-Original-Subject``, ``Aikg-Deliveries``. The
    publish is retried ``attempts`` times (a cluster leader change takes a moment);
    if it still fails the original is left unacked, so it is redelivered rather than
    lost.

    Returns:
        True when the copy is in the DLQ and the original acked.
    """
    headers = {
        "Aikg-Dlq-Reason": reason[:1000].replace("\r", " ").replace("\n", " "),
        "Aikg-Original-Subject": msg.subject,
        "Aikg-Deliveries": str(deliveries(msg)),
    }
    with contextlib.suppress(Exception):  # a message without JetStream metadata: no id
        meta = msg.metadata
        # A retry after a lost publish acknowledgement is dropped by the DLQ stream's
        # duplicate window instead of storing the copy twice.
        headers["Nats-Msg-Id"] = f"dlq-{meta.stream}-{meta.sequence.stream}"
    try:
        await retry_async(lambda: js.publish(subjects.dlq(msg.subject), msg.data or b"",
                                             headers=headers),
                          attempts=attempts, first_wait_s=0.5, logger=log,
                          event="dead_letter_publish_retry", subject=msg.subject)
    except Exception as exc:  # noqa: BLE001 - left unacked: redelivered, not lost
        log.error("dead_letter_publish_failed", subject=msg.subject,
                  error=f"{type(exc).__name__}: {exc}")
        return False
    with contextlib.suppress(Exception):
        await msg.ack()
    return True


async def keep_in_progress(msg: Msg, every_s: float) -> None:
    """Tell JetStream every ``every_s`` seconds that ``msg`` is still being worked on,
    so a long run is not redelivered to another consumer. Cancel the task to stop."""
    while True:
        await asyncio.sleep(every_s)
        with contextlib.suppress(Exception):
            await msg.in_progress()


async def run_with_progress(msg: Msg, every_s: float, work: Callable[[], Awaitable[None]]) -> None:
    """Run ``work()`` while :func:`keep_in_progress` heartbeats ``msg``."""
    beat = asyncio.create_task(keep_in_progress(msg, every_s))
    try:
        await work()
    finally:
        await cancel_and_wait(beat)

