"""The trials of one verification: planning each call, replaying it, judging it, and
the variants of the first call.

:class:`TrialRuns` is the part of :class:`~services.worker.procedure.core.Procedure`
that queues the calls (the trials, the task's declared shapes, the other sizes), has
the planner trace each on its decoy while the reference makes the real inputs, posts
each plan to a replayer (:mod:`services.worker.replay`) and judges the replayed
outputs against the reference's (:mod:`services.worker.correctness`): emptiness (rule
D010), inputs left unchanged, no aliasing, values within tolerance, and the ghost
check (outputs matching without the kernels: stage ``audit``). A trial whose floating
outputs fail is first rechecked against the task's Model in float64, which the
reference child computes on the trial's inputs (:meth:`TrialRuns._recheck`): where the
float32 reference is itself noise at those inputs, a candidate within that noise of
the float64 outputs passes, with a note. The variants are the first call again without
its launches (rule D003) and with every autotune config.
"""

from __future__ import annotations

import asyncio
import json
import math
import secrets
from typing import Any

import torch

from services.sandbox import values, wire
from services.sandbox.pool import ProtocolError
from services.worker import init_compute
from services.worker import inputs as trial_inputs
from services.worker import sizes as size_rules
from services.worker._reference import digest
from services.worker.children import ChildFailed, decode_tensor
from services.worker.correctness import (
    Comparison,
    compare_outputs,
    compared_elements,
    ran_tf32,
    recheck,
    recheckable,
)
from services.worker.procedure.outcome import STAGES, Verdict
from services.worker.procedure.state import Trial, constant, outputs_of
from services.worker.rules import op_packet
from services.worker.trace import FILL_KINDS, PLAUSIBLE_FILLS, POISON_FILLS, UNDEFINED_ALLOCATIONS

# The fills of the first call's replay: NaN, quiet or signalling (integers: their
# largest or smallest value), so that what matched there can differ under a
# plausible fill in its variant.
NAN_FILLS = ("nan", "snan")

# What a float64 recheck leaves of the request's timeout_s, seconds: the verdict still
# has to be made and sent when it does not answer.
_RECHECK_MARGIN_S = 5.0


class TrialRuns:
    """Trials and variants of a :class:`~services.worker.procedure.core.Procedure` (a
    mixin: its state is the procedure's)."""

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
        trial = Trial(key, index, model)
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
            # The ghost run's fill: its own secret seed, of any kind (rule D022).
            await self.planner.send(wire.PlanCall(key=trial.key, index=trial.index,
                                                  model=trial.model, inputs=frame.inputs,
                                                  fill_kind=secrets.choice(FILL_KINDS),
                                                  fill_seed=trial_inputs.draw_seeds(1)[0]),
                                    raws[:count])
            trial.traced = await self._await("candidate", "traced", trial.key, trial.index)
            trial.real = await self._await("reference", "trial", trial.key, trial.index, False)
            first = self.first_call is None
            if first:
                self.first_call = trial
            # Every call's launches are compiled for a GPU (new specialisations only).
            self._compile_call(trial)
            # The other sizes' single calls run from a fresh state: the side replayer
            # may have run the first call's variants before them.
            # The first call's fill is NaN (of either kind); its "orders" variant's is
            # plausible: what a kernel reads from memory it never wrote differs (D022).
            await self._replay(trial, "run", config=trial.index if trial.key == "main" else None,
                               fresh=self.replayer_of(trial) == "replay:side",
                               fill_kind=secrets.choice(NAN_FILLS) if first else None)
            if first:
                await self._request_variants(trial)

    async def _replay(self, trial: Trial, label: str, *, fresh: bool = False,
                      skip_launches: bool = False, config: int | None = None,
                      fill_kind: str | None = None, order_seed: int | None = None,
                      replace: dict[int, bytes] | None = None) -> None:
        """Post ``trial``'s plan to a replayer. Every replay fills fresh allocations from
        a seed of its own, of kind ``fill_kind`` (default: a poison kind for the
        trials, whose outputs are compared with the reference's, any kind for the other
        sizes and variants); each config of a multi-config autotuned launch runs
        :attr:`autotune_runs` times (rules D022, D023; :mod:`services.worker.replay`).
        ``replace``: captured storage id -> the bytes it holds instead (rule D030)."""
        if fill_kind is None:
            fill_kind = secrets.choice(POISON_FILLS if trial.key == "main" else FILL_KINDS)
        traced, traced_raws = trial.traced
        real, real_raws = trial.real
        count = len(values.raw_refs(real.inputs))
        captures = traced_raws[:len(traced.captures)]
        if replace:
            captures = [replace.get(storage_id, data) for (storage_id, _), data
                        in zip(traced.captures, captures, strict=True)]
        # A fresh state is the side replayer's (the variants, the other sizes).
        replayer = "replay:side" if fresh else self.replayer_of(trial)
        # Posted: the planner goes on with the next call while the replayer is busy.
        self.children[replayer].post(wire.ReplayRequest(
            key=trial.key, index=trial.index, label=label, events=traced.events,
            captures=traced.captures, inputs=traced.inputs, real=real.inputs,
            outputs=traced.outputs, fresh=fresh, skip_launches=skip_launches, config=config,
            fill_kind=fill_kind, fill_seed=trial_inputs.draw_seeds(1)[0], order_seed=order_seed,
            autotune_runs=self.autotune_runs), captures + real_raws[:count])

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
                outcome = verdict.outcome
                outcome.set(sizes_checked=self._checked_sizes())
                if trial.key == "generic":
                    self.shape_generic = False
                    self.shape_generic_error = f"{outcome.fields.error}"
                    continue
                outcome.set(error=f"{where}{label}: {outcome.fields.error}")
                raise
            if trial.key == "generic":
                self.shape_generic = True

    async def _judge(self, trial: Trial, label: str, *, quick: bool = False
                     ) -> wire.Replayed:
        # The replay was asked for once the plan and the real inputs were in.
        replayer = "replay:side" if label != "run" else self.replayer_of(trial)
        frame, raws = await self._await(replayer, "replay", trial.key, trial.index, label)
        real, real_raws = trial.real
        count = len(values.raw_refs(real.inputs))
        expected = outputs_of(real, real_raws, skip=count)
        where = f"trial {trial.index}" if trial.key == "main" else f"the {trial.key} trial"
        if trial.key == "main" and label == "run":
            self._check_nonempty(real, expected, where)
        if isinstance(frame, wire.ReplayFailed):
            raise Verdict(frame.stage if frame.stage in STAGES else "runtime",
                          frame.message, log=frame.traceback, trials=self.compared)
        got = outputs_of(frame, raws)
        if label == "run" and trial is self.first_call:
            self.first_outputs = got
        if quick:
            return frame, got, expected
        traced = trial.traced[0]
        problem = self._refusals(traced.refused, traced.refused_ops)
        if problem is not None:
            raise problem
        self._check_inputs(trial, frame, raws, where)
        self._check_aliasing(trial, real, where)
        # A TF32 tl.dot in the replay: float32 is judged as on a GPU (correctness.ran_tf32).
        tf32 = ran_tf32(frame.traffic)
        comparison = await asyncio.to_thread(compare_outputs, expected, got, self.v.backend,
                                             tf32=tf32)
        tolerance = comparison.outputs[0].tolerance if comparison.outputs else None
        if not comparison.passed:
            rechecked = await self._recheck(trial, expected, got, comparison, where, tf32=tf32)
            if rechecked is None:
                raise await self._mismatch(trial, comparison, where)
            comparison = rechecked
        if trial.key == "main":
            if trial.index == 0:
                self.first_counted = (frame, real)
            self.compared += 1
            self.distributions.append(real.distribution + (f" ({real.fallback})"
                                                           if real.fallback else ""))
            if tolerance is not None and self.tolerance is None:
                self.tolerance = tolerance
            for name in self.errors:
                value = getattr(comparison, name)
                if value is not None:
                    self.errors[name] = value if self.errors[name] is None else max(
                        self.errors[name], value)
            await self._check_ghost(trial, expected)
        return frame

    async def _recheck(self, trial: Trial, expected: list[torch.Tensor],
                       got: list[torch.Tensor], comparison: Comparison,
                       where: str, *, tf32: bool = False) -> Comparison | None:
        """The failed ``comparison`` of ``trial`` redone against the task's Model in
        float64 (:func:`services.worker.correctness.recheck`): the comparison against
        those outputs when the float32 reference is noise at the trial's inputs and the
        candidate is within that noise of them (a note says so); None when the failure
        stands (not a floating-point mismatch, no float64 outputs, an accurate
        reference, a candidate beyond the widened tolerance).

        Only the task's code runs for it, in the reference child, on the inputs that
        child made; the candidate's part is the outputs it already returned."""
        if not recheckable(comparison, expected, got):
            return None
        truth = await self._truth(trial, expected)
        if truth is None:
            return None
        result = await asyncio.to_thread(recheck, comparison, expected, truth, got,
                                         self.v.backend, tf32=tf32)
        if not result.passed:
            return None
        self.notes.extend(f"float64 recheck, {where}: {note}" for note in result.notes)
        return result.comparison

    async def _truth(self, trial: Trial, expected: list[torch.Tensor]
                     ) -> list[torch.Tensor] | None:
        """``trial``'s outputs from the task's Model in float64, asked of the reference
        child once per trial (:class:`~services.sandbox.wire.RefRecheck`); None when it
        cannot give them (its error, a failed child, no answer within task_timeout_s or
        before the request's deadline less a margin)."""
        if (trial.key, trial.index) in self.truths:
            return self.truths[trial.key, trial.index]
        truth = None
        loop = asyncio.get_running_loop()
        limit = (self.deadline - loop.time() - _RECHECK_MARGIN_S) if self.deadline else \
            math.inf
        limit = min(limit, self.v.task_timeout_s or math.inf)
        real, raws = trial.real
        count = len(values.raw_refs(real.inputs))
        size = self.sizes.get(trial.key) or self.sizes["main"]
        if limit > 0:
            try:
                await self.ref.send(wire.RefRecheck(
                    key=trial.key, index=trial.index, overrides=size.overrides,
                    inputs=real.inputs, digests=[digest(t) for t in expected],
                    max_output_bytes=self.v.max_frame_bytes), raws[:count])
                frame, out = await asyncio.wait_for(
                    self._await("reference", "rechecked", trial.key, trial.index),
                    None if limit == math.inf else limit)
                if not frame.error:
                    truth = [decode_tensor(m, d)
                             for m, d in zip(frame.outputs, out, strict=True)]
            except (ChildFailed, ProtocolError, TimeoutError):
                truth = None
        self.truths[trial.key, trial.index] = truth
        return truth

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

    def _check_inputs(self, trial: Trial, frame: wire.Replayed, raws: list[bytearray],
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

    def _check_aliasing(self, trial: Trial, real: wire.RefTrial, where: str) -> None:
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

    async def _mismatch(self, trial: Trial, comparison: Any, where: str) -> Verdict:
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
        fill = await self._fill_problem()
        if fill is not None:
            return Verdict("mismatch", f"{fill} ({comparison.message} in {where})", **fields)
        tuned = ""
        if trial.key == "main" and _autotune_configs(trial.traced[0]) > 1:
            # Trial i ran config i of each autotuned launch (as its replay was asked).
            tuned = (f" with autotune config {trial.index} of "
                     f"{self._config_text(trial, trial.index)} (each config must compute the "
                     "same outputs; a GPU may pick any)")
        return Verdict("mismatch", f"{comparison.message} in {where}{dist}{tuned}", **fields)

    async def _ghost_matches(self, trial: Trial) -> bool:
        """Whether the planner's own outputs (launches no-ops, allocations NaN) equal the
        reference's at the decoys: the candidate's process computed them itself."""
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
        result = await asyncio.to_thread(compare_outputs, want, ghost, self.v.backend,
                                         detail=False)
        return result.passed

    async def _check_ghost(self, trial: Trial, expected: list[torch.Tensor]) -> None:
        if await self._ghost_matches(trial):
            raise Verdict("audit", "outputs do not depend on the Triton kernels: with every "
                          "launch a no-op in its own process ModelNew.forward still returned "
                          f"the expected outputs (trial {trial.index}); compute them in the "
                          "kernels", ghost_replay="outputs matched without the kernels",
                          trials=self.compared)

    # ------------------------------------------------------------ variants

    async def _request_variants(self, trial: Trial) -> None:
        """Ask the side replayer for the variants of the first call as soon as it is
        planned, so that they run beside the trials (judged by :meth:`_variants`)."""
        real, real_raws = trial.real
        expected = outputs_of(real, real_raws, skip=len(values.raw_refs(real.inputs)))
        self.no_launch_variant = not all(constant(t) for t in expected)
        if self.no_launch_variant:
            await self._replay(trial, "no-launch", fresh=True, skip_launches=True)
        # Rules D021 and D022: the first call again with its launches run in other
        # orders too (the first call only: its cost stays bounded), and with a
        # plausible fill (random finite values or zeros, what a GPU's fresh memory
        # holds) where the trial had a poison one.
        await self._replay(trial, "orders", fresh=True,
                           config=trial.index if trial.key == "main" else None,
                           fill_kind=secrets.choice(PLAUSIBLE_FILLS),
                           order_seed=trial_inputs.draw_seeds(1)[0])
        for config in range(self.trials, _autotune_configs(trial.traced[0])):
            await self._replay(trial, f"config {config}", fresh=True, config=config)
        await self._request_init_variant(trial)

    async def _request_init_variant(self, trial: Trial) -> None:
        """Rule D030: the captured storages of the first call whose bytes torch computed
        before forward (:mod:`services.worker.init_compute`) and that equal no tensor
        of the task's Model are named in the notes, and the call is replayed once more
        with all of them perturbed from a secret seed (judged by :meth:`_init_check`)."""
        traced, raws = trial.traced
        captured = {storage_id: data for (storage_id, _), data
                    in zip(traced.captures, raws[:len(traced.captures)], strict=False)}
        suspects = []
        for entry in getattr(traced, "init_computed", None) or []:
            if not isinstance(entry, dict) or entry.get("id") not in captured:
                continue
            if set(entry.get("digests") or []) & self.state_digests:
                continue
            suspects.append(entry)
            self.notes.append(f"ModelNew computed {_init_name(entry)} before forward with "
                              f"{_init_ops(entry)}")
        self.init_suspects = suspects
        if not suspects:
            return
        seed = trial_inputs.draw_seeds(1)[0]
        replace = {e["id"]: init_compute.perturb(captured[e["id"]], str(e.get("dtype")),
                                                 seed + i)
                   for i, e in enumerate(suspects)}
        await self._replay(trial, "init-perturbed", fresh=True,
                           config=trial.index if trial.key == "main" else None,
                           fill_kind=secrets.choice(PLAUSIBLE_FILLS), replace=replace)

    async def _init_check(self) -> None:
        """Rule D030: the first call replayed with the computed storages perturbed must
        give the first call's outputs within tolerance; otherwise the outputs depend on
        values torch computed before forward, not on the kernels (stage ``audit``)."""
        if not self.init_suspects or self.first_outputs is None:
            return
        what = "; ".join(f"{_init_name(e)}, computed with {_init_ops(e)}"
                         for e in self.init_suspects)
        try:
            frame, got, _ = await self._judge(self.first_call, "init-perturbed", quick=True)
            result = await asyncio.to_thread(compare_outputs, self.first_outputs, got,
                                             self.v.backend, tf32=ran_tf32(frame.traffic))
            changed = None if result.passed else result.message
        except Verdict as verdict:
            changed = f"the replay failed: {verdict.outcome.fields.error}"
        if changed is None:
            self.notes.append(f"the outputs do not depend on what ModelNew computed before "
                              f"forward ({what}): replayed with it perturbed, they matched")
            return
        raise Verdict("audit", f"outputs depend on {what}: ModelNew made it before forward "
                      "(in __init__ or at import), not a kernel; replayed with its values "
                      "perturbed (a secret permutation and scaling), the first call's outputs "
                      f"changed ({changed}); compute it in a kernel, or build it as the "
                      "task's Model does (rule D030)", trials=self.compared)

    async def _orders_outputs(self) -> list[torch.Tensor]:
        """The outputs of the first call's ``orders`` variant (its launches in other
        orders, another fill), awaited once and kept.

        Raises:
            Verdict: the variant failed (a race: stage ``mismatch``), each time asked."""
        if self.orders_judged is None:
            try:
                _, got, _ = await self._judge(self.first_call, "orders", quick=True)
                self.orders_judged = got
            except Verdict as verdict:
                self.orders_judged = verdict
        if isinstance(self.orders_judged, Verdict):
            raise self.orders_judged
        return self.orders_judged

    async def _fill_problem(self) -> str | None:
        """When a trial mismatched: whether the first call's outputs depend on the fill
        of fresh allocations (rule D022), the root cause to name; None when they do not,
        or the variant failed (the mismatch stands)."""
        if self.first_call is None or self.first_outputs is None:
            return None
        try:
            got = await self._orders_outputs()
        except Verdict:
            return None
        return _fill_dependence(self.first_outputs, got, self.first_call.traced[0])

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
        got = await self._orders_outputs()
        problem = _fill_dependence(self.first_outputs, got, trial.traced[0])
        if problem is not None:
            raise Verdict("mismatch", problem, trials=self.compared)
        await self._init_check()
        configs = _autotune_configs(trial.traced[0])
        for config in range(self.trials, configs):
            label = f"config {config}"
            frame, got, want = await self._judge(trial, label, quick=True)
            tf32 = ran_tf32(frame.traffic)
            result = await asyncio.to_thread(compare_outputs, want, got, self.v.backend,
                                             tf32=tf32)
            if not result.passed and await self._recheck(
                    trial, want, got, result, f"the first call with autotune config {config}",
                    tf32=tf32) is None:
                raise Verdict("mismatch", f"autotune config {config} of "
                              f"{self._config_text(trial, config)}: {result.message} (each "
                              "config must compute the same outputs; a GPU may pick any)",
                              trials=self.compared)
        if configs > 1:
            self.notes.append(f"autotune: each of {configs} configs ran (benchmark runs, then "
                              "the real one, as the GPU autotuner does; how often is secret) "
                              "and matched the reference")

    def _config_text(self, trial: Trial, config: int) -> str:
        for event in trial.traced[0].events:
            tune = event.get("autotune") if isinstance(event, dict) else None
            if isinstance(tune, dict) and tune.get("configs"):
                return f"{event.get('launch')} ({tune['configs'][config % len(tune['configs'])]})"
        return "the kernel"


# ATen ops that write a storage they were given (or return a copy of another).
_WRITING_OPS = ("copy_", "fill_", "zero_", "clone", "_to_copy", "contiguous", "full", "zeros",
                "ones", "zeros_like", "ones_like", "full_like", "new_zeros", "new_ones",
                "new_full", "arange", "lift_fresh", "lift_fresh_copy", "scalar_tensor")


def _init_name(entry: dict[str, Any]) -> str:
    """How a verdict names a computed storage (rule D030)."""
    name = str(entry.get("name") or "")
    if name.startswith(init_compute.MODULE_PREFIX):
        what = f"module constant `{name.removeprefix(init_compute.MODULE_PREFIX)}`"
    else:
        what = f"buffer `{name}`" if name else "a tensor no attribute names"
    return f"{what} (shape {list(entry.get('shape') or [])}, {entry.get('dtype')})"


def _init_ops(entry: dict[str, Any]) -> str:
    ops = [str(o) for o in entry.get("ops") or []]
    return ", ".join(ops[:6]) + (f" and {len(ops) - 6} more" if len(ops) > 6 else "")


def _autotune_configs(traced: Any) -> int:
    """The most configs any autotuned launch of a traced call has (0: none)."""
    return max((len(e["autotune"].get("variants") or []) for e in traced.events
                if isinstance(e, dict) and isinstance(e.get("autotune"), dict)), default=0)


def draw_autotune_runs() -> int:
    """How often each config of a multi-config autotuned launch runs in one
    verification's replays (2 to 4: benchmark runs, then the real one), from the OS's
    cryptographic source (rule D023)."""
    return 2 + secrets.randbelow(3)


def _fill_dependence(first: list[torch.Tensor] | None, other: list[torch.Tensor],
                     traced: Any) -> str | None:
    """Rule D022: the first call's outputs (``first``, fresh allocations poison-filled)
    against the same call replayed with another fill (``other``): the message naming
    the first output that differs, and the allocation it came from where the plan
    says; None when all are equal (floating point: equal values, NaN equal to NaN)."""
    if first is None:
        return None
    allocated = {}
    for event in traced.events:
        if isinstance(event, dict) and op_packet(str(event.get("op"))) in UNDEFINED_ALLOCATIONS:
            for node in values.tensors_in(event.get("out")):
                allocated.setdefault(node["s"], (str(event["op"]), list(node["z"])))
    nodes = values.tensors_in(traced.outputs)
    for i, (a, b) in enumerate(zip(first, other, strict=False)):
        if a.shape != b.shape or a.dtype != b.dtype:
            continue
        if a.dtype.is_floating_point or a.dtype.is_complex:
            same = (a == b) | (torch.isnan(a) & torch.isnan(b))
        else:
            same = a == b
        wrong = (~same).nonzero()
        if wrong.numel() == 0:
            continue
        index = [int(v) for v in wrong[0]]
        where = tuple(index)
        storage = nodes[i]["s"] if i < len(nodes) else None
        taken = ("computed from a fresh allocation a kernel read before any wrote it (a "
                 "scratch buffer, an initial value or a sentinel taken from torch.empty)")
        if storage in allocated:
            op, shape = allocated[storage]
            source = (f"it is the allocation {op} of shape {shape}: the kernels left elements "
                      f"of it unwritten, or {taken}")
        else:
            source = f"it was {taken}"
        return (f"output {i} was not written by the kernels (it depends on what the fresh "
                f"allocation held): replayed twice with different fills of fresh allocations, "
                f"{wrong.shape[0]} of {a.numel()} elements differ, the first at {list(where)} "
                f"({a[where].item()!r} with one fill, {b[where].item()!r} with the other); "
                f"{source}. A GPU's torch.empty holds whatever memory it had: write every "
                "element of an output, and initialise what a kernel reads")
    return None


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
