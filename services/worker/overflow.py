"""Offsets that leave int32 at the task's own sizes, found without allocating them.

A Triton kernel computes its pointer offsets in the type of their operands: a program
id, ``tl.arange``, an integer literal and a scalar argument below 2**31 are int32, so
``pid * BLOCK * stride`` wraps on a GPU once it passes 2**31 - 1, and ``ptr + off``
(64-bit) then points before the tensor or into another one. The interpreter never sees
it at the reduced sizes a cpu verification runs, and the task's own sizes (the ones
that overflow) are only dry-run on meta tensors. :func:`find` takes those dry-run
launches (grid, scalar arguments, constexprs, tensor extents) and the kernels' source
and evaluates every ``tl.load`` / ``tl.store`` / ``tl.atomic_*`` pointer offset with
interval arithmetic (:mod:`services.worker.index_ranges`: program ids over
``0 .. grid - 1``, ``tl.arange`` ranges, loop variables, scalar arguments); an offset
whose int32 part leaves ``[-2**31, 2**31 - 1]`` is a finding naming the kernel, the
expression and how far it reaches. Casting to ``tl.int64`` before the product (``pid
= tl.program_id(0).to(tl.int64)``) makes the arithmetic 64-bit and passes; a cast of
the already-wrapped result does not.

Rule D026 (:mod:`services.worker.rules`): such a finding fails the verification at
stage ``compile``. Source: Triton's integer promotion (``triton/language/semantic.py``:
int32 unless an operand is int64; scalar arguments specialised as int64 only from
2**31) and the recorded GPU failures of kernels right at small sizes that fault or
write elsewhere at large ones (an int32 offset that overflows only at the task's size).
What the evaluator does not understand (loaded values, calls of other jit functions,
``while`` loops, block pointers) is unknown and never reported.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Any

from services.worker import index_ranges


@dataclass(frozen=True)
class Overflow:
    """One offset past int32: ``kernel``, ``line`` (in the candidate's file), the
    pointer ``access`` (source text), the int32 sub-expression that leaves the range
    (``expression``) and the largest magnitude it reaches (``reaches``), and ``where``
    (which sizes' launch)."""

    kernel: str
    line: int
    access: str
    expression: str
    reaches: int
    where: str

    def message(self) -> str:
        return (f"kernel {self.kernel}: offset `{self.expression}` reaches "
                f"{index_ranges.magnitude(self.reaches)} at {self.where}, beyond int32 "
                f"(line {self.line}, in `{self.access}`); a GPU wraps it to a wrong address: "
                "cast to tl.int64 first (e.g. pid = tl.program_id(0).to(tl.int64))")


def find(launches: list[dict[str, Any]], source: str, where: str = "the task's own sizes",
         ) -> list[Overflow]:
    """Every offset past int32 in ``launches`` (recorded launch events, each with
    ``launch`` naming a kernel of ``source``, ``grid`` and ``args``; every autotune
    config's arguments are evaluated), one per kernel and expression, in launch order.

    Raises:
        SyntaxError: ``source`` does not parse (it is the kernel module, which does).
    """
    defs = index_ranges.kernel_defs(source)
    constants = index_ranges.module_constants(source)
    found: dict[tuple[str, str], Overflow] = {}
    seen: set[tuple[str, str]] = set()
    for event in launches:
        name = str(event.get("launch"))
        fn = defs.get(name)
        if fn is None:
            continue
        tune = event.get("autotune")
        runs = (tune.get("variants") or [event]) if isinstance(tune, dict) else [event]
        for run in runs:
            key = (name, repr((run.get("grid"), sorted((run.get("args") or {}).items(),
                                                       key=lambda kv: kv[0]))))
            if key in seen:
                continue
            seen.add(key)
            for hit in offsets(fn, run, constants):
                found.setdefault((name, hit[1]), Overflow(
                    kernel=name, line=hit[0], access=hit[2], expression=hit[1],
                    reaches=hit[3], where=where))
    return list(found.values())


def offsets(fn: ast.FunctionDef, launch: dict[str, Any],
            constants: dict[str, int] | None = None) -> list[tuple[int, str, str, int]]:
    """The overflowing offsets of one kernel at one launch: (line, int32 expression,
    pointer expression, magnitude reached)."""
    out = []
    for access in index_ranges.evaluate(fn, launch, constants).accesses:
        pointer = access.pointer
        if pointer is None or pointer.off is None or pointer.off.over is None:
            continue
        expression, reaches = pointer.off.over
        out.append((access.line, expression, access.text, reaches))
    return out
