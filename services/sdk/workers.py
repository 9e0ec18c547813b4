"""Workers for code you run yourself: :class:`RemoteWorker` (over NATS),
:class:`LocalWorker` (in this process) and the :class:`WorkerManager` that picks one.

These keep the HTTP AIKG service's worker API (docs/compatibility.md, "Kept"): ``register_local_worker([0], backend=..., arch=...)``,
``register_remote_worker(backend=..., arch=...)`` (capacity read from the workers
themselves), ``get_worker_manager().register(worker, backend=..., arch=..., capacity=...)``.
What changed: a remote worker is reached through NATS (``AIKG_NATS_URL``, not
``AIKG_WORKER_URL``) and device acquire/release happens on the worker side (its
``leases`` bucket), so ``verify`` / ``profile`` take the candidate source directly.

Both workers answer ``verify(task_desc, code, op_name, ...)`` with a
:class:`~schemas.events.VerifyResult`, so code written against one runs on the other.
"""

from __future__ import annotations

import abc
import asyncio
import atexit
import contextlib
import os
import socket
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec
import nats
import nats.errors
import nats.js.errors

from schemas import VerifyRequest, VerifyResult, WorkerInfo, decode, encode, new_id, subjects
from services.common.jobs import heartbeats
from services.common.lane_watch import LaneWatch, UnservedLane, while_served
from services.common.records import normalised_hash
from services.common.runtime import cancel_and_wait
from services.common.settings import (
    VERIFY_RESULT_TIMEOUT_S,
    Settings,
    load_settings,
    machine_arch,
    memory_limit_for,
)
from services.common.task_source import check_shape_overrides
from services.common.verdicts import VerdictWaiter, random_key

_CONNECT_TIMEOUT_S = 10.0
_STATUS_TIMEOUT_S = 2.0


class NoWorkerError(RuntimeError):
    """No worker offers the requested backend/arch; the message lists what there is."""


class Worker(Protocol):
    """What :class:`WorkerManager` needs of a worker."""

    backend: str | None
    arch: str | None

    @property
    def in_flight(self) -> int: ...

    async def capacity(self) -> int: ...

    async def verify(self, task_desc: str, code: str, op_name: str, **kwargs: Any
                     ) -> VerifyResult: ...

    async def close(self) -> None: ...


def build_request(task_desc: str, code: str, op_name: str, *, backend: str, arch: str,
                  mode: str = "verify", dsl: str = "triton", framework: str = "torch",
                  shape_overrides: dict[str, Any] | None = None, timeout_s: float = 300.0,
                  trials: int = 3, job_id: str | None = None,
                  candidate_id: str | None = None,
                  allow_unchecked: bool = False) -> VerifyRequest:
    """A validated VerifyRequest with fresh ids (``allow_unchecked``: accept a partial
    check, :class:`~schemas.events.VerifyRequest`).

    Raises:
        ValueError: a field breaks the wire schema; the message names it (e.g.
            ``Expected `float` > 0 - at `$.timeout_s```); or a ``shape_overrides`` name
            the task does not assign at top level (the message lists those it does).
    """
    # Source that does not parse is sent: the worker's verdict says what is wrong with it.
    check_shape_overrides(task_desc, shape_overrides)
    request = VerifyRequest(
        request_id=new_id("req-"), job_id=job_id or new_id("sdk-"),
        candidate_id=candidate_id or new_id("cand-"), op_name=op_name, task_desc=task_desc,
        code=code, backend=backend, arch=arch, dsl=dsl, framework=framework, mode=mode,
        shape_overrides=dict(shape_overrides or {}), timeout_s=timeout_s, trials=trials,
        allow_unchecked=allow_unchecked)
    try:
        # Constructors do not check constraints; a round trip through the wire does.
        return decode(encode(request), VerifyRequest)
    except msgspec.ValidationError as exc:
        raise ValueError(f"invalid verify request: {exc}") from exc


class _WorkerBase(abc.ABC):
    """What both workers share: ``backend`` / ``arch``, the count of verifications under
    way, a repr naming where they run, and :meth:`profile` as :meth:`verify` in profile
    mode. A subclass sets ``_where`` (the repr's first argument) and ``verify``."""

    backend: str | None
    arch: str | None
    _in_flight = 0

    @abc.abstractmethod
    def _where(self) -> str:
        """Where verifications run, as the repr's first argument."""

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self._where()}, backend={self.backend!r}, "
                f"arch={self.arch!r})")

    @property
    def in_flight(self) -> int:
        """Verifications under way on this worker now (a LocalWorker: devices running a
        candidate; a RemoteWorker: verdicts it is waiting on)."""
        return self._in_flight

    @abc.abstractmethod
    async def verify(self, task_desc: str, code: str, op_name: str, **kwargs: Any
                     ) -> VerifyResult:
        """Verify ``code`` against the task (the subclass's own docstring says how)."""

    async def profile(self, task_desc: str, code: str, op_name: str, **kwargs: Any
                      ) -> VerifyResult:
        """:meth:`verify` with ``mode="profile"``: also times the candidate and the
        reference on the same device (``base_time_us``, ``gen_time_us``, ``speedup``);
        on ``cpu`` the result says ``interpreted`` and carries no timings."""
        return await self.verify(task_desc, code, op_name, mode="profile", **kwargs)


class RemoteWorker(_WorkerBase):
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
                servers = [u.strip() for u in self.nats_url.split(",") if u.strip()]
                try:
                    self._nc = await asyncio.wait_for(nats.connect(
                        servers=servers, name="aikg-remote-worker", connect_timeout=5,
                        max_reconnect_attempts=-1, reconnect_time_wait=0.5,
                        **self._credentials),
                        _CONNECT_TIMEOUT_S)
                except (TimeoutError, nats.errors.NoServersError, OSError) as exc:
                    raise ConnectionError(f"cannot reach NATS at {self.nats_url}: "
                                          f"{exc or exc.__class__.__name__}") from exc
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
        answers (as the reference's capacity query when it fails)."""
        with contextlib.suppress(ConnectionError):
            return sum(w.capacity for w in await self.live_workers()) or 1
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
            waiter = VerdictWaiter(js, request.job_id, self._verdict_key)
            waiter.seal(request)
            try:
                await waiter.start()
                await js.publish(subjects.verify(request.backend, request.arch), encode(request),
                                 headers={"Nats-Msg-Id": request.request_id})
            except (nats.js.errors.NotFoundError, nats.js.errors.NoStreamResponseError,
                    nats.errors.NoRespondersError) as exc:
                await waiter.stop()
                raise ConnectionError(
                    f"NATS at {self.nats_url} has no AIKG streams ({exc.__class__.__name__}): "
                    "is it the server the AIKG workers use? (`aikg worker` creates them)"
                ) from exc
            try:
                return await while_served(
                    waiter.wait(request.request_id, self.result_timeout_s),
                    self._lane_watch(js, request.backend, request.arch))
            except UnservedLane as exc:
                raise NoWorkerError(f"request {request.request_id}: {exc}") from None
            except TimeoutError:
                raise TimeoutError(
                    f"no verdict for request {request.request_id} within "
                    f"{self.result_timeout_s:g} s: is a worker for {request.backend}/"
                    f"{request.arch} running and free? (`aikg workers`)") from None
            finally:
                await waiter.stop()
        finally:
            self._in_flight -= 1

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
        ones (same normalised AST, :func:`services.common.records.normalised_hash`)
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
        first: dict[str, int] = {}
        original = [first.setdefault(normalised_hash(code), i) for i, code in enumerate(codes)]
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
            async with VerdictWaiter(js, job_id, self._verdict_key) as waiter:
                for request in requests.values():
                    waiter.seal(request)
                    try:
                        await js.publish(subjects.verify(request.backend, request.arch),
                                         encode(request),
                                         headers={"Nats-Msg-Id": request.request_id})
                    except (nats.js.errors.NotFoundError, nats.js.errors.NoStreamResponseError,
                            nats.errors.NoRespondersError) as exc:
                        raise ConnectionError(
                            f"NATS at {self.nats_url} has no AIKG streams "
                            f"({exc.__class__.__name__}): is it the server the AIKG workers "
                            "use? (`aikg worker` creates them)") from exc
                pending = {waiter.expect(r.request_id): i for i, r in requests.items()}
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


class DevicePool:
    """The reference's device pool, kept for ``Task(device_pool=DevicePool([0]))``.

    Deprecated: call ``await register_local_worker([0], backend=..., arch=...)``.
    """

    def __init__(self, devices: Iterable[int | str]) -> None:
        self.devices = [str(d) for d in devices]


class LocalWorker(_WorkerBase):
    """Verify candidates in this process's sandbox, with no NATS and no network.

    Uses the worker's :class:`services.worker.verifier.Verifier` (a warm fork server;
    each candidate in its own sandboxed child) and a pool of ``devices``: at most one
    candidate per device at a time. The fork server starts on the first verify (a few
    seconds: it imports torch and triton) or on :meth:`start`.

    Args:
        devices: device ordinals (GPUs) or slots (cpu): ``[0]``, ``[0, 1, 2, 3]``.
        backend: ``cpu`` (Triton interpreter) | ``cuda`` | ``ascend``.
        arch: reported arch; default this machine's CPU arch on ``cpu``.
        memory_limit_bytes: largest total of a task's inputs, bytes; default 4 GiB on cpu.
        client_command: the command a too-large-inputs hint names with its ``--shape``
            option (``aikg run`` from the CLI); None: the hint names ``shape_overrides``
            only, as a library user passes them.
    """

    def __init__(self, devices: Iterable[int | str] = (0,), backend: str = "cpu",
                 arch: str | None = None, *, memory_limit_bytes: int | None = None,
                 client_command: str | None = None) -> None:
        self.devices = [str(d) for d in devices]
        if not self.devices:
            raise ValueError("LocalWorker needs at least one device (e.g. devices=[0])")
        if backend not in ("cpu", "cuda", "ascend"):
            raise ValueError(f"backend must be cpu, cuda or ascend, not {backend!r}")
        self.backend = backend
        self.arch = arch or (machine_arch() if backend == "cpu" else None)
        self.memory_limit_bytes = memory_limit_for(backend, memory_limit_bytes)
        self.worker_id = f"local-{socket.gethostname()[:32]}-{os.getpid()}"
        self.client_command = client_command
        self._verifier: Any = None
        self._free: asyncio.Queue[str] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def _where(self) -> str:
        return f"devices={self.devices!r}"

    async def capacity(self) -> int:
        """Number of devices: candidates run at once."""
        return len(self.devices)

    async def start(self) -> None:
        """Start the sandbox's fork server (idempotent; blocks a thread for seconds).

        Raises:
            services.sandbox.pool.PoolBroken: no sandboxed child could run here.
        """
        if self._verifier is None:
            from services.worker.verifier import Verifier

            self._verifier = Verifier(self.backend, worker_id=self.worker_id,
                                      memory_limit_bytes=self.memory_limit_bytes,
                                      client_command=self.client_command)
            atexit.register(self._verifier.close)
        await asyncio.to_thread(self._verifier.start)

    def abort_start(self) -> None:
        """Cut short a :meth:`start` still under way: its fork server, not ready yet, is
        killed and that start raises PoolBroken. A started sandbox is left alone; the
        next verify starts one again. For a caller that will verify nothing (the coder
        declined the task)."""
        if self._verifier is not None:
            self._verifier.abort_start()

    async def close(self) -> None:
        """Stop the fork server and every running child."""
        if self._verifier is not None:
            await asyncio.to_thread(self._verifier.close)

    def _pool(self) -> asyncio.Queue[str]:
        loop = asyncio.get_running_loop()
        if self._free is None or self._loop is not loop:
            # An asyncio.Queue belongs to one loop; a script may call asyncio.run twice.
            self._free, self._loop = asyncio.Queue(), loop
            for d in self.devices:
                self._free.put_nowait(d)
        return self._free

    async def acquire_device(self) -> str:
        """Wait for a free device and take it (the reference's ``acquire_device``)."""
        device = await self._pool().get()
        self._in_flight += 1
        return device

    def release_device(self, device: str) -> None:
        """Give a device back (the reference's ``release_device``)."""
        self._in_flight -= 1
        self._pool().put_nowait(device)

    async def verify(self, task_desc: str, code: str, op_name: str, *, dsl: str = "triton",
                     framework: str = "torch", shape_overrides: dict[str, Any] | None = None,
                     timeout_s: float = 300.0, trials: int = 3, job_id: str | None = None,
                     candidate_id: str | None = None, mode: str = "verify",
                     allow_unchecked: bool = False) -> VerifyResult:
        """Check ``code`` against ``task_desc`` on the next free device; arguments and
        result as :meth:`RemoteWorker.verify`. Never raises for the candidate's faults:
        they are a result with ``passed=False`` and a ``stage``.

        Raises:
            ValueError: a bad field (the message names it).
            services.sandbox.pool.PoolBroken: the sandbox cannot start here.
        """
        request = build_request(task_desc, code, op_name, backend=self.backend,
                                arch=self.arch or "local", mode=mode, dsl=dsl,
                                framework=framework, shape_overrides=shape_overrides,
                                timeout_s=timeout_s, trials=trials, job_id=job_id,
                                candidate_id=candidate_id, allow_unchecked=allow_unchecked)
        await self.start()
        device = await self.acquire_device()
        try:
            return await self._verifier.verify(request, device=device)
        finally:
            self.release_device(device)


@dataclass
class Registration:
    """A worker known to a :class:`WorkerManager`; ``arch`` None serves any arch."""

    worker: Any
    backend: str
    arch: str | None
    capacity: int

    @property
    def load(self) -> float:
        return self.worker.in_flight / max(self.capacity, 1)


class WorkerManager:
    """Registered workers, by backend and arch; :meth:`select` picks the least loaded.

    Load is a worker's in-flight verifications over its registered capacity.
    """

    def __init__(self) -> None:
        self.registrations: list[Registration] = []

    async def register(self, worker: Any, backend: str | None = None, arch: str | None = None,
                       capacity: int | None = None) -> Registration:
        """Add ``worker`` for ``backend``/``arch`` (default: the worker's own).

        Args:
            capacity: candidates it runs at once; None asks the worker (a LocalWorker's
                device count; a RemoteWorker's live workers' total, 1 if none).

        Raises:
            ValueError: no backend given or known.
        """
        backend = backend or getattr(worker, "backend", None)
        if not backend:
            raise ValueError("register needs backend= (cpu, cuda or ascend)")
        arch = arch or getattr(worker, "arch", None)
        if getattr(worker, "backend", None) is None:
            worker.backend = backend
        if getattr(worker, "arch", None) is None and arch is not None:
            worker.arch = arch
        if capacity is None:
            capacity = await worker.capacity()
        return self.add(worker, backend, arch, capacity)

    def add(self, worker: Any, backend: str, arch: str | None, capacity: int) -> Registration:
        """:meth:`register` without asking the worker (``capacity`` given)."""
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, not {capacity}")
        self.registrations = [r for r in self.registrations if r.worker is not worker]
        registration = Registration(worker, backend, arch, capacity)
        self.registrations.append(registration)
        return registration

    def unregister(self, worker: Any) -> None:
        """Forget ``worker`` (it is not closed)."""
        self.registrations = [r for r in self.registrations if r.worker is not worker]

    @property
    def workers(self) -> list[Any]:
        return [r.worker for r in self.registrations]

    def select(self, backend: str, arch: str | None = None) -> Any:
        """The least loaded worker registered for ``backend``/``arch`` (any arch when
        ``arch`` is None; a worker registered without arch serves any).

        Raises:
            NoWorkerError: none registered; the message lists what is.
        """
        matching = [r for r in self.registrations if r.backend == backend
                    and (arch is None or r.arch is None or r.arch == arch)]
        if not matching:
            known = sorted({f"{r.backend}/{r.arch or '*'}" for r in self.registrations})
            raise NoWorkerError(
                f"no worker registered for {backend}/{arch or '*'} (registered: "
                f"{', '.join(known) or 'none'}); call `await register_local_worker([0], "
                f"backend={backend!r}, arch=...)` or `await register_remote_worker("
                f"backend={backend!r}, arch=...)` first")
        return min(matching, key=lambda r: r.load).worker

    async def close(self) -> None:
        """Close every registered worker and forget them."""
        registrations, self.registrations = self.registrations, []
        for r in registrations:
            with contextlib.suppress(Exception):
                await r.worker.close()


_MANAGER = WorkerManager()


def get_worker_manager() -> WorkerManager:
    """The process-wide manager that :class:`~services.sdk.task.Task` uses by default."""
    return _MANAGER


async def register_local_worker(devices: Iterable[int | str] = (0,), backend: str = "cpu",
                                arch: str | None = None) -> LocalWorker:
    """Register a :class:`LocalWorker` on ``devices`` with the process-wide manager.

    Returns:
        The worker (its sandbox starts on first use).
    """
    worker = LocalWorker(devices, backend=backend, arch=arch)
    await get_worker_manager().register(worker, backend, worker.arch)
    return worker


async def register_remote_worker(backend: str, arch: str | None = None,
                                 nats_url: str | None = None, capacity: int | None = None,
                                 *, worker_url: str | None = None,
                                 settings: Settings | None = None) -> RemoteWorker:
    """Register a :class:`RemoteWorker` with the process-wide manager.

    Args:
        nats_url: NATS URL of the AIKG workers; None reads ``AIKG_NATS_URL``.
        capacity: None reads it from the workers: the sum of the capacities of the live
            workers of ``backend``/``arch`` in the ``workers`` bucket (1 if none).
        worker_url: the reference's keyword; accepted when it is a NATS URL.
        settings: NATS credentials, as for :class:`RemoteWorker`; None reads the
            ``AIKG_NATS_*`` variables.

    Raises:
        ValueError: no NATS URL, an HTTP one, or incomplete credentials.
    """
    worker = RemoteWorker(nats_url or worker_url, backend=backend, arch=arch, settings=settings)
    await get_worker_manager().register(worker, backend, arch, capacity)
    return worker
