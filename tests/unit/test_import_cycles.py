"""No import cycle between the modules of ``services/`` at run time.

The graph is read from each module's source (``ast``), not by importing it: an edge
``a -> b`` for every ``import b`` / ``from b import x`` / ``from b import module`` that
runs when ``a`` is imported or when one of its functions is called, so an import placed
inside a function to break a cycle is still the cycle it breaks. Imports under
``if TYPE_CHECKING:`` never run and are left out; so is the implicit import of a
module's parent packages (``import a.b.c`` runs ``a/b/__init__.py`` first, which is
where a package chooses what to re-export, not a dependency of ``c``).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "services"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted((ROOT / PACKAGE).rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement that can run, at any depth, except TYPE_CHECKING blocks."""
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def _targets(name: str, path: Path, node: ast.Import | ast.ImportFrom,
             modules: dict[str, Path]) -> set[str]:
    """The modules of ``services`` that ``node`` (in module ``name``) imports."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names if alias.name in modules}
    if node.level:
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        base = f"{package}.{node.module}" if node.module else package
    else:
        base = node.module or ""
    out: set[str] = set()
    for alias in node.names:
        sub = f"{base}.{alias.name}"
        if sub in modules:
            out.add(sub)  # from package import module
        elif base in modules:
            out.add(base)
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of ``services`` it imports at run time (itself excluded)."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        edges: set[str] = set()
        for node in _imports(tree):
            edges |= _targets(name, path, node, modules)
        graph[name] = edges - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        # iterative Tarjan: (node, iterator over its successors)
        work: list[tuple[str, Iterator[str]]] = []
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        work.append((root, iter(sorted(graph[root]))))
        while work:
            node, successors = work[-1]
            advanced = False
            for nxt in successors:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    advanced = True
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def test_graph_sees_function_level_imports() -> None:
    tree = ast.parse("import os\nif TYPE_CHECKING:\n    import services.a\n"
                     "def f():\n    from services import b\n    from services.c import d\n")
    modules = {"services": Path("services/__init__.py"), "services.b": Path("b.py"),
               "services.c": Path("c.py")}
    targets: set[str] = set()
    for node in _imports(tree):
        targets |= _targets("services.x", Path("x.py"), node, modules)
    assert targets == {"services.b", "services.c"}
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycle_in_services() -> None:
    found = cycles(import_graph())
    assert not found, "import cycles between modules of services/ (each a strongly " \
        "connected component):\n" + "\n".join(" <-> ".join(c) for c in found)
