"""A task's source and its shape overrides, checked without running the task: the one
place that says what is wrong with either, in one message per mistake.

Every door a task comes in by checks it here before any work: the gateway's submit
(400), the generator's admission of a job published straight on ``jobs.submit`` (the
job fails), the SDK's ``Task`` and ``build_request``, and ``aikg submit`` / ``run`` /
``verify`` / ``demo`` (exit 2, the message after the file's name). ``aikg``'s
``--shape NAME=VALUE`` is read by :func:`parse_shape`. The task's code is not trusted
here: everything is read with :mod:`ast`; what only running it shows (its module code
raising, a ``get_inputs()`` that fails) is the sandboxed lowering's and reference's to
report.

The format is KernelBench's: a module defining ``class Model``, ``get_inputs()`` and
``get_init_inputs()``; a shape override rebinds a name the module assigns at top level
(``batch_size = 16``) before ``get_init_inputs()`` and ``get_inputs()`` run.
"""

from __future__ import annotations

import ast
from collections.abc import Mapping
from typing import Literal

import msgspec

from schemas.events import ShapeValue
from services.common.pyast import parse

REQUIRED_TASK_NAMES = ("Model", "get_inputs", "get_init_inputs")

# A ``--shape`` value as :func:`parse_shape` returns it.
ShapeOverride = int | float | bool | str | tuple[int, ...]


class TaskError(ValueError):
    """The task or its shape overrides cannot be used; the message says why and what
    to do.

    Attributes:
        field: the request field at fault: ``task_desc`` or ``shape_overrides``.
    """

    def __init__(self, message: str, field: Literal["task_desc", "shape_overrides"]
                 = "task_desc") -> None:
        super().__init__(message)
        self.field = field


def check_task(task_desc: str, shape_overrides: Mapping[str, object] | None = None) -> None:
    """:func:`check_task_source`, then :func:`check_shape_overrides`: every static
    check a task gets before any work.

    Raises:
        TaskError: the first mistake found (``field`` says which input).
    """
    check_task_source(task_desc)
    check_shape_overrides(task_desc, shape_overrides)


def check_task_source(task_desc: str) -> None:
    """The task parses as Python and defines ``Model``, ``get_inputs`` and
    ``get_init_inputs`` at module level (by ``def``, ``class`` or assignment).

    Raises:
        TaskError: a syntax error (with its line), source the parser refuses (a NUL
            byte, nesting too deep), or the names missing.
    """
    tree = _parse(task_desc)
    defined = {node.name for node in tree.body
               if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)}
    defined |= {t.id for node in tree.body if isinstance(node, ast.Assign)
                for t in node.targets if isinstance(t, ast.Name)}
    missing = [n for n in REQUIRED_TASK_NAMES if n not in defined]
    if missing:
        raise TaskError("the task must define class Model, get_inputs() and "
                        f"get_init_inputs() (KernelBench format); missing: {', '.join(missing)}")


def check_shape_overrides(task_desc: str, shape_overrides: Mapping[str, object] | None) -> None:
    """Every ``shape_overrides`` name is one the task assigns at top level
    (:func:`task_module_names`). Source that does not parse is not judged here:
    :func:`check_task_source` says what is wrong with it.

    Raises:
        TaskError: ``field`` ``shape_overrides``; the message
            (:func:`unknown_overrides_message`) lists the names the task assigns.
    """
    if not shape_overrides:
        return
    try:
        assigned = task_module_names(task_desc)
    except TaskError:
        return
    unknown = [name for name in shape_overrides if name not in assigned]
    if unknown:
        raise TaskError(unknown_overrides_message(unknown, assigned), "shape_overrides")


def unknown_overrides_message(unknown: list[str], assigned: list[str]) -> str:
    """The message for shape overrides naming what the task does not assign; also the
    sandboxed lowering's, which finds them by running the task."""
    names = ", ".join(map(repr, unknown))
    return (f"shape_overrides name{'s' if len(unknown) > 1 else ''} {names}, which the task "
            f"does not assign at top level; it assigns: {', '.join(assigned) or '(none)'}")


def task_module_names(task_desc: str) -> list[str]:
    """Names a task's module binds by assignment at top level, in source order.

    Found with :mod:`ast`, without running the task: targets of ``=``, ``+=`` and
    annotated assignments, also inside top-level ``if``, ``try``, ``for`` and ``with``
    blocks, never inside functions or classes.

    Raises:
        TaskError: the task does not parse (as :func:`check_task_source`).
    """
    names: dict[str, None] = {}

    def targets(node: ast.AST) -> None:
        if isinstance(node, ast.Name):
            names[node.id] = None
        elif isinstance(node, ast.Tuple | ast.List):
            for element in node.elts:
                targets(element)
        elif isinstance(node, ast.Starred):
            targets(node.value)

    def visit(body: list[ast.stmt]) -> None:
        for stmt in body:
            if isinstance(stmt, ast.Assign):
                for target in stmt.targets:
                    targets(target)
            elif isinstance(stmt, ast.AugAssign | ast.AnnAssign):
                targets(stmt.target)
            elif isinstance(stmt, ast.For | ast.AsyncFor):
                targets(stmt.target)
            elif isinstance(stmt, ast.With | ast.AsyncWith):
                for withitem in stmt.items:
                    if withitem.optional_vars is not None:
                        targets(withitem.optional_vars)
            for field_name in ("body", "orelse", "finalbody"):
                if not isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                    visit(getattr(stmt, field_name, []) or [])
            for handler in getattr(stmt, "handlers", []):
                visit(handler.body)

    visit(_parse(task_desc).body)
    return list(names)


def parse_shape(item: str) -> tuple[str, ShapeOverride]:
    """``NAME=VALUE`` (``aikg --shape``) -> ``(NAME, VALUE)``.

    VALUE is read as a Python literal (:func:`ast.literal_eval`): an int (``16``), a
    float (``1e-5``), a bool (``True``; ``true``/``false`` also accepted), a quoted
    string, or a tuple or list of ints (``(64,)``, ``[8, 8]``), returned as a tuple;
    text that is not a literal is kept as a string (``mode=fast``). These are the
    values a job's ``shape_overrides`` carries, within the same bounds
    (``schemas.events.ShapeValue``: ints in [0, 2**31), ...).

    Raises:
        ValueError: no ``=``, an empty name, a literal of another kind (a tuple of
            floats, a dict, None, ...), or a value out of bounds.
    """
    name, sep, text = item.partition("=")
    name = name.strip()
    if not sep or not name:
        raise ValueError(f"{item!r}: expected NAME=VALUE, e.g. batch_size=16")
    text = text.strip()
    if text.lower() in ("true", "false"):
        return name, text.lower() == "true"
    try:
        value = ast.literal_eval(parse(text, mode="eval"))
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return name, text  # not a Python literal: a bare word such as mode=fast
    if isinstance(value, int | float | bool | str) or (isinstance(value, tuple | list) and all(
            isinstance(v, int) and not isinstance(v, bool) for v in value)):
        try:
            msgspec.convert(list(value) if isinstance(value, tuple | list) else value,
                            ShapeValue, strict=True)
        except msgspec.ValidationError as exc:
            raise ValueError(f"{item!r}: {exc}") from None
        return name, tuple(value) if isinstance(value, tuple | list) else value
    raise ValueError(
        f"{item!r}: VALUE must be an int, a float, true/false, a string or a tuple of "
        f"ints such as (64,), not {type(value).__name__} {text}")


def _parse(task_desc: str) -> ast.Module:
    try:
        return parse(task_desc)
    except SyntaxError as exc:
        where = f"line {exc.lineno}: " if exc.lineno else ""  # a NUL byte has no line
        raise TaskError(f"the task is not valid Python: {where}{exc.msg}") from exc
    except (ValueError, RecursionError, MemoryError) as exc:
        # Older parsers refuse NUL bytes with ValueError, and very deep nesting may
        # raise RecursionError: the task is unusable either way.
        raise TaskError(f"the task cannot be parsed as Python: "
                        f"{type(exc).__name__}: {exc}") from exc
