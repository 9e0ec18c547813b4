"""The replays of one verification: each planned call posted to a replayer child, its
outputs taken back, and a failed comparison rechecked in float64.

:class:`Replays` is the step of :class:`~services.worker.procedure.core.Procedure`
that sends a traced call's plan and the real inputs to a replayer
(:mod:`services.worker.replay`), which runs the candidate's kernels and nothing else of
its code; every replay fills fresh allocations from a secret seed of its own and runs
each autotune config a secret number of times (rules D022, D023). A trial whose
floating outputs fail is first rechecked against the task's Model in float64, which
the reference child computes on the trial's inputs (:meth:`Replays.recheck`): where
the float32 reference is itself noise at those inputs, a candidate within that noise
of the float64 outputs passes, with a note.
"""

from __future__ import annotations

import asyncio
import math
import secrets

import torch

from services.sandbox import values
from services.sandbox.errors import ProtocolError
from services.worker import inputs as trial_inputs
from services.worker import wire
from services.worker._reference import digest
from services.worker.children import ChildFailed, decode_tensor
from services.worker.correctness import Comparison, compare_outputs, recheck, recheckable
from services.worker.procedure.host import Limits
from services.worker.procedure.outcome import STAGES, Verdict
from services.worker.procedure.state import RunState, Trial, outputs_of
from services.worker.trace import FILL_KINDS, POISON_FILLS

# What a float64 recheck leaves of the request's timeout_s, seconds: the verdict still
# has to be made and sent when it does not answer.
_RECHECK_MARGIN_S = 5.0


def draw_autotune_runs() -> int:
    """How often each config of a multi-config autotuned launch runs in one
    verification's replays (2 to 4: benchmark runs, then the real one), from the OS's
    cryptographic source (rule D023)."""
    return 2 + secrets.randbelow(3)


def replay_failure(frame: wire.ReplayFailed, compared: int) -> Verdict:
    """The verdict of a replay that failed (its stage, else ``runtime``)."""
    return Verdict(frame.stage if frame.stage in STAGES else "runtime", frame.message,
                   log=frame.traceback, trials=compared)


class Replays:
    """Replays of one verification's calls (``state``), compared on the verifier's
    backend (``limits``)."""

    def __init__(self, state: RunState, limits: Limits) -> None:
        self.state = state
        self.limits = limits
        # How often each config of a multi-config autotuned launch runs (secret).
        self.autotune_runs = draw_autotune_runs()
        # Trials' outputs from the task's Model in float64 (None: not to be had), by
        # (key, index), once a float64 recheck asked for them.
        self.truths: dict[tuple[str, int], list[torch.Tensor] | None] = {}

    def post(self, trial: Trial, label: str, *, fresh: bool = False,
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
        assert trial.traced is not None and trial.real is not None
        traced, traced_raws = trial.traced
        real, real_raws = trial.real
        count = len(values.raw_refs(real.inputs))
        captures: list[bytes | bytearray] = list(traced_raws[:len(traced.captures)])
        if replace:
            captures = [replace.get(storage_id, data) for (storage_id, _), data
                        in zip(traced.captures, captures, strict=True)]
        # A fresh state is the side replayer's (the variants, the other sizes).
        replayer = "replay:side" if fresh else trial.replayer
        # Posted: the planner goes on with the next call while the replayer is busy.
        self.state.children[replayer].post(wire.ReplayRequest(
            key=trial.key, index=trial.index, label=label, events=traced.events,
            captures=traced.captures, inputs=traced.inputs, real=real.inputs,
            outputs=traced.outputs, fresh=fresh, skip_launches=skip_launches, config=config,
            fill_kind=fill_kind, fill_seed=trial_inputs.draw_seeds(1)[0], order_seed=order_seed,
            autotune_runs=self.autotune_runs), captures + real_raws[:count])

    async def receive(self, trial: Trial, label: str) -> tuple[
            wire.Replayed | wire.ReplayFailed, list[bytearray], list[torch.Tensor]]:
        """The replay of ``trial`` labelled ``label`` (its frame and raw buffers) and the
        reference's outputs it is judged against."""
        # The trials' run replays on the trial's replayer; every variant on the side one.
        replayer = "replay:side" if label != "run" else trial.replayer
        frame, raws = await self.state.answer(replayer, "replay", trial.key, trial.index,
                                              label)
        assert trial.real is not None
        real, real_raws = trial.real
        expected = outputs_of(real, real_raws, skip=len(values.raw_refs(real.inputs)))
        return frame, raws, expected

    async def outputs(self, trial: Trial, label: str) -> tuple[
            wire.Replayed, list[torch.Tensor], list[torch.Tensor]]:
        """The frame, outputs and expected outputs of a variant's replay.

        Raises:
            Verdict: the replay failed.
        """
        frame, raws, expected = await self.receive(trial, label)
        if isinstance(frame, wire.ReplayFailed):
            raise replay_failure(frame, self.state.compared)
        return frame, outputs_of(frame, raws), expected

    async def compare(self, expected: list[torch.Tensor], got: list[torch.Tensor], *,
                      tf32: bool = False, detail: bool = True) -> Comparison:
        """``got`` against ``expected`` on the verifier's backend
        (:func:`services.worker.correctness.compare_outputs`), in a thread."""
        return await asyncio.to_thread(compare_outputs, expected, got, self.limits.backend,
                                       tf32=tf32, detail=detail)

    async def recheck(self, trial: Trial, expected: list[torch.Tensor],
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
                                         self.limits.backend, tf32=tf32)
        if not result.passed:
            return None
        self.state.notes.extend(f"float64 recheck, {where}: {note}" for note in result.notes)
        return result.comparison

    async def _truth(self, trial: Trial, expected: list[torch.Tensor]
                     ) -> list[torch.Tensor] | None:
        """``trial``'s outputs from the task's Model in float64, asked of the reference
        child once per trial (:class:`~services.worker.wire.RefRecheck`); None when it
        cannot give them (its error, a failed child, no answer within task_timeout_s or
        before the request's deadline less a margin)."""
        if (trial.key, trial.index) in self.truths:
            return self.truths[trial.key, trial.index]
        state = self.state
        truth = None
        loop = asyncio.get_running_loop()
        limit = (state.deadline - loop.time() - _RECHECK_MARGIN_S) if state.deadline else \
            math.inf
        limit = min(limit, self.limits.task_timeout_s or math.inf)
        assert trial.real is not None
        real, raws = trial.real
        count = len(values.raw_refs(real.inputs))
        size = state.sizes.get(trial.key) or state.sizes["main"]
        if limit > 0:
            try:
                await state.ref.send(wire.RefRecheck(
                    key=trial.key, index=trial.index, overrides=size.overrides,
                    inputs=real.inputs, digests=[digest(t) for t in expected],
                    max_output_bytes=self.limits.max_frame_bytes), raws[:count])
                frame, out = await asyncio.wait_for(
                    state.answer("reference", "rechecked", trial.key, trial.index),
                    None if limit == math.inf else limit)
                if not frame.error:
                    truth = [decode_tensor(m, d)
                             for m, d in zip(frame.outputs, out, strict=True)]
            except (ChildFailed, ProtocolError, TimeoutError):
                truth = None
        self.truths[trial.key, trial.index] = truth
        return truth
