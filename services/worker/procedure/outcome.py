"""What a verification decides: :class:`Outcome`, the fields of a verdict, and
:class:`Verdict`, the exception that stops a verification with one.

An :class:`Outcome` holds exactly the fields of :class:`schemas.events.VerifyResult`
that a verification sets (the worker adds the request's identity, its own, the
device, the phases and the provenance). ``None`` means "not set": :meth:`Outcome.result`
leaves such a field to the VerifyResult's default, and the verifier fills ``trials``,
``notes`` and ``sizes_checked`` of a failed verification only where the step that
failed left them unset. A misspelt field name fails where the outcome is made
(``TypeError``), not later as a silently dropped key.
"""

from __future__ import annotations

import typing
from typing import Any, Literal

import msgspec

from schemas.events import CompileFact, ProfiledKernel, Stage, Traffic, VerifyResult

# The verdict stages a child's failure may name (schemas.events.Stage, the one list).
STAGES = frozenset(typing.get_args(Stage))


class Timings(msgspec.Struct, kw_only=True, frozen=True):
    """The times of a profiled, passed verification: ``base_time_us`` (the eager
    reference) and ``gen_time_us`` (the candidate), microseconds; ``speedup`` their
    ratio (``speedup_eager`` too); ``flag`` the ``flagged: ...`` text when the speedup
    is above the worker's bound (it becomes the result's ``error``; the pass stands),
    else None. The rest as the VerifyResult fields of the same names:
    ``compile_time_us`` and ``speedup_compile`` (the ``torch.compile`` baseline; None
    without one), ``peak_fraction`` / ``peak_bound``, ``launch_floor_us``,
    ``profiled_kernels``."""

    base_time_us: float
    gen_time_us: float
    speedup: float
    flag: str | None = None
    speedup_eager: float | None = None
    speedup_compile: float | None = None
    compile_time_us: float | None = None
    peak_fraction: float | None = None
    peak_bound: str | None = None
    launch_floor_us: float | None = None
    profiled_kernels: list[ProfiledKernel] | None = None


class Outcome(msgspec.Struct, kw_only=True):
    """The fields of one verification's :class:`~schemas.events.VerifyResult` (their
    meanings are documented there); None: not set, the VerifyResult's default applies.

    Raises:
        TypeError: (at construction) a field name that is not one of these.
    """

    passed: bool = False
    stage: Stage | None = None
    error: str | None = None
    log: str | None = None
    max_abs_error: float | None = None
    max_rel_error: float | None = None
    rel_l2_error: float | None = None
    mismatch_count: int | None = None
    mismatch_indices: list[list[int]] | None = None
    atol: float | None = None
    rtol: float | None = None
    trials: int | None = None
    base_time_us: float | None = None
    gen_time_us: float | None = None
    speedup: float | None = None
    sizes_checked: list[dict[str, Any]] | None = None
    task_sizes_checked: bool | None = None
    ghost_replay: str | None = None
    shape_generic: bool | None = None
    shape_generic_sizes: dict[str, Any] | None = None
    unchecked: list[str] | None = None
    notes: list[str] | None = None
    traffic: Traffic | None = None
    speedup_eager: float | None = None
    speedup_compile: float | None = None
    compile_time_us: float | None = None
    peak_fraction: float | None = None
    peak_bound: Literal["memory", "compute"] | None = None
    launch_floor_us: float | None = None
    profiled_kernels: list[ProfiledKernel] | None = None
    compile_facts: list[CompileFact] | None = None

    def timed(self, timings: Timings) -> Outcome:
        """This outcome with the times of a profiled run; the speedup flag, or None,
        becomes ``error``."""
        return msgspec.structs.replace(
            self, base_time_us=timings.base_time_us, gen_time_us=timings.gen_time_us,
            speedup=timings.speedup, error=timings.flag,
            speedup_eager=timings.speedup if timings.speedup_eager is None
            else timings.speedup_eager,
            speedup_compile=timings.speedup_compile, compile_time_us=timings.compile_time_us,
            peak_fraction=timings.peak_fraction, peak_bound=timings.peak_bound,
            launch_floor_us=timings.launch_floor_us, profiled_kernels=timings.profiled_kernels)

    def set_fields(self) -> dict[str, Any]:
        """The fields that are set (not None), by name."""
        return {name: value for name in self.__struct_fields__
                if (value := getattr(self, name)) is not None}

    def result(self, **envelope: Any) -> VerifyResult:
        """The VerifyResult of this outcome: ``envelope`` gives the fields a
        verification does not decide (``request_id``, ``worker_id``, ``duration_s``
        ...); unset fields take VerifyResult's defaults.

        Raises:
            TypeError: ``envelope`` names a field this outcome set, or lacks a
                required VerifyResult field.
        """
        return VerifyResult(**envelope, **self.set_fields())


class Verdict(Exception):
    """Stop verifying with a failed :class:`Outcome` (``outcome``): ``stage``, ``error``
    and the keyword fields (names of Outcome's fields).

    Raises:
        TypeError: a keyword that is not a field of :class:`Outcome`.
    """

    def __init__(self, stage: str, error: str, **fields: Any) -> None:
        super().__init__(error)
        self.outcome = Outcome(passed=False, stage=stage, error=error, **fields)
