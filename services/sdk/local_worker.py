"""``LocalWorker``: verify candidates in this process's sandbox, with no NATS and no
network (local mode), and the reference's ``DevicePool``.
"""

from __future__ import annotations

import asyncio
import atexit
import os
import socket
import time
from collections.abc import Callable, Iterable
from typing import Any

from schemas import VerifyResult
from schemas.events import VerifyPhase
from services.common.settings import machine_arch, memory_limit_for
from services.sdk.worker_base import WorkerBase, build_request


class DevicePool:
    """The reference's device pool, kept for ``Task(device_pool=DevicePool([0]))``.

    Deprecated: call ``await register_local_worker([0], backend=..., arch=...)``.
    """

    def __init__(self, devices: Iterable[int | str]) -> None:
        self.devices = [str(d) for d in devices]


class LocalWorker(WorkerBase):
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
        on_phase: told each phase of every verification as it starts and ends (a
            :class:`~schemas.events.VerifyPhase`; the sandbox's start included), in the
            verifying event loop; it must not block (a status line's update).
    """

    def __init__(self, devices: Iterable[int | str] = (0,), backend: str = "cpu",
                 arch: str | None = None, *, memory_limit_bytes: int | None = None,
                 client_command: str | None = None,
                 on_phase: Callable[[VerifyPhase], None] | None = None) -> None:
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
        self.on_phase = on_phase
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
        if self.on_phase is None or self._verifier.sandbox.started:
            await asyncio.to_thread(self._verifier.start)
            return
        from services.worker.progress import phase

        self.on_phase(phase("sandbox_start"))
        starting = time.monotonic()
        await asyncio.to_thread(self._verifier.start)
        self.on_phase(phase("sandbox_start", "ended", time.monotonic() - starting))

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
                     allow_unchecked: bool = False, source: str | None = None
                     ) -> VerifyResult:
        """Check ``code`` against ``task_desc`` on the next free device; arguments and
        result as :meth:`RemoteWorker.verify`; ``source``: the file ``code`` was read
        from, which the verdict's messages and tracebacks name (default
        ``candidate.py``). Never raises for the candidate's faults: they are a result
        with ``passed=False`` and a ``stage``.

        Raises:
            ValueError: a bad field (the message names it).
            services.sandbox.pool.PoolBroken: the sandbox cannot start here.
        """
        request = build_request(task_desc, code, op_name, backend=self.backend,
                                arch=self.arch or "local", mode=mode, dsl=dsl,
                                framework=framework, shape_overrides=shape_overrides,
                                timeout_s=timeout_s, trials=trials, job_id=job_id,
                                candidate_id=candidate_id, allow_unchecked=allow_unchecked,
                                source=source)
        await self.start()
        device = await self.acquire_device()
        try:
            return await self._verifier.verify(request, device=device, on_phase=self.on_phase)
        finally:
            self.release_device(device)
