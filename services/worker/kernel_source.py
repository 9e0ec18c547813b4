"""The candidate's kernels and nothing else: the module the replayer and the GPU
compile check load.

:func:`kernel_module` keeps, from the candidate's source, its module-level
``@triton.jit`` functions (``@triton.autotune`` / ``@triton.heuristics`` dropped: the
plan records what they chose), imports of ``triton``, ``triton.language`` (and its
``extra`` libraries) and ``math``, and module-level constants whose values are plain
expressions (literals, arithmetic, ``tl.constexpr(...)``, ``triton.cdiv``,
``math`` functions, other kept names). Every other line is blanked, so line numbers
(and the file name, ``candidate.py``) stay those of the candidate: a kernel's error
points at the line the coder wrote. Loading the result runs no candidate code but
decorators and those constants.

The replayer runs kernels in Triton's interpreter, where a kernel body is Python; the
GPU compile check compiles the same source. So that both see the same code, each
kept kernel (body, defaults and annotations) may name only its parameters and
locals, other kept names (kernels, constants, the allowed imports), a few builtins
the Triton compiler knows (:data:`KERNEL_BUILTINS`), and may not reach, through any
attribute, the runtime's state or the interpreter's internals
(:data:`FORBIDDEN_ATTRIBUTES`, anything starting with ``_``): a kernel that reads
``triton.knobs.runtime.interpret`` could branch to host code that only the
interpreter runs. What breaks this is in :attr:`KernelModule.refused` (stage
``compile``, rule D013).
"""

from __future__ import annotations

import ast
import hashlib
import re
from dataclasses import dataclass, field

from services.common.pyast import parse

# What ``from triton import ...`` may bring into a kernel module.
_FROM_TRITON = frozenset({"jit", "language", "cdiv", "next_power_of_2", "constexpr"})
# Attributes no kernel or constant may reach: the runtime's state (whose values differ
# between the interpreter and the GPU compiler), the interpreter's tensors
# (``tensor.handle`` holds its numpy array), triton.language's internals, Python's
# builtins module, and the target queries whose answers differ between the two.
FORBIDDEN_ATTRIBUTES = frozenset({
    "knobs", "runtime", "interpreter", "compiler", "backends", "tools", "testing",
    "handle", "core", "semantic", "builtins", "target_info", "driver", "os", "sys",
    "importlib"})
# Builtins a kernel body may call (what Triton's code generator accepts).
KERNEL_BUILTINS = frozenset({"range", "min", "max", "len", "int", "float", "bool", "abs",
                             "print", "isinstance", "tuple", "zip", "enumerate", "True",
                             "False", "None"})
# Builtins a module-level constant may call.
_CONSTANT_BUILTINS = frozenset({"int", "float", "bool", "min", "max", "abs", "round"})
# The decorator written in place of a kernel's own (PEP 614 expression): it does not
# depend on how the candidate imported triton.
_JIT = '@__import__("triton").jit'


@dataclass
class KernelModule:
    """``source`` (same line count as the candidate's), the kernel names kept, the
    names of functions that look like kernels but were dropped, with why, each
    kernel's ``tl.constexpr`` parameters, and ``refused``: why a kept kernel may not
    run (it names what the GPU compiler and the interpreter see differently), one
    message per finding."""

    source: str
    kernels: list[str] = field(default_factory=list)
    dropped: dict[str, str] = field(default_factory=dict)
    constexpr_params: dict[str, set[str]] = field(default_factory=dict)
    refused: list[str] = field(default_factory=list)
    def_lines: dict[str, int] = field(default_factory=dict)
    # kernel -> digest of its definition with its own name blanked: kernels of one module
    # whose digests match compile alike (the same globals), so one compile serves all
    bodies: dict[str, str] = field(default_factory=dict)

    def file_line(self, kernel: str, message: str) -> str:
        """``message`` (a Triton compile error) with its ``at L:C:`` position, which
        counts from the kernel's ``def`` line, as ``at candidate.py line N:``."""
        first = self.def_lines.get(kernel)
        if first is None:
            return message
        return re.sub(r"\bat (\d+):(\d+):",
                      lambda m: f"at candidate.py line {first + int(m.group(1)) - 1}:",
                      message, count=1)


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


def _chain_ok(chain: str, roots: dict[str, str]) -> bool:
    """Whether a dotted name (``tl.float16``, ``triton.cdiv``, ``math.pi``) reaches only
    what a kernel may: ``roots`` maps each kept module-level import name to what it
    imports (``"triton"``, ``"triton.language"``, ``"math"``, a triton.language name)."""
    parts = chain.split(".")
    if any(p.startswith("_") or p in FORBIDDEN_ATTRIBUTES for p in parts):
        return False
    origin = roots.get(parts[0])
    if origin is None:
        return False
    if origin == "triton" and len(parts) > 1:
        return parts[1] in _FROM_TRITON
    return True


def _plain(node: ast.AST, known: set[str], roots: dict[str, str]) -> bool:
    """Whether a constant's value is a plain expression: literals, arithmetic, kept
    names, allowed attribute reads and calls of ``tl.constexpr``, ``triton.cdiv`` /
    ``next_power_of_2``, ``math`` functions and a few numeric builtins."""
    def plain(n: ast.AST) -> bool:
        return _plain(n, known, roots)

    if isinstance(node, ast.Constant):
        return True
    if isinstance(node, ast.Name):
        return node.id in known or node.id in roots
    if isinstance(node, ast.Attribute):
        chain = _dotted(node)
        return chain is not None and _chain_ok(chain, roots)
    if isinstance(node, (ast.Tuple, ast.List)):
        return all(plain(e) for e in node.elts)
    if isinstance(node, ast.UnaryOp):
        return plain(node.operand)
    if isinstance(node, ast.BinOp):
        return plain(node.left) and plain(node.right)
    if isinstance(node, ast.BoolOp):
        return all(plain(v) for v in node.values)
    if isinstance(node, ast.Compare):
        return plain(node.left) and all(plain(c) for c in node.comparators)
    if isinstance(node, ast.IfExp):
        return all(plain(n) for n in (node.test, node.body, node.orelse))
    if isinstance(node, ast.Call):
        target = _dotted(node.func)
        if target is None or node.keywords or not all(plain(a) for a in node.args):
            return False
        if target in _CONSTANT_BUILTINS:
            return True
        if not _chain_ok(target, roots):
            return False
        origin = roots[target.split(".")[0]]
        last = target.rsplit(".", 1)[-1]
        return (origin == "math" or last in ("constexpr", "cdiv", "next_power_of_2")
                or (origin in ("triton", "triton.language") and last == "constexpr"))
    return False


def _import_origins(node: ast.stmt) -> tuple[dict[str, str], ast.stmt] | None:
    """The names a module-level import brings into a kernel module, each with what it
    imports, and the import of those names alone (``import torch, triton.language as tl``
    keeps ``tl``: the other names are left out, as every other module is); None when it
    imports nothing a kernel module may hold."""
    names: dict[str, str] = {}
    kept: list[ast.alias] = []
    if isinstance(node, ast.Import):
        for alias in node.names:
            if alias.name == "math":
                names[alias.asname or "math"] = "math"
            elif alias.name == "triton" or alias.name == "triton.language" \
                    or alias.name.startswith("triton.language.extra"):
                if alias.asname:
                    names[alias.asname] = alias.name
                else:
                    names["triton"] = "triton"
            else:
                continue
            kept.append(alias)
        return (names, ast.Import(names=kept)) if kept else None
    if not isinstance(node, ast.ImportFrom) or node.level != 0 or not node.module:
        return None
    for alias in node.names:
        name = alias.name
        if name == "*" or name.startswith("_") or name in FORBIDDEN_ATTRIBUTES:
            continue
        if node.module == "math":
            names[alias.asname or name] = "math"
        elif node.module == "triton" and name in _FROM_TRITON:
            names[alias.asname or name] = "triton.language" if name == "language" \
                else f"triton.{name}"
        elif node.module == "triton.language" or node.module.startswith(
                "triton.language.extra"):
            names[alias.asname or name] = f"{node.module}.{name}"
        else:
            continue
        kept.append(alias)
    return (names, ast.ImportFrom(module=node.module, names=kept, level=0)) if kept else None


def _kernel_refusals(fn: ast.FunctionDef, kept: set[str], roots: dict[str, str],
                     not_plain: dict[str, str]) -> list[str]:
    """What kernel ``fn`` names that the interpreter and the GPU compiler would see
    differently (see the module doc), one message each; ``not_plain``: module-level
    names whose values were not kept, with their source."""
    local = {a.arg for a in fn.args.args + fn.args.kwonlyargs + fn.args.posonlyargs}
    for extra in (fn.args.vararg, fn.args.kwarg):
        if extra is not None:
            local.add(extra.arg)
    for node in ast.walk(fn):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            local.add(node.id)
    found: list[str] = []

    def refuse(node: ast.AST, what: str) -> None:
        message = (f"the Triton kernel {fn.name} {what} (candidate.py line "
                   f"{getattr(node, 'lineno', fn.lineno)}): a kernel may use only "
                   "triton.language, math, its parameters and locals, other @triton.jit "
                   "functions and plain module-level constants, so that the GPU compiles "
                   "the code the interpreter runs")
        if message not in found:
            found.append(message)

    nodes = [*fn.body, *fn.args.defaults, *(d for d in fn.args.kw_defaults if d is not None),
             *(a.annotation for a in fn.args.args + fn.args.kwonlyargs if a.annotation)]
    for top in nodes:
        for node in ast.walk(top):
            if isinstance(node, (ast.Lambda, ast.FunctionDef, ast.AsyncFunctionDef,
                                 ast.ClassDef, ast.Import, ast.ImportFrom, ast.Global,
                                 ast.Nonlocal)):
                refuse(node, f"contains a {type(node).__name__} statement")
            elif isinstance(node, ast.Attribute):
                if node.attr.startswith("_") or node.attr in FORBIDDEN_ATTRIBUTES:
                    refuse(node, f"reads the attribute {node.attr!r}")
                chain = _dotted(node)
                root = chain.split(".")[0] if chain else None
                if root is not None and root not in local and root in roots \
                        and not _chain_ok(chain, roots):
                    refuse(node, f"reaches {chain}")
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
                if node.id in local or node.id in kept or node.id in roots \
                        or node.id in KERNEL_BUILTINS:
                    continue
                if node.id in not_plain:
                    refuse(node, f"uses the module-level name {node.id!r}, whose value "
                           f"({not_plain[node.id]}) is not a plain constant")
                else:
                    refuse(node, f"uses the name {node.id!r}, which is not a parameter, a "
                           "local, a kept module-level name or a builtin Triton compiles")
    return found


def kernel_module(source: str) -> KernelModule:
    """The module of the candidate's kernels (see the module doc).

    Raises:
        SyntaxError: the candidate does not parse (the static check reports it first).
    """
    tree = parse(source)
    lines = source.splitlines()
    out = [""] * len(lines)
    names = _Names(tree)
    roots: dict[str, str] = {}
    known: set[str] = set()
    not_plain: dict[str, str] = {}
    kernels: list[ast.FunctionDef] = []
    result = KernelModule(source="")

    def keep(node: ast.stmt, first: int | None = None) -> None:
        start = (first if first is not None else node.lineno) - 1
        for i in range(start, node.end_lineno):
            out[i] = lines[i]

    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found = _import_origins(node)
            if found is not None:
                origins, kept = found
                # The kept names alone, on the statement's first line (line numbers stay).
                out[node.lineno - 1] = ast.unparse(kept)
                roots.update(origins)
        elif isinstance(node, ast.FunctionDef):
            jit = [d for d in node.decorator_list if names.is_jit(d)]
            if not jit:
                continue
            if node.decorator_list and node.lineno - 1 < 1:
                result.dropped[node.name] = "no line for its decorator"
                continue
            keep(node)
            out[node.lineno - 2] = _JIT + _literal_kwargs(jit[0])
            kernels.append(node)
            result.kernels.append(node.name)
            result.def_lines[node.name] = node.lineno
            result.bodies[node.name] = hashlib.sha256(
                ast.dump(ast.FunctionDef(**{**vars(node), "name": "_"})).encode()).hexdigest()[:32]
            result.constexpr_params[node.name] = {
                a.arg for a in node.args.args + node.args.kwonlyargs
                if a.annotation is not None and "constexpr" in ast.unparse(a.annotation)}
            known.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            value = node.value
            if value is None or not all(isinstance(t, ast.Name) for t in targets):
                continue
            if _plain(value, known, roots):
                keep(node)
                known.update(t.id for t in targets)
                for t in targets:
                    not_plain.pop(t.id, None)
            else:
                text = ast.unparse(value)
                for t in targets:
                    not_plain[t.id] = text if len(text) <= 80 else text[:77] + "..."
                    known.discard(t.id)
    for fn in kernels:
        result.refused += _kernel_refusals(fn, known, roots, not_plain)
    result.source = "\n".join(out) + ("\n" if source.endswith("\n") else "")
    return result
