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
from services.common.runtime import cancel_and_wait, retry_async

log = structlog.get_logger("aikg.consumer")


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
                       max_ack_pending: int = 1000) -> JetStreamContext.PullSubscription:
    """Bind to (creating if missing) a durable pull consumer shared by every instance.

    All processes that bind the same ``durable`` share its messages: each message
    goes to one of them (JetStream's queue semantics for pull consumers).
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
    return await js.pull_subscribe(subject, durable=durable, stream=stream, config=config)


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


async def shorten_ack_wait(js: JetStreamContext, stream: str, durable: str,
                           ack_wait_s: float) -> float | None:
    """Set an existing durable consumer's ack wait to ``ack_wait_s`` seconds when its
    own is longer (created under an older, longer default).

    Binding a durable keeps its configuration, so a consumer made with a 60 s ack
    wait would hold a dead worker's request that long. A consumer with a shorter or
    equal ack wait is left alone. Where this user may not update consumers (they are
    provisioned by an admin), the consumer keeps its value and a warning says so.

    Returns:
        The consumer's ack wait afterwards, seconds; None when it cannot be read.
        Never raises.
    """
    try:
        config = (await js.consumer_info(stream, durable)).config
    except Exception as exc:  # noqa: BLE001 - the caller keeps what it has
        log.warning("consumer_info_failed", stream=stream, consumer=durable, error=str(exc))
        return None
    old = config.ack_wait
    if not old or old <= ack_wait_s + 1e-3:
        return old
    config.ack_wait = ack_wait_s
    try:
        await js.add_consumer(stream, config)
    except Exception as exc:  # noqa: BLE001 - the old ack wait still works, only slower
        log.warning("consumer_ack_wait_update_failed", stream=stream, consumer=durable,
                    ack_wait_s=old, wanted_s=ack_wait_s, error=str(exc),
                    hint="whoever provisions the consumers must set the shorter ack wait")
        return old
    log.info("consumer_ack_wait_shortened", stream=stream, consumer=durable,
             from_s=old, to_s=ack_wait_s)
    return ack_wait_s
