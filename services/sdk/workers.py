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

This module holds the manager and the ``register_*`` calls, and is where the workers
are imported from: :class:`RemoteWorker` lives in services/sdk/remote_worker.py,
:class:`LocalWorker` in services/sdk/local_worker.py, what they share in
services/sdk/worker_base.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from services.common.settings import Settings
from services.sdk.local_worker import DevicePool, LocalWorker
from services.sdk.remote_worker import RemoteWorker
from services.sdk.worker_base import NoWorkerError, Worker, build_request

__all__ = [
    "DevicePool",
    "LocalWorker",
    "NoWorkerError",
    "Registration",
    "RemoteWorker",
    "Worker",
    "WorkerManager",
    "build_request",
    "get_worker_manager",
    "register_local_worker",
    "register_remote_worker",
]


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
