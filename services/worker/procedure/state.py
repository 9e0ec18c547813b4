"""What one verification holds: :class:`RunState`, the state its steps share (declared
here, with types, in one place), its children, and the sizes and calls it runs.

:class:`CheckedSize` is one set of sizes the procedure runs (the requested ones, the
task's own or a congruent one, the shape-generality one); :class:`Trial` is one call
of ``forward`` at such a size, with what the reference made for it and what the
planner traced. The rules that pick sizes are :mod:`services.worker.sizes`. What a
single step keeps for itself (the compile jobs, the replays' secrets, the variants'
judgements) is that step's own state, not here.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from dataclasses import dataclass, field
from typing import Any

import structlog
import torch

from schemas.events import EagerCount, VerifyPhase, VerifyRequest
from services.sandbox.errors import PoolBroken
from services.worker import inputs as trial_inputs
from services.worker import kernel_source, progress, wire
from services.worker.children import ChildFailed, Conversation, decode_tensor
from services.worker.procedure.host import Host
from services.worker.procedure.outcome import STAGES, Verdict
from services.worker.progress import PhaseObserver

log = structlog.get_logger("aikg.worker.procedure")

# The children of one verification by name, and how a verdict names each.
_WHO = {"candidate": "candidate", "replay": "candidate's kernels", "reference": "reference"}

# A frame and the raw buffers that followed it.
Answer = tuple[Any, list[bytearray]]


class PhaseClock:
    """Where one verification's time goes: consecutive spans plus children run beside them.

    :meth:`lap` closes the span that started at the previous lap (or at creation) and
    adds its length to ``name``; :meth:`add` records a child's own wall time without
    moving the mark (phases in :data:`schemas.events.VERIFY_PHASES_BESIDE`). Times are
    seconds on ``time.monotonic()``, taken in this process only: the children's own
    clocks are never read, so a candidate cannot shift them.

    ``observer`` (:data:`services.worker.progress.PhaseObserver`) is told each phase as
    it happens: :meth:`begin` reports one starting (a step of it: a trial, the other
    sizes, the replays, the compile check), :meth:`lap` the span it closes ending. An
    observer that raises is logged and dropped, never the verification's fault.
    """

    def __init__(self, observer: PhaseObserver | None = None) -> None:
        self.spans: dict[str, float] = {}
        self._mark = self._start = time.monotonic()
        self._observer = observer

    def begin(self, name: str, *, step: str = "", trial: int | None = None,
              trials: int | None = None) -> None:
        """Report phase ``name`` (its ``step``; ``trial`` of ``trials``, 1-based)
        starting now; the spans are :meth:`lap`'s alone."""
        if self._observer is not None:
            self._tell(VerifyPhase(
                name=name, label=progress.label(name, step, trial, trials), step=step,
                trial=trial, trials=trials,
                elapsed_s=round(time.monotonic() - self._start, 3)))

    def lap(self, name: str) -> None:
        now = time.monotonic()
        seconds = now - self._mark
        self.spans[name] = self.spans.get(name, 0.0) + seconds
        self._mark = now
        if self._observer is not None:
            self._tell(VerifyPhase(name=name, label=progress.label(name), state="ended",
                                   seconds=round(seconds, 3),
                                   elapsed_s=round(now - self._start, 3)))

    def add(self, name: str, seconds: float) -> None:
        self.spans[name] = self.spans.get(name, 0.0) + seconds

    def _tell(self, phase: VerifyPhase) -> None:
        assert self._observer is not None
        try:
            self._observer(phase)
        except Exception as exc:  # noqa: BLE001 - a display must not fail a verification
            log.warning("phase_observer_failed", phase=phase.name, error=str(exc))
            self._observer = None


@dataclass
class Trial:
    """What the reference made for one input set, and what came of it: ``key`` names
    the size (``main``, ``declared``, ``second``, ``generic``), ``index`` the trial or
    declared shape, ``model`` the built ModelNew it runs on."""

    key: str
    index: int
    model: str
    real: Answer | None = None
    decoy: Answer | None = None
    traced: Answer | None = None

    @property
    def replayer(self) -> str:
        """Its replayer: one for the trials and the declared shapes (they share the
        requested model's state), another, running beside it, for the other sizes and
        the variants of the first call (each from a fresh state)."""
        return "replay" if self.key in ("main", "declared") else "replay:side"


@dataclass
class CheckedSize:
    """One set of sizes checked: the task's module-level names rebound
    (``overrides``), the resulting size names, its input bytes and the reference's
    ``get_init_inputs()`` (frame and raw buffers)."""

    key: str
    overrides: dict[str, Any]
    names: dict[str, Any] = field(default_factory=dict)
    input_bytes: int = 0
    init: Answer | None = None


@dataclass(eq=False)
class RunState:
    """The state one verification's steps share. ``host`` lends the sandbox, the
    caches and the settings (:class:`~services.worker.procedure.host.Host`)."""

    host: Host
    request: VerifyRequest
    device: str
    clock: PhaseClock
    # The candidate's kernel module (services.worker.kernel_source) and its digest.
    kernels: kernel_source.KernelModule = field(init=False)
    source_sha: str = field(init=False)
    # Secret seeds of the trials and their decoys; each trial's input distribution.
    seeds: list[int] = field(init=False)
    decoy_seeds: list[int] = field(init=False)
    schedule: list[trial_inputs.Distribution] = field(init=False)
    children: dict[str, Conversation] = field(default_factory=dict)
    # Background work (planning, judging, compile jobs), cancelled by close().
    tasks: list[asyncio.Future[Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    unchecked: list[str] = field(default_factory=list)
    sizes: dict[str, CheckedSize] = field(default_factory=dict)
    # The calls to plan, in order; the first one planned.
    order: list[Trial] = field(default_factory=list)
    first_call: Trial | None = None
    # The first call's replayed outputs, compared with its variants'.
    first_outputs: list[torch.Tensor] | None = None
    # The first trial's replayed frame and its reference trial (counted traffic).
    first_counted: tuple[wire.Replayed, wire.RefTrial] | None = None
    # The task's declared shapes (get_inputs_dyn_list) and its Model's value digests
    # (rule D030), from the reference's answer at the requested sizes.
    declared: int = 0
    state_digests: set[str] = field(default_factory=set)
    # The task's own sizes' dry-run launches and size names, when they were only
    # dry-run (the compile check compiles them too).
    real_launches: list[dict[str, Any]] | None = None
    real_names: dict[str, Any] | None = None
    # Trials compared so far, the largest errors seen, the tolerance, the inputs.
    compared: int = 0
    errors: dict[str, float | None] = field(default_factory=lambda: {
        "max_abs_error": None, "max_rel_error": None, "rel_l2_error": None})
    tolerance: Any = None
    distributions: list[str] = field(default_factory=list)
    shape_generic: bool | None = None
    shape_generic_sizes: dict[str, Any] | None = None
    shape_generic_error: str | None = None
    ghost_replay: str | None = None
    # When the request's timeout_s runs out (the event loop's clock; set by run).
    deadline: float | None = None
    _eager: EagerCount | None = None
    _eager_read: bool = False

    def __post_init__(self) -> None:
        self.kernels = kernel_source.kernel_module(self.request.code)
        self.source_sha = hashlib.sha256(self.kernels.source.encode()).hexdigest()
        self.seeds = trial_inputs.draw_seeds(self.request.trials)
        self.decoy_seeds = trial_inputs.draw_seeds(self.request.trials)
        self.schedule = trial_inputs.schedule(self.request.trials)

    @property
    def trials(self) -> int:
        """Trials the request asks for."""
        return self.request.trials

    # ------------------------------------------------------------ children

    async def spawn(self, role: str, name: str | None = None, *,
                    address_space_bytes: int | None = None,
                    kernels: str | None = None) -> Conversation:
        """Start a child of ``role`` (kept as ``name``, default the role).

        Raises:
            Verdict: (infrastructure) the sandbox pool is broken.
        """
        try:
            run = await self.host.spawn(self.request, role, self.device,
                                        address_space_bytes=address_space_bytes,
                                        kernels=kernels)
        except PoolBroken as exc:
            raise Verdict("infrastructure", f"sandbox pool broken: {exc}") from None
        conversation = Conversation(_WHO[role], run,
                                    "infrastructure" if role == "reference" else "crash")
        self.children[name or role] = conversation
        return conversation

    @property
    def ref(self) -> Conversation:
        return self.children["reference"]

    @property
    def planner(self) -> Conversation:
        return self.children["candidate"]

    async def answer(self, child: str, *key: Any, keep: bool = False) -> Answer:
        """``child``'s answer keyed ``key`` (left for the next wait when ``keep``)."""
        if keep:
            return await self.children[child].peek(*key)
        return await self.children[child].get(*key)

    async def close(self) -> None:
        """Cancel the background work and end every child."""
        for task in self.tasks:
            task.cancel()
        with contextlib.suppress(BaseException):
            await asyncio.gather(*self.tasks, return_exceptions=True)
        await asyncio.gather(*(c.close() for c in self.children.values()),
                             return_exceptions=True)

    def output_log(self) -> str:
        """What the candidate's children printed, each at most half the verifier's
        ``output_limit_bytes``."""
        parts = []
        for name in ("candidate", "replay", "replay:side"):
            child = self.children.get(name)
            if child is not None:
                text = child.run.output(self.host.output_limit_bytes // 2)
                if text:
                    parts.append(text if name == "candidate" else f"(kernels)\n{text}")
        return "\n".join(parts)

    def child_verdict(self, exc: ChildFailed) -> Verdict:
        """The verdict of a failed child: the reference's is the task's or the
        infrastructure's, the others' the candidate's."""
        stage = exc.stage if exc.stage in STAGES else "runtime"
        if exc.who == "reference":
            return Verdict("task" if exc.stage == "task" else "infrastructure",
                           f"reference run: {exc.message}", log=exc.traceback)
        return Verdict(stage, exc.message, log=exc.traceback, trials=self.compared)

    # ------------------------------------------------------------ facts

    def checked_sizes(self) -> list[dict[str, Any]]:
        """The requested sizes' module-level sizes, then the other sizes checked."""
        return [dict(self.sizes[k].names) for k in ("main", "second") if k in self.sizes]

    async def eager_count(self) -> EagerCount | None:
        """The task's eager graph at the requested sizes as the reference counted it
        (None when it could not be counted); awaited once, then kept."""
        if not self._eager_read:
            done, _ = await self.answer("reference", "done", "main")
            self._eager = done.eager
            self._eager_read = True
        return self._eager


def outputs_of(frame: Any, raws: list[bytearray], skip: int = 0) -> list[torch.Tensor]:
    """The output tensors of a reference trial, a replay or a traced call; ``skip``
    raw buffers (the inputs' or captures') come first."""
    metas = frame.outputs if isinstance(frame, (wire.RefTrial, wire.Replayed)) else \
        frame.output_metas
    return [decode_tensor(m, raws[skip + i]) for i, m in enumerate(metas)]


def constant(t: torch.Tensor) -> bool:
    """Whether every element of ``t`` is equal (an empty tensor is)."""
    flat = t.reshape(-1)
    return flat.numel() == 0 or bool((flat == flat[0]).all())


def format_bytes(n: float) -> str:
    """``n`` bytes as GiB, MiB or KiB with one decimal."""
    if n >= 1 << 30:
        return f"{n / (1 << 30):.1f} GiB"
    if n >= 1 << 20:
        return f"{n / (1 << 20):.1f} MiB"
    return f"{n / 1024:.1f} KiB"
