"""Rules on what a candidate imports and which modules it names (S009, S020; S023 and
the ``os``/``sys`` names of ``from ... import``, through their families' modules).

A candidate may import torch, triton, math and the like; it may not import the
modules that start threads or processes, load native code, handle signals, use the
network or files, or import dynamically (S009), nor the task's module or the
harness's own (S020): the child loads the task as :data:`TASK_MODULE` and runs the
harness as ``__main__``.
"""

from __future__ import annotations

import ast
from typing import TYPE_CHECKING

from services.worker.static_check import system, tensor_internals

if TYPE_CHECKING:
    from services.worker.static_check.checker import Checker

# Modules whose import alone is rejected: concurrency, native code, signals,
# networking, dynamic import, process/file-system control, serialisation that runs code.
FORBIDDEN_MODULES = frozenset({
    "threading", "_thread", "multiprocessing", "subprocess", "concurrent", "asyncio",
    "ctypes", "cffi", "signal", "socket", "ssl", "http", "urllib", "requests", "pty",
    "importlib", "builtins", "mmap", "resource", "shutil", "tempfile", "pathlib", "pickle",
    "marshal", "dill", "sched", "selectors",
})
# The task's module and the harness's own (S020).
HARNESS_MODULES = frozenset({"aikg_task", "__main__", "services", "schemas"})
TASK_MODULE = "aikg_task"


def check_import(ctx: Checker, node: ast.Import | ast.ImportFrom) -> None:
    """``import m`` / ``from m import n``: forbidden modules (S009), the task's or the
    harness's modules (S020), torch's dispatch internals (S023), and forbidden ``os``
    and ``sys`` names (S010, S011, S014)."""
    if isinstance(node, ast.Import):
        modules = [a.name for a in node.names]
    else:
        modules = [node.module or ""]
        system.check_from_import(ctx, node)
    for module in modules:
        root = module.split(".")[0]
        tensor_internals.check_import(ctx, node, module)
        if root in HARNESS_MODULES:
            what = ("the task's module (the reference the candidate is checked against)"
                    if root == TASK_MODULE else "a module of the verification harness")
            ctx.add(node.lineno, f"import of {module} is not allowed: it is {what}; a "
                    "candidate must compute its output itself", "S020")
        if root in FORBIDDEN_MODULES:
            ctx.add(node.lineno, f"import of {module} is not allowed (candidates must "
                    "not start threads or processes, load native code, handle signals, "
                    "use the network or files, or import dynamically)", "S009")


def check_task_name(ctx: Checker, node: ast.Constant) -> None:
    """The task's module name as a literal (``sys.modules["aikg_task"]``, a computed
    import): S020."""
    if node.value == TASK_MODULE:
        ctx.add(node.lineno, f"the task's module name {TASK_MODULE!r} used (a "
                "candidate must compute its output, not reach the reference it is "
                "checked against)", "S020")
