"""Rules on patching libraries (S015).

A candidate must not assign, delete or ``setattr`` attributes of the libraries a
verdict depends on (:data:`PROTECTED_ROOTS`): replacing ``time.perf_counter``,
``torch.cuda.synchronize`` or a comparison function fakes speed or correctness.
"""

from __future__ import annotations

import ast
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.worker.static_check.checker import Checker

# Roots whose attributes a candidate must not assign, delete or setattr.
PROTECTED_ROOTS = frozenset({"torch", "triton", "time", "timeit", "builtins", "os", "sys",
                             "numpy", "gc", "math", "random", "statistics"})


def check_setattr_call(ctx: Checker, node: ast.Call, name: str) -> None:
    """``setattr(torch, ...)`` / ``delattr(time, ...)`` on a protected root."""
    if name in ("setattr", "delattr") and node.args:
        target = ctx.qual(node.args[0])
        if target and target.split(".")[0] in PROTECTED_ROOTS:
            ctx.add(node.lineno, f"{name}({target}, ...) patches a library (timers and "
                    "torch/triton functions must not be replaced)", "S015")


def check_patch(ctx: Checker, node: ast.Assign | ast.AugAssign | ast.AnnAssign | ast.Delete,
                ) -> None:
    """An assignment or ``del`` whose target is an attribute or item of a protected
    root (``time.perf_counter = ...``, ``del torch.relu``)."""
    if isinstance(node, ast.Assign | ast.Delete):
        targets = node.targets
    else:
        targets = [node.target]
    for target in targets:
        for sub in ast.walk(target):
            if isinstance(sub, (ast.Attribute, ast.Subscript)):
                base = sub.value
                name = ctx.qual(base) if not isinstance(base, ast.Subscript) else None
                if name and name.split(".")[0] in PROTECTED_ROOTS:
                    shown = ctx.qual(sub) if isinstance(sub, ast.Attribute) else name
                    ctx.add(node.lineno, f"assignment to {shown} patches a library "
                            "(timers and torch/triton functions must not be replaced)",
                            "S015")
                    break
