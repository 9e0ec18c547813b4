"""Waiting for verdicts: the one place that reads a job's ``results.<job_id>.>`` for a
caller, and decides which verdicts count.

Provenance. A verdict counts only from the worker that holds its request:

- every request carries a **claim nonce**, ``HMAC(key, request_id)`` under a key only
  its requester knows (a job's in the generators' ``artifacts`` object store,
  :func:`job_key`; a batch's in the gateways' ``batches`` bucket, :func:`batch_key`;
  ``RemoteWorker``'s in its memory), kept where workers cannot read it so a restarted
  generator or gateway (even with new bus credentials) reads it again. Only the worker JetStream
  delivers the request to reads the body: workers wake on headers-only copies of
  verify requests (``aikg.wake.>``), cannot read the VERIFY, RESULTS or JOB_EVENTS
  streams, and job records hold no nonce;
- before it runs a request the worker publishes a :class:`~schemas.VerifyClaim` on
  ``results.<job_id>.<worker_id>.claim`` (a worker's user may publish only under its
  own id), and later its verdict on ``results.<job_id>.<worker_id>``;
  with a proof, ``HMAC(nonce, "claim:<worker>:<request>")``; its verdict carries
  ``HMAC(nonce, "result:<worker>:<request>")``;
- a reader (:class:`Provenance`) takes messages in stream order: the latest claim with
  a good proof names the holder (JetStream gives a request to a second worker only
  after the first gave it back or stopped beating its ack timer); a verdict counts when
  its subject, body and proof name the holder. Anything else is dropped, logged with
  the sender and the holder, and counted in ``aikg_verdicts_rejected_total`` by reason:
  ``relayed`` (a copy the server made, e.g. a JetStream API reply sent onto a results
  subject: it carries ``Nats-Stream`` headers), ``wrong_subject`` (the body names
  another worker than the subject), ``bad_proof``, ``unclaimed`` (no claim from
  anyone), ``not_holder`` (another worker holds the request; also the verdict of a
  request JetStream gave to a second worker while the first was still running it).

Reading. A :class:`VerdictWaiter` collects the verdicts a job's verify requests get
and hands each to whoever awaits its ``request_id``; a :class:`ResultsReader` returns
them in stream order to a caller that folds them itself. Requesters use both through
:class:`services.common.verify_client.VerifyClient` (the generator's single and evolve
jobs and the SDK's ``RemoteWorker`` wait, the gateway's batches fold). It uses no JetStream consumer (services may not create any:
services/common/nats_auth.py): the stream's own message-get API
(``$JS.API.STREAM.MSG.GET`` with ``next_by_subj``) walks the job's subject from the last
sequence seen, woken by a core NATS subscription on the same subject (used only as a
doorbell: what it delivers is read again from the stream, with sequence and headers)
and every :data:`CATCH_UP_S` while someone waits (a wake-up lost to a reconnect, or
verdicts published while a crashed generator was down).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import secrets
from typing import Any

import msgspec
import nats.errors
import nats.js.errors
import structlog
from nats.js import JetStreamContext
from prometheus_client import Counter

from schemas import VerifyClaim, VerifyRequest, VerifyResult, decode, subjects
from services.common.bus import next_stored, object_bytes
from services.common.runtime import cancel_and_wait

log = structlog.get_logger("aikg.verdicts")

# How often a waiter with pending requests reads the stream itself, seconds, besides
# the reads its wake-up subscription triggers.
CATCH_UP_S = 2.0

VERDICTS_RECOVERED = Counter(
    "aikg_verdicts_recovered_total",
    "Verdicts found by a periodic read of the RESULTS stream that no wake-up had "
    "announced (a wake-up lost to a reconnect, or published while the reader was down).",
)
VERDICTS_REJECTED = Counter(
    "aikg_verdicts_rejected_total",
    "Verdicts and claims on a results subject that did not count, by reason (relayed, "
    "wrong_subject, bad_proof, unclaimed, not_holder, malformed): see "
    "services/common/verdicts.py.",
    ["reason"],
)

# Headers the server adds to a stored message it relays (a JetStream direct get's
# reply; nats-server server/stream.go): a results message carrying one is a copy the
# server made on someone's request, not a worker's publish.
RELAY_HEADERS = ("Nats-Stream", "Nats-Subject", "Nats-Sequence", "Nats-Time-Stamp")
def random_key() -> bytes:
    """A requester key: 32 random bytes (kept by :func:`job_key` / :func:`batch_key`,
    or in memory by a process that never reads its verdicts after a restart, the SDK's
    ``RemoteWorker``)."""
    return secrets.token_bytes(32)


async def job_key(js: JetStreamContext, job_id: str) -> bytes:
    """The requester key of a generator's job: 32 random bytes kept as the object
    ``verdict-keys/<job_id>`` of the ``artifacts`` object store (which only generators
    may read), made on the job's first start and read again when it resumes (after a
    crash, on another generator, or after the bus credentials were rotated).

    Raises:
        nats.errors.Error: NATS trouble (the job is retried as for any such failure).
    """
    name = f"verdict-keys/{job_id}"
    try:
        store = await js.object_store(subjects.OBJECT_STORE_ARTIFACTS)
    except nats.js.errors.BucketNotFoundError:
        store = await js.create_object_store(subjects.OBJECT_STORE_ARTIFACTS)
    try:
        return bytes.fromhex((await object_bytes(js, subjects.OBJECT_STORE_ARTIFACTS,
                                                 name)).decode())
    except nats.js.errors.ObjectNotFoundError:
        pass
    key = random_key()
    await store.put(name, key.hex().encode())
    return key


async def forget_job_key(js: JetStreamContext, job_id: str) -> None:
    """Delete a finished job's key object (best effort: a leftover costs 64 bytes)."""
    with contextlib.suppress(Exception):
        store = await js.object_store(subjects.OBJECT_STORE_ARTIFACTS)
        await store.delete(f"verdict-keys/{job_id}")


async def batch_key(kv: Any, batch_id: str) -> bytes:
    """The requester key of a gateway's batch: 32 random bytes (hex) under
    ``verdict-key.<batch_id>`` in the ``batches`` bucket (which only gateways may
    read), made by the first gateway that asks and read by every other one.

    Raises:
        nats.errors.Error: NATS trouble.
    """
    name = f"verdict-key.{batch_id}"
    for _ in range(2):
        try:
            return bytes.fromhex((await kv.get(name)).value.decode())
        except (nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
            pass
        key = random_key()
        try:
            await kv.create(name, key.hex().encode())
            return key
        except nats.js.errors.KeyWrongLastSequenceError:
            continue  # another gateway made it first: read theirs
    raise nats.js.errors.KeyNotFoundError


def claim_nonce(key: bytes, request_id: str) -> str:
    """The claim nonce of ``request_id`` under ``key``: hex HMAC-SHA256, 32 chars."""
    return hmac.new(key, request_id.encode(), hashlib.sha256).hexdigest()[:32]


def proof(nonce: str, kind: str, worker_id: str, request_id: str) -> str:
    """What a worker that read ``nonce`` attaches to its ``kind`` (``claim`` or
    ``result``) for ``request_id``: hex HMAC-SHA256 of ``<kind>:<worker>:<request>``
    under the nonce, 32 chars; empty when the request had no nonce."""
    if not nonce:
        return ""
    message = f"{kind}:{worker_id}:{request_id}".encode()
    return hmac.new(nonce.encode(), message, hashlib.sha256).hexdigest()[:32]


class Provenance:
    """Decides, message by message in stream order, which verdicts on one job's
    results subject count (the rule: module docstring).

    Args:
        key: the requester key the job's requests were sealed with.
        job_id: for logs.
    """

    def __init__(self, key: bytes, job_id: str) -> None:
        self.key = key
        self.job_id = job_id
        # request id -> the worker whose claim is the latest with a good proof.
        self.holders: dict[str, str] = {}
        self.rejected = 0

    def _reject(self, reason: str, request_id: str | None, sender: str | None,
                seq: int | None, **more: Any) -> None:
        self.rejected += 1
        VERDICTS_REJECTED.labels(reason=reason).inc()
        log.warning("verdict_rejected", reason=reason, job_id=self.job_id,
                    request_id=request_id, sender=sender,
                    holder=self.holders.get(request_id or ""), seq=seq, **more)

    def take(self, subject: str, data: bytes, headers: dict | None,
             seq: int | None = None) -> VerifyResult | None:
        """The verdict of one stored message when it counts, else None (a claim, which
        updates the holder, or a message that does not count: logged and counted)."""
        parsed = subjects.results_sender(subject or "")
        sender, on_claims = parsed if parsed is not None else (None, False)
        if headers and any(h in headers for h in RELAY_HEADERS):
            self._reject("relayed", None, sender, seq)
            return None
        try:
            record = decode(data, VerifyClaim if on_claims else VerifyResult)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            self._reject("malformed", None, sender, seq, error=str(exc)[:200])
            return None
        request_id, worker_id = record.request_id, record.worker_id
        if sender is None or worker_id != sender:
            self._reject("wrong_subject", request_id, sender, seq, named=worker_id)
            return None
        nonce = claim_nonce(self.key, request_id)
        kind = "claim" if isinstance(record, VerifyClaim) else "result"
        if not hmac.compare_digest(record.proof or "", proof(nonce, kind, sender, request_id)):
            self._reject("bad_proof", request_id, sender, seq, kind=kind)
            return None
        if isinstance(record, VerifyClaim):
            self.holders[request_id] = sender
            return None
        holder = self.holders.get(request_id)
        if holder != sender:
            self._reject("unclaimed" if holder is None else "not_holder", request_id,
                         sender, seq)
            return None
        return record


class ResultsReader:
    """Reads one job's ``results.<job_id>.>`` from the RESULTS stream in order and
    returns the verdicts that count (:class:`Provenance`); no consumer involved.

    Args:
        js: a JetStream context whose user may ``STREAM.MSG.GET`` on RESULTS.
        job_id: the job (or batch) whose subject is read.
        key: the requester key its requests were sealed with.
    """

    def __init__(self, js: JetStreamContext, job_id: str, key: bytes) -> None:
        self.js = js
        self.job_id = job_id
        self.filter = subjects.job_results(job_id)
        self.provenance = Provenance(key, job_id)
        self.last_seq = 0
        self._lock = asyncio.Lock()

    async def read(self) -> list[tuple[int, VerifyResult]]:
        """The counted verdicts stored after the last read, with their RESULTS
        sequence, in stream order.

        Raises:
            nats.errors.TimeoutError: JetStream did not answer (e.g. while the stream
                elects a leader); the next call resumes where this one stopped.
        """
        out = []
        async with self._lock:
            while (raw := await next_stored(self.js, subjects.STREAM_RESULTS, self.filter,
                                            self.last_seq)) is not None:
                self.last_seq = raw.seq
                result = self.provenance.take(raw.subject or "", raw.data or b"",
                                              raw.headers, raw.seq)
                if result is not None:
                    out.append((raw.seq, result))
        return out


class VerdictWaiter:
    """Collects the verdicts that count on ``results.<job_id>.>`` for callers awaiting
    them.

    Use as ``async with VerdictWaiter(js, job_id, key) as waiter`` (or
    ``start``/``stop``); :meth:`seal` each request before publishing it; ``await
    waiter.wait(request_id, timeout_s)`` returns the verdict.

    Args:
        js: a JetStream context whose user may read the RESULTS stream
            (``STREAM.MSG.GET``) and subscribe on ``results.>``.
        job_id: the job whose ``results.<job_id>.>`` subjects are read.
        key: the requester key (:func:`verdict_key` or :func:`random_key`).
        catch_up_s: seconds between reads while a request is awaited.
    """

    def __init__(self, js: JetStreamContext, job_id: str, key: bytes, *,
                 catch_up_s: float = CATCH_UP_S) -> None:
        self.js = js
        self.job_id = job_id
        self.key = key
        self.reader = ResultsReader(js, job_id, key)
        self.catch_up_s = catch_up_s
        self.futures: dict[str, asyncio.Future[VerifyResult]] = {}
        self.results: dict[str, VerifyResult] = {}
        self._sub = None
        self._woken = asyncio.Event()
        self._reading: asyncio.Task | None = None

    def seal(self, request: VerifyRequest) -> VerifyRequest:
        """Set ``request.claim_nonce`` from this waiter's key; returns the request."""
        request.claim_nonce = claim_nonce(self.key, request.request_id)
        return request

    async def __aenter__(self) -> VerdictWaiter:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(self) -> None:
        """Subscribe the wake-ups and start reading (from the stream's start, so
        verdicts stored before are taken at once).

        Raises:
            nats.errors.Error: the subscription could not be made (connection closed).
        """
        async def on_msg(_msg: Any) -> None:
            self._woken.set()

        self._sub = await self.js._nc.subscribe(self.reader.filter, cb=on_msg)
        self._woken.set()
        self._reading = asyncio.create_task(self._read_loop(), name=f"verdicts-{self.job_id}")

    def expect(self, request_id: str) -> asyncio.Future[VerifyResult]:
        """A future resolved with the verdict of ``request_id`` (at once if it came)."""
        future = self.futures.get(request_id)
        if future is None or future.cancelled():
            future = asyncio.get_running_loop().create_future()
            self.futures[request_id] = future
            self._woken.set()
        if not future.done() and request_id in self.results:
            future.set_result(self.results[request_id])
        return future

    async def wait(self, request_id: str, timeout_s: float) -> VerifyResult:
        """The verdict of ``request_id``.

        Raises:
            TimeoutError: none within ``timeout_s`` seconds.
        """
        return await asyncio.wait_for(asyncio.shield(self.expect(request_id)), timeout_s)

    async def stop(self) -> None:
        """Unsubscribe and stop reading; pending futures stay unresolved."""
        if self._reading is not None:
            await cancel_and_wait(self._reading)
            self._reading = None
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
            self._sub = None

    async def catch_up(self) -> int:
        """Read the verdicts stored since the last read; how many counted.

        Raises:
            nats.errors.TimeoutError: JetStream did not answer; the next call resumes.
        """
        taken = await self.reader.read()
        for seq, result in taken:
            self._take(result, seq)
        return len(taken)

    def _pending(self) -> bool:
        return any(not f.done() for f in self.futures.values())

    async def _read_loop(self) -> None:
        while True:
            woken = False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._woken.wait(), self.catch_up_s)
                woken = True
            self._woken.clear()
            if not woken and not self._pending():
                continue
            try:
                before = len(self.results)
                await self.catch_up()
                if not woken and len(self.results) > before:
                    VERDICTS_RECOVERED.inc(len(self.results) - before)
            except (nats.errors.Error, nats.js.errors.Error, TimeoutError, OSError) as exc:
                log.debug("verdict_read_failed", job_id=self.job_id, error=repr(exc))

    def _take(self, result: VerifyResult, seq: int | None) -> None:
        if result.request_id in self.results:
            return
        self.results[result.request_id] = result
        future = self.futures.get(result.request_id)
        if future is not None and not future.done():
            future.set_result(result)
