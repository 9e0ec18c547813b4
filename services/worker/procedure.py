"""One verification, from the children it starts to the fields of its verdict.

:class:`Procedure` is what :meth:`services.worker.verifier.Verifier.verify` runs after
the static check. The facts the verdict rests on never pass through the candidate's
process:

1. The **reference** child (the task's code only) makes every input from seeds drawn
   from the OS's cryptographic source, each trial from a distribution of
   :mod:`services.worker.inputs`, and the outputs to match; and decoys (inputs at other
   secret seeds) for the candidate.
2. The **planner** child imports the candidate, builds ``ModelNew`` at every size
   checked (before it holds any input), dry-runs ``forward`` on meta tensors at the
   task's own sizes, then runs ``forward`` on the decoys with every launch a no-op,
   recording the plan (:mod:`services.worker.trace`).
3. The **replayer** child runs each plan on the real inputs with the candidate's
   kernels and nothing else of its code (:mod:`services.worker.replay`); this process
   compares its outputs with the reference's (:mod:`services.worker.correctness`).
4. Beside them: the same plan without launches (rule D003), every autotune config,
   the sizes congruent with the task's own (:mod:`services.worker.sizes`), the
   declared shapes of ``get_inputs_dyn_list()``, an awkward size for
   ``shape_generic``, and every kernel compiled for a GPU target
   (:mod:`services.worker.aot`).

When a replayed output mismatches while the planner's own (ghost) outputs match the
reference at the decoys, the candidate's process computed them outside its kernels:
stage ``audit``, not ``mismatch``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import math
import typing
from dataclasses import dataclass, field
from typing import Any

import structlog
import torch

from schemas.events import Stage, VerifyRequest
from services.sandbox import values, wire
from services.sandbox.pool import PoolBroken
from services.worker import aot, kernel_source
from services.worker import inputs as trial_inputs
from services.worker import sizes as size_rules
from services.worker._reference import digest
from services.worker.children import ChildFailed, Conversation, decode_tensor
from services.worker.correctness import compare_outputs, compared_elements, tolerance_for
from services.worker.rules import op_packet
from services.worker.targets import target_for

log = structlog.get_logger("aikg.worker.procedure")

# The second and shape-generality sizes on cpu: at most this many input bytes, so the
# interpreter finishes in seconds.
CPU_CHECK_BYTES = 1 << 20
# Rounds of the search for a size congruent with the task's own.
_SEARCH_ROUNDS = 6
# Candidate address space beyond the forked child's own, as a multiple of its task's
# input + output bytes, plus slack for libraries (an interpreted elementwise kernel on
# 128 MiB grew the address space by 1.6x its inputs + outputs; 8x leaves room).
ADDRESS_SPACE_SLACK = 2 << 30
ADDRESS_SPACE_FACTOR = 8
# A call into the task's code that hangs is blamed on its sizes (with a shape_overrides
# hint) only when its inputs exceed this many bytes; below, the code itself is named.
TASK_LARGE_INPUT_BYTES = 256 << 20


class Verdict(Exception):
    """Stop verifying; the keyword fields go into the VerifyResult."""

    def __init__(self, stage: str, error: str, **fields: Any) -> None:
        super().__init__(error)
        self.fields = {"passed": False, "stage": stage, "error": error, **fields}


@dataclass
class _Trial:
    """What the reference made for one input set, and what came of it."""

    key: str
    index: int
    model: str
    real: tuple[Any, list[bytearray]] | None = None
    decoy: tuple[Any, list[bytearray]] | None = None
    traced: tuple[Any, list[bytearray]] | None = None


@dataclass
class _Size:
    key: str
    overrides: dict[str, Any]
    names: dict[str, Any] = field(default_factory=dict)
    input_bytes: int = 0
    init: tuple[Any, list[bytearray]] | None = None


def _outputs_of(frame: Any, raws: list[bytearray], skip: int = 0) -> list[torch.Tensor]:
    metas = frame.outputs if isinstance(frame, (wire.RefTrial, wire.Replayed)) else \
        frame.output_metas
    return [decode_tensor(m, raws[skip + i]) for i, m in enumerate(metas)]


def _constant(t: torch.Tensor) -> bool:
    flat = t.reshape(-1)
    return flat.numel() == 0 or bool((flat == flat[0]).all())


class Procedure:
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
        self.sizes: dict[str, _Size] = {}
        self.trials_by_key: dict[tuple[str, int], _Trial] = {}
        self.order: list[_Trial] = []
        self.real_launches: list[dict[str, Any]] | None = None
        self.tasks: list[asyncio.Task] = []
        self.compared = 0
        self.errors: dict[str, float | None] = {"max_abs_error": None, "max_rel_error": None,
                                                "rel_l2_error": None}
        self.tolerance = None
        self.distributions: list[str] = []
        self.shape_generic: bool | None = None
        self.shape_generic_sizes: dict[str, Any] | None = None
        self.shape_generic_error: str | None = None
        self.first_call: _Trial | None = None
        self.compile_task: asyncio.Task | None = None
        self.compile_notes: list[str] = []
        self.compile_target: Any = None
        self.ghost_replay: str | None = None
        self.no_launch_variant = False
        self.declared = 0
        self._waiting = ""

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

    def replayer_of(self, trial: _Trial) -> str:
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

    async def run(self) -> dict[str, Any]:
        """The verdict's fields (see :class:`schemas.events.VerifyResult`).

        Raises:
            Verdict: the candidate failed.
        """
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
            hint = (f"; its inputs are {_format_bytes(size.input_bytes)}: "
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
        stage = exc.stage if exc.stage in _STAGES else "runtime"
        if exc.who == "reference":
            return Verdict("task" if exc.stage == "task" else "infrastructure",
                           f"reference run: {exc.message}", log=exc.traceback)
        return Verdict(stage, exc.message, log=exc.traceback, trials=self.compared)

    async def _await(self, child: str, *key: Any) -> tuple[Any, list[bytearray]]:
        self._waiting = child
        try:
            return await self.children[child].get(*key)
        finally:
            self._waiting = ""

    async def _run(self) -> dict[str, Any]:
        request = self.request
        if self.kernels.refused:
            # Rule D013: the interpreter and the GPU compiler would run different code.
            raise Verdict("compile", self.kernels.refused[0],
                          log="\n".join(self.kernels.refused))
        ref = await self._spawn("reference")
        main = _Size("main", dict(request.shape_overrides))
        self.sizes["main"] = main
        # Each decoy before its real trial: the planner starts on it while the
        # reference computes the real outputs.
        specs = []
        for i in range(self.trials):
            specs.append(wire.RefTrialSpec(index=i, seed=self.decoy_seeds[i], decoy=True))
            specs.append(wire.RefTrialSpec(index=i, seed=self.seeds[i],
                                           distribution=self.schedule[i].name))
        await ref.send(wire.RefRequest(key="main", overrides=main.overrides, trials=specs,
                                       input_limit_bytes=self.v.memory_limit_bytes),
                       answers=2 + len(specs))
        if request.shape_overrides:
            await ref.send(wire.RefRequest(key="real", overrides={}, meta_only=True))
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
        timings: dict[str, Any] = {}
        if compile_failure is None and self.v.profiles(request):
            timings = await self.v.profile(self)
            self.clock.lap("profile")
        audit = await self._audit()
        for problem in (audit, compile_failure):
            if problem is not None:
                raise problem
        fields = self._passed_fields()
        fields.update(timings)
        if fields.get("error"):
            self.notes.append(fields["error"])
        return fields

    # ------------------------------------------------------------ sizes and models

    def _size_answer(self, size: _Size, frame: wire.RefSize, raws: list[bytearray],
                     limit: int | None) -> None:
        size.names = dict(frame.size_names)
        size.input_bytes = frame.input_bytes
        if frame.refused:
            raise Verdict("infrastructure", f"task inputs need "
                          f"{_format_bytes(frame.input_bytes)} (limit "
                          f"{_format_bytes(limit or 0)}); "
                          f"{self.v.size_hint(frame.input_bytes, limit or 0, size.names)}")
        size.init = (frame.init, raws)
        if size.key == "main":
            self.declared = frame.declared

    def _address_space(self, size: _Size) -> int | None:
        if self.v.backend != "cpu":
            return None
        data = max(size.input_bytes, CPU_CHECK_BYTES)
        return ADDRESS_SPACE_FACTOR * 2 * data + ADDRESS_SPACE_SLACK

    async def _build(self, size: _Size, meta: tuple[Any, Any] | None = None) -> str | None:
        """Build ModelNew at ``size`` in the planner; the constructor's error when it
        failed at the shape-generality size (or on meta), else None."""
        optional = size.key == "generic"
        if meta is None:
            init, raws = size.init
            await self.planner.send(wire.PlanBuild(key=size.key, init=init,
                                                   optional=optional), raws)
        else:
            await self.planner.send(wire.PlanBuild(key=size.key, init=meta[0], meta=True))
        built, _ = await self._await("candidate", "built", size.key)
        return built.error

    async def _dry_run(self, key: str, overrides: dict[str, Any]) -> tuple[
            list[dict[str, Any]] | None, str | None, int, dict[str, Any]]:
        """The launches ``forward`` makes at ``overrides`` on meta tensors (or why not),
        those sizes' input bytes and size names."""
        if key != "real":
            await self.ref.send(wire.RefRequest(key=key, overrides=overrides, meta_only=True))
        try:
            frame, _ = await self._await("reference", "meta", key)
        except ChildFailed as exc:
            if exc.who != "reference" or self.ref.failure is not None:
                raise
            return None, f"the task cannot be built on meta tensors: {exc.message}", 0, {}
        launches, error = await self._dry_run_meta(key, frame)
        return launches, error, frame.input_bytes, dict(frame.size_names)

    async def _dry_run_meta(self, key: str, frame: Any) -> tuple[list[dict[str, Any]] | None,
                                                                 str | None]:
        await self._build(_Size(key, {}), meta=(frame.init, frame.inputs))
        await self.planner.send(wire.PlanDryRun(key=key, inputs=frame.inputs))
        dry, _ = await self._await("candidate", "dry", key)
        return (dry.launches if dry.error is None else None), dry.error

    def _budget(self, main: _Size) -> int:
        limit = self.v.memory_limit_bytes
        if self.v.backend == "cpu":
            return min(limit or CPU_CHECK_BYTES, max(CPU_CHECK_BYTES, main.input_bytes))
        return limit or max(main.input_bytes, CPU_CHECK_BYTES)

    async def _choose_sizes(self, main: _Size) -> list[_Size]:
        """The sizes checked besides the requested ones: the task's own when they fit,
        else one congruent with them when the requested sizes are not (see
        :mod:`services.worker.sizes`); and the shape-generality size. Records the task's
        own launches (for the compile check) when they are only dry-run."""
        extra: list[_Size] = []
        budget = self._budget(main)
        if self.request.shape_overrides:
            meta, _ = await self._meta("real")
            own = None
            if meta is not None and meta.input_bytes <= budget:
                own = await self._second("second", {})
            if own is not None:
                extra.append(own)
            elif meta is not None:
                found = await self._congruence(main, meta, budget)
                if found is not None:
                    extra.append(found)
        generic = await self._generic_size(main, budget)
        if generic is not None:
            extra.append(generic)
        return extra

    async def _meta(self, key: str) -> tuple[Any, str | None]:
        try:
            frame, _ = await self._await("reference", "meta", key)
        except ChildFailed as exc:
            if exc.who != "reference" or self.ref.failure is not None:
                raise
            self.unchecked.append(f"the task's own sizes: the task cannot be built on meta "
                                  f"tensors ({exc.message}), so what runs there was not "
                                  "dry-run")
            return None, exc.message
        return frame, None

    async def _congruence(self, main: _Size, meta: Any, budget: int) -> _Size | None:
        """The task's own sizes do not fit: dry-run them and the requested ones, and
        check a congruent size when the requested one is not."""
        constexprs = self.kernels.constexpr_params
        launches, error = await self._dry_run_meta("real", meta)
        if launches is None:
            self.unchecked.append(f"the task's own sizes: forward could not be dry-run there "
                                  f"({error})")
            return None
        self.real_launches = launches
        main_launches, main_error, _, _ = await self._dry_run("main:dry", main.overrides)
        if main_launches is None:
            self.unchecked.append(f"the requested sizes could not be dry-run ({main_error}), "
                                  "so they were not compared with the task's own")
            return None
        reason = size_rules.congruent(launches, main_launches, constexprs)
        if reason is None:
            self.notes.append("the task's own sizes do not fit this worker; a dry run there "
                              "launches the same kernels, congruently, as the checked sizes")
            return None
        return await self._congruent_size(dict(meta.size_names), meta.input_bytes, launches,
                                          budget, reason)

    async def _congruent_size(self, real_names: dict[str, Any], real_bytes: int,
                              launches: list[dict[str, Any]], budget: int,
                              reason: str) -> _Size | None:
        constexprs = self.kernels.constexpr_params
        m = size_rules.launch_modulus(launches, constexprs)
        current = {k: v for k, v in real_names.items() if size_rules.is_extent(k)}
        current_bytes = real_bytes
        tries = 0
        for _ in range(_SEARCH_ROUNDS):
            best = None
            for candidate in size_rules.congruent_candidates(current, m):
                tries += 1
                found, _, nbytes, _ = await self._dry_run(f"probe{tries}", candidate)
                if found is None or size_rules.congruent(launches, found, constexprs):
                    continue
                if best is None or nbytes < best[1]:
                    best = (candidate, nbytes)
            if best is None:
                break
            current, current_bytes = best
            if current_bytes <= budget:
                break
        if current_bytes <= budget and size_rules.changed(current, real_names):
            size = await self._second("second", current)
            if size is not None:
                self.notes.append(f"the requested sizes are not congruent with the task's "
                                  f"own ({reason}); {size_rules.text(current)} is, and was "
                                  "checked too")
                return size
        self.unchecked.append(f"{reason}; no size within the worker's budget "
                              f"({_format_bytes(budget)}) launches what the task's own sizes "
                              "launch, so that path was not checked")
        return None

    async def _second(self, key: str, overrides: dict[str, Any]) -> _Size | None:
        try:
            return await self._reference_size(key, overrides)
        except ChildFailed as exc:
            if exc.who != "reference" or self.ref.failure is not None:
                raise
            self.notes.append(f"the task's Model fails at {size_rules.text(overrides)}: "
                              f"{exc.message}")
            return None

    async def _reference_size(self, key: str, overrides: dict[str, Any],
                              limit: int | None = None) -> _Size | None:
        """Ask the reference for one trial (and its decoy) at ``overrides``: the sizes,
        or None when their inputs exceed ``limit``.

        Raises:
            ChildFailed: the task's own code fails at these sizes.
        """
        size = _Size(key, overrides)
        self.ref.forget(key)
        seed, decoy = trial_inputs.draw_seeds(2)
        await self.ref.send(wire.RefRequest(
            key=key, overrides=overrides, input_limit_bytes=limit,
            trials=[wire.RefTrialSpec(index=0, seed=decoy, decoy=True),
                    wire.RefTrialSpec(index=0, seed=seed, distribution=self.schedule[0].name)]),
            answers=4)
        frame, raws = await self._await("reference", "size", key)
        if frame.refused:
            return None
        self._size_answer(size, frame, raws, limit)
        self.sizes[key] = size
        return size

    async def _generic_size(self, main: _Size, budget: int) -> _Size | None:
        base = {k: v for k, v in main.names.items() if size_rules.is_extent(k)}
        for factor in (0.75, 0.5, 0.25, 0.125):
            awkward = size_rules.awkward_sizes(base, factor)
            if not size_rules.changed(awkward, base):
                self.notes.append("shape generality not checked: the task has no extents "
                                  "to vary")
                return None
            overrides = {**main.overrides, **awkward}
            try:
                size = await self._reference_size("generic", overrides, limit=budget)
            except ChildFailed as exc:
                if exc.who != "reference" or self.ref.failure is not None:
                    raise
                self.notes.append(f"shape generality not checked: the task's Model fails at "
                                  f"{size_rules.text(awkward)}: {exc.message}")
                return None
            if size is not None:
                self.shape_generic_sizes = awkward
                return size
        self.notes.append("shape generality not checked: no awkward size fits the budget")
        return None

    # ------------------------------------------------------------ trials

    async def _queue_trials(self, declared: int) -> None:
        """The calls to plan, in order: the trials, the task's declared shapes (on the
        requested model), the congruent and the shape-generality sizes."""
        for i in range(self.trials):
            self._add_trial("main", i, "main")
        if declared:
            specs = []
            for d in range(declared):
                seed, decoy = trial_inputs.draw_seeds(2)
                specs.append(wire.RefTrialSpec(index=d, seed=decoy, decoy=True, declared=d))
                specs.append(wire.RefTrialSpec(index=d, seed=seed, declared=d,
                                               distribution=self.schedule[0].name))
                self._add_trial("declared", d, "main")
            await self.ref.send(wire.RefRequest(key="declared",
                                                overrides=self.sizes["main"].overrides,
                                                trials=specs), answers=2 + len(specs))
        for key in ("second", "generic"):
            if key in self.sizes:
                self._add_trial(key, 0, key)

    def _add_trial(self, key: str, index: int, model: str) -> None:
        trial = _Trial(key, index, model)
        self.trials_by_key[key, index] = trial
        self.order.append(trial)

    async def _plan_all(self) -> None:
        """Plan every call in order; each plan goes to the replayer as it comes."""
        for trial in self.order:
            if trial.key == "declared" and trial.index == 0:
                await self._await("reference", "size", "declared")
            trial.decoy = await self._await("reference", "trial", trial.key, trial.index, True)
            frame, raws = trial.decoy
            count = len(values.raw_refs(frame.inputs))
            await self.planner.send(wire.PlanCall(key=trial.key, index=trial.index,
                                                  model=trial.model, inputs=frame.inputs),
                                    raws[:count])
            trial.traced = await self._await("candidate", "traced", trial.key, trial.index)
            trial.real = await self._await("reference", "trial", trial.key, trial.index, False)
            first = self.first_call is None
            if first:
                self.first_call = trial
                self._start_compile()
            # The other sizes' single calls run from a fresh state: the side replayer
            # may have run the first call's variants before them.
            await self._replay(trial, "run", config=trial.index if trial.key == "main" else None,
                               fresh=self.replayer_of(trial) == "replay:side")
            if first:
                await self._request_variants(trial)

    async def _replay(self, trial: _Trial, label: str, *, fresh: bool = False,
                      skip_launches: bool = False, config: int | None = None) -> None:
        traced, traced_raws = trial.traced
        real, real_raws = trial.real
        count = len(values.raw_refs(real.inputs))
        captures = traced_raws[:len(traced.captures)]
        # A fresh state is the side replayer's (the variants, the other sizes).
        replayer = "replay:side" if fresh else self.replayer_of(trial)
        # Posted: the planner goes on with the next call while the replayer is busy.
        self.children[replayer].post(wire.ReplayRequest(
            key=trial.key, index=trial.index, label=label, events=traced.events,
            captures=traced.captures, inputs=traced.inputs, real=real.inputs,
            outputs=traced.outputs, fresh=fresh, skip_launches=skip_launches, config=config),
            captures + real_raws[:count])

    async def _judge_all(self) -> None:
        for trial in self.order:
            if trial.key == "main":
                await self._judge(trial, "run")
                if trial.index == self.trials - 1:
                    self.clock.lap("trials")
                continue
            try:
                await self._judge(trial, "run")
            except Verdict as verdict:
                sizes = self.sizes.get(trial.key)
                where = {"second": "at the task's own sizes" if sizes is not None and not
                         sizes.overrides else "at sizes congruent with the task's own",
                         "declared": f"at the task's declared shape {trial.index}",
                         "generic": "at the shape-generality sizes"}[trial.key]
                label = f" ({size_rules.text(sizes.names)})" if sizes else ""
                verdict.fields["sizes_checked"] = self._checked_sizes()
                if trial.key == "generic":
                    self.shape_generic = False
                    self.shape_generic_error = f"{verdict.fields['error']}"
                    continue
                verdict.fields["error"] = f"{where}{label}: {verdict.fields['error']}"
                raise
            if trial.key == "generic":
                self.shape_generic = True

    async def _judge(self, trial: _Trial, label: str, *, quick: bool = False
                     ) -> wire.Replayed:
        # The replay was asked for once the plan and the real inputs were in.
        replayer = "replay:side" if label != "run" else self.replayer_of(trial)
        frame, raws = await self._await(replayer, "replay", trial.key, trial.index, label)
        real, real_raws = trial.real
        count = len(values.raw_refs(real.inputs))
        expected = _outputs_of(real, real_raws, skip=count)
        where = f"trial {trial.index}" if trial.key == "main" else f"the {trial.key} trial"
        if trial.key == "main" and label == "run":
            self._check_nonempty(real, expected, where)
        if isinstance(frame, wire.ReplayFailed):
            raise Verdict(frame.stage if frame.stage in _STAGES else "runtime",
                          frame.message, log=frame.traceback, trials=self.compared)
        got = _outputs_of(frame, raws)
        if quick:
            return frame, got, expected
        traced = trial.traced[0]
        problem = self._refusals(traced.refused, traced.refused_ops)
        if problem is not None:
            raise problem
        self._check_inputs(trial, frame, raws, where)
        self._check_aliasing(trial, real, where)
        comparison = await asyncio.to_thread(compare_outputs, expected, got, self.v.backend)
        if not comparison.passed:
            raise await self._mismatch(trial, comparison, where)
        if trial.key == "main":
            self.compared += 1
            self.distributions.append(real.distribution + (f" ({real.fallback})"
                                                           if real.fallback else ""))
            if comparison.outputs and self.tolerance is None:
                self.tolerance = comparison.outputs[0].tolerance
            for name in self.errors:
                value = getattr(comparison, name)
                if value is not None:
                    self.errors[name] = value if self.errors[name] is None else max(
                        self.errors[name], value)
            await self._check_ghost(trial, expected)
        return frame

    def _check_nonempty(self, real: wire.RefTrial, expected: list[torch.Tensor],
                        where: str) -> None:
        """Rule D010: a trial that compares no elements never passes."""
        total, empty = compared_elements(expected)
        overrides = json.dumps(self.request.shape_overrides, sort_keys=True)
        if total == 0:
            raise Verdict("infrastructure", f"nothing to compare: the reference "
                          f"{empty or 'returned no outputs'} (no elements) at shape_overrides "
                          f"{overrides}; pass sizes above zero")
        for i, node in enumerate(values.tensors_in(real.inputs)):
            if math.prod(node["z"]) == 0:
                raise Verdict("infrastructure", f"nothing to compare: input {i} has shape "
                              f"{tuple(node['z'])} (no elements) in {where}; pass "
                              "shape_overrides with sizes above zero")

    def _check_inputs(self, trial: _Trial, frame: wire.Replayed, raws: list[bytearray],
                      where: str) -> None:
        real = trial.real[0]
        after = raws[len(frame.outputs):]
        for i, (meta, data) in enumerate(zip(frame.inputs_after, after, strict=False)):
            if meta is None or i >= len(real.inputs_after):
                continue
            if digest(decode_tensor(meta, data)) != real.inputs_after[i]:
                raise Verdict("mismatch", f"candidate modified input {i} in place during "
                              f"{where}; kernels must leave their inputs unchanged and write "
                              "only to tensors they allocate", trials=self.compared + 1)

    def _check_aliasing(self, trial: _Trial, real: wire.RefTrial, where: str) -> None:
        traced = trial.traced[0]
        inputs = {n["s"]: i for i, n in enumerate(values.tensors_in(traced.inputs))}
        outputs = values.tensors_in(traced.outputs)
        seen: dict[int, int] = {}
        for i, node in enumerate(outputs):
            storage = node["s"]
            if storage in inputs and not real.aliasing:
                raise Verdict("mismatch", f"output {i} shares memory with input "
                              f"{inputs[storage]} in {where}; return new tensors that the "
                              "kernel wrote, not inputs or views of them",
                              trials=self.compared + 1)
            if storage in seen and not real.aliasing:
                raise Verdict("mismatch", f"output {i} shares memory with output "
                              f"{seen[storage]} in {where}; return separate tensors",
                              trials=self.compared + 1)
            seen[storage] = i

    async def _mismatch(self, trial: _Trial, comparison: Any, where: str) -> Verdict:
        failed = comparison.first_failure
        details = "\n".join(o.message for o in comparison.outputs if o.message)
        fields: dict[str, Any] = {"trials": self.compared + 1, "log": details}
        if failed is not None:
            fields.update(max_abs_error=failed.max_abs_error, max_rel_error=failed.max_rel_error,
                          mismatch_count=failed.mismatch_count,
                          mismatch_indices=failed.mismatch_indices,
                          atol=failed.tolerance.atol, rtol=failed.tolerance.rtol)
        if await self._ghost_matches(trial):
            return Verdict("audit", "ModelNew.forward returned the expected outputs in its own "
                           "process while its kernels did not run there, but its recorded "
                           f"kernel launches do not compute them ({comparison.message} in "
                           f"{where}): the outputs were computed outside the Triton kernels "
                           "(host code or PyTorch hidden from the record)", **fields)
        real = trial.real[0]
        dist = f" (inputs: {real.distribution})" if real.distribution != "task" else ""
        unwritten = _unwritten_outputs(trial.traced[0])
        if failed is not None and failed.index in unwritten:
            return Verdict("mismatch", f"output {failed.index} was never written: no kernel "
                           "launch wrote it (nor a copy), so it holds what was allocated "
                           f"({comparison.message} in {where}); pass the output tensor to "
                           "the kernel that computes it", **fields)
        tuned = ""
        if trial.key == "main" and _autotune_configs(trial.traced[0]) > 1:
            # Trial i ran config i of each autotuned launch (as its replay was asked).
            tuned = (f" with autotune config {trial.index} of "
                     f"{self._config_text(trial, trial.index)} (each config must compute the "
                     "same outputs; a GPU may pick any)")
        return Verdict("mismatch", f"{comparison.message} in {where}{dist}{tuned}", **fields)

    async def _ghost_matches(self, trial: _Trial) -> bool:
        """Whether the planner's own outputs (launches no-ops, allocations NaN) equal the
        reference's at the decoys: the candidate's process computed them itself."""
        traced, traced_raws = trial.traced
        decoy, decoy_raws = trial.decoy
        if not decoy.outputs or not traced.output_metas:
            return False
        count = len(values.raw_refs(decoy.inputs))
        want = _outputs_of(decoy, decoy_raws, skip=count)
        if all(_constant(t) for t in want):
            return False
        try:
            ghost = _outputs_of(traced, traced_raws, skip=len(traced.captures))
        except Exception:  # noqa: BLE001 - malformed ghost outputs decide nothing
            return False
        result = await asyncio.to_thread(compare_outputs, want, ghost, self.v.backend,
                                         detail=False)
        return result.passed

    async def _check_ghost(self, trial: _Trial, expected: list[torch.Tensor]) -> None:
        if await self._ghost_matches(trial):
            raise Verdict("audit", "outputs do not depend on the Triton kernels: with every "
                          "launch a no-op in its own process ModelNew.forward still returned "
                          f"the expected outputs (trial {trial.index}); compute them in the "
                          "kernels", ghost_replay="outputs matched without the kernels",
                          trials=self.compared)

    # ------------------------------------------------------------ variants

    async def _request_variants(self, trial: _Trial) -> None:
        """Ask the side replayer for the variants of the first call as soon as it is
        planned, so that they run beside the trials (judged by :meth:`_variants`)."""
        real, real_raws = trial.real
        expected = _outputs_of(real, real_raws, skip=len(values.raw_refs(real.inputs)))
        self.no_launch_variant = not all(_constant(t) for t in expected)
        if self.no_launch_variant:
            await self._replay(trial, "no-launch", fresh=True, skip_launches=True)
        for config in range(self.trials, _autotune_configs(trial.traced[0])):
            await self._replay(trial, f"config {config}", fresh=True, config=config)

    async def _variants(self) -> None:
        """The first call again, from scratch (asked for by :meth:`_request_variants`):
        without its launches (D003), then with each autotune config the trials did not
        use."""
        trial = self.first_call
        if trial is None:
            return
        if not self.no_launch_variant:
            self.ghost_replay = "skipped: the reference output is constant"
        else:
            try:
                frame, got, want = await self._judge(trial, "no-launch", quick=True)
                result = await asyncio.to_thread(compare_outputs, want, got, self.v.backend,
                                                 detail=False)
                matched = result.passed
            except Verdict:
                matched = False
            if matched:
                raise Verdict("audit", "outputs do not depend on the Triton kernels: the "
                              "recorded plan without its kernel launches (only allocation, "
                              "views and copies) still gives the expected outputs; compute "
                              "them in the kernels", ghost_replay="outputs matched without "
                              "the kernels", trials=self.compared)
            self.ghost_replay = "outputs depend on the Triton kernels"
        configs = _autotune_configs(trial.traced[0])
        for config in range(self.trials, configs):
            label = f"config {config}"
            frame, got, want = await self._judge(trial, label, quick=True)
            result = await asyncio.to_thread(compare_outputs, want, got, self.v.backend)
            if not result.passed:
                raise Verdict("mismatch", f"autotune config {config} of "
                              f"{self._config_text(trial, config)}: {result.message} (each "
                              "config must compute the same outputs; a GPU may pick any)",
                              trials=self.compared)
        if configs > 1:
            self.notes.append(f"autotune: each of {configs} configs ran (twice, as the GPU "
                              "autotuner does) and matched the reference")

    def _config_text(self, trial: _Trial, config: int) -> str:
        for event in trial.traced[0].events:
            tune = event.get("autotune") if isinstance(event, dict) else None
            if isinstance(tune, dict) and tune.get("configs"):
                return f"{event.get('launch')} ({tune['configs'][config % len(tune['configs'])]})"
        return "the kernel"

    # ------------------------------------------------------------ compile check

    def _start_compile(self) -> None:
        target_name = self.v.aot_target
        if not target_name or self.first_call is None:
            return
        target = target_for(self.request.arch, default=target_name)
        launches = [("the task's own sizes", e) for e in self.real_launches or []]
        launches += [("the checked sizes", e) for e in self.first_call.traced[0].events
                     if isinstance(e, dict) and "launch" in e]
        specs, notes = aot.specs(launches, self.kernels.constexpr_params, target,
                                 self.source_sha)
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
        grid_notes = [n for n in getattr(self, "compile_notes", []) if "grid" in n]
        if grid_notes:
            return Verdict("compile", grid_notes[0], trials=self.compared)
        self.notes.extend(n for n in getattr(self, "compile_notes", []) if "grid" not in n)
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

    # ------------------------------------------------------------ verdict

    def _checked_sizes(self) -> list[dict[str, Any]]:
        """The requested sizes' module-level sizes, then the other sizes checked."""
        return [dict(self.sizes[k].names) for k in ("main", "second") if k in self.sizes]

    def _passed_fields(self) -> dict[str, Any]:
        second = self.sizes.get("second")
        checked = self._checked_sizes()
        tol = self.tolerance or tolerance_for(torch.float32, self.v.backend)
        if self.distributions:
            self.notes.append("inputs: " + "; ".join(
                f"trial {i}: {d}" for i, d in enumerate(self.distributions)))
        if self.shape_generic is False:
            self.notes.append(f"shape generality: wrong at {size_rules.text(self.shape_generic_sizes or {})}: "
                              f"{self.shape_generic_error}")
        if self.unchecked:
            self.notes.extend(f"unchecked: {u}" for u in self.unchecked)
        own = not self.request.shape_overrides or (second is not None and not second.overrides)
        if not own:
            self.notes.append("the task's own sizes were not run (they do not fit this "
                              "worker); the result holds for the sizes in sizes_checked")
        return {"passed": True, "stage": None, "error": None, "log": self.output_log(),
                **self.errors, "mismatch_count": 0, "atol": tol.atol, "rtol": tol.rtol,
                "trials": self.compared, "sizes_checked": checked, "task_sizes_checked": own,
                "ghost_replay": getattr(self, "ghost_replay", None), "notes": self.notes,
                "shape_generic": self.shape_generic,
                "shape_generic_sizes": self.shape_generic_sizes or {},
                "unchecked": self.unchecked}



# The verdict stages a child's failure may name (schemas.events.Stage, the one list).
_STAGES = frozenset(typing.get_args(Stage))
# ATen ops that write a storage they were given (or return a copy of another).
_WRITING_OPS = ("copy_", "fill_", "zero_", "clone", "_to_copy", "contiguous", "full", "zeros",
                "ones", "zeros_like", "ones_like", "full_like", "new_zeros", "new_ones",
                "new_full", "arange", "lift_fresh", "lift_fresh_copy", "scalar_tensor")


def _autotune_configs(traced: Any) -> int:
    """The most configs any autotuned launch of a traced call has (0: none)."""
    return max((len(e["autotune"].get("variants") or []) for e in traced.events
                if isinstance(e, dict) and isinstance(e.get("autotune"), dict)), default=0)


def _unwritten_outputs(traced: Any) -> set[int]:
    """Indexes of outputs whose storage no launch took as an argument and no writing
    op produced or filled: what ``forward`` allocated and returned untouched."""
    written: set[int] = set()
    for event in traced.events:
        if not isinstance(event, dict):
            continue
        if "launch" in event:
            tune = event.get("autotune")
            runs = (tune.get("variants") or [event]) if isinstance(tune, dict) else [event]
            for run in runs:
                written.update(n["s"] for n in values.tensors_in(run.get("args")))
        elif op_packet(str(event.get("op"))) in _WRITING_OPS:
            written.update(n["s"] for n in values.tensors_in(event.get("out")))
            if str(event.get("op")).split(".")[1].endswith("_"):
                written.update(n["s"] for n in values.tensors_in(event.get("args", [])[:1]))
    inputs = {n["s"] for n in values.tensors_in(traced.inputs)}
    return {i for i, n in enumerate(values.tensors_in(traced.outputs))
            if n["s"] not in written and n["s"] not in inputs}


def _format_bytes(n: float) -> str:
    if n >= 1 << 30:
        return f"{n / (1 << 30):.1f} GiB"
    if n >= 1 << 20:
        return f"{n / (1 << 20):.1f} MiB"
    return f"{n / 1024:.1f} KiB"
