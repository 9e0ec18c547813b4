"""The candidate's kernels and nothing else: the module the replayer and the GPU
compile check load.

:func:`kernel_module` keeps, from the candidate's source, its module-level
``@triton.jit`` functions (``@triton.autotune`` / ``@triton.heuristics`` dropped: the
plan records what they chose), imports of ``triton`` and ``math``, and module-level
constants whose values are plain expressions (literals, ``tl.constexpr(...)``,
``math`` calls, arithmetic on other kept names). Every other line is blanked, so line
numbers (and the file name, ``candidate.py``) stay those of the candidate: a kernel's
error points at the line the coder wrote. Loading the result runs no candidate code
but decorators and constants.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field

# Modules a kernel module may import (kernel bodies use triton.language; constants
# may use math).
_IMPORT_ROOTS = ("triton", "math")
# The decorator written in place of a kernel's own (PEP 614 expression): it does not
# depend on how the candidate imported triton.
_JIT = '@__import__("triton").jit'


@dataclass
class KernelModule:
    """``source`` (same line count as the candidate's), the kernel names kept, the
    names of functions that look like kernels but were dropped, with why, and each
    kernel's ``tl.constexpr`` parameters."""

    source: str
    kernels: list[str] = field(default_factory=list)
    dropped: dict[str, str] = field(default_factory=dict)
    constexpr_params: dict[str, set[str]] = field(default_factory=dict)


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else None
    return None


class _Names:
    """How the candidate spelled triton's decorators (``triton.jit``, ``jit``, ...)."""

    def __init__(self, tree: ast.Module) -> None:
        self.triton = {"triton"}
        self.jit = {"triton.jit"}
        self.language = {"tl", "triton.language"}
        for node in tree.body:
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name == "triton":
                        self.triton.add(alias.asname or "triton")
                        self.jit.add(f"{alias.asname or 'triton'}.jit")
                    if alias.name == "triton.language":
                        self.language.add(alias.asname or "triton.language")
            elif isinstance(node, ast.ImportFrom) and node.module == "triton":
                for alias in node.names:
                    if alias.name == "jit":
                        self.jit.add(alias.asname or "jit")
                    if alias.name == "language":
                        self.language.add(alias.asname or "language")

    def is_jit(self, decorator: ast.expr) -> bool:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        return _dotted(target) in self.jit


def _literal_kwargs(decorator: ast.expr) -> str:
    """``(do_not_specialize=[...])`` of a ``@triton.jit(...)`` call, literal keywords only."""
    if not isinstance(decorator, ast.Call):
        return ""
    kept = []
    for keyword in decorator.keywords:
        if keyword.arg is None:
            continue
        try:
            ast.literal_eval(keyword.value)
        except ValueError:
            continue
        kept.append(f"{keyword.arg}={ast.unparse(keyword.value)}")
    return f"({', '.join(kept)})" if kept else ""


def _plain(node: ast.AST, known: set[str], modules: set[str]) -> bool:
    """Whether a constant's value is a plain expression (no candidate function)."""
    if isinstance(node, ast.Constant):
        return True
    if isinstance(node, ast.Name):
        return node.id in known or node.id in modules
    if isinstance(node, ast.Attribute):
        root = _dotted(node)
        return root is not None and root.split(".")[0] in modules
    if isinstance(node, (ast.Tuple, ast.List)):
        return all(_plain(e, known, modules) for e in node.elts)
    if isinstance(node, ast.UnaryOp):
        return _plain(node.operand, known, modules)
    if isinstance(node, ast.BinOp):
        return _plain(node.left, known, modules) and _plain(node.right, known, modules)
    if isinstance(node, ast.BoolOp):
        return all(_plain(v, known, modules) for v in node.values)
    if isinstance(node, ast.Compare):
        return _plain(node.left, known, modules) and all(
            _plain(c, known, modules) for c in node.comparators)
    if isinstance(node, ast.IfExp):
        return all(_plain(n, known, modules) for n in (node.test, node.body, node.orelse))
    if isinstance(node, ast.Call):
        target = _dotted(node.func)
        return (target is not None and target.split(".")[0] in modules
                and not node.keywords
                and all(_plain(a, known, modules) for a in node.args))
    return False


def kernel_module(source: str) -> KernelModule:
    """The module of the candidate's kernels (see the module doc).

    Raises:
        SyntaxError: the candidate does not parse (the static check reports it first).
    """
    tree = ast.parse(source)
    lines = source.splitlines()
    out = [""] * len(lines)
    names = _Names(tree)
    modules: set[str] = set()
    known: set[str] = set()
    result = KernelModule(source="")

    def keep(node: ast.stmt, first: int | None = None) -> None:
        start = (first if first is not None else node.lineno) - 1
        for i in range(start, node.end_lineno):
            out[i] = lines[i]

    for node in tree.body:
        if isinstance(node, ast.Import):
            if all(a.name.split(".")[0] in _IMPORT_ROOTS for a in node.names):
                keep(node)
                for alias in node.names:
                    modules.add((alias.asname or alias.name).split(".")[0])
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0 and node.module and node.module.split(".")[0] in _IMPORT_ROOTS \
                    and not any(a.name == "*" for a in node.names):
                keep(node)
                for alias in node.names:
                    modules.add(alias.asname or alias.name)
        elif isinstance(node, ast.FunctionDef):
            jit = [d for d in node.decorator_list if names.is_jit(d)]
            if not jit:
                continue
            if node.decorator_list and node.lineno - 1 < 1:
                result.dropped[node.name] = "no line for its decorator"
                continue
            keep(node)
            out[node.lineno - 2] = _JIT + _literal_kwargs(jit[0])
            result.kernels.append(node.name)
            result.constexpr_params[node.name] = {
                a.arg for a in node.args.args + node.args.kwonlyargs
                if a.annotation is not None and "constexpr" in ast.unparse(a.annotation)}
            known.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            value = node.value
            if value is None or not all(isinstance(t, ast.Name) for t in targets):
                continue
            if _plain(value, known, modules):
                keep(node)
                known.update(t.id for t in targets)
    result.source = "\n".join(out) + ("\n" if source.endswith("\n") else "")
    return result
