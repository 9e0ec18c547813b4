"""The one pull loop of the generator (jobs) and the worker (verify requests).

Both services take work the same way, and everything but what they do with a message
is here:

- **asks**: while there is free capacity (job slots, free devices), the tenant lanes
  are asked for at most that many messages, in fair order
  (:class:`~services.common.lanes.LanePull`: high priority first, tenants in turn,
  lanes of tenants at their share left out or served last); while there is none, the
  loop waits until a message's handling ends (or the service frees a slot), deaf to
  the lanes' publish wake-ups (:meth:`~services.common.lanes.LanePull.deafen`), which
  would otherwise reach every busy worker of a backend/arch on every request;
- **the consumer**: the default lane's durable consumer is bound with the one
  configuration policy (:func:`services.common.provision.consumer_for`, from the
  settings; the admin-side provisioner makes missing ones) and the ack wait and
  deliveries it really has are adopted (:func:`bind_default`); when it answers an
  error status (deleted, JetStream gone) it is bound again after a pause;
- **in progress**: while a message is handled, ``in_progress()`` is sent every
  :attr:`Delivery.progress_every_s` (a fifth of the consumer's ack wait), so JetStream
  does not hand a long run to another consumer;
- **nak**: a message whose handling is cancelled (the service stops, or gives up its
  in-flight work) is nak'ed, so another consumer takes it at once rather than after
  the ack wait; one whose handler raised is nak'ed with :data:`NAK_DELAY_S`;
- **dead letters**: a message that does not decode, or one delivered more than
  :attr:`Delivery.max_deliver` times (the consumer allows one more delivery, which
  only dead-letters), is copied to ``dlq.<subject>`` with the reason
  (:func:`dead_letter`) and acked, then the service is told (``dead_lettered``).

Nothing is queued in memory: a message is asked for only when there is capacity to
start it at once, so a service that dies holds no more than it was running, and
JetStream redelivers that after the ack wait.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import msgspec
import structlog
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from schemas import subjects
from services.common.consumer import ensure_durable
from services.common.lanes import LanePull
from services.common.provision import consumer_for
from services.common.runtime import cancel_and_wait, retry_async
from services.common.settings import Settings

log = structlog.get_logger("aikg.pull_loop")

T = TypeVar("T")

# Pause before binding the default lane's consumer again after it answered an error
# status, seconds: long enough not to spin on a JetStream that is restarting.
REBIND_PAUSE_S = 1.0
# In-progress beats per ack wait: four may be late or lost before JetStream hands the
# message to another consumer.
BEATS_PER_ACK_WAIT = 5
# The shortest period of in-progress beats, seconds (a consumer with a tiny ack wait).
MIN_BEAT_S = 0.1
# Redelivery delay of a message whose handler raised, seconds: soon, but not in a
# tight loop when the fault is the bus's.
NAK_DELAY_S = 1.0
# Attempts at a dead-letter copy's publish before the original is left unacked.
DEAD_LETTER_ATTEMPTS = 3


@dataclass(frozen=True)
class Delivery:
    """What a durable consumer enforces on its messages.

    Attributes:
        ack_wait_s: JetStream's ack wait, seconds: a message neither acked nor marked
            in progress for this long goes to another consumer.
        max_deliver: deliveries that are handled; the consumer allows one more, which
            only dead-letters (services/common/provision.py, ``consumer_for``).
    """

    ack_wait_s: float
    max_deliver: int

    @property
    def progress_every_s(self) -> float:
        """Period of ``in_progress()`` while a message is handled: the ack wait over
        :data:`BEATS_PER_ACK_WAIT`, at least :data:`MIN_BEAT_S`, seconds."""
        return max(MIN_BEAT_S, self.ack_wait_s / BEATS_PER_ACK_WAIT)


def lane_subject(base: str, tenant: str, priority: str) -> str:
    """The subject of ``tenant``'s lane at ``priority`` under ``base``."""
    return base if subjects.is_default_lane(tenant, priority) else f"{base}.{tenant}.{priority}"


async def bind_default(js: JetStreamContext, settings: Settings, *, stream: str,
                       base: str) -> Delivery:
    """Have the default lane's durable consumer of ``stream`` exist (made by the
    provisioner, or here without one, with :func:`~services.common.provision.consumer_for`
    of ``settings``) and return what it enforces.

    A durable consumer keeps the configuration it was created with: when it differs
    from the settings, a warning is logged and the consumer's values are used (a beat
    by a longer ack wait than the consumer's would see runs redelivered).

    Raises:
        services.common.provision.ProvisionError: the consumer could not be had.
        ValueError: ``base`` is no default lane of ``stream``.
    """
    wanted = consumer_for(stream, base, settings)
    name = await ensure_durable(js, stream, base, wanted)
    want = Delivery(float(wanted.ack_wait or 0), int(wanted.max_deliver or 1) - 1)
    try:
        config = (await js.consumer_info(stream, name)).config
    except Exception as exc:  # noqa: BLE001 - keep the settings' values
        log.warning("consumer_info_failed", consumer=name, error=f"{type(exc).__name__}: {exc}")
        return want
    have = Delivery(float(config.ack_wait or want.ack_wait_s),
                    int(config.max_deliver) - 1 if config.max_deliver and config.max_deliver > 1
                    else want.max_deliver)
    if have != want:
        log.warning("consumer_config_differs", consumer=name,
                    consumer_ack_wait_s=have.ack_wait_s, setting_ack_wait_s=want.ack_wait_s,
                    consumer_max_deliver=have.max_deliver + 1,
                    setting_max_deliver=want.max_deliver + 1,
                    hint="the consumer's values apply; `aikg nats-setup` brings it to the "
                         "settings")
    return have


def lane_pull(js: JetStreamContext, nc: Any, settings: Settings, *, stream: str, base: str,
              idle_poll_s: float = 1.0, sweep_strays: bool = False) -> LanePull:
    """A :class:`~services.common.lanes.LanePull` of ``stream``'s lanes under ``base``
    whose consumers' names and configuration are
    :func:`~services.common.provision.consumer_for`'s (not started)."""
    def config_of(subject: str, _durable: str):
        return consumer_for(stream, subject, settings)

    def consumer_of(tenant: str, priority: str) -> str:
        name = config_of(lane_subject(base, tenant, priority), "").durable_name
        assert name is not None
        return name

    return LanePull(js, nc, stream=stream, base=base, consumer_of=consumer_of,
                    config_of=config_of, idle_poll_s=idle_poll_s, sweep_strays=sweep_strays)


def deliveries(msg: Msg) -> int:
    """How many times JetStream has delivered ``msg`` (1 on the first delivery)."""
    try:
        return int(msg.metadata.num_delivered)
    except Exception:  # noqa: BLE001 - a core NATS message has no metadata
        return 1


async def dead_letter(js: JetStreamContext, msg: Msg, reason: str, *,
                      attempts: int = DEAD_LETTER_ATTEMPTS) -> bool:
    """Copy ``msg`` to ``dlq.<subject>`` (the DLQ stream) with the reason in headers,
    then ack the original.

    Headers: ``Aikg-Dlq-Reason`` (at most 1000 characters, one line),
    ``Aikg-Original-Subject``, ``Aikg-Deliveries``, and ``Nats-Msg-Id``
    ``dlq-<stream>-<sequence>`` (a retry after a lost publish acknowledgement is dropped
    by the DLQ stream's duplicate window). The publish is tried ``attempts`` times (a
    cluster leader change takes a moment); if it still fails the original is left
    unacked, so it is not lost.

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
        headers["Nats-Msg-Id"] = f"dlq-{meta.stream}-{meta.sequence.stream}"
    try:
        await retry_async(lambda: js.publish(subjects.dlq(msg.subject), msg.data or b"",
                                             headers=headers),
                          attempts=attempts, first_wait_s=0.5, logger=log,
                          event="dead_letter_publish_retry", subject=msg.subject)
    except Exception as exc:  # noqa: BLE001 - left unacked: not lost
        log.error("dead_letter_publish_failed", subject=msg.subject,
                  error=f"{type(exc).__name__}: {exc}")
        return False
    with contextlib.suppress(Exception):
        await msg.ack()
    log.warning("message_dead_lettered", subject=msg.subject, reason=headers["Aikg-Dlq-Reason"],
                deliveries=headers["Aikg-Deliveries"])
    return True


class PullLoop(Generic[T]):
    """Take messages from ``lanes`` whenever there is capacity and handle each in a task
    of its own, until stopped.

    Args:
        lanes: the started lane pull of the service's stream.
        delivery: what the stream's consumers enforce (:func:`bind_default`).
        kind: what a message is, for reasons (``job submission``, ``verify request``).
        decode: ``bytes -> T``; a :class:`msgspec.ValidationError` or
            :class:`msgspec.DecodeError` dead-letters the message as malformed.
        handle: ``(msg, value, slot)``: does the service's work and acks ``msg``
            when done. ``slot`` is what ``claim`` returned. An exception naks the
            message (:data:`NAK_DELAY_S`); cancellation naks it at once.
        capacity: how many more messages could start now (free slots or devices);
            :attr:`in_hand` counts those being handled.
        rebind: binds the default lane's durable consumer again and returns what it
            enforces (:func:`bind_default`).
        claim: called when a message is taken, before the next ``capacity()``, to take
            the service's slot for it (a device); its value is passed to ``handle``.
        dead_lettered: ``(msg, value or None, reason, why)`` after a message was moved
            to the DLQ; ``why`` is ``"malformed"`` (``value`` None) or
            ``"max_deliver"``. For telling the job.
        freed: set whenever capacity may have come back (the loop sets it when a
            handling ends; a service may set it sooner).
        exclude: ``tenant -> bool``: lanes of such tenants are not asked now.
        defer: ``tenant -> bool``: lanes of such tenants are asked only after every
            other lane came up empty.
        stopping: ``() -> bool``: stop asking (a drain), besides the ``stop`` event.
        idle_s: longest wait for freed capacity before it is looked at again, seconds.
    """

    def __init__(self, lanes: LanePull, delivery: Delivery, *, kind: str,
                 decode: Callable[[bytes], T],
                 handle: Callable[[Msg, T, Any], Awaitable[None]],
                 capacity: Callable[[], int],
                 rebind: Callable[[], Awaitable[Delivery | None]],
                 claim: Callable[[Msg], Any] | None = None,
                 dead_lettered: Callable[[Msg, T | None, str, str], Awaitable[None]]
                 | None = None,
                 freed: asyncio.Event | None = None,
                 exclude: Callable[[str], bool] | None = None,
                 defer: Callable[[str], bool] | None = None,
                 stopping: Callable[[], bool] = lambda: False, idle_s: float = 1.0) -> None:
        self.lanes = lanes
        self.delivery = delivery
        self.kind = kind
        self.decode = decode
        self.handle = handle
        self.capacity = capacity
        self.rebind = rebind
        self.claim = claim
        self.dead_lettered = dead_lettered
        self.freed = freed if freed is not None else asyncio.Event()
        self.exclude = exclude
        self.defer = defer
        self.stopping = stopping
        self.idle_s = idle_s
        self.rebinds = 0
        self.dead_letters = 0
        # True once asking has stopped (stop, a drain): what is in hand is ending.
        self.finishing = False
        # One task per message being handled; messages in hand per tenant.
        self.tasks: set[asyncio.Task] = set()
        self.held: collections.Counter[str] = collections.Counter()

    @property
    def in_hand(self) -> int:
        """Messages being handled now."""
        return len(self.tasks)

    def tenant_of(self, msg: Msg) -> str:
        """The tenant whose lane ``msg`` came from (the default tenant's for the base
        subject)."""
        lane = subjects.parse_lane(self.lanes.base, msg.subject or "")
        return lane[0] if lane is not None else subjects.DEFAULT_TENANT

    async def run(self, stop: asyncio.Event, abandon: asyncio.Event | None = None) -> None:
        """Take work until ``stop`` is set or :attr:`stopping` says so, then end the
        messages in hand: without ``abandon`` they are cancelled (nak'ed) at once; with
        it they finish, unless ``abandon`` is set meanwhile (then cancelled). A
        cancellation of ``run`` itself cancels them at once."""
        try:
            await self._ask(stop)
        except BaseException:
            self.finishing = True
            await cancel_and_wait(*self.tasks)
            raise
        await self.finish(abandon)

    async def finish(self, abandon: asyncio.Event | None = None) -> None:
        """End the messages in hand (see :meth:`run`)."""
        self.finishing = True
        tasks = list(self.tasks)
        if not tasks:
            return
        if abandon is None:
            await cancel_and_wait(*tasks)
            return
        log.info("finishing_in_hand", stream=self.lanes.stream, in_hand=len(tasks))
        finished = asyncio.gather(*tasks, return_exceptions=True)
        abandoned = asyncio.create_task(abandon.wait())
        try:
            await asyncio.wait({finished, abandoned}, return_when=asyncio.FIRST_COMPLETED)
            if not finished.done():
                log.warning("abandoning_in_hand", stream=self.lanes.stream,
                            in_hand=len(self.tasks))
                await cancel_and_wait(*tasks)
                await finished
        except BaseException:
            await cancel_and_wait(*tasks)
            raise
        finally:
            await cancel_and_wait(abandoned)

    async def _ask(self, stop: asyncio.Event) -> None:
        while not stop.is_set() and not self.stopping():
            free = self.capacity()
            if free <= 0:
                # Woken by the release itself, so the next ask follows it at once; no
                # wake-ups from the lanes meanwhile (they would reach every busy one).
                self.freed.clear()
                if self.capacity() <= 0:
                    await self.lanes.deafen()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self.freed.wait(), self.idle_s)
                continue
            await self.lanes.fetch_or_wait(free, self._take, exclude=self.exclude,
                                           defer=self.defer)
            if self.lanes.default_failed:
                # The consumer or JetStream is gone (409 Consumer Deleted, 503 No
                # Responders ...): bind it again rather than spin on errors.
                self.lanes.default_failed = False
                await asyncio.sleep(REBIND_PAUSE_S)
                try:
                    delivery = await self.rebind()
                    if delivery is not None:
                        self.delivery = delivery
                    self.rebinds += 1
                except Exception as exc:  # noqa: BLE001 - tried again on the next error
                    log.warning("consumer_rebind_failed", stream=self.lanes.stream,
                                error=f"{type(exc).__name__}: {exc}")

    def _take(self, msg: Msg) -> None:
        """Start handling ``msg`` now. It is decoded and its deliveries counted here,
        so that only a message that will be handled takes the service's slot
        (``claim``), before the next capacity look."""
        tenant = self.tenant_of(msg)
        value: T | None = None
        dead: tuple[str, str] | None = None
        try:
            value = self.decode(msg.data)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            dead = (f"malformed {self.kind}: {exc}", "malformed")
        else:
            delivered = deliveries(msg)
            if delivered > self.delivery.max_deliver:
                dead = (f"{self.kind} delivered {delivered} times without being finished "
                        "(each consumer that took it died, was killed or lost its "
                        "connection first)", "max_deliver")
        slot = self.claim(msg) if self.claim is not None and dead is None else None
        self.held[tenant] += 1
        task = asyncio.create_task(self._handle(msg, value, slot, dead))
        self.tasks.add(task)

        def done(finished: asyncio.Task) -> None:
            self.tasks.discard(finished)
            self.held[tenant] -= 1
            if self.held[tenant] <= 0:
                del self.held[tenant]
            self.freed.set()
            self.lanes.woken.set()  # a tenant held back may be asked again now

        task.add_done_callback(done)

    async def _handle(self, msg: Msg, value: T | None, slot: Any,
                      dead: tuple[str, str] | None) -> None:
        """Dead-letter or handle ``msg`` while beating ``in_progress()``; never raises
        but a cancellation (after the nak)."""
        beat = asyncio.create_task(self._beat(msg))
        try:
            if dead is not None:
                await self._dead_letter(msg, value, *dead)
            else:
                await self.handle(msg, value, slot)  # type: ignore[arg-type]
        except asyncio.CancelledError:
            # Stopping mid-message: hand it straight back to the stream.
            with contextlib.suppress(Exception):
                await msg.nak()
            raise
        except Exception:  # noqa: BLE001 - one bad message must not stop the loop
            log.exception("message_handler_failed", subject=msg.subject)
            with contextlib.suppress(Exception):
                await msg.nak(delay=NAK_DELAY_S)
        finally:
            await cancel_and_wait(beat)

    async def _beat(self, msg: Msg) -> None:
        while True:
            await asyncio.sleep(self.delivery.progress_every_s)
            with contextlib.suppress(Exception):
                await msg.in_progress()

    async def _dead_letter(self, msg: Msg, value: T | None, reason: str, why: str) -> None:
        if not await dead_letter(self.lanes.js, msg, reason):
            return
        self.dead_letters += 1
        if self.dead_lettered is not None:
            await self.dead_lettered(msg, value, reason, why)


async def open_pull_loop(js: JetStreamContext, nc: Any, settings: Settings, *, stream: str,
                         base: str, sweep_strays: bool = False, idle_s: float = 1.0,
                         **handling: Any) -> PullLoop:
    """The pull loop of a service: the default consumer bound (:func:`bind_default`),
    the lanes (:func:`lane_pull`) started; ``handling`` are :class:`PullLoop`'s
    keyword arguments from ``kind`` on. Stop the lanes with ``loop.lanes.stop()``.

    Raises:
        services.common.provision.ProvisionError: the default consumer could not be had.
    """
    delivery = await bind_default(js, settings, stream=stream, base=base)
    lanes = lane_pull(js, nc, settings, stream=stream, base=base, idle_poll_s=idle_s,
                      sweep_strays=sweep_strays)
    await lanes.start()

    async def rebind() -> Delivery:
        return await bind_default(js, settings, stream=stream, base=base)

    return PullLoop(lanes, delivery, rebind=rebind, idle_s=idle_s, **handling)
