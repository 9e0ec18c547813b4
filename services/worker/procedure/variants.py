"""The variants of one verification's first call: the same call replayed again, from a
fresh state, to find what its outputs depend on besides the kernels.

:class:`Variants` is the step of :class:`~services.worker.procedure.core.Procedure`
that asks the side replayer for the variants as soon as the first call is planned
(:meth:`Variants.request`), so that they run beside the trials, and judges them once
the trials are judged (:meth:`Variants.judge`):

- without its launches (rule D003): outputs that still match do not come from the
  kernels (stage ``audit``);
- with its launches in other orders and a plausible fill of fresh allocations (rules
  D021, D022): outputs that differ were read from memory no kernel wrote, or raced
  (stage ``mismatch``);
- with every autotune config the trials did not use: each must compute the same
  outputs (a GPU may pick any);
- with the storages torch computed before forward perturbed (rule D030): outputs that
  change depend on them, not on the kernels (stage ``audit``).
"""

from __future__ import annotations

import secrets
from typing import Any

import torch

from services.sandbox import values
from services.worker import init_compute
from services.worker import inputs as trial_inputs
from services.worker.correctness import ran_tf32
from services.worker.procedure.outcome import Verdict
from services.worker.procedure.replays import Replays
from services.worker.procedure.state import RunState, Trial, constant, outputs_of
from services.worker.rules import op_packet
from services.worker.trace import PLAUSIBLE_FILLS, UNDEFINED_ALLOCATIONS


class Variants:
    """The first call's variants of one verification (``state``), through its
    ``replays``."""

    def __init__(self, state: RunState, replays: Replays) -> None:
        self.state = state
        self.replays = replays
        # Whether the no-launch variant was asked for (not when the reference's
        # outputs are constant: they would match without the kernels anyway).
        self.no_launch_variant = False
        # The orders variant's outputs, or the verdict of its failure, once judged.
        self.orders_judged: list[torch.Tensor] | Verdict | None = None
        # Rule D030: the first call's captured storages torch computed before forward
        # that match no value of the task's Model.
        self.init_suspects: list[dict[str, Any]] = []

    def request(self, trial: Trial) -> None:
        """Ask the side replayer for the variants of the first call as soon as it is
        planned, so that they run beside the trials (judged by :meth:`judge`)."""
        assert trial.real is not None and trial.traced is not None
        real, real_raws = trial.real
        expected = outputs_of(real, real_raws, skip=len(values.raw_refs(real.inputs)))
        self.no_launch_variant = not all(constant(t) for t in expected)
        if self.no_launch_variant:
            self.replays.post(trial, "no-launch", fresh=True, skip_launches=True)
        # Rules D021 and D022: the first call again with its launches run in other
        # orders too (the first call only: its cost stays bounded), and with a
        # plausible fill (random finite values or zeros, what a GPU's fresh memory
        # holds) where the trial had a poison one.
        self.replays.post(trial, "orders", fresh=True,
                          config=trial.index if trial.key == "main" else None,
                          fill_kind=secrets.choice(PLAUSIBLE_FILLS),
                          order_seed=trial_inputs.draw_seeds(1)[0])
        for config in range(self.state.trials, autotune_configs(trial.traced[0])):
            self.replays.post(trial, f"config {config}", fresh=True, config=config)
        self._request_init_variant(trial)

    def _request_init_variant(self, trial: Trial) -> None:
        """Rule D030: the captured storages of the first call whose bytes torch computed
        before forward (:mod:`services.worker.init_compute`) and that equal no tensor
        of the task's Model are named in the notes, and the call is replayed once more
        with all of them perturbed from a secret seed (judged by :meth:`_init_check`)."""
        assert trial.traced is not None
        traced, raws = trial.traced
        captured = {storage_id: data for (storage_id, _), data
                    in zip(traced.captures, raws[:len(traced.captures)], strict=False)}
        suspects = []
        for entry in getattr(traced, "init_computed", None) or []:
            if not isinstance(entry, dict) or entry.get("id") not in captured:
                continue
            if set(entry.get("digests") or []) & self.state.state_digests:
                continue
            suspects.append(entry)
            self.state.notes.append(f"ModelNew computed {_init_name(entry)} before forward with "
                                    f"{_init_ops(entry)}")
        self.init_suspects = suspects
        if not suspects:
            return
        seed = trial_inputs.draw_seeds(1)[0]
        replace = {e["id"]: init_compute.perturb(captured[e["id"]], str(e.get("dtype")),
                                                 seed + i)
                   for i, e in enumerate(suspects)}
        self.replays.post(trial, "init-perturbed", fresh=True,
                          config=trial.index if trial.key == "main" else None,
                          fill_kind=secrets.choice(PLAUSIBLE_FILLS), replace=replace)

    async def _init_check(self) -> None:
        """Rule D030: the first call replayed with the computed storages perturbed must
        give the first call's outputs within tolerance; otherwise the outputs depend on
        values torch computed before forward, not on the kernels (stage ``audit``)."""
        first = self.state.first_call
        if not self.init_suspects or self.state.first_outputs is None or first is None:
            return
        what = "; ".join(f"{_init_name(e)}, computed with {_init_ops(e)}"
                         for e in self.init_suspects)
        try:
            frame, got, _ = await self.replays.outputs(first, "init-perturbed")
            result = await self.replays.compare(self.state.first_outputs, got,
                                                tf32=ran_tf32(frame.traffic))
            changed = None if result.passed else result.message
        except Verdict as verdict:
            changed = f"the replay failed: {verdict.outcome.fields.error}"
        if changed is None:
            self.state.notes.append(f"the outputs do not depend on what ModelNew computed before "
                                    f"forward ({what}): replayed with it perturbed, they matched")
            return
        raise Verdict("audit", f"outputs depend on {what}: ModelNew made it before forward "
                      "(in __init__ or at import), not a kernel; replayed with its values "
                      "perturbed (a secret permutation and scaling), the first call's outputs "
                      f"changed ({changed}); compute it in a kernel, or build it as the "
                      "task's Model does (rule D030)", trials=self.state.compared)

    async def _orders_outputs(self) -> list[torch.Tensor]:
        """The outputs of the first call's ``orders`` variant (its launches in other
        orders, another fill), awaited once and kept.

        Raises:
            Verdict: the variant failed (a race: stage ``mismatch``), each time asked."""
        first = self.state.first_call
        assert first is not None
        if self.orders_judged is None:
            try:
                _, got, _ = await self.replays.outputs(first, "orders")
                self.orders_judged = got
            except Verdict as verdict:
                self.orders_judged = verdict
        if isinstance(self.orders_judged, Verdict):
            raise self.orders_judged
        return self.orders_judged

    async def fill_problem(self) -> str | None:
        """When a trial mismatched: whether the first call's outputs depend on the fill
        of fresh allocations (rule D022), the root cause to name; None when they do not,
        or the variant failed (the mismatch stands)."""
        first = self.state.first_call
        if first is None or first.traced is None or self.state.first_outputs is None:
            return None
        try:
            got = await self._orders_outputs()
        except Verdict:
            return None
        return _fill_dependence(self.state.first_outputs, got, first.traced[0])

    async def judge(self) -> None:
        """The first call again, from scratch (asked for by :meth:`request`):
        without its launches (D003), then with each autotune config the trials did not
        use."""
        trial = self.state.first_call
        if trial is None or trial.traced is None:
            return
        if not self.no_launch_variant:
            self.state.ghost_replay = "skipped: the reference output is constant"
        else:
            try:
                frame, got, want = await self.replays.outputs(trial, "no-launch")
                result = await self.replays.compare(want, got, detail=False)
                matched = result.passed
            except Verdict:
                matched = False
            if matched:
                raise Verdict("audit", "outputs do not depend on the Triton kernels: the "
                              "recorded plan without its kernel launches (only allocation, "
                              "views and copies) still gives the expected outputs; compute "
                              "them in the kernels", ghost_replay="outputs matched without "
                              "the kernels", trials=self.state.compared)
            self.state.ghost_replay = "outputs depend on the Triton kernels"
        got = await self._orders_outputs()
        problem = _fill_dependence(self.state.first_outputs, got, trial.traced[0])
        if problem is not None:
            raise Verdict("mismatch", problem, trials=self.state.compared)
        await self._init_check()
        configs = autotune_configs(trial.traced[0])
        for config in range(self.state.trials, configs):
            label = f"config {config}"
            frame, got, want = await self.replays.outputs(trial, label)
            tf32 = ran_tf32(frame.traffic)
            result = await self.replays.compare(want, got, tf32=tf32)
            if not result.passed and await self.replays.recheck(
                    trial, want, got, result, f"the first call with autotune config {config}",
                    tf32=tf32) is None:
                raise Verdict("mismatch", f"autotune config {config} of "
                              f"{config_text(trial, config)}: {result.message} (each "
                              "config must compute the same outputs; a GPU may pick any)",
                              trials=self.state.compared)
        if configs > 1:
            self.state.notes.append(f"autotune: each of {configs} configs ran (benchmark runs, "
                                    "then the real one, as the GPU autotuner does; how often is "
                                    "secret) and matched the reference")



def config_text(trial: Trial, config: int) -> str:
    """How messages name autotune config ``config`` of ``trial``'s first autotuned
    launch: ``kernel (the config)``."""
    assert trial.traced is not None
    for event in trial.traced[0].events:
        tune = event.get("autotune") if isinstance(event, dict) else None
        if isinstance(tune, dict) and tune.get("configs"):
            return f"{event.get('launch')} ({tune['configs'][config % len(tune['configs'])]})"
    return "the kernel"


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


def autotune_configs(traced: Any) -> int:
    """The most configs any autotuned launch of a traced call has (0: none)."""
    return max((len(e["autotune"].get("variants") or []) for e in traced.events
                if isinstance(e, dict) and isinstance(e.get("autotune"), dict)), default=0)


def _fill_dependence(first: list[torch.Tensor] | None, other: list[torch.Tensor],
                     traced: Any) -> str | None:
    """Rule D022: the first call's outputs (``first``, fresh allocations poison-filled)
    against the same call replayed with another fill (``other``): the message naming
    the first output that differs, and the allocation it came from where the plan
    says; None when all are equal (floating point: equal values, NaN equal to NaN)."""
    if first is None:
        return None
    allocated: dict[int, tuple[str, list[int]]] = {}
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
