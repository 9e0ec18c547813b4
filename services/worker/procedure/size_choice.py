"""Which sizes one verification checks, and the models and dry runs it takes.

:class:`SizeChoice` is the step of :class:`~services.worker.procedure.core.Procedure`
that answers the reference's size frames, builds ``ModelNew`` in the planner at each
size, dry-runs ``forward`` on meta tensors, and picks the sizes checked besides the
requested ones: the task's own when they fit the worker's budget, else a size
congruent with them, and an awkward size for ``shape_generic``. The rules it applies
(extents, congruence modulo block sizes, the candidates of the search) are
:mod:`services.worker.sizes`; this module only runs them against the children.
"""

from __future__ import annotations

import random
import secrets
from typing import Any

from services.worker import inputs as trial_inputs
from services.worker import overflow, wire
from services.worker import sizes as size_rules
from services.worker.children import ChildFailed
from services.worker.procedure.host import Limits
from services.worker.procedure.outcome import Verdict
from services.worker.procedure.state import CheckedSize, RunState, format_bytes

# The second and shape-generality sizes on cpu: at most this many input bytes, so the
# interpreter finishes in seconds (the default of the setting worker_check_bytes; the
# measurements behind it are in docs/settings.md).
CPU_CHECK_BYTES = 4 << 20
# Rounds of the search for a size congruent with the task's own.
_SEARCH_ROUNDS = 6
# Candidate address space beyond the forked child's own, as a multiple of its task's
# input + output bytes, plus slack for libraries (an interpreted elementwise kernel on
# 128 MiB grew the address space by 1.6x its inputs + outputs; 8x leaves room).
ADDRESS_SPACE_SLACK = 2 << 30
ADDRESS_SPACE_FACTOR = 8


class SizeChoice:
    """Sizes, models and dry runs of one verification (``state``), within the
    verifier's ``limits``."""

    def __init__(self, state: RunState, limits: Limits) -> None:
        self.state = state
        self.limits = limits
        # The candidate's kernels parsed once (None until asked).
        self._parsed_kernels: size_rules.KernelSource | None = None

    def size_answer(self, size: CheckedSize, frame: wire.RefSize, raws: list[bytearray],
                    limit: int | None) -> None:
        """Take the reference's sizes of ``size`` (its names, input bytes, constructor
        arguments).

        Raises:
            Verdict: (task) the inputs are larger than ``limit`` bytes, the worker's
                memory limit: the task is too big for this worker, which the user's
                shape_overrides fix (the message names the task's largest sizes), not
                the worker's fault.
        """
        size.names = dict(frame.size_names)
        size.input_bytes = frame.input_bytes
        if frame.refused:
            raise Verdict("task", f"task inputs need "
                          f"{format_bytes(frame.input_bytes)} (limit "
                          f"{format_bytes(limit or 0)}): the task is too big for this "
                          "worker; "
                          f"{self.limits.size_hint(frame.input_bytes, limit or 0, size.names)}")
        size.init = (frame.init, raws)
        if size.key == "main":
            self.state.declared = frame.declared
            self.state.state_digests = set(frame.state)

    @property
    def _check_bytes(self) -> int:
        """The cpu budget of the other sizes' inputs, bytes (setting worker_check_bytes)."""
        return self.limits.check_bytes or CPU_CHECK_BYTES

    def address_space(self, size: CheckedSize) -> int | None:
        if self.limits.backend != "cpu":
            return None
        data = max(size.input_bytes, self._check_bytes)
        return ADDRESS_SPACE_FACTOR * 2 * data + ADDRESS_SPACE_SLACK

    async def build(self, size: CheckedSize, meta: tuple[Any, Any] | None = None) -> str | None:
        """Build ModelNew at ``size`` in the planner; the constructor's error when it
        failed at the shape-generality size (or on meta), else None."""
        optional = size.key == "generic"
        if meta is None:
            assert size.init is not None
            init, raws = size.init
            await self.state.planner.send(wire.PlanBuild(key=size.key, init=init,
                                                         optional=optional), raws)
        else:
            await self.state.planner.send(wire.PlanBuild(key=size.key, init=meta[0], meta=True))
        built, _ = await self.state.answer("candidate", "built", size.key)
        return built.error

    async def _dry_run(self, key: str, overrides: dict[str, Any]) -> tuple[
            list[dict[str, Any]] | None, str | None, int, dict[str, Any]]:
        """The launches ``forward`` makes at ``overrides`` on meta tensors (or why not),
        those sizes' input bytes and size names."""
        if key != "real":
            await self.state.ref.send(wire.RefRequest(key=key, overrides=overrides, meta_only=True))
        try:
            frame, _ = await self.state.answer("reference", "meta", key)
        except ChildFailed as exc:
            if exc.who != "reference" or self.state.ref.failure is not None:
                raise
            return None, f"the task cannot be built on meta tensors: {exc.message}", 0, {}
        launches, error = await self._dry_run_meta(key, frame)
        return launches, error, frame.input_bytes, dict(frame.size_names)

    async def _dry_run_meta(self, key: str, frame: Any) -> tuple[list[dict[str, Any]] | None,
                                                                 str | None]:
        await self.build(CheckedSize(key, {}), meta=(frame.init, frame.inputs))
        await self.state.planner.send(wire.PlanDryRun(key=key, inputs=frame.inputs))
        dry, _ = await self.state.answer("candidate", "dry", key)
        return (dry.launches if dry.error is None else None), dry.error

    def _budget(self, main: CheckedSize) -> int:
        limit = self.limits.memory_limit_bytes
        check = self._check_bytes
        if self.limits.backend == "cpu":
            return min(limit or check, max(check, main.input_bytes))
        return limit or max(main.input_bytes, check)

    async def choose_sizes(self, main: CheckedSize) -> list[CheckedSize]:
        """The sizes checked besides the requested ones: the task's own when they fit,
        else one congruent with them when the requested sizes are not (see
        :mod:`services.worker.sizes`); and the shape-generality size. Records the task's
        own launches (for the compile check) when they are only dry-run."""
        extra: list[CheckedSize] = []
        budget = self._budget(main)
        if self.state.request.shape_overrides:
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
        self._check_offsets()
        generic = await self._generic_size(main, budget)
        if generic is not None:
            extra.append(generic)
        return extra

    def _kernel_source(self) -> size_rules.KernelSource | None:
        """The candidate's kernels parsed once (None when they do not parse)."""
        if self._parsed_kernels is None:
            try:
                self._parsed_kernels = size_rules.KernelSource.of(self.state.kernels.source)
            except SyntaxError:
                return None
        return self._parsed_kernels

    def _check_offsets(self) -> None:
        """Rule D026: an int32 offset past its range at the task's own sizes (their dry
        run's launches) fails at ``compile``, naming the kernel and the expression.

        Raises:
            Verdict: such an offset was found.
        """
        if not self.state.real_launches:
            return
        try:
            found = overflow.find(self.state.real_launches, self.state.kernels.source,
                                  where="the task's own sizes "
                                        f"({size_rules.text(self.state.real_names or {})})")
        except SyntaxError:
            return
        if found:
            raise Verdict("compile", found[0].message(),
                          log="\n".join(f.message() for f in found))

    async def _meta(self, key: str) -> tuple[Any, str | None]:
        try:
            frame, _ = await self.state.answer("reference", "meta", key)
        except ChildFailed as exc:
            if exc.who != "reference" or self.state.ref.failure is not None:
                raise
            self.state.unchecked.append(f"the task's own sizes: the task cannot be built on meta "
                                        f"tensors ({exc.message}), so which kernels run there was "
                                        "not dry-run")
            return None, exc.message
        return frame, None

    async def _congruence(self, main: CheckedSize, meta: Any, budget: int) -> CheckedSize | None:
        """The task's own sizes do not fit: dry-run them and the requested ones, and
        check a congruent size when the requested one is not."""
        constexprs = self.state.kernels.constexpr_params
        launches, error = await self._dry_run_meta("real", meta)
        if launches is None:
            self.state.unchecked.append(f"the task's own sizes: forward could not be dry-run there "
                                        f"({error})")
            return None
        self.state.real_launches = launches
        self.state.real_names = dict(meta.size_names)
        main_launches, main_error, _, _ = await self._dry_run("main:dry", main.overrides)
        if main_launches is None:
            self.state.unchecked.append(f"the requested sizes could not be dry-run ({main_error}), "
                                        "so they were not compared with the task's own")
            return None
        reason = size_rules.congruent(launches, main_launches, constexprs,
                                      self._kernel_source())
        if reason is None:
            self.state.notes.append("the task's own sizes do not fit this worker; a dry run there "
                                    "launches the same kernels, congruently, as the checked sizes")
            return None
        return await self._congruent_size(dict(meta.size_names), meta.input_bytes, launches,
                                          budget, reason)

    async def _congruent_size(self, real_names: dict[str, Any], real_bytes: int,
                              launches: list[dict[str, Any]], budget: int,
                              reason: str) -> CheckedSize | None:
        constexprs = self.state.kernels.constexpr_params
        source = self._kernel_source()
        m = size_rules.launch_modulus(launches, constexprs)
        current = {k: v for k, v in real_names.items() if size_rules.is_extent(k)}
        current_bytes = real_bytes
        tries = 0
        # Greedy: each round keeps the smallest congruent candidate, and the search goes
        # on below the budget (the smallest congruent size is the cheapest to check).
        for _ in range(_SEARCH_ROUNDS):
            best = None
            for candidate in size_rules.congruent_candidates(current, m):
                tries += 1
                found, _, nbytes, _ = await self._dry_run(f"probe{tries}", candidate)
                if found is None or nbytes >= current_bytes or \
                        size_rules.congruent(launches, found, constexprs, source):
                    continue
                if best is None or nbytes < best[1]:
                    best = (candidate, nbytes)
            if best is None:
                break
            current, current_bytes = best
        if current_bytes <= budget and size_rules.changed(current, real_names):
            size = await self._second("second", current)
            if size is not None:
                self.state.notes.append(f"the requested sizes are not congruent with the task's "
                                        f"own ({reason}); {size_rules.text(current)} is, and was "
                                        "checked too")
                return size
        self.state.unchecked.append(
            f"{reason} (the task's own sizes: {size_rules.text(real_names)}); no size within "
            f"the worker's budget ({format_bytes(budget)}, setting worker_check_bytes) "
            "launches what the task's own sizes launch, so that path was not checked")
        return None

    async def _second(self, key: str, overrides: dict[str, Any]) -> CheckedSize | None:
        size, _ = await self._task_sizes(key, overrides)
        return size

    async def _task_sizes(self, key: str, overrides: dict[str, Any], *,
                          limit: int | None = None, shown: dict[str, Any] | None = None,
                          note: str = "") -> tuple[CheckedSize | None, bool]:
        """:meth:`_reference_size`, with the task's own failure at these sizes noted
        (after ``note``, naming ``shown`` or ``overrides``) instead of raised: the sizes
        (None when refused or failed) and whether the task's Model failed.

        Raises:
            ChildFailed: the reference child itself failed (not the task at these sizes).
        """
        try:
            return await self._reference_size(key, overrides, limit), False
        except ChildFailed as exc:
            if exc.who != "reference" or self.state.ref.failure is not None:
                raise
            named = size_rules.text(overrides if shown is None else shown)
            self.state.notes.append(f"{note}the task's Model fails at {named}: {exc.message}")
            return None, True

    async def _reference_size(self, key: str, overrides: dict[str, Any],
                              limit: int | None = None) -> CheckedSize | None:
        """Ask the reference for one trial (and its decoy) at ``overrides``: the sizes,
        or None when their inputs exceed ``limit``.

        Raises:
            ChildFailed: the task's own code fails at these sizes.
        """
        size = CheckedSize(key, overrides)
        self.state.ref.forget(key)
        seed, decoy = trial_inputs.draw_seeds(2)
        await self.state.ref.send(wire.RefRequest(
            key=key, overrides=overrides, input_limit_bytes=limit,
            trials=[wire.RefTrialSpec(index=0, seed=decoy, decoy=True),
                    wire.RefTrialSpec(index=0, seed=seed,
                                      distribution=self.state.schedule[0].name)]),
            answers=4)
        frame, raws = await self.state.answer("reference", "size", key)
        if frame.refused:
            return None
        self.size_answer(size, frame, raws, limit)
        # The size frame comes before the task's Model runs there: a Model that builds
        # its inputs at these sizes but fails in forward (a LayerNorm whose shape ties
        # two extents together) fails here, so the sizes are dropped with a note rather
        # than failing the verification later.
        await self.state.answer("reference", "trial", key, 0, True, keep=True)
        self.state.sizes[key] = size
        return size

    async def _generic_size(self, main: CheckedSize, budget: int) -> CheckedSize | None:
        base = {k: v for k, v in main.names.items() if size_rules.is_extent(k)}
        # Drawn from a secret seed of this verification (the OS's cryptographic source,
        # like the trials' seeds): the candidate cannot know the size in advance.
        rng = random.Random(secrets.randbits(64))
        for factor in (1.0, 0.5, 0.25, 0.125):
            awkward = size_rules.awkward_sizes(base, factor, rng)
            if not size_rules.changed(awkward, base):
                self.state.notes.append("shape generality not checked: the task has no extents "
                                        "to vary")
                return None
            overrides = {**main.overrides, **awkward}
            size, failed = await self._task_sizes("generic", overrides, limit=budget,
                                                  shown=awkward,
                                                  note="shape generality not checked: ")
            if failed:
                return None
            if size is not None:
                self.state.shape_generic_sizes = awkward
                return size
        self.state.notes.append("shape generality not checked: no awkward size fits the budget")
        return None
