"""What a verification decides: :class:`Outcome`, the fields of a verdict, and
:class:`Verdict`, the exception that stops a verification with one.

An :class:`Outcome` holds the fields of a :class:`schemas.events.VerifyResult` that a
verification decides: every field but :data:`ENVELOPE` (the request's identity, the
worker's, the device, the phases and the message's own fields, which the worker adds).
It keeps them in a VerifyResult (``fields``, its envelope blank), so the schema is
their one definition and each read is typed as the schema types it. ``None`` given
for a field means "not set": :meth:`Outcome.result` leaves such a field to the
VerifyResult's default, and the verifier fills ``trials``, ``notes`` and
``sizes_checked`` of a failed verification only where the step that failed left them
unset (:meth:`Outcome.fill`). A misspelt field name fails where the outcome is made
(``TypeError``), not later as a silently dropped key.
"""

from __future__ import annotations

import typing
from typing import Any, Literal

import msgspec

from schemas.events import ProfiledKernel, Stage, VerifyResult

# The verdict stages a child's failure may name (schemas.events.Stage, the one list).
STAGES = frozenset(typing.get_args(Stage))

# The VerifyResult fields the worker sets around a verification (its request, itself,
# the device, how long it took and where its reference came from) and the message's
# own; a verification decides every other field (DECIDED).
ENVELOPE = frozenset({"request_id", "job_id", "candidate_id", "worker_id", "device",
                      "interpreted", "duration_s", "phases", "reference_source",
                      "finished_at", "proof", "type", "schema_version"})
DECIDED = frozenset(VerifyResult.__struct_fields__) - ENVELOPE

_BLANK = VerifyResult(request_id="", job_id="", candidate_id="", worker_id="", device="",
                      passed=False)


class Timings(msgspec.Struct, kw_only=True, frozen=True):
    """The times of a profiled, passed verification: ``base_time_us`` (the eager
    reference) and ``gen_time_us`` (the candidate), microseconds; ``speedup`` their
    ratio (``speedup_eager`` too); ``flag`` the ``flagged: ...`` text when the speedup
    is above the worker's bound (it becomes the result's ``error``; the pass stands),
    else None. The rest as the VerifyResult fields of the same names:
    ``compile_time_us`` and ``speedup_compile`` (the ``torch.compile`` baseline; None
    without one), ``peak_fraction`` / ``peak_bound``, ``launch_floor_us``,
    ``profiled_kernels``, and where the eager baseline came from
    (``baseline_source``, ``baseline_age_s``)."""

    base_time_us: float
    gen_time_us: float
    speedup: float
    flag: str | None = None
    speedup_eager: float | None = None
    speedup_compile: float | None = None
    compile_time_us: float | None = None
    peak_fraction: float | None = None
    peak_bound: Literal["memory", "compute"] | None = None
    launch_floor_us: float | None = None
    profiled_kernels: list[ProfiledKernel] | None = None
    baseline_source: Literal["measured", "worker_cache", "shared_cache"] | None = None
    baseline_age_s: float | None = None


class Outcome:
    """The fields one verification decided (:data:`DECIDED`; their meanings are
    :class:`~schemas.events.VerifyResult`'s). ``fields``: those fields as a
    VerifyResult whose envelope is blank (an unset field reads as the schema's
    default); ``decided``: the names set. ``passed`` is always set (False unless
    given).

    Raises:
        TypeError: (at construction, :meth:`set`) a name that is not one of
            :data:`DECIDED`.
    """

    __slots__ = ("decided", "fields")

    def __init__(self, **fields: Any) -> None:
        self.fields = _BLANK
        self.decided: set[str] = {"passed"}
        self.set(**fields)

    def set(self, **fields: Any) -> None:
        """Set ``fields`` (a None value leaves its field as it is).

        Raises:
            TypeError: a name that is not one of :data:`DECIDED`.
        """
        unknown = sorted(set(fields) - DECIDED)
        if unknown:
            raise TypeError(f"Outcome has no field {', '.join(unknown)}: a verification "
                            "decides the fields of schemas.events.VerifyResult outside "
                            "outcome.ENVELOPE")
        given = {name: value for name, value in fields.items() if value is not None}
        self.fields = msgspec.structs.replace(self.fields, **given)
        self.decided |= set(given)

    def fill(self, **fields: Any) -> None:
        """Set those of ``fields`` that are not set yet."""
        self.set(**{name: value for name, value in fields.items()
                    if name not in self.decided})

    def timed(self, timings: Timings) -> Outcome:
        """Set the times of a profiled run (the speedup flag, when there is one,
        becomes ``error``); returns this outcome."""
        times = {name: getattr(timings, name) for name in timings.__struct_fields__
                 if name != "flag"}
        if times["speedup_eager"] is None:
            times["speedup_eager"] = timings.speedup
        self.set(**times, error=timings.flag)
        return self

    def set_fields(self) -> dict[str, Any]:
        """The fields that are set, by name."""
        return {name: getattr(self.fields, name) for name in self.fields.__struct_fields__
                if name in self.decided}

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
    and the keyword fields (names of :data:`DECIDED`).

    Raises:
        TypeError: a keyword that is not a field of :data:`DECIDED`.
    """

    def __init__(self, stage: str, error: str, **fields: Any) -> None:
        super().__init__(error)
        self.outcome = Outcome(passed=False, stage=stage, error=error, **fields)
