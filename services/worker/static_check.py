"""AST checks of a candidate's source, run before anything is spawned.

A candidate must define ``class ModelNew`` whose ``forward`` launches a Triton
kernel (``kernel[grid](...)``) defined in the same module with ``@triton.jit``
(optionally under ``@triton.autotune`` / ``@triton.heuristics``), directly or
through helper functions and methods it calls. In ``forward`` and those helpers it
must not compute with PyTorch (``torch.<op>(...)``, ``F.<op>(...)``, tensor compute
methods such as ``x.sum()``, the ``@`` operator, calling ``torch.nn`` submodules);
allocation and layout helpers (``torch.empty_like``, ``x.contiguous()``,
``x.view(...)`` ...) are fine. Anywhere in the module it must not create streams,
start threads or processes, load native code, handle signals, open sockets or
files, read the environment, run dynamic code (``eval``/``exec``/``__import__``/
``importlib``/``compile``) or patch library attributes (``time.perf_counter = ...``,
``setattr(torch, ...)``).

The checks are a first filter for LLM-written code, not a security boundary: the
sandbox (:mod:`services.worker.sandbox`) is. They are written so that honest
kernels pass and the common reward hacks fail with a message a coder can act on.
"""

from __future__ import annotations

import ast
from collections import deque
from dataclasses import dataclass

from schemas.events import normalize_dsl

# Modules whose import alone is rejected: concurrency, native code, signals,
# networking, dynamic import, process/file-system control, serialisation that runs code.
FORBIDDEN_MODULES = frozenset({
    "threading", "_thread", "multiprocessing", "subprocess", "concurrent", "asyncio",
    "ctypes", "cffi", "signal", "socket", "ssl", "http", "urllib", "requests", "pty",
    "importlib", "builtins", "mmap", "resource", "shutil", "tempfile", "pathlib", "pickle",
    "marshal", "dill", "sched", "selectors",
})

# os functions that start, replace or end processes, touch files, or read the env.
_OS_FORBIDDEN = frozenset({
    "system", "fork", "forkpty", "_exit", "abort", "kill", "killpg", "popen", "setsid",
    "setpgid", "spawnl", "spawnle", "spawnlp", "spawnlpe", "spawnv", "spawnve", "spawnvp",
    "spawnvpe", "execl", "execle", "execlp", "execlpe", "execv", "execve", "execvp",
    "execvpe", "posix_spawn", "posix_spawnp", "getenv", "getenvb", "putenv", "unsetenv",
    "environ", "environb", "open", "remove", "unlink", "rename", "renames", "replace",
    "mkdir", "makedirs", "rmdir", "removedirs", "chmod", "chown", "symlink", "link",
    "truncate", "write", "chdir", "fchdir", "chroot", "dup2", "register_at_fork",
})
_SYS_FORBIDDEN = frozenset({"exit", "modules", "settrace", "setprofile", "setrecursionlimit",
                            "addaudithook", "_getframe"})
_BUILTIN_FORBIDDEN = frozenset({"eval", "exec", "compile", "__import__", "open", "input",
                                "breakpoint", "exit", "quit", "globals", "vars"})
_DUNDER_FORBIDDEN = frozenset({"__globals__", "__builtins__", "__subclasses__", "__import__",
                               "__loader__", "__code__", "__closure__", "__dict__"})
# Roots whose attributes a candidate must not assign, delete or setattr.
_PROTECTED_ROOTS = frozenset({"torch", "triton", "time", "timeit", "builtins", "os", "sys",
                              "numpy", "gc", "math", "random", "statistics"})
_STREAM_CALLS = frozenset({
    "torch.cuda.Stream", "torch.cuda.stream", "torch.cuda.set_stream",
    "torch.cuda.ExternalStream", "torch.Stream", "torch.cuda.streams.Stream",
    "torch.npu.Stream", "torch.npu.stream", "torch.npu.set_stream",
})
# torch calls that allocate, describe or lay out tensors: allowed in forward.
ALLOWED_TORCH_CALLS = frozenset({
    "empty", "empty_like", "empty_strided", "zeros", "zeros_like", "ones", "ones_like",
    "full", "full_like", "arange", "tensor", "as_tensor", "as_strided", "is_tensor",
    "is_floating_point", "is_complex", "numel", "device", "dtype", "Size", "finfo", "iinfo",
    "get_default_dtype", "promote_types", "result_type", "broadcast_shapes", "no_grad",
    "inference_mode", "is_grad_enabled", "cuda.synchronize", "cuda.current_device",
    "cuda.device_count", "cuda.get_device_properties", "cuda.get_device_capability",
    "cuda.is_available", "cuda.current_stream", "cuda.device", "npu.synchronize",
    "npu.current_device", "npu.current_stream",
})
# Tensor methods that compute (in-place variants with a trailing underscore too).
COMPUTE_METHODS = frozenset({
    "abs", "absolute", "acos", "acosh", "add", "addbmm", "addcdiv", "addcmul", "addmm",
    "addmv", "addr", "all", "amax", "amin", "aminmax", "any", "argmax", "argmin", "argsort",
    "asin", "asinh", "atan", "atan2", "atanh", "baddbmm", "bitwise_and", "bitwise_not",
    "bitwise_or", "bitwise_xor", "bmm", "ceil", "clamp", "clamp_max", "clamp_min", "clip",
    "cos", "cosh", "count_nonzero", "cross", "cummax", "cummin", "cumprod", "cumsum", "diag",
    "diff", "digamma", "dist", "div", "divide", "dot", "eq", "erf", "erfc", "erfinv", "exp",
    "exp2", "expm1", "floor", "floor_divide", "fmax", "fmin", "fmod", "frac", "gather",
    "ge", "gelu", "greater", "gt", "hardtanh", "heaviside", "histc", "hypot", "index_add",
    "index_fill", "index_put", "index_reduce", "index_select", "inner", "isclose", "kron",
    "kthvalue", "le", "lerp", "less", "lgamma", "log", "log10", "log1p", "log2",
    "log_softmax", "logaddexp", "logcumsumexp", "logical_and", "logical_not", "logical_or",
    "logical_xor", "logit", "logsumexp", "lt", "masked_fill", "masked_scatter",
    "masked_select", "matmul", "max", "maximum", "mean", "median", "min", "minimum", "mm",
    "mode", "mul", "multiply", "mv", "nan_to_num", "nanmean", "nansum", "ne", "neg",
    "negative", "norm", "outer", "pow", "prod", "quantile", "reciprocal", "relu",
    "remainder", "renorm", "round", "rsqrt", "scatter", "scatter_add", "scatter_reduce",
    "sgn", "sigmoid", "sign", "silu", "sin", "sinh", "softmax", "softplus", "sort", "sqrt",
    "square", "std", "sub", "subtract", "sum", "tan", "tanh", "tensordot", "topk", "trace",
    "tril", "triu", "true_divide", "trunc", "var", "where", "xlogy", "__matmul__",
    "__add__", "__mul__", "__sub__", "__truediv__", "einsum", "conv1d", "conv2d", "conv3d",
    "linear", "layer_norm", "group_norm", "batch_norm", "dropout", "mish", "hardswish",
    "hardsigmoid", "elu", "selu", "celu", "leaky_relu", "prelu", "rrelu", "glu",
    "softmin", "normalize", "cosine_similarity", "pairwise_distance", "cdist",
})
_NN_CONTAINERS = frozenset({"Parameter", "ParameterList", "ParameterDict", "ModuleList",
                            "ModuleDict", "Identity", "Buffer"})
_JIT_DECORATORS = frozenset({"triton.jit"})
_KERNEL_WRAPPERS = frozenset({"triton.autotune", "triton.heuristics"})


@dataclass(frozen=True)
class Finding:
    """One rejection: what was found and on which line (1-based).

    ``rule`` is a stable tag (``syntax``, ``dsl``, ``no-model``, ``no-forward``,
    ``no-kernel``, ``no-launch``, ``torch-op``, ``stream``, ``forbidden-import``,
    ``forbidden-call``, ``environment``, ``dynamic-code``, ``file-io``, ``patch``).
    """

    line: int
    message: str
    rule: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.message}"


class _Aliases(ast.NodeVisitor):
    """Map local names to the dotted module paths they stand for (``F`` -> torch.nn.functional)."""

    def __init__(self) -> None:
        self.names: dict[str, str] = {}

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.asname:
                self.names[alias.asname] = alias.name
            else:
                root = alias.name.split(".")[0]
                self.names[root] = root

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.module and not node.level:
            for alias in node.names:
                self.names[alias.asname or alias.name] = f"{node.module}.{alias.name}"


def _qualname(node: ast.AST, aliases: dict[str, str]) -> str | None:
    """Dotted name of ``node`` with import aliases resolved (``F.relu`` -> ``torch.nn.functional.relu``)."""
    if isinstance(node, ast.Name):
        return aliases.get(node.id, node.id)
    if isinstance(node, ast.Attribute):
        base = _qualname(node.value, aliases)
        return f"{base}.{node.attr}" if base else None
    return None


class _Checker:
    def __init__(self, tree: ast.Module) -> None:
        self.tree = tree
        collector = _Aliases()
        collector.visit(tree)
        self.aliases = collector.names
        self._alias_assignments()
        self.findings: list[Finding] = []
        self._seen: set[tuple[int, str]] = set()

    def _alias_assignments(self) -> None:
        """``cuda = torch.cuda`` or ``fast = time.perf_counter``: follow simple rebinding."""
        for node in ast.walk(self.tree):
            if (isinstance(node, ast.Assign) and len(node.targets) == 1
                    and isinstance(node.targets[0], ast.Name)):
                name = _qualname(node.value, self.aliases)
                if name and name.split(".")[0] in _PROTECTED_ROOTS:
                    self.aliases.setdefault(node.targets[0].id, name)

    def add(self, line: int, message: str, rule: str) -> None:
        if (line, message) not in self._seen:
            self._seen.add((line, message))
            self.findings.append(Finding(line, message, rule))

    def qual(self, node: ast.AST) -> str | None:
        return _qualname(node, self.aliases)

    # ------------------------------------------------------------ whole module

    def check_module(self) -> None:
        for node in ast.walk(self.tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                self._check_import(node)
            elif isinstance(node, ast.Call):
                self._check_call(node)
            elif isinstance(node, ast.Attribute):
                self._check_attribute(node)
            elif isinstance(node, ast.Name):
                if node.id == "__builtins__":
                    self.add(node.lineno, "__builtins__ used (access to builtins is not "
                             "allowed)", "dynamic-code")
            elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
                self._check_patch(node)

    def _check_import(self, node: ast.Import | ast.ImportFrom) -> None:
        if isinstance(node, ast.Import):
            modules = [a.name for a in node.names]
        else:
            modules = [node.module or ""]
            if node.module == "os":
                for alias in node.names:
                    if alias.name in _OS_FORBIDDEN:
                        self._os_finding(node.lineno, f"os.{alias.name}")
            if node.module == "sys":
                for alias in node.names:
                    if alias.name in _SYS_FORBIDDEN:
                        self.add(node.lineno, f"sys.{alias.name} imported (candidates must "
                                 "not exit, trace, or reach into loaded modules)",
                                 "forbidden-call")
        for module in modules:
            root = module.split(".")[0]
            if root in FORBIDDEN_MODULES:
                self.add(node.lineno, f"import of {module} is not allowed (candidates must "
                         "not start threads or processes, load native code, handle signals, "
                         "use the network or files, or import dynamically)", "forbidden-import")

    def _os_finding(self, line: int, name: str) -> None:
        attr = name.split(".", 1)[1]
        if attr in ("environ", "environb", "getenv", "getenvb", "putenv", "unsetenv"):
            self.add(line, f"{name} used (candidates must not read or change the "
                     "environment)", "environment")
        elif attr in ("open", "remove", "unlink", "rename", "renames", "replace", "mkdir",
                      "makedirs", "rmdir", "removedirs", "chmod", "chown", "symlink", "link",
                      "truncate", "write", "chdir", "fchdir", "chroot", "dup2"):
            self.add(line, f"{name} used (candidates must not touch files)", "file-io")
        else:
            self.add(line, f"{name} used (candidates must not start, replace or end "
                     "processes)", "forbidden-call")

    def _check_call(self, node: ast.Call) -> None:
        name = self.qual(node.func)
        if name is None:
            return
        if name in _BUILTIN_FORBIDDEN and name not in self.aliases:
            rule = "file-io" if name == "open" else "dynamic-code"
            why = ("candidates must not open files" if name == "open"
                   else "candidates must not run dynamic code or reach into namespaces")
            self.add(node.lineno, f"{name}() called ({why})", rule)
        elif name in ("setattr", "delattr") and node.args:
            target = self.qual(node.args[0])
            if target and target.split(".")[0] in _PROTECTED_ROOTS:
                self.add(node.lineno, f"{name}({target}, ...) patches a library (timers and "
                         "torch/triton functions must not be replaced)", "patch")
        elif name in _STREAM_CALLS:
            self.add(node.lineno, f"{name} called (candidates must not create or switch "
                     "streams; work runs on the current stream, which the profiler times)",
                     "stream")
        elif name in ("torch.load", "torch.save", "io.open", "numpy.load", "numpy.save"):
            self.add(node.lineno, f"{name} called (candidates must not touch files)", "file-io")

    def _check_attribute(self, node: ast.Attribute) -> None:
        name = self.qual(node)
        if name and name.startswith("os.") and name.split(".")[1] in _OS_FORBIDDEN:
            self._os_finding(node.lineno, ".".join(name.split(".")[:2]))
        elif name and name.startswith("sys.") and name.split(".")[1] in _SYS_FORBIDDEN:
            self.add(node.lineno, f"{'.'.join(name.split('.')[:2])} used (candidates must not "
                     "exit, trace, or reach into loaded modules)", "forbidden-call")
        elif node.attr in _DUNDER_FORBIDDEN:
            self.add(node.lineno, f"{node.attr} accessed (reaching into module or function "
                     "internals is not allowed)", "dynamic-code")

    def _check_patch(self, node: ast.AST) -> None:
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.Delete):
            targets = node.targets
        else:
            targets = [node.target]
        for target in targets:
            for sub in ast.walk(target):
                if isinstance(sub, (ast.Attribute, ast.Subscript)):
                    base = sub.value
                    name = self.qual(base) if not isinstance(base, ast.Subscript) else None
                    if name and name.split(".")[0] in _PROTECTED_ROOTS:
                        shown = self.qual(sub) if isinstance(sub, ast.Attribute) else name
                        self.add(node.lineno, f"assignment to {shown} patches a library "
                                 "(timers and torch/triton functions must not be replaced)",
                                 "patch")
                        break

    # ------------------------------------------------------------ kernels and forward

    def kernels(self) -> dict[str, int]:
        """Module-level Triton kernels: name -> line."""
        found: dict[str, int] = {}
        for node in self.tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for dec in node.decorator_list:
                    target = dec.func if isinstance(dec, ast.Call) else dec
                    if self.qual(target) in _JIT_DECORATORS:
                        found[node.name] = node.lineno
            elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
                call = node.value
                # kernel = triton.autotune(...)(triton.jit(fn)) or triton.jit(fn)
                while isinstance(call, ast.Call):
                    func = call.func
                    if self.qual(func) in _JIT_DECORATORS:
                        for t in node.targets:
                            if isinstance(t, ast.Name):
                                found[t.id] = node.lineno
                        break
                    if isinstance(func, ast.Call) and self.qual(func.func) in _KERNEL_WRAPPERS:
                        call = call.args[0] if call.args else None
                        continue
                    break
        return found

    def check_model(self) -> None:
        classes = {n.name: n for n in self.tree.body if isinstance(n, ast.ClassDef)}
        functions = {n.name: n for n in self.tree.body
                     if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        kernels = self.kernels()
        model = classes.get("ModelNew")
        if model is None:
            self.add(1, "class ModelNew is not defined (define class ModelNew(nn.Module) with "
                     "the task Model's constructor and forward signature)", "no-model")
            return
        methods = _methods(model)
        forward = methods.get("forward")
        if forward is None:
            self.add(model.lineno, "ModelNew has no forward method", "no-forward")
            return
        if not kernels:
            self.add(model.lineno, "no @triton.jit kernel is defined (write the computation as "
                     "a Triton kernel and launch it from ModelNew.forward)", "no-kernel")
        submodules = self._submodules(methods.get("__init__"))
        launched = False
        # Breadth-first over forward and the helpers it calls in this module.
        queue: deque[tuple[ast.AST, str, ast.ClassDef | None]] = deque(
            [(forward, "ModelNew.forward", model)])
        visited = {id(forward)}
        while queue:
            func, where, owner = queue.popleft()
            for node in _walk_body(func):
                if isinstance(node, ast.BinOp) and isinstance(node.op, ast.MatMult):
                    self.add(node.lineno, f"matrix multiply operator @ used in {where} (torch "
                             "compute ops are not allowed; do the work in a Triton kernel)",
                             "torch-op")
                if not isinstance(node, ast.Call):
                    continue
                func_node = node.func
                if isinstance(func_node, ast.Subscript):
                    if isinstance(func_node.value, ast.Name) and func_node.value.id in kernels:
                        launched = True
                    continue
                self._check_compute(node, where, submodules if owner is model else {})
                for callee, callee_where, callee_owner in self._callees(
                        node, owner, classes, functions, kernels, submodules):
                    if id(callee) not in visited:
                        visited.add(id(callee))
                        queue.append((callee, f"{callee_where} (called from ModelNew.forward)",
                                      callee_owner))
        if kernels and not launched:
            self.add(forward.lineno, "ModelNew.forward never launches a Triton kernel (expected "
                     "kernel[grid](...) in forward or in a helper it calls)", "no-launch")

    def _submodules(self, init: ast.AST | None) -> dict[str, str]:
        """``self.x = nn.Linear(...)`` in __init__: attribute -> torch.nn class."""
        found: dict[str, str] = {}
        if init is None:
            return found
        for node in ast.walk(init):
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
                cls = self.qual(node.value.func)
                if (cls and cls.startswith("torch.nn.") and cls.split(".")[-1][:1].isupper()
                        and cls.split(".")[-1] not in _NN_CONTAINERS):
                    for t in node.targets:
                        if (isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                                and t.value.id == "self"):
                            found[t.attr] = cls
        return found

    def _check_compute(self, node: ast.Call, where: str, submodules: dict[str, str]) -> None:
        func = node.func
        name = self.qual(func)
        why = "torch compute ops are not allowed; do the work in a Triton kernel"
        if name and name.startswith("torch."):
            short = name[len("torch."):]
            if short not in ALLOWED_TORCH_CALLS and name not in _STREAM_CALLS:
                self.add(node.lineno, f"{name} called in {where} ({why})", "torch-op")
            return
        if not isinstance(func, ast.Attribute):
            return
        base = func.value
        if (isinstance(base, ast.Name) and base.id == "self" and func.attr in submodules):
            self.add(node.lineno, f"self.{func.attr} ({submodules[func.attr]}) called in {where} "
                     "(torch modules compute in PyTorch; keep its parameters but do the work "
                     "in a Triton kernel)", "torch-op")
            return
        base_name = self.qual(base)
        if base_name and base_name.split(".")[0] in self.aliases:
            return  # a module function (math.exp, triton.cdiv), not a tensor method
        method = func.attr
        if method.endswith("_") and not method.endswith("__"):
            method = method[:-1]
        if method in COMPUTE_METHODS:
            self.add(node.lineno, f".{func.attr}() called in {where} ({why})", "torch-op")

    def _callees(self, node: ast.Call, owner: ast.ClassDef | None,
                 classes: dict[str, ast.ClassDef], functions: dict[str, ast.AST],
                 kernels: dict[str, int], submodules: dict[str, str]):
        func = node.func
        if isinstance(func, ast.Name):
            if func.id in functions and func.id not in kernels:
                yield functions[func.id], func.id, None
            elif func.id in classes:
                cls = classes[func.id]
                for m in ("__init__", "forward", "__call__"):
                    if m in _methods(cls):
                        yield _methods(cls)[m], f"{cls.name}.{m}", cls
        elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
            base = func.value.id
            if base == "self" and owner is not None:
                method = _methods(owner).get(func.attr)
                if method is not None:
                    yield method, f"{owner.name}.{func.attr}", owner
                elif owner.name == "ModelNew":
                    # self.op(x) where self.op is an instance of a class in this module.
                    for cls in self._instance_classes(owner, func.attr, classes):
                        for m in ("forward", "__call__"):
                            if m in _methods(cls):
                                yield _methods(cls)[m], f"{cls.name}.{m}", cls
            elif base in classes:
                cls = classes[base]
                target = "forward" if func.attr == "apply" else func.attr
                if target in _methods(cls):
                    yield _methods(cls)[target], f"{cls.name}.{target}", cls

    def _instance_classes(self, owner: ast.ClassDef, attr: str,
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


def _methods(cls: ast.ClassDef) -> dict[str, ast.AST]:
    return {n.name: n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def _walk_body(func: ast.AST):
    """Nodes of a function body, not descending into nested functions or classes."""
    stack = list(getattr(func, "body", []))
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                stack.append(child)


def check_candidate(code: str, dsl: str = "triton") -> list[Finding]:
    """Statically check a candidate's source.

    Args:
        code: the candidate's Python source.
        dsl: the request's DSL (``triton``; ``triton_cuda`` / ``triton_ascend`` accepted).

    Returns:
        Findings sorted by line; empty when the candidate may run. A syntax error is
        a single finding with rule ``syntax`` (the verifier reports it as stage
        ``compile``); every other rule is stage ``static``. Example:
        ``line 12: torch.relu called in ModelNew.forward (torch compute ops are not
        allowed; do the work in a Triton kernel)``.
    """
    if normalize_dsl(dsl) != "triton":
        return [Finding(1, f"dsl {dsl!r} is not supported (this worker verifies triton "
                           "kernels)", "dsl")]
    try:
        tree = ast.parse(code)
    except SyntaxError as exc:
        text = f": {exc.text.strip()}" if exc.text and exc.text.strip() else ""
        return [Finding(exc.lineno or 1, f"SyntaxError: {exc.msg}{text}", "syntax")]
    checker = _Checker(tree)
    checker.check_module()
    checker.check_model()
    return sorted(checker.findings, key=lambda f: f.line)
