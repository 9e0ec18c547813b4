"""What the SDK's workers share: the :class:`Worker` protocol a
:class:`~services.sdk.workers.WorkerManager` needs, :class:`NoWorkerError`, the
checked request both workers send (:func:`build_request`) and their common base.
"""

from __future__ import annotations

import abc
from typing import Any, Protocol

from schemas import VerifyRequest, VerifyResult
from services.common.task_source import check_shape_overrides
from services.common.verify_client import build_request as verify_request


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
                  allow_unchecked: bool = False, source: str | None = None) -> VerifyRequest:
    """A validated VerifyRequest with fresh ids, not sealed yet
    (:func:`services.common.verify_client.build_request`; ``allow_unchecked``: accept a
    partial check, :class:`~schemas.events.VerifyRequest`; ``source``: the file the
    code was read from, which the verdict's messages name instead of ``candidate.py``).

    Raises:
        ValueError: a field breaks the wire schema; the message names it (e.g.
            ``Expected `float` > 0 - at `$.timeout_s```); or a ``shape_overrides`` name
            the task does not assign at top level (the message lists those it does).
    """
    # Source that does not parse is sent: the worker's verdict says what is wrong with it.
    check_shape_overrides(task_desc, shape_overrides)
    return verify_request(task_desc=task_desc, code=code, op_name=op_name, backend=backend,
                          arch=arch, job_id=job_id, candidate_id=candidate_id, dsl=dsl,
                          framework=framework, mode=mode,
                          shape_overrides=dict(shape_overrides or {}), timeout_s=timeout_s,
                          trials=trials, allow_unchecked=allow_unchecked, source=source,
                          validate=True)


class WorkerBase(abc.ABC):
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
