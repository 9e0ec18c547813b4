"""The one verify client: builds verify requests, publishes them on their lane and
collects the verdicts that count, for every requester (the generator's jobs and evolve
runs, the gateway's batches, the SDK's ``RemoteWorker`` and ``verify_many``;
``LocalWorker``, the benchmarks and the tests build their requests here too).

- **Build.** :func:`build_request` is the one place a :class:`~schemas.VerifyRequest`
  is made: keyword arguments named as the request's fields, fresh ids where none are
  given, and the claim nonce from the requester's key
  (:func:`services.common.verdicts.claim_nonce`). :func:`task_fields` gives the fields
  that a job's or a batch's task shares with every candidate's request.
- **Publish.** :func:`publish` sends a request on its tenant's lane of VERIFY
  (:func:`schemas.subjects.verify_lane`: ``verify.<backend>.<arch>`` for the default
  tenant at normal priority, else ``verify.<backend>.<arch>.<tenant>.<priority>``), with
  the request id as ``Nats-Msg-Id``: a request published again within the VERIFY
  stream's duplicate window (a resent request, a generator resuming a job) is stored
  once.
- **Identical candidates.** :func:`originals` maps each candidate to the first one
  with the same normalised AST (:func:`services.common.records.normalised_hash`): only
  those get a request, the others share their verdict.
- **Collect.** A :class:`VerifyClient` of one job (or batch) id and requester key seals
  and publishes that job's requests and wraps the readers of
  services/common/verdicts.py: :meth:`VerifyClient.wait` awaits one request's verdict
  (a :class:`~services.common.verdicts.VerdictWaiter`), :meth:`VerifyClient.read`
  returns the verdicts in stream order to a caller that folds them itself (its
  :class:`~services.common.verdicts.ResultsReader`). Either counts a verdict only from
  the worker that holds its request (:class:`~services.common.verdicts.Provenance`;
  docs/security.md, "Who decides a verdict").
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Sequence
from typing import Any

import msgspec
from nats.js import JetStreamContext
from nats.js.api import PubAck

from schemas import VerifyRequest, VerifyResult, decode, encode, new_id, subjects
from schemas.events import SOURCE_NAME_DEFAULT
from services.common.lane_watch import LaneWatch, while_served
from services.common.records import normalised_hash
from services.common.verdicts import CATCH_UP_S, VerdictWaiter, claim_nonce

# The fields of a verify request that come from its job's (JobSubmit) or batch's
# (BatchTask) task, the same for every candidate of it.
TASK_FIELDS = ("op_name", "task_desc", "dsl", "framework", "backend", "shape_overrides",
               "timeout_s", "trials", "allow_unchecked")


def source_name(path: str) -> str:
    """A request's ``source_name`` for the file at ``path`` (only its name is kept):
    each character other than letters, digits and ``_ . + -`` becomes ``_``, a leading
    ``.``/``+``/``-`` is dropped, and a name over 64 characters keeps its first ones
    and its extension (``schemas.events.SourceName``); ``candidate.py`` when nothing is
    left. E.g. ``kernels/my kernel.py`` -> ``my_kernel.py``."""
    name = re.sub(r"[^A-Za-z0-9_.+-]", "_", re.split(r"[\\/]", path)[-1]).lstrip(".+-")
    if len(name) > 64:
        stem, dot, ext = name.rpartition(".")
        ext = ext[:16] if dot and stem else ""
        name = name[:64 - len(ext) - 1] + "." + ext if ext else name[:64]
    return name or SOURCE_NAME_DEFAULT


def build_request(*, task_desc: str, code: str, op_name: str, backend: str, arch: str,
                  request_id: str | None = None, job_id: str | None = None,
                  candidate_id: str | None = None, key: bytes | None = None,
                  source: str | None = None, validate: bool = False,
                  **fields: Any) -> VerifyRequest:
    """A :class:`~schemas.VerifyRequest` of ``code`` against ``task_desc``.

    Args:
        task_desc, code, op_name, backend, arch: as the request's fields.
        source: the file ``code`` was read from (``kernels/relu.py``): the verdict's
            messages and tracebacks name it (``relu.py line 30``) instead of
            ``candidate.py``; only its name is sent, made safe by :func:`source_name`.
        request_id, job_id, candidate_id: default fresh ids (``req-…``, ``sdk-…``,
            ``cand-…``, :func:`schemas.new_id`). A job id that no job record has is a
            worker-only request, which workers accept.
        key: the requester key (services/common/verdicts.py); given, the request's
            ``claim_nonce`` is derived from it and the request id, so only verdicts of
            the worker that holds the request count. None leaves ``claim_nonce`` as
            given (default empty: no provenance can be checked, as for a ``nats pub``).
        validate: check every field against the wire schema (constructors do not
            check constraints; a round trip through the wire does).
        fields: any other field of the request (``dsl``, ``framework``, ``mode``,
            ``shape_overrides``, ``timeout_s`` in seconds, ``trials``,
            ``allow_unchecked``, ``source_name``, ``tenant``, ``priority``,
            ``created_at``, ``claim_nonce``); unset, the request's defaults.

    Raises:
        TypeError: a keyword that is no field of the request.
        ValueError: with ``validate``, a field breaks the wire schema; the message names
            it (e.g. ``Expected `float` > 0 - at `$.timeout_s```).
    """
    request_id = request_id or new_id("req-")
    if source is not None:
        fields["source_name"] = source_name(source)
    if key is not None:
        fields["claim_nonce"] = claim_nonce(key, request_id)
    request = VerifyRequest(
        request_id=request_id, job_id=job_id or new_id("sdk-"),
        candidate_id=candidate_id or new_id("cand-"), op_name=op_name,
        task_desc=task_desc, code=code, backend=backend, arch=arch, **fields)
    if not validate:
        return request
    try:
        return decode(encode(request), VerifyRequest)
    except msgspec.ValidationError as exc:
        raise ValueError(f"invalid verify request: {exc}") from exc


def task_fields(task: Any, *, arch: str, tenant: str, priority: str) -> dict[str, Any]:
    """The request fields every candidate of a job or batch shares: those of
    :data:`TASK_FIELDS` read from ``task`` (a :class:`~schemas.JobSubmit` or a
    :class:`~schemas.events.BatchTask`), ``arch``, ``tenant`` and ``priority`` (the
    lane), and ``mode`` ``profile`` on a GPU backend (timings mean something there),
    ``verify`` on ``cpu`` (Triton's interpreter: correctness only)."""
    fields = {name: getattr(task, name) for name in TASK_FIELDS}
    fields.update(arch=arch, tenant=tenant, priority=priority,
                  mode="verify" if task.backend == "cpu" else "profile")
    return fields


def lane(request: VerifyRequest) -> str:
    """The VERIFY subject ``request`` waits on (:func:`schemas.subjects.verify_lane`).

    Raises:
        ValueError: a backend, arch, tenant or priority not usable in a subject.
    """
    return subjects.verify_lane(request.backend, request.arch, request.tenant,
                                request.priority)


async def publish(js: JetStreamContext, request: VerifyRequest) -> PubAck:
    """Publish ``request`` on its lane (:func:`lane`) with its request id as
    ``Nats-Msg-Id``.

    Returns:
        The VERIFY stream's acknowledgement (``seq``; ``duplicate`` when the stream
        already held a request of this id within its duplicate window).

    Raises:
        nats.errors.Error: NATS trouble (``nats.js.errors.NotFoundError`` /
            ``NoStreamResponseError`` / ``nats.errors.NoRespondersError``: no stream
            captures the subject).
    """
    return await js.publish(lane(request), encode(request),
                            headers={"Nats-Msg-Id": request.request_id})


def originals(codes: Sequence[str]) -> tuple[list[int], list[str]]:
    """For each code, the index of the first code with the same normalised AST
    (itself for a code seen first, an earlier index for a duplicate, whose verdict is
    that one's), and each code's normalised hash
    (:func:`services.common.records.normalised_hash`, hex sha256; a code that does not
    parse hashes as its text). Never raises."""
    hashes = [normalised_hash(code) for code in codes]
    first: dict[str, int] = {}
    return [first.setdefault(digest, i) for i, digest in enumerate(hashes)], hashes


class VerifyClient:
    """One requester's verify requests under one job (or batch) id, and their verdicts.

    Requests are sealed with ``key`` (their claim nonce) and published on their lane;
    verdicts are read from ``results.<job_id>.>`` in the RESULTS stream and count only
    from the worker that holds their request (services/common/verdicts.py). Use
    ``async with VerifyClient(...)`` (or :meth:`start` / :meth:`stop`) to :meth:`wait`
    for verdicts; a caller that folds verdicts itself calls :meth:`read` instead and
    never starts it.

    Args:
        js: a JetStream context whose user may publish on ``verify.>``, read the
            RESULTS stream (``STREAM.MSG.GET``) and subscribe on ``results.>``.
        job_id: the job (or batch) id of every request: ``results.<job_id>.>``.
        key: the requester key (:func:`~services.common.verdicts.job_key`,
            :func:`~services.common.verdicts.batch_key` or
            :func:`~services.common.verdicts.random_key`).
        task: request fields every request of this client shares (:func:`task_fields`);
            :meth:`request` adds the candidate's.
        catch_up_s: seconds between reads of the stream while a verdict is awaited
            (:data:`~services.common.verdicts.CATCH_UP_S`).
    """

    def __init__(self, js: JetStreamContext, job_id: str, key: bytes, *,
                 task: dict[str, Any] | None = None, catch_up_s: float = CATCH_UP_S) -> None:
        self.js = js
        self.job_id = job_id
        self.key = key
        self.task = dict(task or {})
        self.waiter = VerdictWaiter(js, job_id, key, catch_up_s=catch_up_s)
        self.started = False

    @property
    def results(self) -> dict[str, VerifyResult]:
        """The verdicts that counted so far, by request id."""
        return self.waiter.results

    def request(self, *, code: str, request_id: str | None = None,
                candidate_id: str | None = None, **fields: Any) -> VerifyRequest:
        """A sealed request of ``code`` under this client's job id: :func:`build_request`
        with the client's ``task`` fields, overridden by ``fields``.

        Raises:
            TypeError, ValueError: as :func:`build_request`.
        """
        return build_request(**{**self.task, **fields}, code=code, request_id=request_id,
                             job_id=self.job_id, candidate_id=candidate_id, key=self.key)

    def seal(self, request: VerifyRequest) -> VerifyRequest:
        """Set ``request.claim_nonce`` from this client's key (a request built
        elsewhere, e.g. checked before connecting); returns the request."""
        return self.waiter.seal(request)

    async def publish(self, request: VerifyRequest) -> PubAck:
        """Publish ``request`` (:func:`publish`); a started client awaits its verdict
        from now on (:meth:`expect`).

        Raises:
            nats.errors.Error: as :func:`publish`.
        """
        if self.started:
            self.expect(request.request_id)
        return await publish(self.js, request)

    async def __aenter__(self) -> VerifyClient:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(self) -> None:
        """Start collecting verdicts (those stored before are taken at once).

        Raises:
            nats.errors.Error: the wake-up subscription could not be made.
        """
        await self.waiter.start()
        self.started = True

    async def stop(self) -> None:
        """Stop collecting; pending waits stay unresolved."""
        self.started = False
        await self.waiter.stop()

    def expect(self, request_id: str) -> asyncio.Future[VerifyResult]:
        """An ``asyncio.Future`` resolved with the verdict of ``request_id`` (at once
        when it came already)."""
        return self.waiter.expect(request_id)

    async def wait(self, request_id: str, timeout_s: float, *,
                   watch: LaneWatch | None = None) -> VerifyResult:
        """The verdict of ``request_id`` (the client must be started).

        Args:
            timeout_s: how long to wait, seconds.
            watch: the request's lane; the wait ends early when it has had no live
                worker for its bound (services/common/lane_watch.py).

        Raises:
            TimeoutError: no verdict within ``timeout_s``.
            services.common.lane_watch.UnservedLane: ``watch`` saw no live worker for
                its bound; the message names the lane.
        """
        verdict = self.waiter.wait(request_id, timeout_s)
        return await (verdict if watch is None else while_served(verdict, watch))

    async def read(self) -> list[tuple[int, VerifyResult]]:
        """The verdicts that count, stored since the last read, with their RESULTS
        sequence, in stream order; for a caller that folds them itself (not while
        started: the waiter reads the same place).

        Raises:
            nats.errors.TimeoutError: JetStream did not answer; the next call resumes.
        """
        return await self.waiter.reader.read()
