"""Waiting for verdicts: the one place that reads ``results.<job_id>`` for a caller.

A :class:`VerdictWaiter` collects every verdict a job's verify requests get (the
generator's single and evolve jobs, the SDK's ``RemoteWorker``) and hands each to
whoever awaits its ``request_id``. It reads the RESULTS stream two ways:

- an *ordered push consumer* on the job's subject from the start of the stream, so
  verdicts published before it subscribed (while a crashed generator was down) are
  delivered at once and new ones arrive with no polling;
- a *catch-up read* every :data:`CATCH_UP_S` while someone waits: the stream's own
  message-get API (``$JS.API.STREAM.MSG.GET`` with ``next_by_subj``) walks the
  subject from the last sequence seen. It needs no consumer, so it survives what an
  ephemeral consumer does not: in a clustered JetStream the server that holds an
  ordered consumer can die or lose leadership, and client libraries do not always
  recreate it (nats-py 2.x tries once and gives up when the stream is electing a
  leader; nats-server issues #5679 and #6025 describe consumers that stop
  delivering after a node restart). Without the catch-up such a job would wait for
  its verdict until ``verify_result_timeout_s`` (an hour by default) although the
  verdict is in the stream.

The first verdict per request id counts; later copies (a redelivered request run
twice) are ignored.
"""

from __future__ import annotations

import asyncio
import contextlib

import msgspec
import nats.errors
import nats.js.errors
import structlog
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from prometheus_client import Counter

from schemas import VerifyResult, decode, subjects
from services.common.runtime import cancel_and_wait

log = structlog.get_logger()

# How often a waiter with pending requests reads the stream itself, seconds: about
# one ordered-consumer heartbeat (nats-py's default idle heartbeat is 5 s), so a
# verdict the consumer lost arrives within a few seconds of being published.
CATCH_UP_S = 3.0

VERDICTS_RECOVERED = Counter(
    "aikg_verdicts_recovered_total",
    "Verdicts found by the catch-up read of the RESULTS stream that the waiter's "
    "ordered consumer had not delivered (a consumer lost in a server failover).",
)


class VerdictWaiter:
    """Collects the verdicts on ``results.<job_id>`` for callers awaiting them.

    Use as ``async with VerdictWaiter(js, job_id) as waiter`` (or ``start``/``stop``);
    ``await waiter.wait(request_id, timeout_s)`` returns the verdict.

    Args:
        js: a JetStream context whose user may read the RESULTS stream (subscribe
            and ``STREAM.MSG.GET``).
        job_id: the job whose ``results.<job_id>`` subject is read.
        catch_up_s: seconds between catch-up reads while a request is awaited.
    """

    def __init__(self, js: JetStreamContext, job_id: str, *,
                 catch_up_s: float = CATCH_UP_S) -> None:
        self.js = js
        self.job_id = job_id
        self.subject = subjects.results(job_id)
        self.catch_up_s = catch_up_s
        self.futures: dict[str, asyncio.Future[VerifyResult]] = {}
        self.results: dict[str, VerifyResult] = {}
        self._last_seq = 0
        self._sub = None
        self._catch_up: asyncio.Task | None = None

    async def __aenter__(self) -> VerdictWaiter:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(self) -> None:
        """Subscribe (ordered consumer from the stream's start) and start catching up.

        Raises:
            nats.js.errors.NotFoundError: the RESULTS stream does not exist.
            nats.errors.TimeoutError: JetStream did not answer.
        """
        async def on_msg(msg: Msg) -> None:
            seq = None
            with contextlib.suppress(Exception):
                seq = msg.metadata.sequence.stream
            self._take(msg.data, seq, recovered=False)

        self._sub = await self.js.subscribe(self.subject, stream=subjects.STREAM_RESULTS,
                                            cb=on_msg, ordered_consumer=True)
        self._catch_up = asyncio.create_task(self._catch_up_loop(),
                                             name=f"verdicts-{self.job_id}")

    def expect(self, request_id: str) -> asyncio.Future[VerifyResult]:
        """A future resolved with the verdict of ``request_id`` (at once if it came)."""
        future = self.futures.get(request_id)
        if future is None or future.cancelled():
            future = asyncio.get_running_loop().create_future()
            self.futures[request_id] = future
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
        """Unsubscribe and stop catching up; pending futures stay unresolved."""
        if self._catch_up is not None:
            await cancel_and_wait(self._catch_up)
            self._catch_up = None
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
            self._sub = None

    async def catch_up(self) -> int:
        """Read the subject's verdicts after the last sequence seen, straight from the
        stream; returns how many messages were read.

        Raises:
            nats.errors.TimeoutError: JetStream did not answer (e.g. while the stream
                elects a leader); the next call resumes where this one stopped.
        """
        read = 0
        while True:
            try:
                raw = await self.js.get_msg(subjects.STREAM_RESULTS, seq=self._last_seq + 1,
                                            subject=self.subject, next=True)
            except nats.js.errors.NotFoundError:
                return read
            if raw.seq is None or raw.seq <= self._last_seq:
                return read
            read += 1
            self._take(raw.data or b"", raw.seq, recovered=True)

    def _pending(self) -> bool:
        return any(not f.done() for f in self.futures.values())

    async def _catch_up_loop(self) -> None:
        while True:
            await asyncio.sleep(self.catch_up_s)
            if not self._pending():
                continue
            try:
                await self.catch_up()
            except (nats.errors.Error, nats.js.errors.Error, TimeoutError, OSError) as exc:
                log.debug("verdict_catch_up_failed", job_id=self.job_id, error=repr(exc))

    def _take(self, data: bytes, seq: int | None, *, recovered: bool) -> None:
        if seq is not None:
            self._last_seq = max(self._last_seq, seq)
        try:
            result = decode(data, VerifyResult)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            if not recovered:
                log.warning("malformed_result", job_id=self.job_id, error=str(exc))
            return
        if result.request_id in self.results:
            return
        self.results[result.request_id] = result
        future = self.futures.get(result.request_id)
        if recovered:
            VERDICTS_RECOVERED.inc()
            log.warning("verdict_recovered", job_id=self.job_id, request_id=result.request_id,
                        seq=seq, awaited=future is not None)
        if future is not None and not future.done():
            future.set_result(result)
