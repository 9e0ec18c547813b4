"""``RemoteWorker``: verify candidates on AIKG workers over NATS (worker-only mode),
through the one verify client (services/common/verify_client.py): each request sealed
with this process's requester key, published on its lane, and its verdict counted only
from the worker that holds it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import nats
import nats.errors
import nats.js.errors

from schemas import VerifyRequest, VerifyResult, WorkerInfo, new_id, subjects
from services.common.jobs import heartbeats
from services.common.lane_watch import LaneWatch, UnservedLane
from services.common.runtime import cancel_and_wait
from services.common.settings import VERIFY_RESULT_TIMEOUT_S, Settings, load_settings
from services.common.verdicts import random_key
from services.common.verify_client import VerifyClient, originals
from services.sdk.worker_base import NoWorkerError, WorkerBase, build_request

_CONNECT_TIMEOUT_S = 10.0
_STATUS_TIMEOUT_S = 2.0
# The SDK's logger: a library's, silent until the application configures logging.
log = logging.getLogger("aikg.sdk")


async def _log_error(exc: Exception) -> None:
    """nats-py's error callback: one warning line, no traceback."""
    from services.common.bus import describe_error

    log.warning("NATS: %s", describe_error(exc))


class RemoteWorker(WorkerBase):
    """Verify candidates on AIKG workers over NATS (worker-only mode).

    Publishes each request on ``verify.<backend>.<arch>`` (stream VERIFY, shared by
    every worker of that pair) and waits for the verdict on ``results.<job_id>.>``
    (stream RESULTS). There is no job record: the request carries a fresh job id
    of its own, which workers accept as a worker-only request.

    Args:
        nats_url: NATS URL(s) of the AIKG workers, comma-separated; None: the
            settings' ``nats_url`` (``AIKG_NATS_URL``).
        backend: ``cpu`` | ``cuda`` | ``ascend``; may be left to
            :meth:`WorkerManager.register`.
        arch: e.g. ``h200``; None picks the least loaded live arch of ``backend``.
        result_timeout_s: how long one verification may take, queueing included,
            seconds.
        require_live_worker: refuse to send a request no live worker would take
            (:class:`NoWorkerError`) rather than leave it queued.
        unserved_timeout_s: once a request is sent, how long its backend/arch may have
            no live worker before the call fails with :class:`NoWorkerError` naming the
            lane, seconds (services/common/lane_watch.py); None: the settings'
            ``verify_unserved_timeout_s`` (60 s); 0: wait for ``result_timeout_s``.
        settings: the NATS credentials to connect with (``nats_user`` /
            ``nats_password``, ``nats_token``, ``nats_creds_file`` ..., see
            :func:`services.common.bus.nats_credentials`); None reads them from the
            ``AIKG_NATS_*`` variables. On a deployment with per-service users, give it
            a user with the generator's rights (``verify.>``, ``RESULTS``, the
            ``workers`` bucket) and ``aikg.worker.*.status``.

    Raises:
        ValueError: no URL, an ``http://`` URL (the reference's worker URL), or
            incomplete credentials.
    """

    def __init__(self, nats_url: str | None = None, backend: str | None = None,
                 arch: str | None = None, *, result_timeout_s: float = VERIFY_RESULT_TIMEOUT_S,
                 require_live_worker: bool = True, settings: Settings | None = None,
                 unserved_timeout_s: float | None = None) -> None:
        from services.common.bus import inbox_prefix_of, nats_credentials

        settings = load_settings() if settings is None else settings
        self._settings = settings
        self._credentials = nats_credentials(settings)
        # Seals this client's requests (services/common/verdicts.py): it never reads
        # verdicts after a restart, so a random key does.
        self._verdict_key = random_key()
        # Replies on the user's own inbox prefix: the only one its user may subscribe to.
        self._credentials["inbox_prefix"] = inbox_prefix_of(settings, self._credentials)
        url = nats_url or settings.nats_url
        if not url:
            raise ValueError("RemoteWorker needs the NATS URL of the AIKG workers: pass "
                             "nats_url='nats://host:4222' or set AIKG_NATS_URL")
        if url.startswith(("http://", "https://")):
            raise ValueError(f"{url!r} is an HTTP URL; AIKG workers are reached through NATS: "
                             "pass the NATS URL they use (nats://host:4222, AIKG_NATS_URL)")
        self.nats_url = url
        self.backend = backend
        self.arch = arch
        self.result_timeout_s = result_timeout_s
        self.require_live_worker = require_live_worker
        self.unserved_timeout_s = (settings.verify_unserved_timeout_s
                                   if unserved_timeout_s is None else unserved_timeout_s)
        self._nc: Any = None
        self._connect_lock: asyncio.Lock | None = None

    def _where(self) -> str:
        return repr(self.nats_url)

    async def _connection(self):
        if self._nc is not None and not self._nc.is_closed:
            return self._nc
        if self._connect_lock is None:
            self._connect_lock = asyncio.Lock()
        async with self._connect_lock:
            if self._nc is None or self._nc.is_closed:
                from services.common.bus import open_nats

                # Each error goes to the SDK's logger (silent unless the application
                # configures logging), not nats-py's traceback per try; a refusal of the
                # credentials ends the tries with one line naming them.
                self._nc = await open_nats(self.nats_url, "aikg-remote-worker",
                                           self._credentials, settings=self._settings,
                                           timeout_s=_CONNECT_TIMEOUT_S, error_cb=_log_error)
        return self._nc

    async def close(self) -> None:
        """Close the NATS connection (opened again by the next call)."""
        if self._nc is not None and not self._nc.is_closed:
            with contextlib.suppress(Exception):
                await self._nc.drain()
        self._nc = None

    async def live_workers(self) -> list[WorkerInfo]:
        """Live workers of this backend (and arch, when set), from the ``workers`` bucket."""
        nc = await self._connection()
        out = [info for info in await heartbeats(nc.jetstream())
               if (self.backend is None or info.backend == self.backend)
               and (self.arch is None or info.arch == self.arch)]
        return sorted(out, key=lambda w: w.worker_id)

    async def capacity(self) -> int:
        """Sum of the capacities of the live workers of this backend/arch; 1 when none
        answers (as the reference's capacity query when it fails).

        Raises:
            services.common.bus.NatsAuthError: the server refused the credentials
                (a ConnectionError that waiting cannot cure, so it is not taken for
                "no answer"); the message names the settings to set.
        """
        from services.common.bus import NatsAuthError

        try:
            return sum(w.capacity for w in await self.live_workers()) or 1
        except NatsAuthError:
            raise
        except ConnectionError:
            return 1

    async def status(self) -> dict[str, Any]:
        """Backend, arch, total capacity and in-flight, and each live worker's status.

        Each worker's entry is its ``nats micro`` status reply (WorkerInfo fields plus
        the ``leases`` it holds), or its heartbeat when it does not answer in time.
        """
        nc = await self._connection()
        workers = []
        for info in await self.live_workers():
            body = msgspec.structs.asdict(info)
            try:
                reply = await nc.request(f"{subjects.worker_service(info.worker_id)}.status", b"",
                                         timeout=_STATUS_TIMEOUT_S)
                body = msgspec.json.decode(reply.data)
            except (nats.errors.TimeoutError, nats.errors.NoRespondersError, msgspec.DecodeError):
                body["leases"] = None
            workers.append(msgspec.to_builtins(body))
        return {
            "backend": self.backend, "arch": self.arch, "nats_url": self.nats_url,
            "capacity": sum(w.get("capacity", 0) for w in workers),
            "in_flight": sum(w.get("in_flight", 0) for w in workers),
            "devices": sum(len(w.get("devices", [])) for w in workers),
            "workers": workers,
        }

    async def _target_arch(self) -> str:
        if self.backend is None:
            raise ValueError("this RemoteWorker has no backend: pass backend= or register it "
                             "with WorkerManager.register(worker, backend=..., arch=...)")
        if self.arch is not None and not self.require_live_worker:
            return self.arch
        live = await self.live_workers()
        if live:
            return self.arch or min(live, key=lambda w: w.in_flight / max(w.capacity, 1)).arch
        wanted = f"{self.backend}/{self.arch or '*'}"
        raise NoWorkerError(f"no live AIKG worker for {wanted} at {self.nats_url}: start one "
                            f"(`aikg worker --backend {self.backend}"
                            f"{' --arch ' + self.arch if self.arch else ''}`) or check "
                            "`aikg workers`")

    async def verify(self, task_desc: str, code: str, op_name: str, *, dsl: str = "triton",
                     framework: str = "torch", shape_overrides: dict[str, Any] | None = None,
                     timeout_s: float = 300.0, trials: int = 3, job_id: str | None = None,
                     candidate_id: str | None = None, mode: str = "verify",
                     allow_unchecked: bool = False) -> VerifyResult:
        """Check ``code`` (source defining ``ModelNew``) against ``task_desc``'s ``Model``.

        Args:
            timeout_s: the worker's wall-clock limit for the candidate's run, seconds.
            trials: seeds, each with fresh inputs.
            job_id: results subject to use (``results.<job_id>.>``); default a fresh id.
            mode: ``verify``, or ``profile`` to time it too (GPU backends).
            allow_unchecked: accept a partial check: a verdict whose path at the task's
                own sizes no checked size reached passes, with ``stage`` ``unchecked``
                and a note (default: it fails at that stage).

        Returns:
            The worker's verdict (``passed``, ``stage``, ``error``, timings in us).

        Raises:
            NoWorkerError: no live worker for backend/arch (``require_live_worker``),
                or none for ``unserved_timeout_s`` while the request waited.
            TimeoutError: no verdict within ``result_timeout_s``.
            ConnectionError: NATS unreachable, or it has no AIKG streams.
            ValueError: a bad field (the message names it).
        """
        arch = await self._target_arch()
        request = build_request(task_desc, code, op_name, backend=self.backend or "", arch=arch,
                                mode=mode, dsl=dsl, framework=framework,
                                shape_overrides=shape_overrides, timeout_s=timeout_s,
                                trials=trials, job_id=job_id, candidate_id=candidate_id,
                                allow_unchecked=allow_unchecked)
        nc = await self._connection()
        js = nc.jetstream(timeout=10)
        self._in_flight += 1
        try:
            async with VerifyClient(js, request.job_id, self._verdict_key) as client:
                await self._publish(client, client.seal(request))
                try:
                    return await client.wait(
                        request.request_id, self.result_timeout_s,
                        watch=self._lane_watch(js, request.backend, request.arch))
                except UnservedLane as exc:
                    raise NoWorkerError(f"request {request.request_id}: {exc}") from None
                except TimeoutError:
                    raise TimeoutError(
                        f"no verdict for request {request.request_id} within "
                        f"{self.result_timeout_s:g} s: is a worker for {request.backend}/"
                        f"{request.arch} running and free? (`aikg workers`)") from None
        finally:
            self._in_flight -= 1

    async def _publish(self, client: VerifyClient, request: VerifyRequest) -> None:
        """Publish ``request`` through ``client`` (its lane, its id as ``Nats-Msg-Id``).

        Raises:
            ConnectionError: no stream captures the subject: not the workers' NATS.
        """
        try:
            await client.publish(request)
        except (nats.js.errors.NotFoundError, nats.js.errors.NoStreamResponseError,
                nats.errors.NoRespondersError) as exc:
            raise ConnectionError(
                f"NATS at {self.nats_url} has no AIKG streams ({exc.__class__.__name__}): "
                "is it the server the AIKG workers use? (`aikg worker` creates them)"
            ) from exc

    def _lane_watch(self, js: Any, backend: str, arch: str) -> LaneWatch:
        return LaneWatch(js, backend, arch, self.unserved_timeout_s, waiter="sdk")

    async def verify_many(self, task_desc: str, codes: Sequence[str], op_name: str, *,
                          dsl: str = "triton", framework: str = "torch",
                          shape_overrides: dict[str, Any] | None = None,
                          timeout_s: float = 300.0, trials: int = 3, mode: str = "verify",
                          job_id: str | None = None,
                          on_verdict: Callable[[int, VerifyResult], Any] | None = None,
                          ) -> list[VerifyResult]:
        """Check every code of ``codes`` against ``task_desc``'s ``Model``; identical
        ones (same normalised AST, :func:`services.common.verify_client.originals`)
        once, sharing the verdict.

        All requests go out at once under one job id (``results.<job_id>.>``; default a
        fresh one); the workers of the pair take them as they have devices free.

        Args:
            codes: candidate sources, each defining ``ModelNew``.
            timeout_s, trials, mode: as :meth:`verify`, for each verification.
            on_verdict: called with ``(index in codes, verdict)`` for each code as its
                verdict lands (a duplicate right after its original).

        Returns:
            One verdict per code, in the order of ``codes``; a duplicate's is its
            original's (``candidate_id`` the original's).

        Raises:
            NoWorkerError, ConnectionError, ValueError: as :meth:`verify` (a bad field
                before anything is sent; the verdicts still awaited when the lane went
                unserved stay queued).
            TimeoutError: no verdict landed for ``result_timeout_s`` seconds while some
                were still awaited (the ones still queued stay queued).
        """
        if not codes:
            return []
        arch = await self._target_arch()
        job_id = job_id or new_id("sdk-")
        original, _ = originals(codes)
        requests = {i: build_request(
            task_desc, codes[i], op_name, backend=self.backend or "", arch=arch, mode=mode,
            dsl=dsl, framework=framework, shape_overrides=shape_overrides,
            timeout_s=timeout_s, trials=trials, job_id=job_id,
            candidate_id=f"{job_id}-c{i}") for i in sorted(set(original))}
        nc = await self._connection()
        js = nc.jetstream(timeout=10)
        results: dict[int, VerifyResult] = {}
        self._in_flight += len(requests)
        try:
            async with VerifyClient(js, job_id, self._verdict_key) as client:
                for request in requests.values():
                    await self._publish(client, client.seal(request))
                pending = {client.expect(r.request_id): i for i, r in requests.items()}
                watch = self._lane_watch(js, self.backend or "", arch)
                guard = asyncio.create_task(watch.wait()) if watch.active else None
                try:
                    await self._collect(pending, requests, original, results, job_id, arch,
                                        guard, on_verdict)
                finally:
                    if guard is not None:
                        await cancel_and_wait(guard)
        finally:
            self._in_flight -= len(requests)
        return [results[i] for i in range(len(codes))]

    async def _collect(self, pending: dict[asyncio.Future, int], requests: dict[int, Any],
                       original: list[int], results: dict[int, VerifyResult], job_id: str,
                       arch: str, guard: asyncio.Task | None,
                       on_verdict: Callable[[int, VerifyResult], Any] | None) -> None:
        """:meth:`verify_many`'s wait: each verdict into ``results`` (and its
        duplicates') as it lands, until none is pending.

        Raises:
            NoWorkerError: ``guard`` (the lane's watch) ended first: no live worker.
            TimeoutError: no verdict for ``result_timeout_s``.
        """
        while pending:
            done, _ = await asyncio.wait(
                [*pending, *([guard] if guard is not None else [])],
                timeout=self.result_timeout_s, return_when=asyncio.FIRST_COMPLETED)
            verdicts = [f for f in done if f is not guard]
            if not verdicts and guard is not None and guard.done():
                raise NoWorkerError(f"{len(pending)} of {len(requests)} requests of "
                                    f"{job_id}: {guard.result()}")
            if not done:
                raise TimeoutError(
                    f"no verdict for {len(pending)} of {len(requests)} requests of "
                    f"{job_id} within {self.result_timeout_s:g} s: is a worker for "
                    f"{self.backend}/{arch} running and free? (`aikg workers`)")
            for future in verdicts:
                index = pending.pop(future)
                for i, source in enumerate(original):
                    if source == index:
                        results[i] = future.result()
                        if on_verdict is not None:
                            on_verdict(i, results[i])
