"""The trials of one verification: planning each call, having it replayed, and judging
it.

:class:`Trials` is the step of :class:`~services.worker.procedure.core.Procedure` that
queues the calls (the trials, the task's declared shapes, the other sizes), has the
planner trace each on its decoy while the reference makes the real inputs, posts each
plan to a replayer (:class:`~services.worker.procedure.replays.Replays`), hands each
call's launches to the compile check and the first call to the variants
(:class:`~services.worker.procedure.variants.Variants`), and judges the replayed
outputs against the reference's (:mod:`services.worker.correctness`): emptiness (rule
D010), inputs left unchanged, no aliasing, values within tolerance (a failure rechecked
in float64 first), and the ghost check (outputs matching without the kernels: stage
``audit``).
"""

from __future__ import annotations

import json
import math
import secrets
from typing import Any

import torch

from services.sandbox import values
from services.worker import inputs as trial_inputs
from services.worker import sizes as size_rules
from services.worker import wire
from services.worker._reference import digest
from services.worker.children import decode_tensor
from services.worker.correctness import Comparison, compared_elements, ran_tf32
from services.worker.procedure.audit import refusals
from services.worker.procedure.compile_check import CompileCheck
from services.worker.procedure.outcome import Verdict
from services.worker.procedure.replays import Replays, replay_failure
from services.worker.procedure.state import RunState, Trial, constant, outputs_of
from services.worker.procedure.variants import Variants, autotune_configs, config_text
from services.worker.rules import op_packet
from services.worker.trace import FILL_KINDS

# The fills of the first call's replay: NaN, quiet or signalling (integers: their
# largest or smallest value), so that what matched there can differ under a
# plausible fill in its variant.
NAN_FILLS = ("nan", "snan")


class Trials:
    """The calls of one verification (``state``): planned, replayed through
    ``replays``, compiled by ``compile_check``, the first one's variants asked of
    ``variants``."""

    def __init__(self, state: RunState, replays: Replays, variants: Variants,
                 compile_check: CompileCheck) -> None:
        self.state = state
        self.replays = replays
        self.variants = variants
        self.compile_check = compile_check

    async def queue(self, declared: int) -> None:
        """The calls to plan, in order: the trials, the task's declared shapes (on the
        requested model), the congruent and the shape-generality sizes."""
        for i in range(self.state.trials):
            self._add_trial("main", i, "main")
        if declared:
            specs = []
            for d in range(declared):
                seed, decoy = trial_inputs.draw_seeds(2)
                specs.append(wire.RefTrialSpec(index=d, seed=decoy, decoy=True, declared=d))
                specs.append(wire.RefTrialSpec(index=d, seed=seed, declared=d,
                                               distribution=self.state.schedule[0].name))
                self._add_trial("declared", d, "main")
            await self.state.ref.send(wire.RefRequest(key="declared",
                                                      overrides=self.state.sizes["main"].overrides,
                                                      trials=specs), answers=2 + len(specs))
        for key in ("second", "generic"):
            if key in self.state.sizes:
                self._add_trial(key, 0, key)

    def _add_trial(self, key: str, index: int, model: str) -> None:
        self.state.order.append(Trial(key, index, model))

    async def plan_all(self) -> None:
        """Plan every call in order; each plan goes to the replayer as it comes."""
        for trial in self.state.order:
            if trial.key == "declared" and trial.index == 0:
                await self.state.answer("reference", "size", "declared")
            trial.decoy = await self.state.answer("reference", "trial", trial.key, trial.index,
                                                  True)
            frame, raws = trial.decoy
            count = len(values.raw_refs(frame.inputs))
            # The ghost run's fill: its own secret seed, of any kind (rule D022).
            await self.state.planner.send(wire.PlanCall(key=trial.key, index=trial.index,
                                                        model=trial.model, inputs=frame.inputs,
                                                        fill_kind=secrets.choice(FILL_KINDS),
                                                        fill_seed=trial_inputs.draw_seeds(1)[0]),
                                          raws[:count])
            trial.traced = await self.state.answer("candidate", "traced", trial.key, trial.index)
            trial.real = await self.state.answer("reference", "trial", trial.key, trial.index,
                                                 False)
            first = self.state.first_call is None
            if first:
                self.state.first_call = trial
            # Every call's launches are compiled for a GPU (new specialisations only).
            self.compile_check.add_call(trial)
            # The other sizes' single calls run from a fresh state: the side replayer
            # may have run the first call's variants before them.
            # The first call's fill is NaN (of either kind); its "orders" variant's is
            # plausible: what a kernel reads from memory it never wrote differs (D022).
            self.replays.post(trial, "run", config=trial.index if trial.key == "main" else None,
                              fresh=trial.replayer == "replay:side",
                              fill_kind=secrets.choice(NAN_FILLS) if first else None)
            if first:
                self.variants.request(trial)

    async def judge_all(self) -> None:
        """Judge every call in order, as its replay comes back."""
        clock = self.state.clock
        for trial in self.state.order:
            if trial.key == "main":
                clock.begin("trials", step="trial", trial=trial.index + 1,
                            trials=self.state.trials)
                await self._judge(trial)
                if trial.index == self.state.trials - 1:
                    clock.lap("trials")
                continue
            if trial is self.state.order[self.state.trials]:
                clock.begin("checks", step="other sizes")
            try:
                await self._judge(trial)
            except Verdict as verdict:
                sizes = self.state.sizes.get(trial.key)
                where = {"second": "at the task's own sizes" if sizes is not None and not
                         sizes.overrides else "at sizes congruent with the task's own",
                         "declared": f"at the task's declared shape {trial.index}",
                         "generic": "at the shape-generality sizes"}[trial.key]
                label = f" ({size_rules.text(sizes.names)})" if sizes else ""
                outcome = verdict.outcome
                outcome.set(sizes_checked=self.state.checked_sizes())
                if trial.key == "generic":
                    self.state.shape_generic = False
                    self.state.shape_generic_error = f"{outcome.fields.error}"
                    continue
                outcome.set(error=f"{where}{label}: {outcome.fields.error}")
                raise
            if trial.key == "generic":
                self.state.shape_generic = True

    async def _judge(self, trial: Trial) -> wire.Replayed:
        """Judge the replay of ``trial``'s call against the reference's outputs (module
        doc); a trial of the requested sizes counts toward ``compared`` and the errors.

        Raises:
            Verdict: the call failed a check.
        """
        # The replay was asked for once the plan and the real inputs were in.
        frame, raws, expected = await self.replays.receive(trial, "run")
        assert trial.real is not None and trial.traced is not None
        real = trial.real[0]
        where = f"trial {trial.index}" if trial.key == "main" else f"the {trial.key} trial"
        if trial.key == "main":
            self._check_nonempty(real, expected, where)
        if isinstance(frame, wire.ReplayFailed):
            raise replay_failure(frame, self.state.compared)
        got = outputs_of(frame, raws)
        if trial is self.state.first_call:
            self.state.first_outputs = got
        traced = trial.traced[0]
        problem = refusals(traced.refused, traced.refused_ops, self.state.compared)
        if problem is not None:
            raise problem
        self._check_inputs(trial, frame, raws, where)
        self._check_aliasing(trial, real, where)
        # A TF32 tl.dot in the replay: float32 is judged as on a GPU (correctness.ran_tf32).
        tf32 = ran_tf32(frame.traffic)
        comparison = await self.replays.compare(expected, got, tf32=tf32)
        tolerance = comparison.outputs[0].tolerance if comparison.outputs else None
        if not comparison.passed:
            rechecked = await self.replays.recheck(trial, expected, got, comparison, where,
                                                   tf32=tf32)
            if rechecked is None:
                raise await self._mismatch(trial, comparison, where)
            comparison = rechecked
        if trial.key == "main":
            if trial.index == 0:
                self.state.first_counted = (frame, real)
            self.state.compared += 1
            self.state.distributions.append(real.distribution + (f" ({real.fallback})"
                                                                 if real.fallback else ""))
            if tolerance is not None and self.state.tolerance is None:
                self.state.tolerance = tolerance
            for name in self.state.errors:
                value = getattr(comparison, name)
                if value is not None:
                    self.state.errors[name] = value if self.state.errors[name] is None else max(
                        self.state.errors[name], value)
            await self._check_ghost(trial, expected)
        return frame

    def _check_nonempty(self, real: wire.RefTrial, expected: list[torch.Tensor],
                        where: str) -> None:
        """Rule D010: a trial that compares no elements never passes."""
        total, empty = compared_elements(expected)
        overrides = json.dumps(self.state.request.shape_overrides, sort_keys=True)
        if total == 0:
            raise Verdict("infrastructure", f"nothing to compare: the reference "
                          f"{empty or 'returned no outputs'} (no elements) at shape_overrides "
                          f"{overrides}; pass sizes above zero")
        for i, node in enumerate(values.tensors_in(real.inputs)):
            if math.prod(node["z"]) == 0:
                raise Verdict("infrastructure", f"nothing to compare: input {i} has shape "
                              f"{tuple(node['z'])} (no elements) in {where}; pass "
                              "shape_overrides with sizes above zero")

    def _check_inputs(self, trial: Trial, frame: wire.Replayed, raws: list[bytearray],
                      where: str) -> None:
        assert trial.real is not None
        real = trial.real[0]
        after = raws[len(frame.outputs):]
        for i, (meta, data) in enumerate(zip(frame.inputs_after, after, strict=False)):
            if meta is None or i >= len(real.inputs_after):
                continue
            if digest(decode_tensor(meta, data)) != real.inputs_after[i]:
                raise Verdict("mismatch", f"candidate modified input {i} in place during "
                              f"{where}; kernels must leave their inputs unchanged and write "
                              "only to tensors they allocate", trials=self.state.compared + 1)

    def _check_aliasing(self, trial: Trial, real: wire.RefTrial, where: str) -> None:
        assert trial.traced is not None
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
                              trials=self.state.compared + 1)
            if storage in seen and not real.aliasing:
                raise Verdict("mismatch", f"output {i} shares memory with output "
                              f"{seen[storage]} in {where}; return separate tensors",
                              trials=self.state.compared + 1)
            seen[storage] = i

    async def _mismatch(self, trial: Trial, comparison: Comparison, where: str) -> Verdict:
        """The verdict of ``trial``'s failed ``comparison``, naming its root cause where
        one is found: outputs computed outside the kernels (stage ``audit``), an output
        no launch wrote, outputs that depend on the fill of fresh allocations, the
        autotune config the trial ran."""
        assert trial.real is not None and trial.traced is not None
        failed = comparison.first_failure
        details = "\n".join(o.message for o in comparison.outputs if o.message)
        fields: dict[str, Any] = {"trials": self.state.compared + 1, "log": details}
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
        fill = await self.variants.fill_problem()
        if fill is not None:
            return Verdict("mismatch", f"{fill} ({comparison.message} in {where})", **fields)
        tuned = ""
        if trial.key == "main" and autotune_configs(trial.traced[0]) > 1:
            # Trial i ran config i of each autotuned launch (as its replay was asked).
            tuned = (f" with autotune config {trial.index} of "
                     f"{config_text(trial, trial.index)} (each config must compute the "
                     "same outputs; a GPU may pick any)")
        return Verdict("mismatch", f"{comparison.message} in {where}{dist}{tuned}", **fields)

    async def _ghost_matches(self, trial: Trial) -> bool:
        """Whether the planner's own outputs (launches no-ops, allocations NaN) equal the
        reference's at the decoys: the candidate's process computed them itself."""
        assert trial.traced is not None and trial.decoy is not None
        traced, traced_raws = trial.traced
        decoy, decoy_raws = trial.decoy
        if not decoy.outputs or not traced.output_metas:
            return False
        count = len(values.raw_refs(decoy.inputs))
        want = outputs_of(decoy, decoy_raws, skip=count)
        if all(constant(t) for t in want):
            return False
        try:
            ghost = outputs_of(traced, traced_raws, skip=len(traced.captures))
        except Exception:  # noqa: BLE001 - malformed ghost outputs decide nothing
            return False
        result = await self.replays.compare(want, ghost, detail=False)
        return result.passed

    async def _check_ghost(self, trial: Trial, expected: list[torch.Tensor]) -> None:
        if await self._ghost_matches(trial):
            raise Verdict("audit", "outputs do not depend on the Triton kernels: with every "
                          "launch a no-op in its own process ModelNew.forward still returned "
                          f"the expected outputs (trial {trial.index}); compute them in the "
                          "kernels", ghost_replay="outputs matched without the kernels",
                          trials=self.state.compared)


# ATen ops that write a storage they were given (or return a copy of another).
_WRITING_OPS = ("copy_", "fill_", "zero_", "clone", "_to_copy", "contiguous", "full", "zeros",
                "ones", "zeros_like", "ones_like", "full_like", "new_zeros", "new_ones",
                "new_full", "arange", "lift_fresh", "lift_fresh_copy", "scalar_tensor")


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
