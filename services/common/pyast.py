"""Python source to an :mod:`ast` tree, one thread of this process at a time.

CPython 3.11 counts how deep it is while it turns a parsed tree into :mod:`ast`
objects in state that all of the interpreter's threads share, and checks on the way
out that the count is back where it started. Building those objects can run the
garbage collector, which can run Python code and hand the GIL to another thread; if
that thread is parsing too, both change the one count and a parse raises
``SystemError: AST constructor recursion depth mismatch`` (the error of CPython issue
gh-106905, reported from threaded programs). The worker checks one candidate in a
thread while its event loop parses another's kernels, so every parse of source in
the services goes through :func:`parse`.
"""

from __future__ import annotations

import ast
import threading
from typing import Literal

# Re-entrant: a parse that runs the garbage collector, whose callbacks parse, waits on
# nothing but itself.
_LOCK = threading.RLock()


def parse(source: str, filename: str = "<unknown>",
          mode: Literal["exec", "eval"] = "exec") -> ast.Module | ast.Expression:
    """:func:`ast.parse` of ``source`` under this process's parse lock.

    Args:
        source: Python source text.
        filename: shown in a :class:`SyntaxError`.
        mode: ``"exec"`` (a module, :class:`ast.Module`) or ``"eval"`` (one
            expression, :class:`ast.Expression`).

    Raises:
        SyntaxError: the source does not parse.
        ValueError: it holds a NUL byte (Python 3.11).
        RecursionError: it nests deeper than the parser or the tree builder allows.
        MemoryError: the parser ran out of memory.
    """
    with _LOCK:
        return ast.parse(source, filename, mode)
