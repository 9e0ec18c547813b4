"""Rules on the shape of a candidate: ``ModelNew``, its ``forward`` and its Triton
kernels (S003-S006), and the walk over ``forward`` and the helpers it calls that the
PyTorch-compute rules (:mod:`services.worker.static_check.torch_ops`) apply to.

A candidate must define ``class ModelNew`` (S003) with a ``forward`` (S004), define
at least one ``@triton.jit`` kernel (optionally under ``@triton.autotune`` /
``@triton.heuristics``; S005), and launch one (``kernel[grid](...)``) from
``forward`` or a helper it calls (S006). Branches that run only off a GPU (a CPU
fallback) are left to the dynamic checks.
"""

from __future__ import annotations

import ast
from collections import deque
from typing import TYPE_CHECKING

from services.worker.static_check import torch_ops
from services.worker.static_check.syntax import methods, walk_body

if TYPE_CHECKING:
    from services.worker.static_check.checker import Checker

JIT_DECORATORS = frozenset({"triton.jit"})
KERNEL_WRAPPERS = frozenset({"triton.autotune", "triton.heuristics"})


def find_kernels(ctx: Checker) -> dict[str, int]:
    """Triton kernels, module-level or defined inside a function (a kernel factory,
    or a kernel written inside ``forward``): name -> line."""
    found: dict[str, int] = {}
    for node in ast.walk(ctx.tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for dec in node.decorator_list:
                target = dec.func if isinstance(dec, ast.Call) else dec
                if ctx.qual(target) in JIT_DECORATORS:
                    found[node.name] = node.lineno
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            call = node.value
            # kernel = triton.autotune(...)(triton.jit(fn)) or triton.jit(fn)
            while isinstance(call, ast.Call):
                func = call.func
                if ctx.qual(func) in JIT_DECORATORS:
                    for t in node.targets:
                        if isinstance(t, ast.Name):
                            found[t.id] = node.lineno
                    break
                if isinstance(func, ast.Call) and ctx.qual(func.func) in KERNEL_WRAPPERS:
                    call = call.args[0] if call.args else None
                    continue
                break
    return found


def kernel_holders(ctx: Checker, kernels: dict[str, int]) -> tuple[set[str], set[str]]:
    """Names and ``self`` attributes that hold a kernel: bound to a kernel's name
    (``k = relu_kernel``) or to what a kernel factory returns (``self.k =
    make_kernel(...)``, where ``make_kernel`` defines a jit kernel and returns it)."""
    factories = set()
    for node in ast.walk(ctx.tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for sub in walk_body(node):
                if (isinstance(sub, ast.Return) and isinstance(sub.value, ast.Name)
                        and sub.value.id in kernels):
                    factories.add(node.name)
    names: set[str] = set()
    attrs: set[str] = set()
    for node in ast.walk(ctx.tree):
        if not isinstance(node, ast.Assign):
            continue
        value = node.value
        holds = (isinstance(value, ast.Name) and value.id in kernels) or (
            isinstance(value, ast.Call) and (
                (isinstance(value.func, ast.Name) and value.func.id in factories)
                or (isinstance(value.func, ast.Attribute) and value.func.attr in factories)))
        if not holds:
            continue
        for target in node.targets:
            if isinstance(target, ast.Name):
                names.add(target.id)
            elif (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
                  and target.value.id == "self"):
                attrs.add(target.attr)
    return names, attrs


def check_model(ctx: Checker) -> None:
    """S003-S006 on the module, and S007/S018 (:func:`torch_ops.check_compute`) on
    ``ModelNew.forward`` and every helper it reaches, breadth-first."""
    classes = {n.name: n for n in ctx.tree.body if isinstance(n, ast.ClassDef)}
    functions: dict[str, ast.AST] = {
        n.name: n for n in ctx.tree.body
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    # ``act = lambda t: ...`` at module level is called like a function.
    for n in ctx.tree.body:
        if isinstance(n, ast.Assign) and isinstance(n.value, ast.Lambda):
            for t in n.targets:
                if isinstance(t, ast.Name):
                    functions.setdefault(t.id, n.value)
    kernels = find_kernels(ctx)
    model = classes.get("ModelNew")
    if model is None:
        ctx.add(1, "class ModelNew is not defined (define class ModelNew(nn.Module) with "
                "the task Model's constructor and forward signature)", "S003")
        return
    model_methods = methods(model)
    forward = model_methods.get("forward")
    if forward is None:
        ctx.add(model.lineno, "ModelNew has no forward method", "S004")
        return
    if not kernels:
        ctx.add(model.lineno, "no @triton.jit kernel is defined (write the computation as "
                "a Triton kernel and launch it from ModelNew.forward)", "S005")
    submodules = torch_ops.submodules(ctx, model_methods.get("__init__"))
    holder_names, holder_attrs = kernel_holders(ctx, kernels)
    launched = False
    # Breadth-first over forward and the helpers it calls in this module; a module
    # function used as a value (stored on self in __init__, passed, put in a
    # table) may be called from forward under another name, so it counts as called.
    queue: deque[tuple[ast.AST, str, ast.ClassDef | None]] = deque(
        [(forward, "ModelNew.forward", model)])
    visited = {id(forward)}
    for node in ast.walk(ctx.tree):
        if (isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)
                and id(node) not in ctx.callees and node.id in functions
                and node.id not in kernels and id(functions[node.id]) not in visited):
            visited.add(id(functions[node.id]))
            queue.append((functions[node.id], f"{node.id} (a function used as a value)",
                          None))
    while queue:
        func, where, owner = queue.popleft()
        # Functions defined inside this one (not kernels) are helpers too (found once a
        # function: per call, a 4,600-line forward took minutes).
        local = {n.name: n for n in walk_body(func)
                 if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                 and n.name not in kernels}
        for node in walk_body(func, skip=_off_gpu_branches):
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.MatMult):
                ctx.add(node.lineno, f"matrix multiply operator @ used in {where} (torch "
                        "compute ops are not allowed; do the work in a Triton kernel)",
                        "S007")
            if not isinstance(node, ast.Call):
                continue
            func_node = node.func
            if isinstance(func_node, ast.Subscript):
                base = func_node.value
                if isinstance(base, ast.Name) and (base.id in kernels
                                                   or base.id in holder_names):
                    launched = True
                elif (isinstance(base, ast.Attribute) and isinstance(base.value, ast.Name)
                      and base.value.id == "self" and base.attr in holder_attrs):
                    launched = True
                elif isinstance(base, ast.Name) and base.id in ctx.tables:
                    held = ", ".join(ctx.tables[base.id])
                    ctx.add(node.lineno, f"{base.id}[...] (a table of {held}) called in "
                            f"{where} (torch compute ops are not allowed; do the work "
                            "in a Triton kernel)", "S018")
                continue
            torch_ops.check_compute(ctx, node, where, submodules if owner is model else {})
            for callee, callee_where, callee_owner in _callees(
                    node, owner, classes, {**functions, **local}, kernels, submodules):
                if id(callee) not in visited:
                    visited.add(id(callee))
                    queue.append((callee, f"{callee_where} (called from ModelNew.forward)",
                                  callee_owner))
    if kernels and not launched:
        ctx.add(forward.lineno, "ModelNew.forward never launches a Triton kernel (expected "
                "kernel[grid](...) in forward or in a helper it calls)", "S006")


def _callees(node: ast.Call, owner: ast.ClassDef | None,
             classes: dict[str, ast.ClassDef], functions: dict[str, ast.AST],
             kernels: dict[str, int], submodules: dict[str, str]):
    func = node.func
    if isinstance(func, ast.Name):
        if func.id in functions and func.id not in kernels:
            yield functions[func.id], func.id, None
        elif func.id in classes:
            cls = classes[func.id]
            for m in ("__init__", "forward", "__call__"):
                if m in methods(cls):
                    yield methods(cls)[m], f"{cls.name}.{m}", cls
    elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
        base = func.value.id
        if base == "self" and owner is not None:
            method = methods(owner).get(func.attr)
            if method is not None:
                yield method, f"{owner.name}.{func.attr}", owner
            elif owner.name == "ModelNew":
                # self.op(x) where self.op is an instance of a class in this module.
                for cls in _instance_classes(owner, func.attr, classes):
                    for m in ("forward", "__call__"):
                        if m in methods(cls):
                            yield methods(cls)[m], f"{cls.name}.{m}", cls
        elif base in classes:
            cls = classes[base]
            target = "forward" if func.attr == "apply" else func.attr
            if target in methods(cls):
                yield methods(cls)[target], f"{cls.name}.{target}", cls


def _instance_classes(owner: ast.ClassDef, attr: str,
                      classes: dict[str, ast.ClassDef]) -> list[ast.ClassDef]:
    found = []
    for node in ast.walk(owner):
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
                and isinstance(node.value.func, ast.Name)
                and node.value.func.id in classes):
            for t in node.targets:
                if isinstance(t, ast.Attribute) and t.attr == attr:
                    found.append(classes[node.value.func.id])
    return found


def _cpu_guard(test: ast.expr) -> bool | None:
    """Whether ``if test:`` holds only off a GPU (True), only on one (False), or
    either (None): ``not x.is_cuda``, ``x.device.type != "cuda"``, ``x.device.type ==
    "cpu"``, ``not torch.cuda.is_available()`` and their negations."""
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        inner = _cpu_guard(test.operand)
        return None if inner is None else not inner
    if isinstance(test, ast.Attribute) and test.attr == "is_cuda":
        return False
    if isinstance(test, ast.Call) and isinstance(test.func, ast.Attribute) \
            and test.func.attr == "is_available" and not test.args:
        return False
    if isinstance(test, ast.Compare) and len(test.ops) == 1 \
            and isinstance(test.left, ast.Attribute) and test.left.attr == "type" \
            and isinstance(test.comparators[0], ast.Constant):
        value, op = test.comparators[0].value, test.ops[0]
        if value == "cuda":
            return isinstance(op, ast.NotEq) if isinstance(op, (ast.Eq, ast.NotEq)) else None
        if value == "cpu":
            return isinstance(op, ast.Eq) if isinstance(op, (ast.Eq, ast.NotEq)) else None
    if isinstance(test, ast.BoolOp):
        parts = [_cpu_guard(v) for v in test.values]
        if isinstance(test.op, ast.Or) and all(p is True for p in parts):
            return True
        if isinstance(test.op, ast.And) and all(p is False for p in parts):
            return False
    return None


def _off_gpu_branches(node: ast.AST) -> list[ast.AST]:
    """The statements of an ``if`` that run only when the tensors are not on a GPU (a
    fallback): S007 leaves them to the dynamic checks, which run candidates as on a
    GPU (the cpu backend emulates CUDA for them)."""
    if not isinstance(node, ast.If):
        return []
    guard = _cpu_guard(node.test)
    if guard is True:
        return list(node.body)
    if guard is False:
        return list(node.orelse)
    return []

