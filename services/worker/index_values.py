"""The values and findings of the index-range evaluator
(:mod:`services.worker.index_ranges`, whose module doc gives the model): integer
intervals with their int32/int64 typing (:class:`Ival`), pointers, dtypes and flags;
the loops, accesses and conditions found (:class:`Loop`, :class:`Access`,
:class:`Branch`, :class:`Ranges`); and the interval operations the walker
(:mod:`services.worker.index_walker`) combines them with.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from typing import Any

from services.sandbox import values

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


# Values beyond this magnitude are unknown (no kernel index gets there; it keeps a
# hostile ``1 << 10**9`` from costing the worker anything).
LIMIT = 1 << 96


WIDE_DTYPES = frozenset({"int64", "uint64"})


NARROW_DTYPES = frozenset({"int32", "uint32", "int16", "uint16", "int8", "uint8", "int1"})


ATOMICS = frozenset({"atomic_add", "atomic_max", "atomic_min", "atomic_and", "atomic_or",
                      "atomic_xor", "atomic_xchg", "atomic_cas"})


PASS_THROUGH = frozenset({"multiple_of", "max_contiguous", "max_constancy", "broadcast_to",
                           "reshape", "view", "expand_dims", "ravel", "trans", "permute"})


@dataclass(frozen=True)
class Ival:
    """Integers in ``[lo, hi]``; ``wide``: int64 on a GPU (else int32); ``over``: the
    first sub-expression (source text, largest magnitude) computed in int32 beyond its
    range on the way to this value, or None."""

    lo: int
    hi: int
    wide: bool = False
    over: tuple[str, int] | None = None


@dataclass(frozen=True)
class Ptr:
    """A pointer into tensor argument ``name`` plus offset ``off`` (None: unknown)."""

    name: str
    off: Ival | None


@dataclass(frozen=True)
class DType:
    name: str


@dataclass(frozen=True)
class Flag:
    value: bool


@dataclass
class Loop:
    """One loop of the kernel: ``line`` (of its ``for``), ``text`` (its header), the
    fewest and the most iterations a program makes (None: not known)."""

    line: int
    text: str
    trips: tuple[int, int] | None


@dataclass
class Access:
    """One memory access: ``kind`` (``load``, ``store``, ``atomic_add`` ...), ``line``,
    ``text`` (the pointer expression) and its value (:class:`Ptr`, or None)."""

    kind: str
    line: int
    text: str
    pointer: Ptr | None


# The truth of a condition over a launch: every program and lane, none, some of them.
ALL, NONE, SOME = "all", "none", "some"


@dataclass
class Branch:
    """One condition of the kernel: ``line``, ``col`` (where it starts; with ``part``, its
    place in a chained comparison, its key), ``text`` (its source) and ``truth``
    (:data:`ALL`, :data:`NONE`, :data:`SOME`; None: it depends on values not known
    before the run, loaded ones or ones the evaluator does not model)."""

    line: int
    col: int
    part: int
    text: str
    truth: str | None


@dataclass
class Ranges:
    """What :func:`services.worker.index_ranges.evaluate` found, in source order (branches by first evaluation)."""

    loops: list[Loop] = field(default_factory=list)
    accesses: list[Access] = field(default_factory=list)
    branches: list[Branch] = field(default_factory=list)


def fits_int32(v: int) -> bool:
    return INT32_MIN <= v <= INT32_MAX


def exact(v: int) -> Ival:
    """The literal (or scalar argument) ``v``: int64 when it does not fit int32."""
    return Ival(v, v, wide=not fits_int32(v))


def arg_value(value: Any, name: str) -> Any:
    if isinstance(value, bool):
        return Flag(value)
    if isinstance(value, int):
        return exact(value)
    if isinstance(value, dict) and value.get(values.TAG) == "T":
        return Ptr(name, Ival(0, 0, wide=True))
    if isinstance(value, dict) and value.get(values.TAG) == "tl":
        return DType(str(value.get("v")))
    return None


def callee(node: ast.expr) -> str:
    """``tl.program_id`` -> ``program_id``; ``x.to`` -> ``.to``; ``range`` -> ``range``."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = node.value
        if isinstance(base, ast.Name) and base.id in ("tl", "triton", "libdevice", "math"):
            return node.attr
        if isinstance(base, ast.Attribute) and base.attr == "language":
            return node.attr
        return "." + node.attr
    return ""


def hull(a: Any, b: Any) -> Any:
    if isinstance(a, Ival) and isinstance(b, Ival):
        return Ival(min(a.lo, b.lo), max(a.hi, b.hi), a.wide or b.wide, a.over or b.over)
    if isinstance(a, Ptr) and isinstance(b, Ptr) and a.name == b.name:
        return Ptr(a.name, hull(a.off, b.off) if a.off and b.off else None)
    if isinstance(a, Flag) and isinstance(b, Flag) and a.value == b.value:
        return a
    if isinstance(a, DType) and a == b:
        return a
    return None


def truth_both(a: str | None, b: str | None) -> str | None:
    """The truth of one condition seen twice (two paths or evaluations): the union."""
    if a is None or b is None:
        return None
    return a if a == b else SOME


def truth_and(parts: list[str | None]) -> str | None:
    if NONE in parts:
        return NONE
    if None in parts:
        return None
    return ALL if all(p == ALL for p in parts) else SOME


def truth_not(truth: str | None) -> str | None:
    return {ALL: NONE, NONE: ALL}.get(truth, truth) if truth is not None else None


def compare(op: ast.cmpop, a: Ival, b: Ival) -> str | None:
    """The truth of ``a <op> b`` over every pair of values of the two intervals (an
    interval over-approximates, so SOME may stand for a truth the run never mixes; it
    does so alike at every size)."""
    if isinstance(op, ast.Gt | ast.GtE):
        op, a, b = (ast.Lt() if isinstance(op, ast.Gt) else ast.LtE()), b, a
    if isinstance(op, ast.Lt):
        return ALL if a.hi < b.lo else NONE if a.lo >= b.hi else SOME
    if isinstance(op, ast.LtE):
        return ALL if a.hi <= b.lo else NONE if a.lo > b.hi else SOME
    if isinstance(op, ast.Eq | ast.NotEq):
        equal = ALL if a.lo == a.hi == b.lo == b.hi else \
            NONE if a.hi < b.lo or b.hi < a.lo else SOME
        return equal if isinstance(op, ast.Eq) else truth_not(equal)
    return None
