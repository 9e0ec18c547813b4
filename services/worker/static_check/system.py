"""Rules on processes, the environment, files and streams (S008, S010, S011, S014).

A candidate must not start, replace or end processes (``os.fork``, ``os.system``,
``sys.exit`` ...: S010), read or change the environment (``os.environ``,
``os.getenv``: S011), touch files (``os.remove``, ``torch.load``, ``io.open`` ...:
S014; the builtin ``open`` is refused with the dynamic builtins,
:mod:`services.worker.static_check.dynamic`), or create or switch streams (S008):
work runs on the current stream, which the profiler times.
"""

from __future__ import annotations

import ast
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.worker.static_check.checker import Checker

# os functions that start, replace or end processes, touch files, or read the env.
OS_FORBIDDEN = frozenset({
    "system", "fork", "forkpty", "_exit", "abort", "kill", "killpg", "popen", "setsid",
    "setpgid", "spawnl", "spawnle", "spawnlp", "spawnlpe", "spawnv", "spawnve", "spawnvp",
    "spawnvpe", "execl", "execle", "execlp", "execlpe", "execv", "execve", "execvp",
    "execvpe", "posix_spawn", "posix_spawnp", "getenv", "getenvb", "putenv", "unsetenv",
    "environ", "environb", "open", "remove", "unlink", "rename", "renames", "replace",
    "mkdir", "makedirs", "rmdir", "removedirs", "chmod", "chown", "symlink", "link",
    "truncate", "write", "chdir", "fchdir", "chroot", "dup2", "register_at_fork",
})
_OS_ENVIRONMENT = frozenset({"environ", "environb", "getenv", "getenvb", "putenv",
                             "unsetenv"})
_OS_FILES = frozenset({"open", "remove", "unlink", "rename", "renames", "replace", "mkdir",
                       "makedirs", "rmdir", "removedirs", "chmod", "chown", "symlink", "link",
                       "truncate", "write", "chdir", "fchdir", "chroot", "dup2"})
SYS_FORBIDDEN = frozenset({"exit", "modules", "settrace", "setprofile", "setrecursionlimit",
                           "addaudithook", "_getframe"})
STREAM_CALLS = frozenset({
    "torch.cuda.Stream", "torch.cuda.stream", "torch.cuda.set_stream",
    "torch.cuda.ExternalStream", "torch.Stream", "torch.cuda.streams.Stream",
    "torch.npu.Stream", "torch.npu.stream", "torch.npu.set_stream",
})
# Library calls that read or write files.
FILE_CALLS = frozenset({"torch.load", "torch.save", "io.open", "numpy.load", "numpy.save"})


def os_finding(ctx: Checker, line: int, name: str) -> None:
    """``os.<attr>`` of :data:`OS_FORBIDDEN` used or imported: S011 (environment),
    S014 (files) or S010 (processes)."""
    attr = name.split(".", 1)[1]
    if attr in _OS_ENVIRONMENT:
        ctx.add(line, f"{name} used (candidates must not read or change the "
                "environment)", "S011")
    elif attr in _OS_FILES:
        ctx.add(line, f"{name} used (candidates must not touch files)", "S014")
    else:
        ctx.add(line, f"{name} used (candidates must not start, replace or end "
                "processes)", "S010")


def check_from_import(ctx: Checker, node: ast.ImportFrom) -> None:
    """``from os import system`` / ``from sys import exit`` and the like."""
    if node.module == "os":
        for alias in node.names:
            if alias.name in OS_FORBIDDEN:
                os_finding(ctx, node.lineno, f"os.{alias.name}")
    if node.module == "sys":
        for alias in node.names:
            if alias.name in SYS_FORBIDDEN:
                ctx.add(node.lineno, f"sys.{alias.name} imported (candidates must "
                        "not exit, trace, or reach into loaded modules)", "S010")


def check_call(ctx: Checker, node: ast.Call, name: str) -> None:
    """A call of dotted ``name``: stream creation or switching (S008), file reads and
    writes through torch, numpy or io (S014)."""
    if name in STREAM_CALLS:
        ctx.add(node.lineno, f"{name} called (candidates must not create or switch "
                "streams; work runs on the current stream, which the profiler times)",
                "S008")
    elif name in FILE_CALLS:
        ctx.add(node.lineno, f"{name} called (candidates must not touch files)", "S014")


def check_attribute(ctx: Checker, node: ast.Attribute, name: str | None) -> bool:
    """``os.<forbidden>`` or ``sys.<forbidden>`` named anywhere; whether it was."""
    if name and name.startswith("os.") and name.split(".")[1] in OS_FORBIDDEN:
        os_finding(ctx, node.lineno, ".".join(name.split(".")[:2]))
        return True
    if name and name.startswith("sys.") and name.split(".")[1] in SYS_FORBIDDEN:
        ctx.add(node.lineno, f"{'.'.join(name.split('.')[:2])} used (candidates must not "
                "exit, trace, or reach into loaded modules)", "S010")
        return True
    return False
