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
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from typing import Any

from services.common.pyast import parse
from services.sandbox import values

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
# Values beyond this magnitude are unknown (no kernel index gets there; it keeps a
# hostile ``1 << 10**9`` from costing the worker anything).
_LIMIT = 1 << 96
_WIDE_DTYPES = frozenset({"int64", "uint64"})
_NARROW_DTYPES = frozenset({"int32", "uint32", "int16", "uint16", "int8", "uint8", "int1"})
_ATOMICS = frozenset({"atomic_add", "atomic_max", "atomic_min", "atomic_and", "atomic_or",
                      "atomic_xor", "atomic_xchg", "atomic_cas"})
_PASS_THROUGH = frozenset({"multiple_of", "max_contiguous", "max_constancy", "broadcast_to",
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
    """What :func:`evaluate` found, in source order (branches by first evaluation)."""

    loops: list[Loop] = field(default_factory=list)
    accesses: list[Access] = field(default_factory=list)
    branches: list[Branch] = field(default_factory=list)


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
        if isinstance(value, ast.Call) and _callee(value.func) == "constexpr" and \
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


def _fits(v: int) -> bool:
    return INT32_MIN <= v <= INT32_MAX


def exact(v: int) -> Ival:
    """The literal (or scalar argument) ``v``: int64 when it does not fit int32."""
    return Ival(v, v, wide=not _fits(v))


def _arg_value(value: Any, name: str) -> Any:
    if isinstance(value, bool):
        return Flag(value)
    if isinstance(value, int):
        return exact(value)
    if isinstance(value, dict) and value.get(values.TAG) == "T":
        return Ptr(name, Ival(0, 0, wide=True))
    if isinstance(value, dict) and value.get(values.TAG) == "tl":
        return DType(str(value.get("v")))
    return None


def _callee(node: ast.expr) -> str:
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


def _hull(a: Any, b: Any) -> Any:
    if isinstance(a, Ival) and isinstance(b, Ival):
        return Ival(min(a.lo, b.lo), max(a.hi, b.hi), a.wide or b.wide, a.over or b.over)
    if isinstance(a, Ptr) and isinstance(b, Ptr) and a.name == b.name:
        return Ptr(a.name, _hull(a.off, b.off) if a.off and b.off else None)
    if isinstance(a, Flag) and isinstance(b, Flag) and a.value == b.value:
        return a
    if isinstance(a, DType) and a == b:
        return a
    return None


def _both(a: str | None, b: str | None) -> str | None:
    """The truth of one condition seen twice (two paths or evaluations): the union."""
    if a is None or b is None:
        return None
    return a if a == b else SOME


def _and(parts: list[str | None]) -> str | None:
    if NONE in parts:
        return NONE
    if None in parts:
        return None
    return ALL if all(p == ALL for p in parts) else SOME


def _not(truth: str | None) -> str | None:
    return {ALL: NONE, NONE: ALL}.get(truth, truth) if truth is not None else None


def _compare(op: ast.cmpop, a: Ival, b: Ival) -> str | None:
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
        return equal if isinstance(op, ast.Eq) else _not(equal)
    return None


# How deep calls of the module's other functions are followed.
_MAX_DEPTH = 4


class _Walker:
    def __init__(self, grid: list[int], constants: dict[str, int],
                 defs: dict[str, ast.FunctionDef] | None = None) -> None:
        self.grid = list(grid) + [1] * (3 - len(grid))
        self.constants = constants
        self.defs = defs or {}
        self.out = Ranges()
        self._branches: dict[tuple[int, int, int], Branch] = {}
        self._returns: list[list[Any]] = []

    def inline(self, fn: ast.FunctionDef, node: ast.Call, env: dict[str, Any]) -> Any:
        """A call of another function of the module (a ``@triton.jit`` helper, inlined
        by Triton): its body walked with its parameters bound to the call's values;
        what it returns (the hull of its ``return`` values)."""
        params = fn.args.args + fn.args.kwonlyargs
        bound: dict[str, Any] = {}
        defaults = fn.args.defaults
        for p, d in zip(fn.args.args[len(fn.args.args) - len(defaults):], defaults,
                        strict=True):
            bound[p.arg] = self.value(d, env)
        for p, d in zip(fn.args.kwonlyargs, fn.args.kw_defaults, strict=True):
            if d is not None:
                bound[p.arg] = self.value(d, env)
        for p, a in zip(fn.args.args, node.args, strict=False):
            bound[p.arg] = None if isinstance(a, ast.Starred) else self.value(a, env)
        for k in node.keywords:
            if k.arg is not None:
                bound[k.arg] = self.value(k.value, env)
        inner = {p.arg: bound.get(p.arg) for p in params}
        self._returns.append([])
        self.block(fn.body, inner)
        returned = self._returns.pop()
        if not returned:
            return None
        out = returned[0]
        for r in returned[1:]:
            out = _hull(out, r)
        return out

    def note(self, node: ast.expr, part: int, text: str, truth: str | None) -> None:
        """Record condition ``node`` (``part`` of a chained comparison) as ``truth``."""
        key = (node.lineno, node.col_offset, part)
        seen = self._branches.get(key)
        if seen is None:
            self._branches[key] = Branch(node.lineno, node.col_offset, part, text, truth)
            self.out.branches.append(self._branches[key])
        else:
            seen.truth = _both(seen.truth, truth)

    # ---------------------------------------------------------------- values

    def arith(self, node: ast.AST, op: ast.operator, a: Any, b: Any) -> Any:
        if isinstance(a, Ptr) and isinstance(b, Ival) and isinstance(op, (ast.Add, ast.Sub)):
            return Ptr(a.name, self.arith(node, op, a.off, b) if a.off is not None else None)
        if isinstance(b, Ptr) and isinstance(a, Ival) and isinstance(op, ast.Add):
            return Ptr(b.name, self.arith(node, op, b.off, a) if b.off is not None else None)
        if not (isinstance(a, Ival) and isinstance(b, Ival)):
            return None
        lo, hi = self._bounds(op, a, b)
        if lo is None or max(abs(lo), abs(hi)) > _LIMIT:
            return None
        wide = a.wide or b.wide
        over = a.over or b.over
        if over is None and not wide and not (_fits(lo) and _fits(hi)):
            over = (ast.unparse(node), max(abs(lo), abs(hi)))
        return Ival(lo, hi, wide, over)

    @staticmethod
    def _bounds(op: ast.operator, a: Ival, b: Ival) -> tuple[int | None, int | None]:
        if isinstance(op, ast.Add):
            return a.lo + b.lo, a.hi + b.hi
        if isinstance(op, ast.Sub):
            return a.lo - b.hi, a.hi - b.lo
        if isinstance(op, ast.Mult):
            corners = [a.lo * b.lo, a.lo * b.hi, a.hi * b.lo, a.hi * b.hi]
            return min(corners), max(corners)
        if isinstance(op, ast.FloorDiv) and b.lo > 0 and a.lo >= 0:
            return a.lo // b.hi, a.hi // b.lo
        if isinstance(op, ast.Mod) and b.lo > 0 and a.lo >= 0:
            return (a.lo, a.hi) if a.hi < b.lo else (0, min(a.hi, b.hi - 1))
        if isinstance(op, ast.LShift) and a.lo >= 0 and 0 <= b.lo and b.hi <= 64:
            return a.lo << b.lo, a.hi << b.hi
        if isinstance(op, ast.RShift) and a.lo >= 0 and 0 <= b.lo and b.hi <= 64:
            return a.lo >> b.hi, a.hi >> b.lo
        if isinstance(op, ast.BitAnd) and a.lo >= 0 and b.lo >= 0:
            return 0, min(a.hi, b.hi)
        if isinstance(op, ast.Pow) and a.lo == a.hi and b.lo == b.hi and 0 <= b.lo <= 64 \
                and abs(a.lo) <= 1 << 16:
            return a.lo ** b.lo, a.lo ** b.lo
        return None, None

    def value(self, node: ast.expr, env: dict[str, Any]) -> Any:  # noqa: C901, PLR0911, PLR0912
        if isinstance(node, ast.Constant):
            if isinstance(node.value, bool):
                return Flag(node.value)
            if isinstance(node.value, int):
                return exact(node.value) if abs(node.value) <= _LIMIT else None
            # A float literal holding an integer (8e6) is that integer for comparisons;
            # never an int32 value (wide), so it reports no int32 overflow.
            if isinstance(node.value, float) and node.value.is_integer() and \
                    abs(node.value) <= _LIMIT:
                return Ival(int(node.value), int(node.value), wide=True)
            return None
        if isinstance(node, ast.Name):
            if node.id in env:
                return env[node.id]
            if node.id in self.constants:
                return exact(self.constants[node.id])
            return None
        if isinstance(node, ast.Attribute):
            if _callee(node) in _WIDE_DTYPES | _NARROW_DTYPES:
                return DType(_callee(node))
            return None
        if isinstance(node, ast.BinOp):
            return self.arith(node, node.op, self.value(node.left, env),
                              self.value(node.right, env))
        if isinstance(node, ast.UnaryOp):
            inner = self.value(node.operand, env)
            if isinstance(node.op, ast.USub) and isinstance(inner, Ival):
                return Ival(-inner.hi, -inner.lo, inner.wide, inner.over)
            if isinstance(node.op, ast.UAdd):
                return inner
            if isinstance(node.op, ast.Not) and isinstance(inner, Flag):
                return Flag(not inner.value)
            return None
        if isinstance(node, ast.Subscript):
            base = self.value(node.value, env)
            index = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
            broadcast = all(isinstance(i, ast.Slice) and i.lower is None and i.upper is None
                            and i.step is None
                            or isinstance(i, ast.Constant) and i.value is None for i in index)
            return base if broadcast else None
        if isinstance(node, ast.IfExp):
            test = self.condition(node.test, env)
            if test is not None:
                return self.value(node.body if test else node.orelse, env)
            return _hull(self.value(node.body, env), self.value(node.orelse, env))
        if isinstance(node, ast.Compare | ast.BoolOp):
            truth = self.truth(node, env)
            return Flag(truth == ALL) if truth in (ALL, NONE) else None
        if isinstance(node, ast.Call):
            return self.call(node, env)
        return None

    def call(self, node: ast.Call, env: dict[str, Any]) -> Any:  # noqa: C901, PLR0911, PLR0912
        name = _callee(node.func)
        args = node.args
        kwargs = {k.arg: k.value for k in node.keywords if k.arg}
        if isinstance(node.func, ast.Name) and name in self.defs and \
                len(self._returns) < _MAX_DEPTH:
            return self.inline(self.defs[name], node, env)
        if name in ("load", "store") or name in _ATOMICS:
            self.access(name, node, env)
            return None
        if name in ("program_id", "num_programs"):
            axis_node = args[0] if args else kwargs.get("axis")
            axis = self.value(axis_node, env) if axis_node is not None else None
            if not isinstance(axis, Ival) or axis.lo != axis.hi or not 0 <= axis.lo <= 2:
                return None
            g = self.grid[axis.lo]
            return Ival(0, max(g - 1, 0)) if name == "program_id" else Ival(g, g)
        if name == "arange" and len(args) == 2:
            a, b = self.value(args[0], env), self.value(args[1], env)
            if isinstance(a, Ival) and isinstance(b, Ival) and a.lo == a.hi and b.lo == b.hi:
                return Ival(a.lo, max(a.lo, b.lo - 1))
            return None
        if name == "cdiv" and len(args) == 2:
            a, b = self.value(args[0], env), self.value(args[1], env)
            if isinstance(a, Ival) and isinstance(b, Ival) and b.lo > 0 and a.lo >= 0:
                return Ival(-(-a.lo // b.hi), -(-a.hi // b.lo), a.wide or b.wide,
                            a.over or b.over)
            return None
        if name in ("minimum", "maximum", "min", "max") and len(args) == 2:
            a, b = self.value(args[0], env), self.value(args[1], env)
            if isinstance(a, Ival) and isinstance(b, Ival):
                pick = min if name in ("minimum", "min") else max
                return Ival(pick(a.lo, b.lo), pick(a.hi, b.hi), a.wide or b.wide,
                            a.over or b.over)
            return None
        if name == "where" and len(args) == 3:
            test = self.condition(args[0], env)
            if test is not None:
                return self.value(args[1] if test else args[2], env)
            return _hull(self.value(args[1], env), self.value(args[2], env))
        if name in _PASS_THROUGH and args:
            return self.value(args[0], env)
        if name in ("zeros", "full"):
            dtype = self.value(kwargs.get("dtype", args[-1] if len(args) >= 2 else None), env) \
                if (kwargs.get("dtype") or len(args) >= 2) else None
            fill = exact(0) if name == "zeros" else (
                self.value(args[1], env) if len(args) >= 2 else None)
            if isinstance(dtype, DType) and isinstance(fill, Ival):
                return self.cast(fill, dtype)
            return None
        if name in (".to", "cast"):
            inner = self.value(node.func.value, env) if name == ".to" else (
                self.value(args[0], env) if args else None)
            target = (args[0] if name == ".to" and args else args[1] if len(args) >= 2
                      else kwargs.get("dtype"))
            return self.cast(inner, self.value(target, env) if target is not None else None)
        # Anything else is not modelled, but what it is given is still evaluated: the
        # conditions and memory accesses inside (``tl.sum(tl.where(pid < K, ...))``).
        if isinstance(node.func, ast.Attribute):
            self.value(node.func.value, env)
        for part in [*args, *kwargs.values()]:
            self.value(part.value if isinstance(part, ast.Starred) else part, env)
        return None

    @staticmethod
    def cast(inner: Any, dtype: Any) -> Any:
        if not isinstance(inner, Ival) or not isinstance(dtype, DType):
            return None
        if dtype.name in _WIDE_DTYPES:
            return Ival(inner.lo, inner.hi, True, inner.over)
        if dtype.name in _NARROW_DTYPES and _fits(inner.lo) and _fits(inner.hi):
            return Ival(inner.lo, inner.hi, False, inner.over)
        return None

    def truth(self, node: ast.expr, env: dict[str, Any]) -> str | None:
        """The truth of condition ``node`` over the launch (:data:`ALL`, :data:`NONE`,
        :data:`SOME`, None: unknown); each comparison in it is recorded."""
        if isinstance(node, ast.Compare):
            parts = []
            left = self.value(node.left, env)
            for i, (op, right_node) in enumerate(zip(node.ops, node.comparators,
                                                     strict=True)):
                right = self.value(right_node, env)
                truth = None
                if isinstance(left, Ival) and isinstance(right, Ival):
                    truth = _compare(op, left, right)
                elif isinstance(left, Flag) and isinstance(right, Flag) and \
                        isinstance(op, ast.Eq | ast.Is | ast.NotEq | ast.IsNot):
                    same = left.value == right.value
                    truth = ALL if same == isinstance(op, ast.Eq | ast.Is) else NONE
                text = ast.unparse(node) if len(node.ops) == 1 else \
                    f"{ast.unparse(node.left if i == 0 else node.comparators[i - 1])} " \
                    f"{_OP_TEXT.get(type(op), '?')} {ast.unparse(right_node)}"
                if isinstance(left, Ival | Flag) and isinstance(right, Ival | Flag):
                    self.note(node, i, text, truth)
                parts.append(truth)
                left = right
            return _and(parts)
        if isinstance(node, ast.BoolOp):
            parts = [self.truth(v, env) for v in node.values]
            if isinstance(node.op, ast.And):
                return _and(parts)
            return _not(_and([_not(p) for p in parts]))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            return _not(self.truth(node.operand, env))
        value = self.value(node, env)
        if isinstance(value, Flag):
            return ALL if value.value else NONE
        if isinstance(value, Ival):
            return NONE if value.lo == value.hi == 0 else \
                ALL if value.lo > 0 or value.hi < 0 else SOME
        return None

    def condition(self, node: ast.expr, env: dict[str, Any]) -> bool | None:
        """The test of an ``if``, ``while``, conditional expression or ``tl.where``:
        recorded, and its value when it is the same for every program and lane."""
        truth = self.truth(node, env)
        if truth is not None and not isinstance(node, ast.Compare | ast.BoolOp):
            self.note(node, 0, ast.unparse(node), truth)
        return {ALL: True, NONE: False}.get(truth) if truth is not None else None

    def access(self, kind: str, node: ast.Call, env: dict[str, Any]) -> None:
        target = node.args[0] if node.args else next(
            (k.value for k in node.keywords if k.arg in ("pointer", "ptr")), None)
        if target is None:
            return
        pointer = self.value(target, env)
        for other in [*node.args[1:], *(k.value for k in node.keywords)]:
            self.value(other, env)
        self.out.accesses.append(Access(kind, node.lineno, ast.unparse(target),
                                        pointer if isinstance(pointer, Ptr) else None))

    # ------------------------------------------------------------ statements

    def block(self, body: list[ast.stmt], env: dict[str, Any]) -> None:
        for stmt in body:
            self.statement(stmt, env)

    def statement(self, stmt: ast.stmt, env: dict[str, Any]) -> None:  # noqa: C901, PLR0912
        if isinstance(stmt, ast.Assign):
            value = self.value(stmt.value, env)
            for target in stmt.targets:
                self.bind(target, stmt.value, value, env)
        elif isinstance(stmt, ast.AnnAssign) and stmt.value is not None:
            self.bind(stmt.target, stmt.value, self.value(stmt.value, env), env)
        elif isinstance(stmt, ast.AugAssign):
            if isinstance(stmt.target, ast.Name):
                env[stmt.target.id] = self.arith(stmt, stmt.op, env.get(stmt.target.id),
                                                 self.value(stmt.value, env))
            else:
                self.value(stmt.value, env)
        elif isinstance(stmt, ast.Expr):
            self.value(stmt.value, env)
        elif isinstance(stmt, ast.If):
            test = self.condition(stmt.test, env)
            if test is None:
                left, right = dict(env), dict(env)
                self.block(stmt.body, left)
                self.block(stmt.orelse, right)
                for name in left.keys() | right.keys():
                    env[name] = _hull(left.get(name), right.get(name))
            else:
                self.block(stmt.body if test else stmt.orelse, env)
        elif isinstance(stmt, ast.For):
            self.loop(stmt, env)
        elif isinstance(stmt, ast.While):
            # Whether a program enters the loop: the test on the values before it.
            self.condition(stmt.test, env)
            for name in _assigned(stmt.body):
                env[name] = None
            self.block(stmt.body, env)
            for name in _assigned(stmt.body):
                env[name] = None
        elif isinstance(stmt, ast.With):
            self.block(stmt.body, env)
        elif isinstance(stmt, ast.Return) and stmt.value is not None:
            returned = self.value(stmt.value, env)
            if self._returns:
                self._returns[-1].append(returned)

    def bind(self, target: ast.expr, node: ast.expr, value: Any, env: dict[str, Any]) -> None:
        if isinstance(target, ast.Name):
            env[target.id] = value
        elif isinstance(target, ast.Tuple):
            parts = node.elts if isinstance(node, ast.Tuple) and \
                len(node.elts) == len(target.elts) else None
            for i, t in enumerate(target.elts):
                self.bind(t, parts[i] if parts else node,
                          self.value(parts[i], env) if parts else None, env)

    def trips(self, stmt: ast.For, env: dict[str, Any]) -> tuple[Any, tuple[int, int] | None]:
        """The loop variable's range and the loop's trip counts (fewest, most)."""
        it = stmt.iter
        if not isinstance(it, ast.Call) or not _callee(it.func).endswith("range"):
            return None, None
        args = [self.value(a, env) for a in it.args[:3]]
        if len(args) == 1:
            args = [exact(0), args[0], exact(1)]
        elif len(args) == 2:
            args.append(exact(1))
        step_kw = next((k.value for k in it.keywords if k.arg == "step"), None)
        if step_kw is not None and len(args) == 3:
            args[2] = self.value(step_kw, env)
        if len(args) != 3 or not all(isinstance(a, Ival) for a in args):
            return None, None
        start, stop, step = args
        if step.lo <= 0:
            return None, None
        most = max(0, -(-(stop.hi - start.lo) // step.lo))
        fewest = max(0, -(-(stop.lo - start.hi) // step.hi))
        var = Ival(start.lo, max(start.lo, start.hi + (most - 1) * step.hi) if most else start.hi,
                   start.wide or stop.wide or step.wide)
        return var, (fewest, most)

    def loop(self, stmt: ast.For, env: dict[str, Any]) -> None:
        var, trips = self.trips(stmt, env)
        self.out.loops.append(Loop(stmt.lineno, f"for {ast.unparse(stmt.target)} in "
                                   f"{ast.unparse(stmt.iter)}", trips))
        carried = _assigned(stmt.body)
        increments = _increments(stmt.body)
        start = dict(env)
        if isinstance(stmt.target, ast.Name):
            env[stmt.target.id] = var
        for name in carried:
            if name in increments and trips is not None and isinstance(start.get(name), Ival):
                delta = self.value(increments[name], {**env, **{n: None for n in carried
                                                                if n != name}})
                if isinstance(delta, Ival):
                    most = max(trips[1] - 1, 0)
                    span = self.arith(increments[name], ast.Mult(), Ival(0, most), delta)
                    env[name] = self.arith(increments[name], ast.Add(), start[name], span)
                    continue
            env[name] = None
        self.block(stmt.body, env)
        for name in carried:
            if name in increments and trips is not None and isinstance(env.get(name), Ival):
                continue
            env[name] = None


_OP_TEXT = {ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Eq: "==",
            ast.NotEq: "!=", ast.Is: "is", ast.IsNot: "is not", ast.In: "in",
            ast.NotIn: "not in"}


def _assigned(body: list[ast.stmt]) -> set[str]:
    names: set[str] = set()
    for stmt in body:
        for node in ast.walk(stmt):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
    return names


def _increments(body: list[ast.stmt]) -> dict[str, ast.expr]:
    """Names whose only assignment in ``body`` is ``x += d`` (or ``x = x + d``) at its
    top level: name -> ``d``."""
    found: dict[str, ast.expr] = {}
    counts: dict[str, int] = {}
    for node in (n for s in body for n in ast.walk(s)):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            counts[node.id] = counts.get(node.id, 0) + 1
    for stmt in body:
        if isinstance(stmt, ast.AugAssign) and isinstance(stmt.op, ast.Add) and \
                isinstance(stmt.target, ast.Name):
            found[stmt.target.id] = stmt.value
        elif isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and \
                isinstance(stmt.targets[0], ast.Name) and isinstance(stmt.value, ast.BinOp) \
                and isinstance(stmt.value.op, ast.Add) and isinstance(stmt.value.left, ast.Name) \
                and stmt.value.left.id == stmt.targets[0].id:
            found[stmt.targets[0].id] = stmt.value.right
    return {k: v for k, v in found.items() if counts.get(k) == 1}


def evaluate(fn: ast.FunctionDef, launch: dict[str, Any],
             constants: dict[str, int] | None = None,
             defs: dict[str, ast.FunctionDef] | None = None) -> Ranges:
    """The loops, memory accesses and conditions of kernel ``fn`` at one recorded launch
    (``{"grid": [x, y, z], "args": {name: encoded value}}``, a dry run's or a plan's;
    see the module doc for what is modelled). ``defs``: the module's functions, whose
    calls are followed (up to 4 deep; without, a call of one is not modelled)."""
    walker = _Walker([int(g) for g in launch.get("grid") or [1]], constants or {}, defs)
    env: dict[str, Any] = {}
    args = launch.get("args") or {}
    for a in fn.args.args + fn.args.kwonlyargs:
        env[a.arg] = _arg_value(args.get(a.arg), a.arg)
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
