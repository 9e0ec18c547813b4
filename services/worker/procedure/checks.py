"""The checks of one verification besides its trials: the ahead-of-time compile of
every kernel for a GPU target, and the audit of the candidate's process.

:class:`Checks` is the part of :class:`~services.worker.procedure.core.Procedure` that
starts the compile check once the first call is planned (:mod:`services.worker.aot`)
and judges its results; reads the planner's audit frame; and turns what the
candidate's process refused (rules D002, D004, D016) or changed in torch's and
triton's namespaces (rule D017, :mod:`services.worker.rules`) into verdicts.
"""

from __future__ import annotations

import asyncio
from typing import Any

from services.worker import aot
from services.worker.children import ChildFailed
from services.worker.procedure.outcome import Verdict
from services.worker.targets import target_for


class Checks:
    """Compile check and audit of a :class:`~services.worker.procedure.core.Procedure`
    (a mixin: its state is the procedure's)."""

    def _start_compile(self) -> None:
        target_name = self.v.aot_target
        if not target_name or self.first_call is None:
            return
        target = target_for(self.request.arch, default=target_name)
        launches = [("the task's own sizes", e) for e in self.real_launches or []]
        launches += [("the checked sizes", e) for e in self.first_call.traced[0].events
                     if isinstance(e, dict) and "launch" in e]
        specs, notes = aot.specs(launches, self.kernels.constexpr_params, target,
                                 self.source_sha, self.kernels.bodies)
        self.compile_notes = notes
        self.compile_target = target
        self.compile_task = asyncio.ensure_future(self.v.compile(self.request, specs, target,
                                                                 self.kernels.source))
        self.tasks.append(self.compile_task)

    async def _compile_result(self) -> Verdict | None:
        if self.compile_task is None:
            return None
        results, specs = await self.compile_task
        target = self.compile_target
        by_kernel: dict[str, list[tuple[Any, Any]]] = {}
        for spec in specs:
            by_kernel.setdefault(spec.kernel + spec.where.split(", config")[0], []).append(
                (spec, results.get(spec.key)))
        for _, pairs in by_kernel.items():
            failed = [(s, r) for s, r in pairs if r is not None and not r.ok]
            if not failed:
                continue
            autotuned = any(", config" in s.where for s, _ in pairs)
            resources = all(r.error.startswith("OutOfResources") for _, r in failed)
            if autotuned and resources and len(failed) < len(pairs):
                for s, r in failed:
                    self.notes.append(f"autotune: {s.kernel} {s.where} is skipped on "
                                      f"{target.sm} ({target.name}) as a GPU autotuner would: "
                                      f"{r.error}")
                continue
            spec, result = failed[0]
            error = self.kernels.file_line(spec.kernel, result.error)
            lines = [line.strip() for line in error.splitlines() if line.strip()]
            summary = lines[0][:400] if lines else "no message"
            if len(lines) > 1 and lines[-1] not in summary:
                summary += f" ... {lines[-1][:300]}"
            return Verdict("compile", f"the Triton kernel {spec.kernel} does not compile for "
                           f"{target.sm} ({target.name}) at {spec.where}: {summary}",
                           log=result.error, trials=self.compared)
        grid_notes = [n for n in self.compile_notes if "grid" in n]
        if grid_notes:
            return Verdict("compile", grid_notes[0], trials=self.compared)
        self.notes.extend(n for n in self.compile_notes if "grid" not in n)
        compiled = sum(1 for s in specs if results.get(s.key) is not None)
        if compiled:
            self.notes.append(f"compile: {compiled} kernel specialisation(s) compiled for "
                              f"{target.sm} ({target.name}) ahead of time")
        return None

    # ------------------------------------------------------------ audit

    async def _audit(self) -> Verdict | None:
        planner = self.planner
        await planner.finish()
        try:
            frame, _ = await planner.get("audit")
        except ChildFailed as exc:
            return self._child_verdict(exc)
        problem = self._refusals(frame.refused, frame.refused_ops) or self._namespace(
            frame.namespace)
        if problem is not None:
            return problem
        self.notes.extend(frame.notes)
        if frame.cuda:
            self.notes.append("cpu backend: CUDA was emulated for the candidate ("
                              + ", ".join(frame.cuda) + "): tensors report cuda:0 and stay "
                              "on the CPU, synchronize returns at once, Event times the host "
                              "clock")
        return None

    def _refusals(self, refused: list[str], ops: dict[str, int]) -> Verdict | None:
        """Rules D002, D004 and D016: what the dispatcher, the audit hook and the thread
        and process guard refused in the candidate's process."""
        if ops:
            name, count = max(ops.items(), key=lambda kv: kv[1])
            return Verdict("audit", f"{name} called {count} time{'s' if count != 1 else ''} in "
                           "ModelNew.forward (refused at the dispatcher): PyTorch computed in "
                           "forward; do the work in Triton kernels (only allocation, views "
                           "and layout copies are allowed)",
                           log="\n".join(f"{k}: {v}" for k, v in ops.items()),
                           trials=self.compared)
        if refused:
            return Verdict("audit", f"the sandbox refused {refused[0]} in candidate code: "
                           "candidates may not inspect the harness, its frames or its file "
                           "descriptors, nor start threads or processes",
                           log="\n".join(refused), trials=self.compared)
        return None

    def _namespace(self, changes: list[str]) -> Verdict | None:
        """Rule D017: the candidate's import replaced functions of torch or triton."""
        if not changes:
            return None
        return Verdict("audit", f"the candidate's import changed the libraries it is judged "
                       f"with: {', '.join(changes[:3])}"
                       + (f" (+{len(changes) - 3} more)" if len(changes) > 3 else "")
                       + "; candidates must not replace torch's or triton's functions",
                       log="\n".join(changes), trials=self.compared)
