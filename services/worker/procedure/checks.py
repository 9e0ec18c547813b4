"""The checks of one verification besides its trials: the ahead-of-time compile of
every kernel for a GPU target, and the audit of the candidate's process.

:class:`Checks` is the part of :class:`~services.worker.procedure.core.Procedure` that
compiles every call's launches for a GPU as each call is planned
(:mod:`services.worker.aot`; new specialisations only) and judges the results; reads
the planner's audit frame; and turns what the candidate's process refused (rules
D002, D004, D016) or changed in torch's and triton's namespaces (rule D017,
:mod:`services.worker.rules`) into verdicts.
"""

from __future__ import annotations

import asyncio
from typing import Any

from schemas.events import CompileFact
from services.worker import aot
from services.worker import sizes as size_rules
from services.worker.children import ChildFailed
from services.worker.gpu_facts import HEAVY_SPILL_BYTES
from services.worker.procedure.outcome import Verdict
from services.worker.targets import target_for


class Checks:
    """Compile check and audit of a :class:`~services.worker.procedure.core.Procedure`
    (a mixin: its state is the procedure's)."""

    def _call_label(self, trial: Any) -> str:
        """Where ``trial``'s launches ran, for compile messages."""
        size = self.sizes.get(trial.key)
        where = {"main": f"trial {trial.index}",
                 "declared": f"the task's declared shape {trial.index}",
                 "second": "the task's own sizes" if size is not None and not size.overrides
                 else "the sizes congruent with the task's own",
                 "generic": "the shape-generality sizes"}.get(trial.key, trial.key)
        if trial.key != "main" and size is not None and size.names:
            where += f" ({size_rules.text(size.names)})"
        return where

    def _compile_call(self, trial: Any) -> None:
        """Rule D024: compile every launch of ``trial``'s traced call (with the first
        call, the dry run's at the task's own sizes too) for the GPU target; only
        specialisations not sent before go to a new compile job, which runs after the
        jobs before it (one compile child at a time). Launches no GPU could make are
        kept as problems (judged by :meth:`_compile_result`)."""
        target_name = self.v.aot_target
        if not target_name or trial.traced is None:
            return
        if self.compile_target is None:
            self.compile_target = target_for(self.request.arch, default=target_name)
            self.compile_extra = self.v.extra_targets(self.compile_target)
        launches = []
        if trial is self.first_call:
            launches += [("the task's own sizes (dry run)", e) for e in self.real_launches or []]
        where = self._call_label(trial)
        launches += [(where, e) for e in trial.traced[0].events
                     if isinstance(e, dict) and "launch" in e]
        specs, problems = aot.specs(launches, self.kernels.constexpr_params,
                                    self.compile_target, self.source_sha, self.kernels.bodies)
        for extra in self.compile_extra:
            # The same launches for another target (its launch problems are the same).
            specs += aot.specs(launches, self.kernels.constexpr_params, extra,
                               self.source_sha, self.kernels.bodies)[0]
        self.compile_problems.extend(p for p in problems if p not in self.compile_problems)
        new = [s for s in specs if s.key not in self.compile_keys]
        if not new and self.compile_jobs:
            return
        self.compile_keys.update(s.key for s in new)
        previous = self.compile_jobs[-1] if self.compile_jobs else None
        job = asyncio.ensure_future(self._compile_job(previous, new))
        self.compile_jobs.append(job)
        self.tasks.append(job)

    async def _compile_job(self, previous: asyncio.Task | None, specs: list[Any]) -> Any:
        if previous is not None:
            await asyncio.wait({previous})
        return await self.v.compile(self.request, specs, self.compile_target,
                                    self.kernels.source)

    async def _compile_result(self) -> Verdict | None:
        """The compile check's verdict (rules D013 and D024): a launch no GPU could
        make, a compile child that gave no results, a specialisation that does not
        compile or exceeds the target (but an autotune config a GPU autotuner would
        skip, noted); None when every launch recorded compiled."""
        if not self.compile_jobs:
            return None
        target = self.compile_target
        if self.compile_problems:
            return Verdict("compile", self.compile_problems[0],
                           log="\n".join(self.compile_problems), trials=self.compared)
        results: dict[str, Any] = {}
        specs: list[Any] = []
        for job in self.compile_jobs:
            found, asked, failure = await job
            if failure is not None:
                prefix = "" if target.sm in failure.message else (
                    f"GPU compile check for {target.sm} ({target.name}): ")
                return Verdict(failure.stage, prefix + failure.message, log=failure.log,
                               trials=self.compared)
            results.update(found)
            specs.extend(asked)
        missing = [s for s in specs if s.key not in results]
        if missing:
            return Verdict("infrastructure", f"the GPU compile check returned no result for "
                           f"{missing[0].kernel} ({missing[0].where}); nothing was judged",
                           trials=self.compared)
        facts = self._compile_facts(specs, results)
        primary = [s for s in specs if s.target == target.name]
        failed = self._first_failure(primary, results, target)
        if failed is not None:
            spec, result = failed
            return Verdict("compile", f"the Triton kernel {spec.kernel} does not compile for "
                           f"{target.sm} ({target.name}) at {spec.where}: "
                           f"{self._summary(spec, result)}",
                           log=result.error, trials=self.compared, compile_facts=facts)
        for extra in self.compile_extra:
            failed = self._first_failure([s for s in specs if s.target == extra.name],
                                         results, extra)
            if failed is None:
                continue
            spec, result = failed
            text = (f"the Triton kernel {spec.kernel} compiles for {target.sm} ({target.name}) "
                    f"but not for {extra.sm} ({extra.name}) at {spec.where}: "
                    f"{self._summary(spec, result)}")
            if self.v.extra_targets_required:
                return Verdict("compile", text, log=result.error, trials=self.compared,
                               compile_facts=facts)
            self.notes.append(f"compile: {text} (advisory: the request's target is "
                              f"{target.name})")
        if specs:
            extra = "".join(f", {len([s for s in specs if s.target == t.name])} for "
                            f"{t.sm} ({t.name})" for t in self.compile_extra)
            self.notes.append(f"compile: {len(primary)} kernel specialisation(s) compiled for "
                              f"{target.sm} ({target.name}){extra} ahead of time, from every "
                              "call recorded")
        self.compile_facts = facts
        return None

    def _first_failure(self, specs: list[Any], results: dict[str, Any],
                       target: Any) -> tuple[Any, Any] | None:
        """The first specialisation of ``specs`` that failed to compile for ``target``
        and is not an autotune config a GPU autotuner would skip (those are noted)."""
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
            return failed[0]
        return None

    def _summary(self, spec: Any, result: Any) -> str:
        """The compiler's error of ``result`` in a line or two, at the candidate's line."""
        error = self.kernels.file_line(spec.kernel, result.error)
        lines = [line.strip() for line in error.splitlines() if line.strip()]
        summary = lines[0][:400] if lines else "no message"
        if len(lines) > 1 and lines[-1] not in summary:
            summary += f" ... {lines[-1][:300]}"
        return summary

    def _config(self, spec: Any) -> str:
        """``BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3``: the kernel's scalar
        ``tl.constexpr`` arguments of ``spec`` and its launch options."""
        params = self.kernels.constexpr_params.get(spec.kernel, set())
        items = [f"{path[0]}={value}" for path, value in spec.constexprs
                 if len(path) == 1 and path[0] in params
                 and isinstance(value, (int, float, bool, str))]
        options = dict(spec.options)
        items += [f"{k}={options[k]}" for k in ("num_warps", "num_stages", "maxnreg")
                  if options.get(k) is not None]
        return ", ".join(items)

    def _compile_facts(self, specs: list[Any], results: dict[str, Any]) -> list[CompileFact]:
        """A :class:`~schemas.events.CompileFact` per compiled specialisation and target;
        every one that spills or cannot launch is named in the notes."""
        from services.worker.targets import TARGETS

        facts = []
        for spec in specs:
            r = results.get(spec.key)
            if r is None or not (r.ok or r.error.startswith("OutOfResources")):
                continue
            t = TARGETS.get(spec.target)
            fact = CompileFact(kernel=spec.kernel, target=spec.target,
                               arch=t.sm if t is not None else "", where=spec.where,
                               config=self._config(spec), registers=r.registers,
                               spill_bytes=r.spill_bytes, shared_bytes=r.shared_bytes,
                               num_warps=r.num_warps, occupancy_warps=r.occupancy_warps,
                               max_warps=r.max_warps, limiter=r.limiter, ok=r.ok,
                               error=r.error[:300])
            facts.append(fact)
            name = f"{spec.kernel} [{fact.config}] on {fact.arch} ({fact.target})"
            if fact.spill_bytes > 0:
                heavy = "; heavily" if fact.spill_bytes >= HEAVY_SPILL_BYTES else ""
                self.notes.append(f"compile facts: {name} spills {fact.spill_bytes} bytes per "
                                  f"thread ({fact.registers} registers{heavy}; at "
                                  f"{spec.where}): a GPU would run it with local-memory "
                                  "traffic (smaller tiles or more warps per tile avoid it)")
            elif not r.ok and ", config" not in spec.where:
                self.notes.append(f"compile facts: {name} cannot launch: {r.error[:300]}")
        return facts

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
