"""The :class:`Procedure` of one verification: its steps, the run from the first spawn
to the outcome, and the verdicts of timeouts and failed children.

A procedure owns its state (:class:`~services.worker.procedure.state.RunState`, shared
by its steps) and its steps, each a typed object with a state of its own:
:class:`~services.worker.procedure.size_choice.SizeChoice` (which sizes are checked),
:class:`~services.worker.procedure.trials.Trials` (planning, replaying and judging
the calls, with :class:`~services.worker.procedure.replays.Replays`),
:class:`~services.worker.procedure.variants.Variants` (the first call's variants),
:class:`~services.worker.procedure.compile_check.CompileCheck` (every kernel compiled
for a GPU), the audit of the candidate's process
(:mod:`~services.worker.procedure.audit`) and, profiling on a GPU,
:class:`~services.worker.procedure.profile.Profile` (timings and baselines). What it
needs of the verifier is :class:`~services.worker.procedure.host.Host`. The whole
procedure is described in :mod:`services.worker.procedure`.
"""

from __future__ import annotations

import asyncio
import math

import torch

from schemas.events import CompileFact, Traffic, VerifyRequest
from services.sandbox import values
from services.sandbox.wire import TASK_PHASE
from services.worker import sizes as size_rules
from services.worker import traffic, wire
from services.worker.children import ChildFailed
from services.worker.correctness import tolerance_for
from services.worker.procedure.audit import audit, namespace, refusals
from services.worker.procedure.compile_check import CompileCheck, worst_facts
from services.worker.procedure.host import Host
from services.worker.procedure.outcome import Outcome, Timings, Verdict
from services.worker.procedure.profile import Profile
from services.worker.procedure.replays import Replays
from services.worker.procedure.size_choice import SizeChoice
from services.worker.procedure.state import CheckedSize, PhaseClock, RunState, format_bytes
from services.worker.procedure.trials import Trials
from services.worker.procedure.variants import Variants
from services.worker.targets import target_for

# A call into the task's code that hangs is blamed on its sizes (with a shape_overrides
# hint) only when its inputs exceed this many bytes; below, the code itself is named.
TASK_LARGE_INPUT_BYTES = 256 << 20


def join_log(*parts: str, limit: int) -> str:
    """``parts`` joined by newlines, keeping the last ``limit`` bytes."""
    text = "\n".join(p for p in parts if p)
    data = text.encode()
    if len(data) <= limit:
        return text
    return data[-limit:].decode("utf-8", errors="replace")


class Procedure:
    """One verification of ``request`` on ``device``, lent what it needs by ``host``;
    ``clock`` takes its phases (see the module doc).

    Attributes:
        state: what its steps share (sizes, calls, children, notes).
    """

    def __init__(self, host: Host, request: VerifyRequest, device: str,
                 clock: PhaseClock) -> None:
        self.host = host
        self.state = RunState(host, request, device, clock)
        self.size_choice = SizeChoice(self.state, host)
        self.compile_check = CompileCheck(self.state, host)
        self.replays = Replays(self.state, host)
        self.variants = Variants(self.state, self.replays)
        self.trials = Trials(self.state, self.replays, self.variants, self.compile_check)

    async def close(self) -> None:
        """End its background work and its children; their wall times go to the clock
        (phases beside the spans, named after each child)."""
        await self.state.close()
        for name, child in self.state.children.items():
            self.state.clock.add(name.replace(":", "_"), child.seconds)

    # ------------------------------------------------------------ run

    async def run(self) -> Outcome:
        """The outcome of a verification that passed (see
        :class:`schemas.events.VerifyResult` for its fields).

        Raises:
            Verdict: the candidate failed; its outcome carries the children's output
                (within the verifier's ``output_limit_bytes``) and, where the failing
                step left them unset, the trials compared, the notes and the sizes
                checked.
        """
        try:
            return await self._bounded()
        except Verdict as verdict:
            state = self.state
            failed = verdict.outcome
            failed.set(log=join_log(state.output_log(), failed.fields.log,
                                    limit=self.host.output_limit_bytes))
            failed.fill(trials=state.compared, notes=state.notes)
            if "main" in state.sizes:
                failed.fill(sizes_checked=state.checked_sizes())
            raise

    async def _bounded(self) -> Outcome:
        """:meth:`_run` within the request's ``timeout_s``, beside the watchdog of the
        task's own code."""
        request = self.state.request
        self.state.deadline = asyncio.get_running_loop().time() + request.timeout_s
        watchdog = asyncio.ensure_future(self._watch_task_code())
        running = asyncio.ensure_future(self._run())
        try:
            async with asyncio.timeout(request.timeout_s):
                done, _ = await asyncio.wait({running, watchdog},
                                             return_when=asyncio.FIRST_COMPLETED)
                if running in done:
                    return running.result()
                watchdog.result()  # raises the Verdict naming the task's call
                raise AssertionError("the task-code watchdog ended without a verdict")
        except TimeoutError:
            raise self._timeout() from None
        except ChildFailed as exc:
            raise self.state.child_verdict(exc) from None
        finally:
            for task in (running, watchdog):
                task.cancel()
            await asyncio.gather(running, watchdog, return_exceptions=True)

    async def _watch_task_code(self) -> None:
        """Raise a ``task`` Verdict once one call into the task's own code in the
        reference child (its phase starts with :data:`services.sandbox.wire.TASK_PHASE`)
        has lasted ``task_timeout_s`` (the verifier's setting); never returns otherwise."""
        limit = self.host.task_timeout_s
        if not limit:
            await asyncio.Event().wait()
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(min(0.5, limit / 4))
            ref = self.state.children.get("reference")
            if ref is None or ref.failure is not None or not ref.phase.startswith(TASK_PHASE):
                continue
            if loop.time() - ref.phase_since >= limit:
                raise self._task_hang(ref.phase, limit, "AIKG_TASK_TIMEOUT_S")

    def _task_hang(self, phase: str, limit: float, setting: str) -> Verdict:
        """The verdict of a call into the task's code that did not finish (``phase``
        names it): stage ``task``; smaller shapes are suggested only when the task's
        inputs are large enough to be the cause."""
        size = self.state.sizes.get("main")
        hint = "; the task's own code hangs or is far too slow: fix the task"
        if size is not None and size.input_bytes > TASK_LARGE_INPUT_BYTES:
            hint = (f"; its inputs are {format_bytes(size.input_bytes)}: "
                    f"{self.host.size_hint(size.input_bytes, TASK_LARGE_INPUT_BYTES, size.names)}")
        return Verdict("task", f"{phase} did not finish in {limit:g} s (setting {setting}); "
                       f"the reference process was killed{hint}")

    def _timeout(self) -> Verdict:
        """Blame the child with work outstanding that has been in its phase longest (the
        others wait for it): the reference is the task's fault, the rest the candidate's."""
        children = self.state.children
        timeout_s = self.state.request.timeout_s
        busy = [c for c in children.values() if c.outstanding > 0 and c.failure is None]
        child = min(busy, key=lambda c: c.phase_since) if busy else (
            children.get("candidate") or children.get("reference"))
        phase = child.phase if child is not None else "starting"
        if child is not None and child.who == "reference" and phase.startswith(TASK_PHASE):
            return self._task_hang(phase, timeout_s, "the request's timeout_s")
        if child is not None and child.who == "reference":
            return Verdict("infrastructure",
                           f"the reference Model did not finish within "
                           f"{timeout_s:g} s (during {phase}); pass smaller "
                           "shape_overrides")
        return Verdict("timeout", f"the candidate did not finish within "
                       f"{timeout_s:g} s (during {phase}); its process group was "
                       "killed", trials=self.state.compared)

    async def _run(self) -> Outcome:
        state = self.state
        request = state.request
        if state.kernels.refused:
            # Rule D013: the interpreter and the GPU compiler would run different code.
            raise Verdict("compile", state.kernels.refused[0],
                          log="\n".join(state.kernels.refused))
        main = await self._start_reference()
        state.clock.begin("candidate_start")
        space = self.size_choice.address_space(main)
        # Started together (each start waits for its child's hello); when one cannot
        # start, the others' starts are cancelled and the first failure is raised.
        try:
            async with asyncio.TaskGroup() as group:
                group.create_task(state.spawn("candidate", address_space_bytes=space))
                for name in ("replay", "replay:side"):
                    group.create_task(state.spawn("replay", name, address_space_bytes=space,
                                                  kernels=state.kernels.source))
        except BaseExceptionGroup as failed:
            raise failed.exceptions[0] from None
        imported, _ = await state.answer("candidate", "imported")
        problem = refusals(imported.refused, {}, state.compared) or namespace(
            imported.namespace, state.compared)
        if problem is not None:
            raise problem
        await self.size_choice.build(main)
        state.clock.lap("candidate_start")
        state.clock.begin("dry_run")
        extra = await self.size_choice.choose_sizes(main)
        state.clock.lap("dry_run")
        state.clock.begin("trials")
        for size in extra:
            error = await self.size_choice.build(size)
            if error is not None and size.key == "generic":
                state.shape_generic = False
                state.shape_generic_error = f"ModelNew(*get_init_inputs()) raised {error}"
                del state.sizes["generic"]
        await self.trials.queue(state.declared)
        planning = asyncio.ensure_future(self.trials.plan_all())
        judging = asyncio.ensure_future(self.trials.judge_all())
        state.tasks.extend([planning, judging])
        done, _ = await asyncio.wait({planning, judging},
                                     return_when=asyncio.FIRST_EXCEPTION)
        for task in done:
            task.result()
        await judging
        await planning
        state.clock.begin("checks", step="replays")
        await self.variants.judge()
        state.clock.begin("checks", step="compile check")
        compile_failure = await self.compile_check.result()
        state.clock.lap("checks")
        timings: Timings | None = None
        if compile_failure is None and request.mode == "profile" and \
                self.host.backend != "cpu":
            state.clock.begin("profile")
            timings = await Profile(state, self.host, self.host).run()
            state.clock.lap("profile")
        state.clock.begin("verdict")
        audited = await audit(state)
        for problem in (audited, compile_failure):
            if problem is not None:
                raise problem
        outcome = self._passed_outcome()
        outcome.set(compile_facts=self.compile_check.facts or None,
                    traffic=await self._traffic())
        if timings is not None:
            outcome.timed(timings)
        if outcome.fields.error:
            state.notes.append(outcome.fields.error)
        if request.mode == "profile" and self.host.backend == "cpu":
            outcome.set(log=join_log(
                outcome.fields.log, "profile: no timings on the cpu backend (Triton runs "
                "in its interpreter; times would not mean anything)",
                limit=self.host.output_limit_bytes))
        return outcome

    async def _start_reference(self) -> CheckedSize:
        """Start the reference child and ask it for every input at the requested sizes
        (``main``: its sizes, once answered) and the task's own sizes on meta tensors."""
        state = self.state
        request = state.request
        state.clock.begin("reference_start")
        ref = await state.spawn("reference")
        main = CheckedSize("main", dict(request.shape_overrides))
        state.sizes["main"] = main
        # Each decoy before its real trial: the planner starts on it while the
        # reference computes the real outputs.
        specs = []
        for i in range(state.trials):
            specs.append(wire.RefTrialSpec(index=i, seed=state.decoy_seeds[i], decoy=True))
            specs.append(wire.RefTrialSpec(index=i, seed=state.seeds[i],
                                           distribution=state.schedule[i].name))
        # The task's own sizes on meta tensors first (a few ms): the size choice waits
        # for them once the candidate is built, the trials' inputs not before planning.
        if request.shape_overrides:
            await ref.send(wire.RefRequest(key="real", overrides={}, meta_only=True))
        await ref.send(wire.RefRequest(key="main", overrides=main.overrides, trials=specs,
                                       input_limit_bytes=self.host.memory_limit_bytes,
                                       count_eager=True),
                       answers=2 + len(specs))
        frame, raws = await state.answer("reference", "size", "main")
        self.size_choice.size_answer(main, frame, raws, self.host.memory_limit_bytes)
        state.clock.lap("reference_start")
        return main

    # ------------------------------------------------------------ counted traffic

    async def _traffic(self) -> Traffic | None:
        """The first trial's call as the replayer counted it, with the time model on the
        request's arch (default h100), the compile check's facts of its kernels (the
        worst specialisation of each on that arch family,
        :func:`~services.worker.procedure.compile_check.worst_facts`) and the task's
        eager graph from the reference (see :mod:`services.worker.traffic`); None where
        nothing was counted (a GPU replayer does not count). Counts that cannot describe
        the matched outputs are left out, with a note."""
        first = self.state.first_counted
        if first is None or not first[0].traffic:
            return None
        frame, real = first
        eager = await self.state.eager_count()
        inputs = sum(math.prod(n["z"]) * values.dtype_from_name(n["d"]).itemsize
                     for n in values.tensors_in(real.inputs))
        outputs = sum(m.nbytes for m in real.outputs)
        target = target_for(self.state.request.arch, default="h100")
        facts: dict[str, CompileFact] = worst_facts(self.compile_check.facts, target.sm)
        summary = traffic.summarize(list(frame.traffic),
                                    inputs + outputs + frame.captured_bytes, eager, target,
                                    facts=facts)
        problem = traffic.check_counts(summary, outputs)
        if problem is not None:
            self.state.notes.append(f"traffic not reported: {problem}")
            return None
        return summary

    # ------------------------------------------------------------ verdict

    def _unchecked_error(self) -> str:
        """The ``unchecked`` verdict's message: the first path not checked (it names the
        kernel, the size and why), how many more, and how to accept a partial check."""
        unchecked = self.state.unchecked
        more = len(unchecked) - 1
        return (f"what the task's own sizes launch was not checked: {unchecked[0]}"
                + (f" (+{more} more in unchecked)" if more else "")
                + "; make the kernels take the same path at every size, or pass "
                "allow_unchecked to accept a partial check")

    def _passed_outcome(self) -> Outcome:
        """The outcome of a verification whose every check passed; adds the notes on
        the inputs, the shape generality, what went unchecked and the sizes run."""
        state = self.state
        request = state.request
        notes = state.notes
        second = state.sizes.get("second")
        checked = state.checked_sizes()
        tol = state.tolerance or tolerance_for(torch.float32, self.host.backend)
        if state.distributions:
            notes.append("inputs: " + "; ".join(
                f"trial {i}: {d}" for i, d in enumerate(state.distributions)))
        if state.shape_generic is False:
            notes.append("shape generality: wrong at "
                         f"{size_rules.text(state.shape_generic_sizes or {})}: "
                         f"{state.shape_generic_error}")
        if state.unchecked:
            notes.extend(f"unchecked: {u}" for u in state.unchecked)
        own = not request.shape_overrides or (second is not None and not second.overrides)
        if not own:
            notes.append("the task's own sizes were not run (they do not fit this "
                         "worker); the result holds for the sizes in sizes_checked")
        stage = None
        if state.unchecked:
            # Rule D025: no pass with an unchecked path, unless the request accepts one.
            error = self._unchecked_error()
            if not request.allow_unchecked:
                raise Verdict("unchecked", error, log=state.output_log(),
                              trials=state.compared, sizes_checked=checked,
                              task_sizes_checked=own, unchecked=state.unchecked, notes=notes,
                              **state.errors)
            stage = "unchecked"
            notes.append(f"allow_unchecked: passed on a partial check, as the request "
                         f"accepts: {error}")
        return Outcome(passed=True, stage=stage, log=state.output_log(), **state.errors,
                       mismatch_count=0,
                       atol=tol.atol, rtol=tol.rtol, trials=state.compared,
                       sizes_checked=checked, task_sizes_checked=own,
                       ghost_replay=state.ghost_replay, notes=notes,
                       shape_generic=state.shape_generic,
                       shape_generic_sizes=state.shape_generic_sizes or {},
                       unchecked=state.unchecked)
