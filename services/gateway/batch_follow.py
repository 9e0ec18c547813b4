"""A batch on the bus (services/gateway/batches.py has the routes): its verify requests
sent through the :class:`~services.common.verify_client.VerifyClient` of the batch
(sealed with the batch's requester key, on the tenant's VERIFY lane, the request id as
``Nats-Msg-Id``), its verdicts folded into its record as they land (:func:`fold`,
:func:`follow`: only those from the worker that holds their request count), and
requests no worker was given taken back out of VERIFY (a cancel, an unserved lane).
"""

from __future__ import annotations

import asyncio
import contextlib

import nats.errors
import nats.js.errors
import structlog
from cachetools import LRUCache
from litestar.datastructures import State

from schemas import BatchRecord, VerifyResult, subjects
from services.common.bus import Bus
from services.common.lane_watch import LaneWatch
from services.common.runtime import cancel_and_wait
from services.common.verdicts import batch_key
from services.common.verify_client import VerifyClient, task_fields
from services.gateway.batch_store import BatchStore, add_unserved, add_verdicts, settled

log = structlog.get_logger("aikg.gateway")

# How often a follower (the accepting gateway's task, an event stream) reads the
# RESULTS stream for new verdicts, seconds: verdicts take seconds each, so half a
# second adds little to when a client sees one.
POLL_S = 0.5

# One verify client per batch this gateway folds (its place in the stream and the
# holders of the batch's requests; services/common/verdicts.py), so a fold reads only
# what landed since the last; a gateway that restarts reads a batch's subject from the
# start once.
_CLIENTS: LRUCache[str, VerifyClient] = LRUCache(maxsize=4096)


async def batch_client(bus: Bus, batch_id: str) -> VerifyClient:
    """The batch's verify client (its requester key from the ``batches`` bucket,
    :func:`services.common.verdicts.batch_key`), kept per batch id for this bus.

    Raises:
        nats.errors.Error: NATS trouble reading or making the key.
    """
    client = _CLIENTS.get(batch_id)
    if client is None or client.js is not bus.js:
        key = await batch_key(bus.batches, batch_id)
        client = _CLIENTS[batch_id] = VerifyClient(bus.js, batch_id, key)
    return client


async def _results_after(bus: Bus, batch_id: str, after: int) -> list[tuple[int, VerifyResult]]:
    """The verdicts that count (services/common/verdicts.py: from the worker that holds
    the request) on ``results.<batch_id>.>`` after RESULTS sequence ``after``, read
    with the stream's message-get API (no consumer)."""
    client = await batch_client(bus, batch_id)
    return [(seq, result) for seq, result in await client.read() if seq > after]


async def fold(bus: Bus, store: BatchStore, batch_id: str) -> BatchRecord | None:
    """Bring the batch's record up to date with ``results.<batch_id>``; the record as
    stored (None when there is none)."""
    found = await store.get(batch_id)
    if found is None:
        return None
    record = found[0]
    after = max((v.seq for v in record.verdicts), default=0)
    results = await _results_after(bus, batch_id, after)
    if not results:
        return record
    return await store.update(batch_id, lambda r: add_verdicts(r, results))


async def follow(bus: Bus, batch_id: str) -> None:
    """Fold the batch's verdicts into its record as they land, until it is settled or
    its record is gone; NATS trouble is logged and retried. When the batch's
    backend/arch has had no live worker for ``verify_unserved_timeout_s``
    (services/common/lane_watch.py), every candidate still without a verdict fails
    with a message naming the lane (:func:`fail_unserved`)."""
    store = BatchStore(bus.batches)  # type: ignore[arg-type]
    watch: LaneWatch | None = None
    while True:
        try:
            record = await fold(bus, store, batch_id)
            if record is None or settled(record):
                return
            if watch is None:
                watch = LaneWatch(bus.js, record.task.backend, record.task.arch,
                                  bus.settings.verify_unserved_timeout_s, waiter="batch")
            if record.status == "running" and (message := await watch.check()):
                await fail_unserved(bus, store, record, message)
                return
        except (nats.errors.Error, nats.js.errors.Error, TimeoutError, OSError) as exc:
            log.warning("batch_follow_failed", batch_id=batch_id, error=repr(exc))
        await asyncio.sleep(POLL_S)


async def fail_unserved(bus: Bus, store: BatchStore, record: BatchRecord, message: str) -> None:
    """Fail the candidates of ``record`` without a verdict because no worker serves its
    lane (:func:`add_unserved`), after taking their requests out of VERIFY: no live
    worker holds them (it would heartbeat), so they would only wait there for a
    worker of a pair nobody serves."""
    decided = {v.request_id for v in record.verdicts}
    for c in record.candidates:
        if c.duplicate_of is None and c.request_id not in decided and c.verify_seq:
            with contextlib.suppress(nats.js.errors.NotFoundError):
                await bus.js.delete_msg(subjects.STREAM_VERIFY, c.verify_seq)
    await fold(bus, store, record.batch_id)  # verdicts that landed meanwhile count
    await store.update(record.batch_id, lambda r: add_unserved(r, message))
    log.warning("batch_unserved", batch_id=record.batch_id, backend=record.task.backend,
                arch=record.task.arch, message=message)


def start_follower(state: State, bus: Bus, batch_id: str) -> None:
    followers: set[asyncio.Task] = state.get("batch_followers")
    task = asyncio.create_task(follow(bus, batch_id), name=f"batch-{batch_id}")
    followers.add(task)
    task.add_done_callback(followers.discard)


async def stop_followers(state: State) -> None:
    """Cancel the gateway's batch followers (at shutdown; the records stay, and any
    later read folds what they would have)."""
    await cancel_and_wait(*state.get("batch_followers", set()))


async def delivered_seq(bus: Bus, record: BatchRecord) -> int | None:
    """The VERIFY sequence up to which the batch's lane consumer has handed requests to
    workers, or None when it cannot be read."""
    task = record.task
    consumer = subjects.verify_lane_consumer(task.backend, task.arch, record.tenant,
                                             task.priority)
    try:
        info = await bus.js.consumer_info(subjects.STREAM_VERIFY, consumer)
    except (nats.errors.Error, nats.js.errors.Error, TimeoutError) as exc:
        log.warning("batch_consumer_info_failed", consumer=consumer, error=repr(exc))
        return None
    return info.delivered.stream_seq or 0


async def take_back(bus: Bus, record: BatchRecord) -> set[str]:
    """Delete from VERIFY the requests of ``record`` without a verdict that no worker
    has been given; their request ids. With the consumer unreadable, every request
    without a verdict is deleted (a worker already running one still answers it)."""
    delivered = await delivered_seq(bus, record)
    decided = {v.request_id for v in record.verdicts}
    taken = set()
    for c in record.candidates:
        if c.duplicate_of is not None or c.request_id in decided or not c.verify_seq:
            continue
        if delivered is not None and c.verify_seq <= delivered:
            continue
        try:
            if await bus.js.delete_msg(subjects.STREAM_VERIFY, c.verify_seq):
                taken.add(c.request_id)
        except nats.js.errors.NotFoundError:
            pass  # acked already: its verdict is in RESULTS
    return taken


async def publish_requests(bus: Bus, record: BatchRecord, codes: list[str]) -> dict[str, int]:
    """Publish the verify request of each distinct candidate (``codes`` in the order of
    the record's candidates) through the batch's verify client; request id -> VERIFY
    sequence. On a failure the ones published are deleted again before it raises."""
    task = record.task
    fields = task_fields(task, arch=task.arch, tenant=record.tenant, priority=task.priority)
    seqs: dict[str, int] = {}
    client = await batch_client(bus, record.batch_id)
    try:
        for c in record.candidates:
            if c.duplicate_of is not None:
                continue
            request = client.request(code=codes[c.index], request_id=c.request_id,
                                     candidate_id=c.candidate_id, **fields)
            seqs[c.request_id] = (await client.publish(request)).seq
    except Exception:
        for seq in seqs.values():
            with contextlib.suppress(Exception):
                await bus.js.delete_msg(subjects.STREAM_VERIFY, seq)
        raise
    return seqs



async def cancel_unstarted(bus: Bus, batches: BatchStore, record: BatchRecord) -> None:
    """Take back the cancelled batch's requests no worker was given
    (:func:`take_back`) and mark their candidates (duplicates included) ``cancelled``."""
    taken = await take_back(bus, record)

    def mark(r: BatchRecord) -> bool:
        hit = [c for c in r.candidates if c.request_id in taken and not c.cancelled]
        for c in hit:
            c.cancelled = True
        return bool(hit)

    await batches.update(record.batch_id, mark)
    log.info("batch_cancelled", batch_id=record.batch_id, taken_back=len(taken))

