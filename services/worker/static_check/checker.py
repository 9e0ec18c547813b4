"""The static check's core: one walk over a candidate's AST, the rule modules applied
to each node, and :func:`check_candidate`.

:class:`Checker` resolves import aliases and the simple rebindings that hide a
library or a watched function behind another name (``cuda = torch.cuda``, ``f =
torch.relu``, ``self.act = F.relu``, ``OPS = {"r": torch.relu}``), so every rule
module sees through them; it records findings by rule id (:data:`RULES`), once per
line and message. :meth:`Checker.check_module` visits every node of the module once
and hands it to the families' checks in a fixed order;
:func:`services.worker.static_check.model.check_model` then walks ``ModelNew.forward``
and its helpers.
"""

from __future__ import annotations

import ast

from schemas.events import normalize_dsl
from services.common.pyast import parse
from services.worker.static_check import (
    dynamic,
    imports,
    model,
    patching,
    system,
    tensor_internals,
)
from services.worker.static_check.syntax import Aliases, qualname
from services.worker.static_check.table import RULES_BY_ID, Finding


class Checker:
    """The state of one check: the module's tree, its aliases, its findings.

    Attributes:
        tree: the parsed candidate.
        aliases: local name -> the dotted path it stands for (imports, and names bound
            to an attribute of a protected library).
        value_aliases: local name -> the watched function bound to it (``f = torch.relu``).
        attr_aliases: ``self`` or class attribute -> the watched function bound to it.
        tables: local name -> the watched functions a literal dict/list/tuple/set holds.
        callees: ids of the nodes in a call's callee position (``f`` of ``f(x)``); any
            other load of a name uses it as a value.
        findings: what was found so far, in the order found.
    """

    def __init__(self, tree: ast.Module) -> None:
        self.tree = tree
        collector = Aliases()
        collector.visit(tree)
        self.aliases = collector.names
        self.value_aliases: dict[str, str] = {}
        self.attr_aliases: dict[str, str] = {}
        self.tables: dict[str, list[str]] = {}
        self._alias_assignments()
        self.findings: list[Finding] = []
        self._seen: set[tuple[int, str]] = set()
        self.callees = {id(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}

    def _alias_assignments(self) -> None:
        """``cuda = torch.cuda`` or ``fast = time.perf_counter``: follow simple rebinding,
        also by tuple unpacking (``f, g = torch.relu, torch.tanh``), into attributes
        (``self.act = F.relu``) and into tables (``OPS = {"r": torch.relu}``)."""
        for node in ast.walk(self.tree):
            if not isinstance(node, ast.Assign):
                continue
            pairs: list[tuple[ast.AST, ast.AST]] = []
            for target in node.targets:
                if (isinstance(target, ast.Tuple | ast.List) and isinstance(node.value, ast.Tuple | ast.List)
                        and len(target.elts) == len(node.value.elts)):
                    pairs.extend(zip(target.elts, node.value.elts, strict=True))
                else:
                    pairs.append((target, node.value))
            for target, value in pairs:
                name = self.qual(value)
                if isinstance(target, ast.Name):
                    if name and name.split(".")[0] in patching.PROTECTED_ROOTS:
                        self.aliases.setdefault(target.id, name)
                    if name and dynamic.watched_function(name):
                        self.value_aliases.setdefault(target.id, name)
                    held = self._table_functions(value)
                    if held:
                        self.tables.setdefault(target.id, held)
                elif (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
                      and target.value.id == "self" and name and dynamic.watched_function(name)):
                    self.attr_aliases.setdefault(target.attr, name)
        for cls in (n for n in ast.walk(self.tree) if isinstance(n, ast.ClassDef)):
            for stmt in cls.body:
                if isinstance(stmt, ast.Assign):
                    name = self.qual(stmt.value)
                    if name and dynamic.watched_function(name):
                        for target in stmt.targets:
                            if isinstance(target, ast.Name):
                                self.attr_aliases.setdefault(target.id, name)

    def _table_functions(self, node: ast.AST) -> list[str]:
        """Watched functions held by a dict/list/tuple/set literal (one level deep)."""
        if isinstance(node, ast.Dict):
            items = [*node.keys, *node.values]
        elif isinstance(node, ast.List | ast.Tuple | ast.Set):
            items = list(node.elts)
        else:
            return []
        names = [self.qual(item) for item in items if item is not None]
        return [n for n in names if n and dynamic.watched_function(n)]

    def add(self, line: int, message: str, rule_id: str) -> None:
        """Record a finding of rule ``rule_id`` (an id of :data:`RULES`), once per line
        and message.

        Raises:
            KeyError: ``rule_id`` is not in the table.
        """
        if (line, message) not in self._seen:
            self._seen.add((line, message))
            self.findings.append(Finding(line, message, RULES_BY_ID[rule_id].tag, rule_id))

    def qual(self, node: ast.AST) -> str | None:
        """Dotted name of ``node`` with this module's aliases resolved, or None."""
        return qualname(node, self.aliases)

    def check_module(self) -> None:
        """Every node of the module, each rule family in turn (the order fixes which
        finding a node gets where two families could claim it)."""
        # Nodes that are called, or are the base of a longer dotted name: the rest of
        # the names that load a watched function use it as a value (S017, S019).
        called = set(self.callees)
        called |= {id(n.value) for n in ast.walk(self.tree) if isinstance(n, ast.Attribute)}
        for node in ast.walk(self.tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                tensor_internals.check_definition(self, node)
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                imports.check_import(self, node)
            elif isinstance(node, ast.Call):
                self._check_call(node)
                dynamic.check_computed_name(self, node)
            elif isinstance(node, ast.Attribute):
                name = self.qual(node)
                (system.check_attribute(self, node, name)
                 or tensor_internals.check_attribute(self, node, name)
                 or dynamic.check_attribute(self, node))
            elif isinstance(node, ast.Name):
                dynamic.check_builtins_name(self, node)
            elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
                patching.check_patch(self, node)
            elif isinstance(node, ast.Subscript):
                dynamic.check_namespace_subscript(self, node)
            elif isinstance(node, ast.Constant):
                imports.check_task_name(self, node)
            if (isinstance(node, ast.Name | ast.Attribute) and isinstance(node.ctx, ast.Load)
                    and id(node) not in called):
                dynamic.check_value_use(self, node)

    def _check_call(self, node: ast.Call) -> None:
        """A call by dotted name: each family's call rules (their names do not overlap)."""
        name = self.qual(node.func)
        if name is None:
            return
        tensor_internals.check_super_call(self, node, name)
        dynamic.check_builtin_call(self, node, name)
        patching.check_setattr_call(self, node, name)
        system.check_call(self, node, name)


def check_candidate(code: str, dsl: str = "triton") -> list[Finding]:
    """Statically check a candidate's source.

    Args:
        code: the candidate's Python source.
        dsl: the request's DSL (``triton``; ``triton_cuda`` / ``triton_ascend`` accepted).

    Returns:
        Findings sorted by line; empty when the candidate may run. A syntax error is
        a single finding with rule ``syntax`` (the verifier reports it as stage
        ``compile``); every other rule is stage ``static``. Example:
        ``line 12: torch.relu called in ModelNew.forward (torch compute ops are not
        allowed; do the work in a Triton kernel)``.
    """
    if normalize_dsl(dsl) != "triton":
        return [Finding(1, f"dsl {dsl!r} is not supported (this worker verifies triton "
                           "kernels)", "dsl", "S002")]
    try:
        tree = parse(code)
        checker = Checker(tree)
        checker.check_module()
        model.check_model(checker)
    except SyntaxError as exc:
        text = f": {exc.text.strip()}" if exc.text and exc.text.strip() else ""
        return [Finding(exc.lineno or 1, f"SyntaxError: {exc.msg}{text}", "syntax", "S001")]
    except RecursionError:
        # ast.parse, or the walk over its tree, recursed past the limit: what cannot be
        # checked does not run.
        return [Finding(1, "source nested too deeply to check (Python's recursion limit); "
                           "split long expressions into statements", "too-deep", "S024")]
    return sorted(checker.findings, key=lambda f: f.line)
