"""Which sizes a verification checks: congruent with the task's own, and awkward ones.

A task's module-level sizes (``batch_size = 4096``, ``kernel_size = (3, 3)``) decide
its inputs. A verification runs at the requested sizes (``shape_overrides``), which
may be far smaller than the task's own. What a GPU runs at the task's own sizes is
learned from a *dry run* there: the candidate's ``forward`` on meta tensors records
every launch (kernel, grid, constexprs, every autotune config), nothing allocated.

* :func:`congruent` says whether the launches at checked sizes exercise what the
  launches at the task's own sizes do: the same kernels in the same order with the
  same constexprs (so the same code paths and tile sizes), every integer argument of at
  least one tile that the kernel's body reads congruent modulo the launch's largest
  power-of-two constexpr (so each boundary the real sizes have, a partial last tile or
  none, is exercised, and none is imposed), and a grid axis with several programs at the real sizes has several here too (and
  one program where the real sizes have one).
  Congruence of each size modulo ``M`` carries over to every product and sum of
  sizes, which is what kernels pass as extents and strides.
  Two more rules make a size exercise the same paths: each kernel's grid is the same
  function of its arguments (a grid extent that is ``cdiv(n, BLOCK)``, or a product of
  two such terms, of the launch's int arguments, tensor extents and constexprs at the
  checked sizes must be that at the task's own sizes too: a grid halved there is not
  congruent), and each ``for`` loop of a kernel runs none, once or several times alike
  (trip counts from the kernel's source at each launch's values,
  :mod:`services.worker.index_ranges`; a loop whose count is not known at the task's
  own sizes, data-dependent or beyond what the evaluator understands, is not compared).
  Likewise each condition on program ids, scalar arguments, constexprs and module
  constants (every comparison, ``if``, ``while`` and ``tl.where`` test) is true for
  every program and lane, for none, or for some alike at both sizes: ``if n > 8000000:``
  or ``tl.where(pid < 8192, a, b)`` takes the same branch at a checked size as at the
  task's own; a mask ``offs < n`` mixes lanes at both (or none at both); a condition on
  loaded values is not compared.
* :func:`congruent_candidates` proposes smaller sizes that keep each size congruent
  to the real one modulo the launches' block sizes.
* :func:`awkward_sizes` proposes the shape-generality sizes: odd extents, multiples of
  no block size, drawn from the verification's secret seed below the checked ones.
"""

from __future__ import annotations

import ast
import math
import random
from dataclasses import dataclass
from typing import Any

from services.sandbox import values
from services.worker import index_ranges

# Module-level ints whose names say they are parameters, not extents: reductions and
# awkward sizes leave them alone (kernels may specialise on them).
NOT_EXTENTS = ("kernel", "stride", "pad", "dilation", "group", "class", "head", "axis",
               "seed", "eps", "dim_reduce", "num_layers")
# The largest block size taken as a modulus (bigger constexprs are not tile sizes).
_MAX_MODULUS = 1 << 16


def is_extent(name: str) -> bool:
    """Whether a module-level size of this name may be varied."""
    lowered = name.lower()
    return not any(p in lowered for p in NOT_EXTENTS)


def _pow2(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 1 and \
        value & (value - 1) == 0


def modulus(launch: dict[str, Any], constexpr: set[str]) -> int:
    """The launch's largest power-of-two constexpr argument (its tile size), or 1."""
    best = 1
    for run in _runs(launch):
        for name, value in (run.get("args") or {}).items():
            if name in constexpr and _pow2(value) and value <= _MAX_MODULUS:
                best = max(best, value)
    return best


def _runs(launch: dict[str, Any]) -> list[dict[str, Any]]:
    tune = launch.get("autotune")
    return (tune.get("variants") or [launch]) if isinstance(tune, dict) else [launch]


def _signature(run: dict[str, Any], constexpr: set[str]) -> dict[str, Any]:
    out = {}
    for name, value in (run.get("args") or {}).items():
        if name in constexpr:
            out[name] = value
        elif isinstance(value, dict) and value.get(values.TAG) == "T":
            out[name] = ("tensor", value.get("d"), len(value.get("z", [])))
    return out


def congruent(real: list[dict[str, Any]], checked: list[dict[str, Any]],
              constexprs: dict[str, set[str]],
              source: KernelSource | None = None) -> str | None:
    """None when ``checked`` (the launches at the checked sizes) exercises what
    ``real`` (at the task's own sizes) does (see the module doc), else why not, naming
    the first kernel or path that differs. ``source``: the kernels' source, for the
    loop rule (None: loops are not compared)."""
    if [e.get("launch") for e in real] != [e.get("launch") for e in checked]:
        real_names = [str(e.get("launch")) for e in real]
        checked_names = [str(e.get("launch")) for e in checked]
        missing = [n for n in dict.fromkeys(real_names) if n not in checked_names]
        if missing:
            return (f"at the task's own sizes forward launches {', '.join(missing)}, which it "
                    "does not launch at the checked sizes")
        return (f"at the task's own sizes forward launches {' -> '.join(real_names)}; at the "
                f"checked sizes {' -> '.join(checked_names)}")
    for big, small in zip(real, checked, strict=True):
        name = str(big.get("launch"))
        constexpr = constexprs.get(name, set())
        big_runs, small_runs = _runs(big), _runs(small)
        if len(big_runs) != len(small_runs):
            return f"{name} has {len(big_runs)} autotune configs at the task's own sizes, " \
                   f"{len(small_runs)} at the checked sizes"
        m = modulus(big, constexpr)
        read = _names_read(source.defs[name]) if source is not None and \
            name in source.defs else None
        for a, b in zip(big_runs, small_runs, strict=True):
            sa, sb = _signature(a, constexpr), _signature(b, constexpr)
            if sa != sb:
                diff = sorted(k for k in sa.keys() | sb.keys() if sa.get(k) != sb.get(k))
                return (f"{name} is specialised differently at the task's own sizes "
                        f"({', '.join(f'{k}={sa.get(k)}' for k in diff[:3])}) than at the "
                        f"checked sizes ({', '.join(f'{k}={sb.get(k)}' for k in diff[:3])})")
            for arg, value in (a.get("args") or {}).items():
                other = (b.get("args") or {}).get(arg)
                # An extent below one tile is a single partial tile at either size.
                # A parameter the kernel's body never reads cannot change its path.
                if arg in constexpr or isinstance(value, bool) or not isinstance(value, int) \
                        or not isinstance(other, int) or m == 1 or value < m \
                        or (read is not None and arg not in read):
                    continue
                if value % m != other % m:
                    return (f"{name}'s argument {arg} is {value} at the task's own sizes and "
                            f"{other} at the checked sizes: not congruent modulo its block "
                            f"size {m}, so its boundary tiles differ")
            problem = _grid_congruent(name, a, b, constexpr)
            if problem is None and source is not None and name in source.defs:
                problem = _loops_congruent(name, a, b, source)
            if problem is not None:
                return problem
    return None


def _names_read(kernel: ast.FunctionDef) -> set[str]:
    """The names the body of ``kernel`` reads (its parameters among them)."""
    return {node.id for stmt in kernel.body for node in ast.walk(stmt)
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)}


@dataclass
class KernelSource:
    """The candidate's kernels as the worker parses them (their ``def`` nodes and the
    module's int constants), for the loop rule of :func:`congruent`."""

    defs: dict[str, ast.FunctionDef]
    constants: dict[str, int]

    @classmethod
    def of(cls, source: str) -> KernelSource:
        """Parse the kernel module ``source``.

        Raises:
            SyntaxError: it does not parse.
        """
        return cls(index_ranges.kernel_defs(source), index_ranges.module_constants(source))


def _quantities(run: dict[str, Any], constexpr: set[str]) -> dict[str, int]:
    """The launch's sizes a grid may be computed from: its int arguments and each
    tensor argument's extents and element count, by name (``x.shape[1]``)."""
    out: dict[str, int] = {}
    for name, value in (run.get("args") or {}).items():
        if name in constexpr or isinstance(value, bool):
            continue
        if isinstance(value, int) and value >= 1:
            out[name] = value
        elif isinstance(value, dict) and value.get(values.TAG) == "T":
            extents = [int(e) for e in value.get("z", [])]
            for i, e in enumerate(extents):
                if e >= 1:
                    out[f"{name}.shape[{i}]"] = e
            if len(extents) > 1 and math.prod(extents) >= 1:
                out[f"{name}.numel()"] = math.prod(extents)
    return out


def _divisors(run: dict[str, Any], constexpr: set[str]) -> dict[str, int]:
    out = {"1": 1}
    for name, value in (run.get("args") or {}).items():
        if name in constexpr and isinstance(value, int) and not isinstance(value, bool) \
                and 2 <= value <= _MAX_MODULUS:
            out[name] = value
    return out


def _term(key: tuple[str, str], q: dict[str, int], d: dict[str, int]) -> int | None:
    if key[0] not in q or key[1] not in d:
        return None
    return -(-q[key[0]] // d[key[1]])


def _term_text(key: tuple[str, str]) -> str:
    return key[0] if key[1] == "1" else f"cdiv({key[0]}, {key[1]})"


def _relations(extent: int, q: dict[str, int], d: dict[str, int]) -> list[tuple]:
    """The ways ``extent`` is ``cdiv(q, d)`` or a product of two such terms at these
    arguments (products only when no single term gives it)."""
    terms: dict[int, list[tuple[str, str]]] = {}
    for qn in q:
        for dn in d:
            terms.setdefault(_term((qn, dn), q, d), []).append((qn, dn))
    # Scalar arguments first: they name the relation as the kernel's author wrote it.
    singles = [(t,) for t in sorted(terms.get(extent, []), key=lambda k: "." in k[0])]
    if singles:
        return singles
    pairs = []
    for v, keys in terms.items():
        if v > 1 and extent % v == 0 and extent // v > 1 and extent // v in terms:
            pairs += [(k1, k2) for k1 in keys for k2 in terms[extent // v]]
    return pairs[:256]


def _grid_congruent(name: str, a: dict[str, Any], b: dict[str, Any],
                    constexpr: set[str]) -> str | None:
    """The grid rule of :func:`congruent` for one launch: ``a`` at the task's own
    sizes, ``b`` at the checked ones."""
    qa, qb = _quantities(a, constexpr), _quantities(b, constexpr)
    da, db = _divisors(a, constexpr), _divisors(b, constexpr)
    for axis, (ga, gb) in enumerate(zip(a.get("grid", []), b.get("grid", []), strict=False)):
        if (ga > 1) != (gb > 1):
            return (f"{name} runs {ga} program{'s' if ga != 1 else ''} on grid axis {axis} at "
                    f"the task's own sizes and {gb} at the checked sizes")
        if ga == gb:
            continue
        explained = _relations(gb, qb, db)
        if not explained:
            continue
        if any(math.prod(_term(k, qa, da) or 0 for k in rel) == ga for rel in explained):
            continue
        rel = explained[0]
        formula = " * ".join(_term_text(k) for k in rel)
        there = math.prod(_term(k, qa, da) or 0 for k in rel)
        return (f"{name}'s grid axis {axis} is {formula} = {gb} at the checked sizes but {ga} "
                f"at the task's own sizes, where {formula} = {there}: its grid is computed "
                "differently there")
    return None


def _trips_text(trips: tuple[int, int] | None) -> str:
    if trips is None:
        return "an unknown number of times"
    low, high = trips
    return f"{high} time{'s' if high != 1 else ''}" if low == high else \
        f"{low} to {high} times"


_TRUTH_TEXT = {
    index_ranges.ALL: "holds for every program and lane",
    index_ranges.NONE: "holds for no program or lane",
    index_ranges.SOME: "holds for some programs or lanes and not for others",
    None: "depends on values not known before the run",
}


def _loops_congruent(name: str, a: dict[str, Any], b: dict[str, Any],
                     source: KernelSource) -> str | None:
    """The loop and branch rules of :func:`congruent`: each loop of the kernel runs
    none, once or several times (the most any program makes) alike at both sizes, and
    each condition on known integers (a comparison, an ``if`` / ``while`` /
    ``tl.where`` test) is true for every program and lane, for none, or for some alike
    (a condition unknown at the task's own sizes, on loaded values, is not compared)."""
    fn = source.defs[name]
    big = index_ranges.evaluate(fn, a, source.constants, source.defs)
    small = index_ranges.evaluate(fn, b, source.constants, source.defs)
    for x, y in zip(big.loops, small.loops, strict=False):
        cx, cy = index_ranges.trip_class(x.trips), index_ranges.trip_class(y.trips)
        if cx is None or cx == cy:
            continue
        return (f"{name}'s loop `{x.text}` (line {x.line}) runs {_trips_text(x.trips)} at the "
                f"task's own sizes and {_trips_text(y.trips)} at the checked sizes")
    checked = {(c.line, c.col, c.part): c for c in small.branches}
    for c in big.branches:
        if c.truth is None:
            continue
        other = checked.get((c.line, c.col, c.part))
        there = other.truth if other is not None else "not reached"
        if there == c.truth:
            continue
        said = _TRUTH_TEXT.get(there, "is not reached") if other is not None else \
            "is not reached"
        return (f"{name}'s condition `{c.text}` (line {c.line}) {_TRUTH_TEXT[c.truth]} at "
                f"the task's own sizes and {said} at the checked sizes: the task's own sizes "
                "take a branch the checked sizes do not")
    return None


def launch_modulus(launches: list[dict[str, Any]], constexprs: dict[str, set[str]]) -> int:
    """The largest tile size over ``launches`` (see :func:`modulus`)."""
    return max((modulus(e, constexprs.get(str(e.get("launch")), set())) for e in launches),
               default=1)


def _shrink(value: int, m: int) -> list[int]:
    """Values below ``value`` congruent to it modulo ``m``, smallest first (at most 4)."""
    r = value % m
    first = r if r else m
    out = []
    k = 0
    while True:
        v = first + k * m
        if v >= value:
            break
        out.append(v)
        k = k + 1 if len(out) < 2 else max(k + 1, (value // m) // 2)
        if len(out) == 4:
            break
    return out


def congruent_candidates(real: dict[str, Any], m: int) -> list[dict[str, Any]]:
    """Size dicts below ``real`` (the task's own sizes), each changing one extent to a
    smaller value congruent modulo ``m`` (``m`` 1: any smaller value), for a greedy
    search that keeps what holds."""
    out = []
    for name, value in sorted(real.items(), key=lambda kv: -_volume(kv[1])):
        if not is_extent(name):
            continue
        if isinstance(value, int):
            for v in (_shrink(value, m) if m > 1 else sorted({max(1, value // d)
                                                              for d in (8, 4, 2)})):
                out.append({**real, name: v})
        elif isinstance(value, list):
            for i, part in enumerate(value):
                for v in (_shrink(part, m) if m > 1 else sorted({max(1, part // d)
                                                                 for d in (4, 2)})):
                    out.append({**real, name: [*value[:i], v, *value[i + 1:]]})
    return [c for c in out if c != real]


def _volume(value: Any) -> int:
    return math.prod(value) if isinstance(value, list) else int(value)


def awkward_sizes(sizes: dict[str, Any], factor: float = 0.75,
                  rng: random.Random | None = None) -> dict[str, Any]:
    """The shape-generality sizes: each extent of ``sizes`` (ints and tuple parts of 8
    or more) to an odd value, which no power-of-two block divides; parameters (see
    :data:`NOT_EXTENTS`) unchanged. With ``rng`` (a generator seeded from the
    verification's secret seed) each extent is drawn uniformly among the odd values in
    ``[factor / 2, factor]`` of it (at least 3), so a candidate cannot know the size in
    advance; without, it is the odd value just below ``factor`` of it."""
    out = dict(sizes)
    for name, value in sizes.items():
        if not is_extent(name):
            continue
        if isinstance(value, int) and value >= 8:
            out[name] = _odd(value, factor, rng)
        elif isinstance(value, list):
            out[name] = [_odd(v, factor, rng) if v >= 8 else v for v in value]
    return out


def _odd(value: int, factor: float, rng: random.Random | None = None) -> int:
    high = max(3, min(int(value * factor), value - 1))
    high = high if high % 2 else high - 1
    if rng is None:
        return high
    low = max(3, int(value * factor / 2))
    low = low if low % 2 else low + 1
    return low + 2 * rng.randrange((high - low) // 2 + 1) if high > low else high


def changed(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two size dicts differ in any extent."""
    return any(a.get(k) != b.get(k) for k in a.keys() | b.keys())


def text(sizes: dict[str, Any]) -> str:
    """``batch_size=4, dim=1024`` (or ``the task's own sizes``)."""
    return ", ".join(f"{k}={v}" for k, v in sorted(sizes.items())) or "the task's own sizes"
