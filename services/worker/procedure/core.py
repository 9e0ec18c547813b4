"""The :class:`Procedure` of one verification: its state, its children, the run from
the first spawn to the outcome, and the verdicts of timeouts and failed children.

The parts it runs are mixins: :class:`~services.worker.procedure.size_choice.SizeChoice`
(which sizes are checked), :class:`~services.worker.procedure.trials.TrialRuns` (the
trials, their replays and judgements, the variants of the first call) and
:class:`~services.worker.procedure.checks.Checks` (the compile check and the audit of
the candidate's process). The whole procedure is described in
:mod:`services.worker.procedure`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import math
from typing import Any

import torch

from schemas.events import Traffic, VerifyRequest
from services.sandbox import values, wire
from services.sandbox.pool import PoolBroken
from services.worker import inputs as trial_inputs
from services.worker import kernel_source, traffic
from services.worker import sizes as size_rules
from services.worker.children import ChildFailed, Conversation
from services.worker.correctness import tolerance_for
from services.worker.procedure.checks import Checks
from services.worker.procedure.outcome import STAGES, Outcome, Verdict
from services.worker.procedure.size_choice import SizeChoice
from services.worker.procedure.state import CheckedSize, Trial, format_bytes
from services.worker.procedure.trials import TrialRuns, draw_autotune_runs
from services.worker.targets import target_for

# A call into the task's code that hangs is blamed on its sizes (with a shape_overrides
# hint) only when its inputs exceed this many bytes; below, the code itself is named.
TASK_LARGE_INPUT_BYTES = 256 << 20


_UNSET = object()

class Procedure(SizeChoice, TrialRuns, Checks):
    """See the module doc. ``verifier`` lends its sandbox, caches and settings."""

    def __init__(self, verifier: Any, request: VerifyRequest, device: str, clock: Any) -> None:
        self.v = verifier
        self.request = request
        self.device = device
        self.clock = clock
        self.trials = request.trials
        self.seeds = trial_inputs.draw_seeds(self.trials)
        self.decoy_seeds = trial_inputs.draw_seeds(self.trials)
        self.schedule = trial_inputs.schedule(self.trials)
        self.children: dict[str, Conversation] = {}
        self.notes: list[str] = []
        self.unchecked: list[str] = []
        self.kernels = kernel_source.kernel_module(request.code)
        self.source_sha = hashlib.sha256(self.kernels.source.encode()).hexdigest()
        self.sizes: dict[str, CheckedSize] = {}
        self.trials_by_key: dict[tuple[str, int], Trial] = {}
        self.order: list[Trial] = []
        self.real_launches: list[dict[str, Any]] | None = None
        # The task's own module-level sizes, when they were only dry-run.
        self.real_names: dict[str, Any] | None = None
        self._parsed_kernels: size_rules.KernelSource | None = None
        self.tasks: list[asyncio.Task] = []
        self.compared = 0
        self.errors: dict[str, float | None] = {"max_abs_error": None, "max_rel_error": None,
                                                "rel_l2_error": None}
        self.tolerance = None
        self.distributions: list[str] = []
        self.shape_generic: bool | None = None
        self.shape_generic_sizes: dict[str, Any] | None = None
        self.shape_generic_error: str | None = None
        self.first_call: Trial | None = None
        # Trials' outputs from the task's Model in float64 (None: not to be had), by
        # (key, index), once a float64 recheck asked for them.
        self.truths: dict[tuple[str, int], list[torch.Tensor] | None] = {}
        # The first trial's replayed frame and its reference trial (counted traffic).
        self.first_counted: tuple[wire.Replayed, wire.RefTrial] | None = None
        # The GPU compile check (Checks): its jobs in order, the specialisation keys
        # sent to them, the launches no GPU could make, the target.
        self.compile_jobs: list[asyncio.Task] = []
        self.compile_keys: set[str] = set()
        self.compile_problems: list[str] = []
        self.compile_target: Any = None
        self.compile_extra: list[Any] = []  # other targets compiled for (gpu facts, AMD)
        self.compile_facts: list[Any] = []
        self.ghost_replay: str | None = None
        self.no_launch_variant = False
        # Secrets of the replays (TrialRuns): how often each autotune config runs; the
        # first call's outputs, compared with its replay under another fill.
        self.autotune_runs = draw_autotune_runs()
        self.first_outputs: list[torch.Tensor] | None = None
        self.orders_judged: Any = None
        # Rule D030: the task Model's value digests, and the first call's captured
        # storages torch computed before forward that match none of them.
        self.state_digests: set[str] = set()
        self.init_suspects: list[dict[str, Any]] = []
        self.declared = 0
        self._waiting = ""
        # When the request's timeout_s runs out (the event loop's clock; set by run).
        self.deadline: float | None = None
        # The reference's eager count of the task (eager_count), once awaited.
        self._eager: Any = _UNSET

    # ------------------------------------------------------------ children

    async def _spawn(self, role: str, name: str | None = None, **kwargs: Any) -> Conversation:
        spec = self.v.child_spec(self.request, role, self.device, **kwargs)
        try:
            run = await self.v.sandbox.spawn(spec, max_frame_bytes=self.v.max_frame_bytes)
        except PoolBroken as exc:
            raise Verdict("infrastructure", f"sandbox pool broken: {exc}") from None
        conversation = Conversation({"candidate": "candidate", "replay": "candidate's kernels",
                                     "reference": "reference"}[role], run,
                                    "infrastructure" if role == "reference" else "crash")
        self.children[name or role] = conversation
        return conversation

    @property
    def ref(self) -> Conversation:
        return self.children["reference"]

    @property
    def planner(self) -> Conversation:
        return self.children["candidate"]

    def replayer_of(self, trial: Trial) -> str:
        """The replayer of a trial: one for the trials and the declared shapes (they
        share the requested model's state), another, running beside it, for the other
        sizes and the variants of the first call (each from a fresh state)."""
        return "replay" if trial.key in ("main", "declared") else "replay:side"

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        with contextlib.suppress(BaseException):
            await asyncio.gather(*self.tasks, return_exceptions=True)
        await asyncio.gather(*(c.close() for c in self.children.values()),
                             return_exceptions=True)

    def output_log(self) -> str:
        parts = []
        for name in ("candidate", "replay", "replay:side"):
            child = self.children.get(name)
            if child is not None:
                text = child.run.output(self.v.output_limit_bytes // 2)
                if text:
                    parts.append(text if name == "candidate" else f"(kernels)\n{text}")
        return "\n".join(parts)

    # ------------------------------------------------------------ run

    async def run(self) -> Outcome:
        """The outcome of a verification that passed (see
        :class:`schemas.events.VerifyResult` for its fields).

        Raises:
            Verdict: the candidate failed.
        """
        self.deadline = asyncio.get_running_loop().time() + self.request.timeout_s
        watchdog = asyncio.ensure_future(self._watch_task_code())
        running = asyncio.ensure_future(self._run())
        try:
            async with asyncio.timeout(self.request.timeout_s):
                done, _ = await asyncio.wait({running, watchdog},
                                             return_when=asyncio.FIRST_COMPLETED)
                if running in done:
                    return running.result()
                watchdog.result()  # raises the Verdict naming the task's call
                raise AssertionError("the task-code watchdog ended without a verdict")
        except TimeoutError:
            raise self._timeout() from None
        except ChildFailed as exc:
            raise self._child_verdict(exc) from None
        finally:
            for task in (running, watchdog):
                task.cancel()
            await asyncio.gather(running, watchdog, return_exceptions=True)

    async def _watch_task_code(self) -> None:
        """Raise a ``task`` Verdict once one call into the task's own code in the
        reference child (its phase starts with :data:`services.sandbox.wire.TASK_PHASE`)
        has lasted ``task_timeout_s`` (the verifier's setting); never returns otherwise."""
        limit = self.v.task_timeout_s
        if not limit:
            await asyncio.Event().wait()
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(min(0.5, limit / 4))
            ref = self.children.get("reference")
            if ref is None or ref.failure is not None or not ref.phase.startswith(
                    wire.TASK_PHASE):
                continue
            if loop.time() - ref.phase_since >= limit:
                raise self._task_hang(ref.phase, limit, "AIKG_TASK_TIMEOUT_S")

    def _task_hang(self, phase: str, limit: float, setting: str) -> Verdict:
        """The verdict of a call into the task's code that did not finish (``phase``
        names it): stage ``task``; smaller shapes are suggested only when the task's
        inputs are large enough to be the cause."""
        size = self.sizes.get("main")
        hint = "; the task's own code hangs or is far too slow: fix the task"
        if size is not None and size.input_bytes > TASK_LARGE_INPUT_BYTES:
            hint = (f"; its inputs are {format_bytes(size.input_bytes)}: "
                    f"{self.v.size_hint(size.input_bytes, TASK_LARGE_INPUT_BYTES, size.names)}")
        return Verdict("task", f"{phase} did not finish in {limit:g} s (setting {setting}); "
                       f"the reference process was killed{hint}")

    def _timeout(self) -> Verdict:
        """Blame the child with work outstanding that has been in its phase longest (the
        others wait for it): the reference is the task's fault, the rest the candidate's."""
        busy = [c for c in self.children.values() if c.outstanding > 0 and c.failure is None]
        child = min(busy, key=lambda c: c.phase_since) if busy else (
            self.children.get("candidate") or self.children.get("reference"))
        phase = child.phase if child is not None else "starting"
        if child is not None and child.who == "reference" and phase.startswith(wire.TASK_PHASE):
            return self._task_hang(phase, self.request.timeout_s, "the request's timeout_s")
        if child is not None and child.who == "reference":
            return Verdict("infrastructure",
                           f"the reference Model did not finish within "
                           f"{self.request.timeout_s:g} s (during {phase}); pass smaller "
                           "shape_overrides")
        return Verdict("timeout", f"the candidate did not finish within "
                       f"{self.request.timeout_s:g} s (during {phase}); its process group was "
                       "killed", trials=self.compared)

    def _child_verdict(self, exc: ChildFailed) -> Verdict:
        stage = exc.stage if exc.stage in STAGES else "runtime"
        if exc.who == "reference":
            return Verdict("task" if exc.stage == "task" else "infrastructure",
                           f"reference run: {exc.message}", log=exc.traceback)
        return Verdict(stage, exc.message, log=exc.traceback, trials=self.compared)

    async def _await(self, child: str, *key: Any, keep: bool = False) -> tuple[
            Any, list[bytearray]]:
        """``child``'s answer keyed ``key`` (left for the next wait when ``keep``)."""
        self._waiting = child
        try:
            if keep:
                return await self.children[child].peek(*key)
            return await self.children[child].get(*key)
        finally:
            self._waiting = ""

    async def _run(self) -> Outcome:
        request = self.request
        if self.kernels.refused:
            # Rule D013: the interpreter and the GPU compiler would run different code.
            raise Verdict("compile", self.kernels.refused[0],
                          log="\n".join(self.kernels.refused))
        ref = await self._spawn("reference")
        main = CheckedSize("main", dict(request.shape_overrides))
        self.sizes["main"] = main
        # Each decoy before its real trial: the planner starts on it while the
        # reference computes the real outputs.
        specs = []
        for i in range(self.trials):
            specs.append(wire.RefTrialSpec(index=i, seed=self.decoy_seeds[i], decoy=True))
            specs.append(wire.RefTrialSpec(index=i, seed=self.seeds[i],
                                           distribution=self.schedule[i].name))
        # The task's own sizes on meta tensors first (a few ms): the size choice waits
        # for them once the candidate is built, the trials' inputs not before planning.
        if request.shape_overrides:
            await ref.send(wire.RefRequest(key="real", overrides={}, meta_only=True))
        await ref.send(wire.RefRequest(key="main", overrides=main.overrides, trials=specs,
                                       input_limit_bytes=self.v.memory_limit_bytes,
                                       count_eager=True),
                       answers=2 + len(specs))
        frame, raws = await self._await("reference", "size", "main")
        self._size_answer(main, frame, raws, self.v.memory_limit_bytes)
        self.clock.lap("reference_start")
        space = self._address_space(main)
        # Started together (each start waits for its child's hello); when one cannot
        # start, the others' starts are cancelled and the first failure is raised.
        try:
            async with asyncio.TaskGroup() as group:
                group.create_task(self._spawn("candidate", address_space_bytes=space))
                for name in ("replay", "replay:side"):
                    group.create_task(self._spawn("replay", name, address_space_bytes=space,
                                                  kernels=self.kernels.source))
        except BaseExceptionGroup as failed:
            raise failed.exceptions[0] from None
        imported, _ = await self._await("candidate", "imported")
        problem = self._refusals(imported.refused, {}) or self._namespace(imported.namespace)
        if problem is not None:
            raise problem
        await self._build(main)
        self.clock.lap("candidate_start")
        extra = await self._choose_sizes(main)
        self.clock.lap("dry_run")
        for size in extra:
            error = await self._build(size)
            if error is not None and size.key == "generic":
                self.shape_generic = False
                self.shape_generic_error = f"ModelNew(*get_init_inputs()) raised {error}"
                del self.sizes["generic"]
        await self._queue_trials(self.declared)
        planning = asyncio.ensure_future(self._plan_all())
        judging = asyncio.ensure_future(self._judge_all())
        self.tasks.extend([planning, judging])
        done, _ = await asyncio.wait({planning, judging},
                                     return_when=asyncio.FIRST_EXCEPTION)
        for task in done:
            task.result()
        await judging
        await planning
        await self._variants()
        compile_failure = await self._compile_result()
        self.clock.lap("checks")
        timings = None
        if compile_failure is None and self.v.profiles(request):
            timings = await self.v.profile(self)
            self.clock.lap("profile")
        audit = await self._audit()
        for problem in (audit, compile_failure):
            if problem is not None:
                raise problem
        outcome = self._passed_outcome()
        outcome.set(compile_facts=self.compile_facts or None, traffic=await self._traffic())
        if timings is not None:
            outcome.timed(timings)
        if outcome.fields.error:
            self.notes.append(outcome.fields.error)
        return outcome

    # ------------------------------------------------------------ counted traffic

    async def eager_count(self) -> Any:
        """The task's eager graph at the requested sizes as the reference counted it
        (:class:`schemas.events.EagerCount`, None when it could not be counted); awaited
        once, then kept."""
        if self._eager is _UNSET:
            done, _ = await self._await("reference", "done", "main")
            self._eager = done.eager
        return self._eager

    async def _traffic(self) -> Traffic | None:
        """The first trial's call as the replayer counted it, with the time model on the
        request's arch (default h100) and the task's eager graph from the reference
        (see :mod:`services.worker.traffic`); None where nothing was counted (a GPU
        replayer does not count). Counts that cannot describe the matched outputs are
        left out, with a note."""
        first = self.first_counted
        if first is None or not first[0].traffic:
            return None
        frame, real = first
        eager = await self.eager_count()
        inputs = sum(math.prod(n["z"]) * values.dtype_from_name(n["d"]).itemsize
                     for n in values.tensors_in(real.inputs))
        outputs = sum(m.nbytes for m in real.outputs)
        summary = traffic.summarize(list(frame.traffic),
                                    inputs + outputs + frame.captured_bytes, eager,
                                    target_for(self.request.arch, default="h100"))
        problem = traffic.check_counts(summary, outputs)
        if problem is not None:
            self.notes.append(f"traffic not reported: {problem}")
            return None
        return summary

    # ------------------------------------------------------------ verdict

    def _unchecked_error(self) -> str:
        """The ``unchecked`` verdict's message: the first path not checked (it names the
        kernel, the size and why), how many more, and how to accept a partial check."""
        more = len(self.unchecked) - 1
        return (f"what the task's own sizes launch was not checked: {self.unchecked[0]}"
                + (f" (+{more} more in unchecked)" if more else "")
                + "; make the kernels take the same path at every size, or pass "
                "allow_unchecked to accept a partial check")

    def _checked_sizes(self) -> list[dict[str, Any]]:
        """The requested sizes' module-level sizes, then the other sizes checked."""
        return [dict(self.sizes[k].names) for k in ("main", "second") if k in self.sizes]

    def _passed_outcome(self) -> Outcome:
        """The outcome of a verification whose every check passed; adds the notes on
        the inputs, the shape generality, what went unchecked and the sizes run."""
        second = self.sizes.get("second")
        checked = self._checked_sizes()
        tol = self.tolerance or tolerance_for(torch.float32, self.v.backend)
        if self.distributions:
            self.notes.append("inputs: " + "; ".join(
                f"trial {i}: {d}" for i, d in enumerate(self.distributions)))
        if self.shape_generic is False:
            self.notes.append("shape generality: wrong at "
                              f"{size_rules.text(self.shape_generic_sizes or {})}: "
                              f"{self.shape_generic_error}")
        if self.unchecked:
            self.notes.extend(f"unchecked: {u}" for u in self.unchecked)
        own = not self.request.shape_overrides or (second is not None and not second.overrides)
        if not own:
            self.notes.append("the task's own sizes were not run (they do not fit this "
                              "worker); the result holds for the sizes in sizes_checked")
        stage = None
        if self.unchecked:
            # Rule D025: no pass with an unchecked path, unless the request accepts one.
            error = self._unchecked_error()
            if not self.request.allow_unchecked:
                raise Verdict("unchecked", error, log=self.output_log(), trials=self.compared,
                              sizes_checked=checked, task_sizes_checked=own,
                              unchecked=self.unchecked, notes=self.notes, **self.errors)
            stage = "unchecked"
            self.notes.append(f"allow_unchecked: passed on a partial check, as the request "
                              f"accepts: {error}")
        return Outcome(passed=True, stage=stage, log=self.output_log(), **self.errors,
                       mismatch_count=0,
                       atol=tol.atol, rtol=tol.rtol, trials=self.compared,
                       sizes_checked=checked, task_sizes_checked=own,
                       ghost_replay=self.ghost_replay, notes=self.notes,
                       shape_generic=self.shape_generic,
                       shape_generic_sizes=self.shape_generic_sizes or {},
                       unchecked=self.unchecked)
