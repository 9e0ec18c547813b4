"""Sizes in ``ModelNew.__init__`` as expressions over its init arguments, found by
building the task's Model at other init arguments.

A size the Model derives from its init arguments (a DenseNet layer's
``num_input_features + i * growth_rate`` input channels, an MLP's ``4 * hidden``) must
follow them when ModelNew is built at another size. :func:`follow_init_args` renders
the declarations with plain numbers for the task's Model and for Models built (on the
meta device) with each integer init argument, or integer item of a list argument,
doubled; each number of a declaration that changes with them becomes
``c + k * args[i]`` (``k`` an integer, or ``args[i] // q``), checked once more on a
Model built with every argument tripled. A declaration whose structure differs between
the Models, or whose numbers fit no such expression, keeps its fallback rendering (sizes
equal to an init argument read from ``args``).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from fractions import Fraction
from typing import Any

import torch

# An integer literal of a rendered declaration (not part of a name, a float or 1e-05).
_INT = re.compile(r"(?<![\w.+\-])\d+(?![\w.])")

Lines = list[tuple[str, str]]  # (declared attribute's path, declaration)


def _positions(init_inputs: list[Any]) -> list[tuple[tuple[int, ...], int]]:
    """Each positive integer init argument (``(i,)``) or integer item of a list or
    tuple argument (``(i, j)``) with its value."""
    out = []
    for i, arg in enumerate(init_inputs):
        if type(arg) is int and arg > 0:
            out.append(((i,), arg))
        elif isinstance(arg, list | tuple):
            out += [((i, j), v) for j, v in enumerate(arg) if type(v) is int and v > 0]
    return out


def _scaled(init_inputs: list[Any], where: list[tuple[int, ...]], factor: int) -> list[Any]:
    out = [list(a) if isinstance(a, list | tuple) else a for a in init_inputs]
    for pos in where:
        if len(pos) == 1:
            out[pos[0]] *= factor
        else:
            out[pos[0]][pos[1]] *= factor
    return [type(a)(o) if isinstance(a, tuple) else o
            for a, o in zip(init_inputs, out, strict=True)]


def _name(pos: tuple[int, ...]) -> str:
    return "args" + "".join(f"[{p}]" for p in pos)


def _expression(v0: int, slopes: list[tuple[tuple[int, ...], int, Fraction]]) -> str | None:
    """``v0`` at the task's arguments as ``c + sum(k * arg)``, or None when a slope is
    neither an integer nor one over an integer."""
    terms, rest = [], v0
    for pos, value, k in slopes:
        if k == 0:
            continue
        if k.denominator == 1:
            coef = int(k)
            terms.append(_name(pos) if coef == 1 else f"{coef} * {_name(pos)}")
            rest -= coef * value
        elif k.numerator == 1:
            terms.append(f"{_name(pos)} // {k.denominator}")
            rest -= value // k.denominator
        else:
            return None
    if not terms:
        return str(v0)
    expr = " + ".join(terms)
    if rest:
        expr += f" + {rest}" if rest > 0 else f" - {-rest}"
    return f"({expr})" if len(terms) > 1 or rest else expr


def follow_init_args(task: Any, render: Callable[[torch.nn.Module], Lines],
                     fallback: Lines) -> list[str]:
    """The declarations of ``fallback`` (rendered from the task's Model with sizes equal
    to an init argument as ``args[i]``), each whose numbers all follow the init
    arguments (see the module docstring) rewritten from ``render``'s plain-number
    rendering. ``render(model)`` must give, for any Model of the task, one
    ``(path, declaration)`` per declared attribute."""
    init_inputs = task.init_inputs
    positions = _positions(init_inputs)

    def build(args: list[Any]) -> dict[str, str] | None:
        try:
            with torch.device("meta"):
                model = task.module.Model(*args)
            return dict(render(model))
        except Exception:  # noqa: BLE001 - that size does not build: no information
            return None

    try:
        base = render(task.model)
    except Exception:  # noqa: BLE001 - rendered as the fallback says
        return [text for _, text in fallback]
    variants = [build(_scaled(init_inputs, [pos], 2)) for pos, _ in positions]
    tripled_args = _scaled(init_inputs, [pos for pos, _ in positions], 3)
    tripled = build(tripled_args)
    if not positions or tripled is None or any(v is None for v in variants) \
            or len(base) != len(fallback):
        return [text for _, text in fallback]
    out = []
    for (path, text), (_, fallback_text) in zip(base, fallback, strict=True):
        rewritten = _rewrite(path, text, positions, variants, tripled, tripled_args)
        out.append(fallback_text if rewritten is None else rewritten)
    return out


def _rewrite(path: str, text: str, positions: list[tuple[tuple[int, ...], int]],
             variants: list[dict[str, str] | None], tripled: dict[str, str],
             tripled_args: list[Any]) -> str | None:
    skeleton = _INT.sub("#", text)
    numbers = [int(m) for m in _INT.findall(text)]
    if not numbers:
        return text
    others = [*variants, tripled]
    if any(o is None or path not in o or _INT.sub("#", o[path]) != skeleton for o in others):
        return None
    exprs = []
    for t, v0 in enumerate(numbers):
        slopes = [(pos, value, Fraction(int(_INT.findall(variant[path])[t]) - v0, value))
                  for (pos, value), variant in zip(positions, variants, strict=True)]
        expr = _expression(v0, slopes)
        if expr is None:
            return None
        check = int(_INT.findall(tripled[path])[t])
        if eval(expr, {"args": tripled_args}) != check:  # noqa: S307 - our own arithmetic
            return None
        exprs.append(expr)
    pieces = iter(exprs)
    return _INT.sub(lambda _: next(pieces), text)
