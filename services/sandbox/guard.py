"""The audit hook of the candidate's process, and hiding the harness's modules from it.

Runs inside the sandboxed planner child, so nothing here decides a verdict (the
candidate sees only decoys; the replayer decides): it turns attempts to reach the
harness into refusals the verdict names (stage ``audit``).

:func:`install_audit_hook` adds a PEP 578 hook (``sys.addaudithook``; Python offers no
way to remove one). Until :meth:`AuditHook.strict` it refuses, when the nearest frame
outside the standard library is the candidate's, the events that reach harness
objects or the result channel. From :meth:`AuditHook.strict` on (called before the
candidate first holds inputs) it refuses by *what is asked*, whatever frame asks:
object-graph walks (``gc.get_objects`` / ``get_referrers`` / ``get_referents``), other
threads' frames (``sys._current_frames``), tracing and profiling hooks, ctypes,
sockets and ``/proc``; the harness itself may while it formats a failure
(:meth:`AuditHook.harness`). Reading the current stack (``sys._getframe``, frame and
traceback attributes) and running dynamic code (``exec``, new code and function
objects) stay refused by frame: torch reads stacks of its own (``torch.manual_seed``),
dataclasses and Triton's rewriting run generated code. ``compile`` alone is allowed
(formatting a traceback compiles source lines; a code object does nothing unless run).
"""

from __future__ import annotations

import contextlib
import os
import sys
import sysconfig
import types
from collections.abc import Iterator
from typing import Any

_STDLIB_DIRS = tuple({sysconfig.get_paths()["stdlib"] + os.sep,
                      sysconfig.get_paths()["platstdlib"] + os.sep})
_THIS_FILE = __file__
_HARNESS_DIR = os.path.dirname(os.path.dirname(__file__)) + os.sep

# Refused by frame (the candidate's), before and after strict().
_REFUSED_EVENTS = frozenset({
    "gc.get_objects", "gc.get_referrers", "gc.get_referents", "sys._getframe",
    "sys._current_frames", "sys._current_exceptions", "sys.settrace", "sys.setprofile",
    "object.__getattr__", "object.__setattr__", "object.__delattr__", "code.__new__",
    "function.__new__", "exec", "socket.__new__", "socket.fromfd",
})
# Refused whatever frame asks once strict() was called. Frame access by the calling
# frame stays the rule for sys._getframe and frame attributes: torch's own code reads
# stacks (torch.manual_seed formats one for its lazy device seeding).
_STRICT_EVENTS = frozenset({
    "gc.get_objects", "gc.get_referrers", "gc.get_referents", "sys._current_frames",
    "sys._current_exceptions", "sys.settrace", "sys.setprofile", "socket.__new__",
    "socket.fromfd", "socket.socketpair",
})


def _in_stdlib(filename: str) -> bool:
    # A venv's platstdlib is a prefix of its site-packages: those are libraries.
    return filename.startswith(_STDLIB_DIRS) and "-packages" + os.sep not in filename


class AuditHook:
    """The installed hook's state: ``refused`` (what it refused, in words)."""

    def __init__(self, candidate_path: str) -> None:
        self.refused: list[str] = []
        self._scratch = os.path.dirname(candidate_path) + os.sep
        self._strict = False
        self._harness = 0
        self._busy = False

    def strict(self) -> None:
        """From now on refuse :data:`_STRICT_EVENTS`, frame reads, ctypes, sockets and
        ``/proc`` whatever frame asks (see the module doc)."""
        self._strict = True

    @contextlib.contextmanager
    def harness(self) -> Iterator[None]:
        """The harness formats a failure: frame reads are its own."""
        self._harness += 1
        try:
            yield
        finally:
            self._harness -= 1

    def _candidate_originated(self) -> bool:
        frame = sys._getframe(2)
        while frame is not None:
            name = frame.f_code.co_filename
            if name == _THIS_FILE or _in_stdlib(name):
                frame = frame.f_back
                continue
            # The import system (frozen importlib) decides like a library.
            return name.startswith(self._scratch) or not (
                name.startswith("/") or name.startswith("<frozen"))
        return False

    def _proc(self, event: str, args: tuple[Any, ...]) -> bool:
        if event in ("open", "os.listdir", "os.scandir") and args:
            path = args[0]
            if isinstance(path, bytes):
                path = path.decode(errors="replace")
            return isinstance(path, str) and os.path.abspath(path).startswith("/proc/")
        return False

    def _strictly_refused(self, event: str, args: tuple[Any, ...]) -> bool:
        if self._harness:
            return False
        if event in _STRICT_EVENTS or event.startswith("ctypes."):
            return True
        return self._proc(event, args)

    def __call__(self, event: str, args: tuple[Any, ...]) -> None:
        if self._busy:
            return
        refuse = False
        if self._strict and self._strictly_refused(event, args):
            refuse = True
        elif event in _REFUSED_EVENTS or event.startswith("ctypes.") or self._proc(event, args):
            self._busy = True
            try:
                refuse = not self._harness and self._candidate_originated()
            finally:
                self._busy = False
        if not refuse:
            return
        what = event
        if event in ("object.__getattr__", "object.__setattr__") and len(args) > 1:
            what = f"{event} ({args[1]!r})"
        if event == "open":
            what = f"open({args[0]!r})"
        self.refused.append(what)
        raise PermissionError(f"the sandbox refused {what}: candidate code may not inspect "
                              "the harness, its frames or its file descriptors")


def install_audit_hook(candidate_path: str) -> AuditHook:
    """Install the audit hook for the candidate at ``candidate_path``; returns its state.

    Raises (from the hook, into candidate code):
        PermissionError: ``the sandbox refused gc.get_objects: ...``.
    """
    hook = AuditHook(candidate_path)
    sys.addaudithook(hook)
    return hook


def hide_harness() -> None:
    """Remove the harness's modules from ``sys.modules`` (and the fork server's ``__main__``).

    Candidate code that looks them up gets fresh copies at most, never the objects
    this process's harness runs on. Called just before the candidate is imported.
    """
    for name in [n for n in sys.modules if n == "services" or n.startswith("services.")]:
        del sys.modules[name]
    main = sys.modules.get("__main__")
    if main is not None and getattr(main, "__file__", "").startswith(_HARNESS_DIR):
        sys.modules["__main__"] = types.ModuleType("__main__")
