"""AST helpers the static rules share: import aliases, dotted names, literals, bodies.

Nothing here reports a finding; the rule modules and the checker
(:mod:`services.worker.static_check.checker`) build on these.
"""

from __future__ import annotations

import ast
from typing import Any


class Aliases(ast.NodeVisitor):
    """Map local names to the dotted module paths they stand for (``F`` -> torch.nn.functional)."""

    def __init__(self) -> None:
        self.names: dict[str, str] = {}

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.asname:
                self.names[alias.asname] = alias.name
            else:
                root = alias.name.split(".")[0]
                self.names[root] = root

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.module and not node.level:
            for alias in node.names:
                self.names[alias.asname or alias.name] = f"{node.module}.{alias.name}"


def literal_str(node: ast.AST | None) -> str | None:
    """The value of a string literal, else None."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    return None


def literal_getattr(node: ast.AST) -> tuple[ast.AST, str] | None:
    """``getattr(obj, "name")`` with a literal name: ``(obj, "name")``, else None."""
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id == "getattr" and len(node.args) >= 2):
        name = literal_str(node.args[1])
        if name is not None:
            return node.args[0], name
    return None


def qualname(node: ast.AST, aliases: dict[str, str]) -> str | None:
    """Dotted name of ``node`` with import aliases resolved (``F.relu`` -> ``torch.nn.functional.relu``);
    ``getattr(torch, "relu")`` with a literal name is ``torch.relu``."""
    if isinstance(node, ast.Name):
        return aliases.get(node.id, node.id)
    if isinstance(node, ast.Attribute):
        base = qualname(node.value, aliases)
        return f"{base}.{node.attr}" if base else None
    literal = literal_getattr(node)
    if literal is not None:
        base = qualname(literal[0], aliases)
        return f"{base}.{literal[1]}" if base else None
    return None


def methods(cls: ast.ClassDef) -> dict[str, ast.AST]:
    """The functions defined directly in a class body: name -> node."""
    return {n.name: n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def walk_body(func: ast.AST, skip: Any = None):
    """Nodes of a function (or lambda) body, not descending into nested functions or
    classes; ``skip(node)`` names child statements not to descend into."""
    body = getattr(func, "body", [])
    stack = list(body) if isinstance(body, list) else [body]
    while stack:
        node = stack.pop()
        yield node
        skipped = skip(node) if skip is not None else ()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            if any(child is s for s in skipped):
                continue
            stack.append(child)
