"""The GPU compile check's compiler of one worker: which targets every kernel is
compiled for, a compile child per job, and the results kept in this process.

A verification's :class:`~services.worker.procedure.compile_check.CompileCheck` sends
each new kernel specialisation (:class:`services.worker.aot.CompileSpec`) here; a
:class:`KernelCompiler` answers those it compiled before from this process's cache (at most
:data:`COMPILE_CACHE_ENTRIES`, oldest dropped first) and the rest from one ``compile``
child (:func:`services.worker.aot.compile_in_child`, forked from the worker's sandbox;
its address space and CPU time are the ``compile`` row of the verifier's child limits).
"""

from __future__ import annotations

import os

import structlog

from schemas.events import VerifyRequest
from services.sandbox.limits import ChildLimits
from services.sandbox.pool import Sandbox
from services.worker import aot
from services.worker.targets import TARGETS, GpuTarget, target_for
from services.worker.wire import CompileResult

log = structlog.get_logger("aikg.worker.compiler")

# Compile results kept in this process (kernel specialisations).
COMPILE_CACHE_ENTRIES = 4096
# The GPU a cpu worker compiles for when the request's arch names none (setting
# worker_aot_target; see services.worker.targets).
DEFAULT_AOT_TARGET = "h100"


class KernelCompiler:
    """Compiles kernel specialisations for GPU targets in ``sandbox``'s children.

    Args:
        backend: the worker's backend (the compile child's limits row is per backend).
        aot_target: the GPU every kernel is compiled for when the request's arch names
            none; ``""`` or ``"none"``: the compile check is off (``aot_target`` is
            ``""`` then).
        extra_targets: GPU targets every kernel is also compiled for, comma-separated
            (setting ``worker_compile_extra_targets``): ``auto`` the other vendor's
            (:meth:`extra_targets`), ``none`` or ``""`` none.

    Raises:
        ValueError: an unknown target name (the message lists the known ones).
    """

    def __init__(self, backend: str, aot_target: str = DEFAULT_AOT_TARGET,
                 extra_targets: str = "auto") -> None:
        if aot_target and aot_target.lower() != "none" and aot_target.lower() not in TARGETS:
            raise ValueError(f"unknown aot target {aot_target!r}; choose from "
                             f"{', '.join(sorted(TARGETS))} or none")
        extra = [t.strip().lower() for t in (extra_targets or "").split(",")
                 if t.strip() and t.strip().lower() != "none"]
        unknown = [t for t in extra if t != "auto" and t not in TARGETS]
        if unknown:
            raise ValueError(f"unknown compile extra target {unknown[0]!r}; choose from "
                             f"{', '.join(sorted(TARGETS))}, auto or none")
        self.backend = backend
        self.aot_target = "" if not aot_target or aot_target.lower() == "none" else aot_target
        self.extra_target_names = tuple(extra)
        self._compiled: dict[str, CompileResult] = {}

    def clear(self) -> None:
        """Forget the compile results kept in this process."""
        self._compiled.clear()

    def extra_targets(self, primary: GpuTarget) -> list[GpuTarget]:
        """The targets every kernel is compiled for beside ``primary`` (the request's):
        those of ``extra_targets``, ``auto`` being the other vendor's flagship
        (``mi300x`` beside an NVIDIA target, ``h100`` beside an AMD one); never one of
        ``primary``'s arch."""
        names = [("h100" if primary.backend == "hip" else "mi300x") if n == "auto" else n
                 for n in self.extra_target_names]
        found: list[GpuTarget] = []
        for name in names:
            t = target_for(name)
            if t.sm != primary.sm and all(t.sm != f.sm for f in found):
                found.append(t)
        return found

    async def compile(self, sandbox: Sandbox, limits: ChildLimits, request: VerifyRequest,
                      specs: list[aot.CompileSpec], target: GpuTarget, source: str
                      ) -> tuple[dict[str, CompileResult], list[aot.CompileSpec],
                                 aot.CompileFailure | None]:
        """Compile results of ``specs`` (the candidate's kernel module ``source``) for
        ``target``, from this process's cache, else one compile child: the results by
        key, ``specs``, and why the child gave none (None: every spec has its
        result). The child's address space and CPU time are ``limits``' ``compile``
        row."""
        missing = [s for s in specs if s.key not in self._compiled]
        failure = None
        if missing:
            scratch = sandbox.scratch(request.request_id, "compile")
            (scratch / "candidate.py").write_text(source)
            space, cpu_seconds, notes = limits.notes(
                "compile", self.backend, aot.COMPILE_WALL_S, cores=1)
            spec = sandbox.spec("compile", scratch, "compile",
                                candidate_path=str(scratch / "candidate.py"),
                                arch=request.arch,
                                params={"compile_target": target.name,
                                        "compile_specs": [s.wire() for s in missing]},
                                frame_key=os.urandom(32), cpu_seconds=cpu_seconds,
                                address_space_bytes=space, limit_notes=notes)
            results, failure = await aot.compile_in_child(sandbox, spec, len(missing))
            if failure is not None:
                log.warning("compile.failed", stage=failure.stage, error=failure.message)
            for result in results:
                self._compiled[result.key] = result
            while len(self._compiled) > COMPILE_CACHE_ENTRIES:
                self._compiled.pop(next(iter(self._compiled)))
        return ({s.key: self._compiled[s.key] for s in specs if s.key in self._compiled},
                specs, failure)
