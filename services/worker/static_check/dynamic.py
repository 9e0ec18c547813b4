"""Rules on dynamic code, computed names, references and introspection (S012, S013,
S016, S017, S019, S021).

A candidate must not run dynamic code (``eval``, ``exec``, ``compile``,
``__import__`` ...: S012), reach module or function internals (``__globals__``,
``__dict__``, ``__builtins__`` ...: S013), look attributes of the watched modules up
by a name built at run time (S016), use a torch compute function, timer or harness
function as a value (S017) or a dynamic builtin as one (S019, an alias hides the
call), nor walk frames or the garbage collector's object graph (S021).
"""

from __future__ import annotations

import ast
from typing import TYPE_CHECKING

from services.worker.static_check.imports import HARNESS_MODULES
from services.worker.static_check.patching import PROTECTED_ROOTS
from services.worker.static_check.syntax import literal_str
from services.worker.static_check.tensor_internals import (
    HOST_READ_ATTRS,
    INSTRUMENT_ATTRS,
    host_read_why,
)
from services.worker.static_check.torch_ops import COMPUTE_METHODS, torch_function

if TYPE_CHECKING:
    from services.worker.static_check.checker import Checker

BUILTIN_FORBIDDEN = frozenset({"eval", "exec", "compile", "__import__", "open", "input",
                               "breakpoint", "exit", "quit", "globals", "vars"})
DUNDER_FORBIDDEN = frozenset({"__globals__", "__builtins__", "__subclasses__", "__import__",
                              "__loader__", "__code__", "__closure__", "__dict__"})
# Roots on which a computed attribute name is a finding (S016): the libraries a verdict
# depends on and the harness's own modules (the child loads the task as ``aikg_task``
# and the candidate as ``aikg_candidate``; its ``__main__`` is the harness).
INDIRECTION_ROOTS = PROTECTED_ROOTS | frozenset({
    "services", "schemas", "aikg_task", "aikg_candidate", "__main__", "inspect", "importlib",
    "operator", "functools",
})
# Names whose use as a value (not a direct call) hides a dynamic call (S019).
DYNAMIC_BUILTINS = frozenset({"eval", "exec", "compile", "__import__", "getattr", "setattr",
                              "delattr", "globals", "vars", "importlib.import_module"})
# Frame and object-graph walks (S021): the way to the harness's objects and the task.
INTROSPECTION_CALLS = frozenset({
    "gc.get_objects", "gc.get_referrers", "gc.get_referents", "inspect.currentframe",
    "inspect.stack", "inspect.getouterframes", "inspect.getinnerframes", "inspect.trace",
    "inspect.getmembers", "sys._current_frames",
})
FRAME_ATTRS = frozenset({"f_back", "f_globals", "f_locals", "f_builtins", "tb_frame",
                         "gi_frame", "cr_frame", "ag_frame"})


def watched_function(name: str) -> bool:
    """Functions a candidate must call by name if at all (S017): torch compute
    functions, timers, and anything of the harness's modules."""
    root = name.split(".")[0]
    if root in ("time", "timeit") and "." in name:
        return True
    return torch_function(name) or (root in HARNESS_MODULES and "." in name)


def check_builtin_call(ctx: Checker, node: ast.Call, name: str) -> None:
    """A call of a forbidden builtin not shadowed by an import: S012, or S014 for
    ``open``."""
    if name in BUILTIN_FORBIDDEN and name not in ctx.aliases:
        rule = "S014" if name == "open" else "S012"
        why = ("candidates must not open files" if name == "open"
               else "candidates must not run dynamic code or reach into namespaces")
        ctx.add(node.lineno, f"{name}() called ({why})", rule)


def check_builtins_name(ctx: Checker, node: ast.Name) -> None:
    """The name ``__builtins__`` (S013)."""
    if node.id == "__builtins__":
        ctx.add(node.lineno, "__builtins__ used (access to builtins is not "
                "allowed)", "S013")


def check_attribute(ctx: Checker, node: ast.Attribute) -> bool:
    """A module or function internal (S013) or a frame attribute (S021); whether it
    was one."""
    if node.attr in DUNDER_FORBIDDEN:
        ctx.add(node.lineno, f"{node.attr} accessed (reaching into module or function "
                "internals is not allowed)", "S013")
        return True
    if node.attr in FRAME_ATTRS:
        ctx.add(node.lineno, f".{node.attr} accessed (walking frames reaches the "
                "harness and the task)", "S021")
        return True
    return False


def check_value_use(ctx: Checker, node: ast.Name | ast.Attribute) -> None:
    """A watched function (S017) or dynamic builtin (S019) loaded as a value, not called."""
    name = ctx.qual(node)
    if not name:
        return
    if name in DYNAMIC_BUILTINS and (isinstance(node, ast.Attribute)
                                     or node.id not in ctx.aliases):
        ctx.add(node.lineno, f"{name} used as a value (an alias of {name} hides a dynamic "
                "call or attribute lookup; call it by name with literal arguments, or "
                "not at all)", "S019")
    elif watched_function(name):
        ctx.add(node.lineno, f"{name} used as a value (stored in a table, aliased, passed "
                "or returned); torch compute functions, timers and harness functions "
                "must not be reachable indirectly", "S017")


def check_computed_name(ctx: Checker, node: ast.Call) -> None:
    """getattr/setattr/delattr with a non-literal name on a watched root (S016), on
    anything else (S022), or with a host-read name (S022); operator.attrgetter /
    methodcaller with a non-literal name (S016), a host-read or instrument name (S022)
    or a compute method (S018); frame and object-graph walks (S021)."""
    name = ctx.qual(node.func)
    if name in ("getattr", "setattr", "delattr") and len(node.args) >= 2:
        literal = literal_str(node.args[1])
        target = ctx.qual(node.args[0])
        if literal is None and target and target.split(".")[0] in INDIRECTION_ROOTS:
            ctx.add(node.lineno, f"{name}({target}, <computed name>) looks up an "
                    f"attribute of {target} by a name built at run time (name "
                    "torch/triton/time attributes literally)", "S016")
        elif literal is None:
            ctx.add(node.lineno, f"{name}({target or '<object>'}, <computed name>) looks "
                    "up an attribute by a name built at run time (name attributes "
                    "literally)", "S022")
        elif literal in HOST_READ_ATTRS:
            ctx.add(node.lineno, f"{name}(..., {literal!r}) reaches .{literal}"
                    f"{host_read_why(literal)}", "S022")
    elif name in ("operator.attrgetter", "operator.methodcaller") and node.args:
        literal = literal_str(node.args[0])
        if literal is None:
            ctx.add(node.lineno, f"{name}(<computed name>) looks up an attribute by a "
                    "name built at run time", "S016")
        elif literal.split(".")[0] in HOST_READ_ATTRS | INSTRUMENT_ATTRS:
            ctx.add(node.lineno, f"{name}({literal!r}) reaches .{literal}"
                    f"{host_read_why(literal.split('.')[0])}", "S022")
        elif name == "operator.methodcaller" and literal.rstrip("_") in COMPUTE_METHODS:
            ctx.add(node.lineno, f"operator.methodcaller({literal!r}) calls the tensor "
                    "compute method ." + literal + "() indirectly (do the work in a "
                    "Triton kernel)", "S018")
    elif name in INTROSPECTION_CALLS:
        ctx.add(node.lineno, f"{name}() called (walking frames or the garbage "
                "collector's objects reaches the harness and the task)", "S021")


def check_namespace_subscript(ctx: Checker, node: ast.Subscript) -> None:
    """``torch.__dict__[name]`` / ``vars(torch)[name]`` with a computed name (S016);
    ``sys.modules["aikg_task"]`` is S020, through the literal."""
    base = node.value
    target = None
    if isinstance(base, ast.Attribute) and base.attr == "__dict__":
        target = ctx.qual(base.value)
    elif (isinstance(base, ast.Call) and ctx.qual(base.func) == "vars" and base.args):
        target = ctx.qual(base.args[0])
    if (target and target.split(".")[0] in INDIRECTION_ROOTS
            and literal_str(node.slice) is None):
        ctx.add(node.lineno, f"{target}'s namespace indexed by a computed name (looks up "
                f"an attribute of {target} by a name built at run time)", "S016")
