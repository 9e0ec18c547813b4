"""The walk of one Triton kernel's body with interval arithmetic (:class:`Walker`):
what :func:`services.worker.index_ranges.evaluate` runs, statement by statement, over
the values of :mod:`services.worker.index_values`.
"""

from __future__ import annotations

import ast
from typing import Any

from services.worker.index_values import (
    ALL,
    ATOMICS,
    LIMIT,
    NARROW_DTYPES,
    NONE,
    PASS_THROUGH,
    SOME,
    WIDE_DTYPES,
    Access,
    Branch,
    DType,
    Flag,
    Ival,
    Loop,
    Ptr,
    Ranges,
    callee,
    compare,
    exact,
    fits_int32,
    hull,
    truth_and,
    truth_both,
    truth_not,
)

# How deep calls of the module's other functions are followed.
_MAX_DEPTH = 4


class Walker:
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
            out = hull(out, r)
        return out

    def note(self, node: ast.expr, part: int, text: str, truth: str | None) -> None:
        """Record condition ``node`` (``part`` of a chained comparison) as ``truth``."""
        key = (node.lineno, node.col_offset, part)
        seen = self._branches.get(key)
        if seen is None:
            self._branches[key] = Branch(node.lineno, node.col_offset, part, text, truth)
            self.out.branches.append(self._branches[key])
        else:
            seen.truth = truth_both(seen.truth, truth)

    # ---------------------------------------------------------------- values

    def arith(self, node: ast.AST, op: ast.operator, a: Any, b: Any) -> Any:
        if isinstance(a, Ptr) and isinstance(b, Ival) and isinstance(op, (ast.Add, ast.Sub)):
            return Ptr(a.name, self.arith(node, op, a.off, b) if a.off is not None else None)
        if isinstance(b, Ptr) and isinstance(a, Ival) and isinstance(op, ast.Add):
            return Ptr(b.name, self.arith(node, op, b.off, a) if b.off is not None else None)
        if not (isinstance(a, Ival) and isinstance(b, Ival)):
            return None
        lo, hi = self._bounds(op, a, b)
        if lo is None or max(abs(lo), abs(hi)) > LIMIT:
            return None
        wide = a.wide or b.wide
        over = a.over or b.over
        if over is None and not wide and not (fits_int32(lo) and fits_int32(hi)):
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
                return exact(node.value) if abs(node.value) <= LIMIT else None
            # A float literal holding an integer (8e6) is that integer for comparisons;
            # never an int32 value (wide), so it reports no int32 overflow.
            if isinstance(node.value, float) and node.value.is_integer() and \
                    abs(node.value) <= LIMIT:
                return Ival(int(node.value), int(node.value), wide=True)
            return None
        if isinstance(node, ast.Name):
            if node.id in env:
                return env[node.id]
            if node.id in self.constants:
                return exact(self.constants[node.id])
            return None
        if isinstance(node, ast.Attribute):
            if callee(node) in WIDE_DTYPES | NARROW_DTYPES:
                return DType(callee(node))
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
            return hull(self.value(node.body, env), self.value(node.orelse, env))
        if isinstance(node, ast.Compare | ast.BoolOp):
            truth = self.truth(node, env)
            return Flag(truth == ALL) if truth in (ALL, NONE) else None
        if isinstance(node, ast.Call):
            return self.call(node, env)
        return None

    def call(self, node: ast.Call, env: dict[str, Any]) -> Any:  # noqa: C901, PLR0911, PLR0912
        name = callee(node.func)
        args = node.args
        kwargs = {k.arg: k.value for k in node.keywords if k.arg}
        if isinstance(node.func, ast.Name) and name in self.defs and \
                len(self._returns) < _MAX_DEPTH:
            return self.inline(self.defs[name], node, env)
        if name in ("load", "store") or name in ATOMICS:
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
            return hull(self.value(args[1], env), self.value(args[2], env))
        if name in PASS_THROUGH and args:
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
        if dtype.name in WIDE_DTYPES:
            return Ival(inner.lo, inner.hi, True, inner.over)
        if dtype.name in NARROW_DTYPES and fits_int32(inner.lo) and fits_int32(inner.hi):
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
                    truth = compare(op, left, right)
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
            return truth_and(parts)
        if isinstance(node, ast.BoolOp):
            parts = [self.truth(v, env) for v in node.values]
            if isinstance(node.op, ast.And):
                return truth_and(parts)
            return truth_not(truth_and([truth_not(p) for p in parts]))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            return truth_not(self.truth(node.operand, env))
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
                    env[name] = hull(left.get(name), right.get(name))
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
        if not isinstance(it, ast.Call) or not callee(it.func).endswith("range"):
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
