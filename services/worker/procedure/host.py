"""What a :class:`~services.worker.procedure.core.Procedure` needs of the verifier that
runs it, as typed protocols: its limits, its children, the GPU compile and the
baselines. :class:`services.worker.verifier.Verifier` is one :class:`Host`; a step of
the procedure is given the narrowest of these it uses.

The procedure never reaches into the verifier beyond these members, and the verifier
never into the procedure: it gets an :class:`~services.worker.procedure.outcome.Outcome`
or a :class:`~services.worker.procedure.outcome.Verdict` back.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

from schemas.events import VerifyRequest
from services.worker.cache import BaselineKind, BaselineOrigin, BaseTime

if TYPE_CHECKING:
    from services.sandbox.channel import ChildRun
    from services.worker.aot import CompileFailure, CompileSpec
    from services.worker.targets import GpuTarget
    from services.worker.wire import CompileResult


class Limits(Protocol):
    """The verifier's settings a verification reads (see
    :class:`services.worker.verifier.Verifier` for each)."""

    backend: str
    memory_limit_bytes: int | None
    output_limit_bytes: int
    task_timeout_s: float
    check_bytes: int | None
    speedup_flag_bound: float
    compile_timeout_s: float

    @property
    def max_frame_bytes(self) -> int: ...

    def size_hint(self, need: int, limit: int, names: Mapping[str, Any]) -> str:
        """How to shrink inputs of ``need`` bytes below ``limit`` (a shape_overrides
        suggestion naming one of ``names``)."""
        ...


class Children(Protocol):
    """Sandboxed children of one verification."""

    async def spawn(self, request: VerifyRequest, role: str, device: str, *,
                    address_space_bytes: int | None = None,
                    kernels: str | None = None) -> ChildRun:
        """A started child of ``role`` (``reference``, ``candidate``, ``replay``) for
        ``request`` on ``device``; ``kernels``: the replayer's kernel module.

        Raises:
            services.sandbox.errors.PoolBroken: the sandbox cannot fork it.
        """
        ...


class Compiler(Protocol):
    """The GPU compile check's compiler (:mod:`services.worker.compiler`)."""

    extra_targets_required: bool

    @property
    def aot_target(self) -> str:
        """The GPU compiled for when the request's arch names none (``""``: off)."""
        ...

    def extra_targets(self, primary: GpuTarget) -> list[GpuTarget]:
        """The targets every kernel is compiled for beside ``primary``."""
        ...

    async def compile(self, request: VerifyRequest, specs: list[CompileSpec],
                      target: GpuTarget, source: str) -> tuple[
                          dict[str, CompileResult], list[CompileSpec],
                          CompileFailure | None]:
        """The results of ``specs`` by key, the specs asked, and why a compile child
        gave none (None: every spec has its result)."""
        ...


class Baselines(Protocol):
    """Baseline timings of the task's Model (:mod:`services.worker.cache`)."""

    async def cached_baseline(self, request: VerifyRequest, kind: BaselineKind = "eager"
                              ) -> tuple[BaseTime | None, BaselineOrigin]:
        """The baseline of ``kind`` for ``request``'s task, arch and shapes and where it
        came from, or ``(None, "measured")`` when it must be measured."""
        ...

    async def keep_baseline(self, request: VerifyRequest, kind: BaselineKind,
                            median_us: float, error: str = "") -> BaseTime:
        """Keep a measured baseline (``error``: why it could not be measured)."""
        ...


class Host(Limits, Children, Compiler, Baselines, Protocol):
    """Everything a procedure needs of its verifier."""
