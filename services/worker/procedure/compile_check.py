"""The GPU compile check of one verification: every kernel compiled ahead of time for
the request's GPU target and the extra targets, and the compiler's facts.

:class:`CompileCheck` is the step of :class:`~services.worker.procedure.core.Procedure`
that compiles every call's launches for a GPU as each call is planned
(:mod:`services.worker.aot`; new specialisations only, one compile job after another,
through the verifier's :class:`~services.worker.procedure.host.Compiler`) and judges
the results (rules D013, D024, D031): a launch no GPU could make, a specialisation
that does not compile or exceeds the target, the registers, spills and occupancy of
each (:class:`~schemas.events.CompileFact`).
"""

from __future__ import annotations

import asyncio

from schemas.events import CompileFact
from services.worker import aot
from services.worker import sizes as size_rules
from services.worker.gpu_facts import HEAVY_SPILL_BYTES
from services.worker.procedure.host import Compiler
from services.worker.procedure.outcome import Verdict
from services.worker.procedure.state import RunState, Trial
from services.worker.targets import TARGETS, GpuTarget, target_for
from services.worker.wire import CompileResult

# What one compile job answers: results by spec key, the specs asked, why none came.
CompileAnswer = tuple[dict[str, CompileResult], list[aot.CompileSpec],
                      aot.CompileFailure | None]


class CompileCheck:
    """The compile check of one verification (``state``), through ``compiler``.

    ``facts``: the compiler's facts of every specialisation, once :meth:`result` found
    no failure (empty before, and when the check is off)."""

    def __init__(self, state: RunState, compiler: Compiler) -> None:
        self.state = state
        self.compiler = compiler
        # Its jobs in order, the specialisation keys sent to them, the launches no
        # GPU could make, the target and the other targets compiled for.
        self.jobs: list[asyncio.Task[CompileAnswer]] = []
        self.keys: set[str] = set()
        self.problems: list[str] = []
        self.target: GpuTarget | None = None
        self.extra: list[GpuTarget] = []
        self.facts: list[CompileFact] = []

    def _call_label(self, trial: Trial) -> str:
        """Where ``trial``'s launches ran, for compile messages."""
        size = self.state.sizes.get(trial.key)
        where = {"main": f"trial {trial.index}",
                 "declared": f"the task's declared shape {trial.index}",
                 "second": "the task's own sizes" if size is not None and not size.overrides
                 else "the sizes congruent with the task's own",
                 "generic": "the shape-generality sizes"}.get(trial.key, trial.key)
        if trial.key != "main" and size is not None and size.names:
            where += f" ({size_rules.text(size.names)})"
        return where

    def add_call(self, trial: Trial) -> None:
        """Rule D024: compile every launch of ``trial``'s traced call (with the first
        call, the dry run's at the task's own sizes too) for the GPU target; only
        specialisations not sent before go to a new compile job, which runs after the
        jobs before it (one compile child at a time). Launches no GPU could make are
        kept as problems (judged by :meth:`result`)."""
        target_name = self.compiler.aot_target
        if not target_name or trial.traced is None:
            return
        if self.target is None:
            self.target = target_for(self.state.request.arch, default=target_name)
            self.extra = self.compiler.extra_targets(self.target)
        launches = []
        if trial is self.state.first_call:
            launches += [("the task's own sizes (dry run)", e)
                         for e in self.state.real_launches or []]
        where = self._call_label(trial)
        launches += [(where, e) for e in trial.traced[0].events
                     if isinstance(e, dict) and "launch" in e]
        specs, problems = aot.specs(launches, self.state.kernels.constexpr_params,
                                    self.target, self.state.source_sha, self.state.kernels.bodies)
        for extra in self.extra:
            # The same launches for another target (its launch problems are the same).
            specs += aot.specs(launches, self.state.kernels.constexpr_params, extra,
                               self.state.source_sha, self.state.kernels.bodies)[0]
        self.problems.extend(p for p in problems if p not in self.problems)
        new = [s for s in specs if s.key not in self.keys]
        if not new and self.jobs:
            return
        self.keys.update(s.key for s in new)
        previous = self.jobs[-1] if self.jobs else None
        job = asyncio.ensure_future(self._job(previous, new, self.target))
        self.jobs.append(job)
        self.state.tasks.append(job)

    async def _job(self, previous: asyncio.Task[CompileAnswer] | None,
                   specs: list[aot.CompileSpec], target: GpuTarget) -> CompileAnswer:
        if previous is not None:
            await asyncio.wait({previous})
        return await self.compiler.compile(self.state.request, specs, target,
                                           self.state.kernels.source)

    async def result(self) -> Verdict | None:
        """The compile check's verdict (rules D013 and D024): a launch no GPU could
        make, a compile child that gave no results, a specialisation that does not
        compile or exceeds the target (but an autotune config a GPU autotuner would
        skip, noted); None when every launch recorded compiled."""
        target = self.target
        if not self.jobs or target is None:
            return None
        if self.problems:
            return Verdict("compile", self.problems[0],
                           log="\n".join(self.problems), trials=self.state.compared)
        results: dict[str, CompileResult] = {}
        specs: list[aot.CompileSpec] = []
        for job in self.jobs:
            found, asked, failure = await job
            if failure is not None:
                prefix = "" if target.sm in failure.message else (
                    f"GPU compile check for {target.sm} ({target.name}): ")
                return Verdict(failure.stage, prefix + failure.message, log=failure.log,
                               trials=self.state.compared)
            results.update(found)
            specs.extend(asked)
        missing = [s for s in specs if s.key not in results]
        if missing:
            return Verdict("infrastructure", f"the GPU compile check returned no result for "
                           f"{missing[0].kernel} ({missing[0].where}); nothing was judged",
                           trials=self.state.compared)
        facts = self._facts(specs, results)
        primary = [s for s in specs if s.target == target.name]
        failed = self._first_failure(primary, results, target)
        if failed is not None:
            spec, result = failed
            return Verdict("compile", f"the Triton kernel {spec.kernel} does not compile for "
                           f"{target.sm} ({target.name}) at {spec.where}: "
                           f"{self._summary(spec, result)}",
                           log=result.error, trials=self.state.compared, compile_facts=facts)
        for extra in self.extra:
            failed = self._first_failure([s for s in specs if s.target == extra.name],
                                         results, extra)
            if failed is None:
                continue
            spec, result = failed
            text = (f"the Triton kernel {spec.kernel} compiles for {target.sm} ({target.name}) "
                    f"but not for {extra.sm} ({extra.name}) at {spec.where}: "
                    f"{self._summary(spec, result)}")
            if self.compiler.extra_targets_required:
                return Verdict("compile", text, log=result.error, trials=self.state.compared,
                               compile_facts=facts)
            self.state.notes.append(f"compile: {text} (advisory: the request's target is "
                                    f"{target.name})")
        if specs:
            others = "".join(f", {len([s for s in specs if s.target == t.name])} for "
                             f"{t.sm} ({t.name})" for t in self.extra)
            self.state.notes.append(f"compile: {len(primary)} kernel specialisation(s) "
                                    f"compiled for {target.sm} ({target.name}){others} ahead "
                                    "of time, from every call recorded")
        self.facts = facts
        return None

    def _first_failure(self, specs: list[aot.CompileSpec], results: dict[str, CompileResult],
                       target: GpuTarget) -> tuple[aot.CompileSpec, CompileResult] | None:
        """The first specialisation of ``specs`` that failed to compile for ``target``
        and is not an autotune config a GPU autotuner would skip (those are noted)."""
        by_kernel: dict[str, list[tuple[aot.CompileSpec, CompileResult | None]]] = {}
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
                    self.state.notes.append(f"autotune: {s.kernel} {s.where} is skipped on "
                                            f"{target.sm} ({target.name}) as a GPU autotuner "
                                            f"would: {r.error}")
                continue
            return failed[0]
        return None

    def _summary(self, spec: aot.CompileSpec, result: CompileResult) -> str:
        """The compiler's error of ``result`` in a line or two, at the candidate's line."""
        error = self.state.kernels.file_line(spec.kernel, result.error)
        lines = [line.strip() for line in error.splitlines() if line.strip()]
        summary = lines[0][:400] if lines else "no message"
        if len(lines) > 1 and lines[-1] not in summary:
            summary += f" ... {lines[-1][:300]}"
        return summary

    def _config(self, spec: aot.CompileSpec) -> str:
        """``BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3``: the kernel's scalar
        ``tl.constexpr`` arguments of ``spec`` and its launch options."""
        params = self.state.kernels.constexpr_params.get(spec.kernel, set())
        items = [f"{path[0]}={value}" for path, value in spec.constexprs
                 if len(path) == 1 and path[0] in params
                 and isinstance(value, (int, float, bool, str))]
        options = dict(spec.options)
        items += [f"{k}={options[k]}" for k in ("num_warps", "num_stages", "maxnreg")
                  if options.get(k) is not None]
        return ", ".join(items)

    def _facts(self, specs: list[aot.CompileSpec],
               results: dict[str, CompileResult]) -> list[CompileFact]:
        """A :class:`~schemas.events.CompileFact` per compiled specialisation and target;
        every one that spills or cannot launch is named in the notes."""
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
                self.state.notes.append(f"compile facts: {name} spills {fact.spill_bytes} bytes "
                                        f"per thread ({fact.registers} registers{heavy}; at "
                                        f"{spec.where}): a GPU would run it with local-memory "
                                        "traffic (smaller tiles or more warps per tile avoid it)")
            elif not r.ok and ", config" not in spec.where:
                self.state.notes.append(f"compile facts: {name} cannot launch: {r.error[:300]}")
        return facts


def worst_facts(facts: list[CompileFact], arch: str) -> dict[str, CompileFact]:
    """The compiler's facts of each kernel on the arch family ``arch`` (``sm_90``,
    ``gfx942``: the row's ``arch``), as :func:`services.worker.traffic.summarize`
    takes them (by kernel name): of the specialisations that launch (``ok``), the one
    with the fewest resident warps per SM, then the most spill bytes, so the time
    model is not kinder than the slowest config a GPU autotuner might keep."""
    worst: dict[str, CompileFact] = {}
    for fact in facts:
        if fact.arch != arch or not fact.ok:
            continue
        held = worst.get(fact.kernel)
        if held is None or (fact.occupancy_warps, -fact.spill_bytes) < (
                held.occupancy_warps, -held.spill_bytes):
            worst[fact.kernel] = fact
    return worst
