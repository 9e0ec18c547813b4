"""Ranges of a Triton kernel's integer values at one launch, from its source alone.

Given a kernel's ``def`` (its AST, from the kernel module the replayer loads) and one
recorded launch (grid, scalar arguments, constexprs, tensor extents: a dry run's or a
plan's), :func:`evaluate` walks the body once with *interval arithmetic* and returns
what two checks need:

* the trip count of every ``for ... in range(...)`` / ``tl.range(...)`` /
  ``tl.static_range(...)`` loop, as the fewest and the most iterations any program
  makes (:class:`Loop`; :mod:`services.worker.sizes` compares them between sizes);
* the pointer offset of every ``tl.load`` / ``tl.store`` / ``tl.atomic_*``, with the
  first sub-expression of that offset that leaves the int32 range while it is still
  computed in 32 bits (:class:`Access`; :mod:`services.worker.overflow` fails them);
* the truth of every condition on known integers (each comparison, wherever it stands,
  and each ``if`` / ``while`` / conditional-expression / ``tl.where`` test): true for
  every program and lane, for none, or for some and not others (:class:`Branch`;
  :mod:`services.worker.sizes` compares them between sizes, so that a kernel branching
  on a size, ``if n > 8000000:`` or ``tl.where(pid < 8192, a, b)``, takes the same
  branches at a checked size as at the task's own). A mask ``offs < n`` is true for
  some lanes and false for others at both sizes (or true for all at both when ``n`` is
  a multiple of the block, which congruence keeps), so it compares equal; a condition
  on loaded values is unknown and not compared.

Values (the model of Triton's integer typing, ``triton/language/semantic.py``): a
program id, ``tl.num_programs``, ``tl.arange`` and an integer literal or constexpr
below 2**31 are int32; a scalar int argument is int32 unless it is >= 2**31 (Triton
then specialises it as int64); ``x.to(tl.int64)`` / ``tl.cast(x, tl.int64)`` is
int64; a binary operation is int64 when either side is. Pointers (tensor arguments)
are 64-bit: ``ptr + off`` never overflows, but ``off`` may already have. Each interval
holds every value any program of the grid, any lane of a block and any iteration of a
loop may take (program ids range over ``0 .. grid - 1``, a loop variable over its
range, a variable incremented in a loop ``x += d`` over ``x0 + [0, trips - 1] * d``).

Calls of the module's other functions (``@triton.jit`` helpers, which Triton inlines)
are followed with their arguments' values when :func:`evaluate` is given ``defs``.
What is not understood is *unknown* and never guessed: values loaded from memory,
floats, calls of other functions without ``defs``, ``while`` loops (the names they
assign become unknown), tuples that are not literals, subscripts other than
``x[:, None]``-style broadcasts, block pointers (``tl.make_block_ptr``). An offset
with an unknown part raises no finding; a loop with an unknown bound has no trip
count. Masked lanes are not excluded: an offset past int32 only in lanes a mask turns
off is still reported (a GPU computes those addresses too, though it does not use
them).

This module is the evaluator's entry (:func:`evaluate` and the kernel module's
definitions and constants); the values and findings are
:mod:`services.worker.index_values`, the walk of a body :mod:`services.worker.index_walker`.
"""

from __future__ import annotations

import ast
from typing import Any

from services.common.pyast import parse
from services.worker.index_values import (
    ALL,
    INT32_MAX,
    INT32_MIN,
    NONE,
    SOME,
    Access,
    Branch,
    Ival,
    Loop,
    Ptr,
    Ranges,
    arg_value,
    callee,
    exact,
)
from services.worker.index_walker import Walker

# The evaluator's values and findings are index_values' (and its walk index_walker's);
# the checks that use it (services/worker/overflow.py, services/worker/sizes.py) read
# them from here.
__all__ = ["ALL", "INT32_MAX", "INT32_MIN", "NONE", "SOME", "Access", "Branch", "Ival",
           "Loop", "Ptr", "Ranges", "evaluate", "exact", "kernel_defs", "magnitude",
           "module_constants", "trip_class"]

def kernel_defs(source: str) -> dict[str, ast.FunctionDef]:
    """The top-level functions of ``source`` (the candidate's kernel module), by name.

    Raises:
        SyntaxError: the source does not parse.
    """
    tree = parse(source)
    return {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}


def module_constants(source: str) -> dict[str, int]:
    """The module-level ``NAME = <int literal>`` and ``NAME = tl.constexpr(<int
    literal>)`` of ``source`` (kernels may read them; Triton 3.9 wants the second)."""
    out: dict[str, int] = {}
    for node in parse(source).body:
        if not isinstance(node, ast.Assign):
            continue
        value = node.value
        if isinstance(value, ast.Call) and callee(value.func) == "constexpr" and \
                len(value.args) == 1 and not value.keywords:
            value = value.args[0]
        if isinstance(value, ast.UnaryOp) and isinstance(value.op, ast.USub) and \
                isinstance(value.operand, ast.Constant):
            value = ast.Constant(-value.operand.value) \
                if isinstance(value.operand.value, int) else value
        if isinstance(value, ast.Constant) and isinstance(value.value, int) and \
                not isinstance(value.value, bool):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    out[target.id] = value.value
    return out


def evaluate(fn: ast.FunctionDef, launch: dict[str, Any],
             constants: dict[str, int] | None = None,
             defs: dict[str, ast.FunctionDef] | None = None) -> Ranges:
    """The loops, memory accesses and conditions of kernel ``fn`` at one recorded launch
    (``{"grid": [x, y, z], "args": {name: encoded value}}``, a dry run's or a plan's;
    see the module doc for what is modelled). ``defs``: the module's functions, whose
    calls are followed (up to 4 deep; without, a call of one is not modelled)."""
    walker = Walker([int(g) for g in launch.get("grid") or [1]], constants or {}, defs)
    env: dict[str, Any] = {}
    args = launch.get("args") or {}
    for a in fn.args.args + fn.args.kwonlyargs:
        env[a.arg] = arg_value(args.get(a.arg), a.arg)
    walker.block(fn.body, env)
    return walker.out


def trip_class(trips: tuple[int, int] | None) -> str | None:
    """``none``, ``once`` or ``several`` (by the most iterations a program makes)."""
    if trips is None:
        return None
    return "none" if trips[1] == 0 else "once" if trips[1] == 1 else "several"


def magnitude(n: int) -> str:
    """``3.2e+09`` style, for messages."""
    return f"{n:.2g}" if n < 1e6 else f"{n:.2e}".replace("e+0", "e").replace("e+", "e")
