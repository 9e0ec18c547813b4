"""What each package may know of the others, read from the source (ast, imports inside
functions included): the sandbox imports neither the worker nor the generator and
names none of their roles; no module imports a private name of another package."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ROOT / "services"
SANDBOX = SERVICES / "sandbox"


def _modules(base: Path) -> Iterator[tuple[str, ast.Module]]:
    """(dotted name, parsed source) of every module under ``base``."""
    for path in sorted(base.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        yield ".".join(parts), ast.parse(path.read_text(encoding="utf-8"), str(path))


def _imports(module: str, tree: ast.Module, is_package: bool) -> Iterator[tuple[str, str | None]]:
    """(module imported from, name imported or None) of every import in ``tree``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, None
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")
                anchor = anchor[:len(anchor) - node.level + (1 if is_package else 0)]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                yield base, alias.name


def _unit(module: str) -> str:
    """The package a module belongs to for these rules: ``services.<package>``, or the
    module itself for a module directly under ``services/`` (``services.stack``)."""
    return ".".join(module.split(".")[:2])


def _is_package(module: str) -> bool:
    return (ROOT.joinpath(*module.split(".")) / "__init__.py").exists()


def test_the_sandbox_imports_neither_the_worker_nor_the_generator():
    found = []
    for module, tree in _modules(SANDBOX):
        for source, name in _imports(module, tree, _is_package(module)):
            full = f"{source}.{name}" if name else source
            if full.startswith(("services.worker", "services.generator")) or (
                    source == "services" and name in ("worker", "generator")):
                found.append(f"{module} imports {full}")
    assert found == []


def _owner_roles() -> set[str]:
    """The roles registered by the sandbox's users (runners outside services.sandbox)."""
    import services.generator.coders.lowering_role  # noqa: F401 - registers its role
    import services.worker.wire  # noqa: F401 - registers the worker's roles
    from services.sandbox import roles

    return {role for role in roles.registered()
            if not roles.runner_of(role).startswith("services.sandbox.")}


def test_the_sandbox_names_no_role_of_its_users():
    """No string in the sandbox's source is one of the roles its users register, or a
    setting of one of their rows (``sandbox_<role>_...``): the registration says it."""
    owned = _owner_roles()
    assert {"reference", "candidate", "replay", "compile", "lower"} <= owned
    found = []
    for module, tree in _modules(SANDBOX):
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Constant) and isinstance(node.value, str)):
                continue
            for role in owned:
                if node.value == role or f"sandbox_{role}_" in node.value:
                    found.append(f"{module} line {node.lineno}: {node.value[:60]!r}")
    assert found == []


def _private_imports() -> list[str]:
    """``<module> imports <private parts> from <source>`` for every import of a private
    name, or through a private module, of another unit."""
    found = []
    for module, tree in _modules(SERVICES):
        unit = _unit(module)
        for source, name in _imports(module, tree, _is_package(module)):
            if not source.startswith("services.") or _unit(source) == unit:
                continue
            private = [p for p in source.split(".")[2:] if p.startswith("_")]
            if name is not None and name.startswith("_") and not name.startswith("__"):
                private.append(name)
            if private:
                found.append(f"{module} imports {', '.join(private)} from {source}")
    return found


def test_no_module_imports_a_private_name_of_another_package():
    """``services.<package>`` (sandbox, worker, generator, gateway, common, sdk, cli) and
    each module directly under ``services/`` are units: a name with a leading
    underscore, or a module path through one, stays inside its unit."""
    assert _private_imports() == []
