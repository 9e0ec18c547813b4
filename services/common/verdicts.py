"""Waiting for verdicts: the one place that reads a job's ``results.<job_id>.>`` for a
caller, and decides which verdicts count.

Provenance. A verdict counts only from the worker that holds its request:

- every request carries a **claim nonce**, ``HMAC(key, request_id)`` under a key only
  its requester knows (:func:`verdict_key`: derived from the requester's own NATS
  secret, so a restarted generator derives it again). Only the worker JetStream
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
(the generator's single and evolve jobs, the SDK's ``RemoteWorker``; the gateway's
batches use :class:`ResultsReader` directly) and hands each to whoever awaits its
``request_id``. It uses no JetStream consumer (services may not create any:
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
from pathlib import Path
from typing import Any

import msgspec
import nats.errors
import nats.js.errors
import structlog
from nats.js import JetStreamContext
from prometheus_client import Counter

from schemas import VerifyClaim, VerifyRequest, VerifyResult, decode, subjects
from services.common.runtime import cancel_and_wait

log = structlog.get_logger()

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
# The key of a bus without credentials: anyone may publish anything there, so nothing
# can be proven; requests still carry nonces so the checks run the same way.
_OPEN_BUS = b"aikg-open-bus"


def bus_secret(credentials: dict[str, Any]) -> bytes:
    """The secret a service holds on the bus, from ``nats_credentials(settings, role)``
    (services/common/bus.py): its password, token, NKEY seed or ``.creds`` file; empty
    on a bus without credentials."""
    for name in ("password", "token"):
        if credentials.get(name):
            return str(credentials[name]).encode()
    for name in ("nkeys_seed", "user_credentials"):
        path = credentials.get(name)
        if isinstance(path, str) and path:
            with contextlib.suppress(OSError):
                return Path(path).read_bytes()
    return b""


def verdict_key(secret: bytes, scope: str) -> bytes:
    """The requester key of ``scope`` (``job:<job_id>``, ``batch:<batch_id>``):
    ``HMAC-SHA256(secret, scope)``, 32 bytes. The same secret derives it again after a
    restart (and in every replica of the service); an empty secret (a bus without
    credentials) gives a key anyone can derive."""
    return hmac.new(secret or _OPEN_BUS, f"aikg-verdict:{scope}".encode(),
                    hashlib.sha256).digest()


def requester_key(settings: Any, role: str, scope: str) -> bytes:
    """:func:`verdict_key` of ``scope`` from the secret of ``role``'s NATS credentials
    under ``settings`` (services/common/bus.py ``nats_credentials``).

    Raises:
        ValueError: contradictory credentials settings (as ``nats_credentials``).
    """
    from services.common.bus import nats_credentials

    return verdict_key(bus_secret(nats_credentials(settings, role)), scope)


def random_key() -> bytes:
    """A requester key for a process that never reads its verdicts after a restart
    (the SDK's ``RemoteWorker``): 32 random bytes."""
    return secrets.token_bytes(32)


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
            while True:
                try:
                    raw = await self.js.get_msg(subjects.STREAM_RESULTS, seq=self.last_seq + 1,
                                                subject=self.filter, next=True)
                except nats.js.errors.NotFoundError:
                    return out
                if raw.seq is None or raw.seq <= self.last_seq:
                    return out
                self.last_seq = raw.seq
                result = self.provenance.take(raw.subject or "", raw.data or b"",
                                              raw.headers, raw.seq)
                if result is not None:
                    out.append((raw.seq, result))


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
