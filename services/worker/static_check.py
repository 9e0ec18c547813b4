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
``setattr(torch, ...)``). Indirection is seen through: a computed attribute name
(``getattr(torch, "r" + "elu")``), a torch function stored, passed or aliased
(``ops = {"r": torch.relu}``, ``f = torch.relu``, ``self.act = F.relu``), an alias of
``eval``/``exec``/``getattr``, importing the task's module (``aikg_task``) or the
harness's, and walking frames or the garbage collector's object graph.

Every rule has an id (``S001`` ...), listed with what it catches, the public report it
comes from and the test that covers it in :data:`RULES`; a :class:`Finding` carries it
as ``rule_id``.

The checks are a first filter for LLM-written code, not a security boundary: the
sandbox (:mod:`services.sandbox.pool`) is. They are written so that honest
kernels pass and the common reward hacks fail with a message a coder can act on.

Why one module: the rules share one AST walk and one table (:data:`RULES`) that the
README's rule table is generated from; one file per rule would scatter the walker.
"""

from __future__ import annotations

import ast
from collections import deque
from dataclasses import dataclass
from typing import Any

from schemas.events import normalize_dsl


@dataclass(frozen=True)
class Rule:
    """One static rule: ``id`` (``S001`` ...), the :attr:`Finding.rule` tag it reports
    under, what it catches (one line), the public source it comes from, and the test
    (``tests/unit/test_static_check.py::<name>``) that covers it."""

    id: str
    tag: str
    catches: str
    source: str
    test: str


_KB = "KernelBench (github.com/ScalingIntelligence/KernelBench)"
_KB_CHECKER = ("KernelBench PR #110, static kernel checker: PyTorch wrapping and fallback "
               "bypasses (github.com/ScalingIntelligence/KernelBench/pull/110)")
_KB_SCOPE = ("KernelBench issue #57, custom kernels vs forward() calling PyTorch "
             "(github.com/ScalingIntelligence/KernelBench/issues/57)")
_WAFER = ("Wafer, 'A Field Guide to Reward Hacking in AI Kernel Generation' "
          "(wafer.ai/blog/reward-hacks-field-guide)")
_KGUARD = ("KernelGuard: Defending GPU Competitions from Adversarial Agentic Systems "
           "(openreview.net/forum?id=K0dAC7UaXL; github.com/SinatrasC/kernelguard)")
_METR = ("METR, 'Recent Frontier Models Are Reward Hacking', 2025 "
         "(metr.org/blog/2025-06-05-recent-reward-hacking)")
_METR_O3 = ("METR, preliminary evaluation of o3 and o4-mini: o3 disabled CUDA "
            "synchronization to fake speed (metr.github.io/autonomy-evals-guide/openai-o3-report)")
_T = "tests/unit/test_static_check.py::"

# The single table of static rules; the README's rules table is rendered from it.
RULES: tuple[Rule, ...] = (
    Rule("S001", "syntax", "source that does not parse as Python (stage compile)",
         "Python ast.parse (docs.python.org/3/library/ast.html)",
         _T + "test_syntax_error_reports_line"),
    Rule("S002", "dsl", "a request for a DSL other than Triton",
         "Triton language (triton-lang.org)", _T + "test_unsupported_dsl"),
    Rule("S003", "no-model", "no class ModelNew", f"{_KB}: solution format (ModelNew)",
         _T + "test_missing_model_new"),
    Rule("S004", "no-forward", "ModelNew without a forward method",
         f"{_KB}: solution format (ModelNew.forward)", _T + "test_model_without_forward"),
    Rule("S005", "no-kernel", "no @triton.jit kernel defined anywhere in the module",
         f"{_KB_SCOPE}; {_KB_CHECKER}", _T + "test_no_kernel_defined_and_torch_op"),
    Rule("S006", "no-launch",
         "kernels defined but ModelNew.forward (or a helper it calls) never launches one",
         _KB_CHECKER, _T + "test_kernel_defined_but_never_launched"),
    Rule("S007", "torch-op",
         "torch compute call, tensor compute method, @, or torch.nn submodule call in "
         "forward or the helpers it calls", f"{_KB_SCOPE}; {_WAFER} (benign shortcuts)",
         _T + "test_torch_compute_in_forward_is_rejected"),
    Rule("S008", "stream", "creating or switching CUDA/NPU streams",
         f"{_WAFER} (stream injection); {_KGUARD}", _T + "test_forbidden_constructs"),
    Rule("S009", "forbidden-import",
         "importing threading, multiprocessing, subprocess, ctypes, socket, importlib, "
         "pickle ... (threads, processes, native code, network, dynamic import)",
         f"{_WAFER} (background thread injection); {_KGUARD}",
         _T + "test_forbidden_constructs"),
    Rule("S010", "forbidden-call",
         "os process control (fork, system, exec*, _exit, kill ...) and sys.exit, "
         "sys.modules, sys.settrace, sys._getframe ...",
         f"{_KGUARD} (harness manipulation); {_METR}", _T + "test_forbidden_constructs"),
    Rule("S011", "environment", "reading or changing the environment (os.environ, os.getenv ...)",
         "CWE-526, sensitive information in environment variables "
         "(cwe.mitre.org/data/definitions/526.html)", _T + "test_forbidden_constructs"),
    Rule("S012", "dynamic-code",
         "calling eval, exec, compile, __import__, globals, vars, breakpoint or input",
         f"{_KGUARD} (obfuscated exec)", _T + "test_forbidden_constructs"),
    Rule("S013", "dynamic-code",
         "__builtins__ or module/function internals (__globals__, __dict__, __code__, "
         "__subclasses__ ...)", f"{_KGUARD} (obfuscated exec)", _T + "test_forbidden_constructs"),
    Rule("S014", "file-io",
         "open(), os file functions, io.open, torch.load/save, numpy.load/save",
         f"{_KGUARD} (result replay)", _T + "test_forbidden_constructs"),
    Rule("S015", "patch",
         "assigning, deleting or setattr-ing attributes of torch, triton, time, os, sys, "
         "gc ... (timers, synchronize, comparison functions)",
         f"{_METR} (monkey-patched timers); {_METR_O3}", _T + "test_findings_say_what_and_where"),
    Rule("S016", "indirection",
         "a computed attribute name on torch, triton, time, os, sys or the harness's "
         "modules: getattr/setattr/delattr with a non-literal name, X.__dict__[...], "
         "vars(X)[...], operator.attrgetter/methodcaller with a non-literal name",
         f"{_KGUARD} (obfuscation)", _T + "test_computed_attribute_names"),
    Rule("S017", "indirection",
         "a torch compute function, timer or harness function used as a value: stored in "
         "a table ({'r': torch.relu}, [torch.relu][0]), aliased, passed or returned",
         f"{_KGUARD} (obfuscation); {_KB_CHECKER}", _T + "test_function_tables_and_references"),
    Rule("S018", "torch-op",
         "a torch function called in forward through an alias (f = torch.relu; f(x)), an "
         "attribute (self.act = F.relu), a table (OPS['r'](x)) or a literal getattr",
         f"{_KB_SCOPE}; {_KGUARD} (obfuscation)", _T + "test_torch_calls_through_aliases"),
    Rule("S019", "dynamic-code",
         "eval, exec, compile, __import__, importlib.import_module, getattr, setattr, "
         "delattr, globals or vars referenced as a value (an alias hides the call)",
         f"{_KGUARD} (obfuscated exec)", _T + "test_aliases_of_dynamic_builtins"),
    Rule("S020", "harness",
         "importing or naming the task's module (aikg_task: the reference the candidate "
         "is checked against) or the harness's own modules (__main__, services, schemas)",
         f"{_METR} (reaching the grader's reference answer)", _T + "test_task_and_harness_imports"),
    Rule("S021", "harness",
         "walking frames or the object graph: gc.get_objects/get_referrers/get_referents, "
         "inspect.currentframe/stack/getouterframes/getmembers, sys._current_frames, "
         "f_back/f_globals/f_locals/tb_frame",
         f"{_METR} (tracing call stacks to find the grader's answer)",
         _T + "test_frame_and_object_graph_walks"),
    Rule("S022", "host-read",
         "the tensor methods that hand data to numpy or Python (.numpy, .tolist, "
         "__array__, __dlpack__, untyped_storage, storage) and the type-hierarchy "
         "attributes that reach torch's C tensor type past the sandbox's guards "
         "(__base__, __bases__, __mro__, mro), anywhere in the module; getattr, setattr or "
         "delattr with a computed name on any object but self",
         "this project's red-team: a relu computed by numpy through a tensor's numpy view "
         "passed with the ghost replay dodged", _T + "test_host_reads_and_type_walks"),
    Rule("S023", "instruments",
         "torch's dispatch and override machinery, which hides ops from the op record or "
         "reaches the recorder (torch._C, torch.utils._python_dispatch, torch.overrides, "
         "torch._subclasses, triton._C, triton.runtime.interpreter ...), tensor "
         "subclasses (__torch_function__, "
         "__torch_dispatch__, .as_subclass, _make_subclass) and __array_interface__-style "
         "methods defined by the candidate",
         "this project's red-team: torch.relu under _DisableTorchDispatch, the recorder's "
         "counts cleared, a lazy output subclass computing after forward",
         _T + "test_instrument_tampering"),
)
RULES_BY_ID: dict[str, Rule] = {r.id: r for r in RULES}

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
    # Timing and profiler markers: they measure, they do not compute.
    "cuda.Event", "npu.Event", "cuda.nvtx.range_push", "cuda.nvtx.range_pop",
    "cuda.nvtx.range",
    # Generator state: the trial inputs do not depend on it (they come from elsewhere).
    "manual_seed", "initial_seed", "seed", "cuda.manual_seed", "cuda.manual_seed_all",
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
# Roots on which a computed attribute name is a finding (S016): the libraries a verdict
# depends on and the harness's own modules (the child loads the task as ``aikg_task``
# and the candidate as ``aikg_candidate``; its ``__main__`` is the harness).
_INDIRECTION_ROOTS = _PROTECTED_ROOTS | frozenset({
    "services", "schemas", "aikg_task", "aikg_candidate", "__main__", "inspect", "importlib",
    "operator", "functools",
})
_HARNESS_MODULES = frozenset({"aikg_task", "__main__", "services", "schemas"})
TASK_MODULE = "aikg_task"
# Names whose use as a value (not a direct call) hides a dynamic call (S019).
_DYNAMIC_BUILTINS = frozenset({"eval", "exec", "compile", "__import__", "getattr", "setattr",
                               "delattr", "globals", "vars", "importlib.import_module"})
# Frame and object-graph walks (S021): the way to the harness's objects and the task.
_INTROSPECTION_CALLS = frozenset({
    "gc.get_objects", "gc.get_referrers", "gc.get_referents", "inspect.currentframe",
    "inspect.stack", "inspect.getouterframes", "inspect.getinnerframes", "inspect.trace",
    "inspect.getmembers", "sys._current_frames",
})
# S022: tensor methods whose result is the tensor's data in numpy or Python (no ATen op
# records the computation that follows), and the attributes that reach
# torch._C.TensorBase, whose methods the child's host-read guard cannot wrap.
_HOST_READ_ATTRS = frozenset({"numpy", "tolist", "__array__", "__array_interface__",
                              "__array_struct__", "__dlpack__", "untyped_storage", "storage",
                              "_typed_storage", "__base__", "__bases__", "__mro__", "mro",
                              "getmro"})
# S023: torch namespaces that run ops past the op recorder or reach it, and the tensor
# subclass hooks that run code whenever the harness touches an output.
_INSTRUMENT_SPACES = ("torch._C", "torch.utils._python_dispatch", "torch._dispatch",
                      "torch.overrides", "torch._subclasses", "torch._ops",
                      "torch.utils._mode_utils", "torch._functorch", "torch.fx",
                      # The interpreter's own loads and stores read memory at raw
                      # addresses (numpy out, no tensor method, no ATen op).
                      "triton._C", "triton.runtime.interpreter")
_INSTRUMENT_ATTRS = frozenset({"__torch_function__", "__torch_dispatch__", "as_subclass",
                               "_make_subclass", "_make_wrapper_subclass",
                               "DisableTorchFunction", "DisableTorchFunctionSubclass",
                               "_DisableTorchDispatch", "_disable_current_modes",
                               "_get_current_dispatch_mode", "_pop_mode", "_push_mode"})
_FRAME_ATTRS = frozenset({"f_back", "f_globals", "f_locals", "f_builtins", "tb_frame",
                          "gi_frame", "cr_frame", "ag_frame"})
# torch namespaces whose lower-case members are all functions (for S017/S018).
_TORCH_FUNCTION_SPACES = ("torch.nn.functional.", "torch.ops.", "torch.special.",
                          "torch.linalg.", "torch.fft.", "torch._C._nn.")


@dataclass(frozen=True)
class Finding:
    """One rejection: what was found and on which line (1-based).

    ``rule`` is a stable tag (``syntax``, ``dsl``, ``no-model``, ``no-forward``,
    ``no-kernel``, ``no-launch``, ``torch-op``, ``stream``, ``forbidden-import``,
    ``forbidden-call``, ``environment``, ``dynamic-code``, ``file-io``, ``patch``,
    ``indirection``, ``harness``); ``rule_id`` the rule's id in :data:`RULES`
    (``S001`` ...), empty only for findings made outside this module.
    """

    line: int
    message: str
    rule: str
    rule_id: str = ""

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


def _literal_str(node: ast.AST | None) -> str | None:
    """The value of a string literal, else None."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    return None


def _host_read_why(attr: str) -> str:
    """Why an S022 name is refused, for its finding."""
    if attr in ("__base__", "__bases__", "__mro__", "mro"):
        return (" (walking a type's bases reaches torch's C tensor methods past the "
                "sandbox's host-read guard)")
    return (" (it hands tensor data to numpy or Python, where no kernel computes; do the "
            "work in a Triton kernel: pass the tensor to it and tl.load the values, or "
            "read a scalar parameter with .item())")


def _literal_getattr(node: ast.AST) -> tuple[ast.AST, str] | None:
    """``getattr(obj, "name")`` with a literal name: ``(obj, "name")``, else None."""
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id == "getattr" and len(node.args) >= 2):
        name = _literal_str(node.args[1])
        if name is not None:
            return node.args[0], name
    return None


def _qualname(node: ast.AST, aliases: dict[str, str]) -> str | None:
    """Dotted name of ``node`` with import aliases resolved (``F.relu`` -> ``torch.nn.functional.relu``);
    ``getattr(torch, "relu")`` with a literal name is ``torch.relu``."""
    if isinstance(node, ast.Name):
        return aliases.get(node.id, node.id)
    if isinstance(node, ast.Attribute):
        base = _qualname(node.value, aliases)
        return f"{base}.{node.attr}" if base else None
    literal = _literal_getattr(node)
    if literal is not None:
        base = _qualname(literal[0], aliases)
        return f"{base}.{literal[1]}" if base else None
    return None


def _torch_function(name: str) -> bool:
    """Whether dotted ``name`` is a torch function that computes (``torch.relu``,
    ``torch.nn.functional.gelu``, ``torch.ops.aten.mm.default``); dtypes, devices and
    the allocation/layout calls of :data:`ALLOWED_TORCH_CALLS` are not."""
    if not name.startswith("torch.") or name[len("torch."):] in ALLOWED_TORCH_CALLS:
        return False
    last = name.rsplit(".", 1)[-1]
    if last.rstrip("_") in COMPUTE_METHODS or last in COMPUTE_METHODS:
        return True
    return name.startswith(_TORCH_FUNCTION_SPACES) and last[:1].islower()


def _watched_function(name: str) -> bool:
    """Functions a candidate must call by name if at all (S017): torch compute
    functions, timers, and anything of the harness's modules."""
    root = name.split(".")[0]
    if root in ("time", "timeit") and "." in name:
        return True
    return _torch_function(name) or (root in _HARNESS_MODULES and "." in name)


class _Checker:
    def __init__(self, tree: ast.Module) -> None:
        self.tree = tree
        collector = _Aliases()
        collector.visit(tree)
        self.aliases = collector.names
        # Names bound by assignment to a torch function (``f = torch.relu``), attributes
        # set to one (``self.act = F.relu``, or a class attribute), and tables holding
        # them (``OPS = {"r": torch.relu}``): name -> the function(s).
        self.value_aliases: dict[str, str] = {}
        self.attr_aliases: dict[str, str] = {}
        self.tables: dict[str, list[str]] = {}
        self._alias_assignments()
        self.findings: list[Finding] = []
        self._seen: set[tuple[int, str]] = set()
        # Nodes in a call's callee position (``f`` of ``f(x)``): any other load of a
        # name uses it as a value.
        self.callees = {id(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}

    def _alias_assignments(self) -> None:
        """``cuda = torch.cuda`` or ``fast = time.perf_counter``: follow simple rebinding,
        also by tuple unpacking (``f, g = torch.relu, torch.tanh``), into attributes
        (``self.act = F.relu``) and into tables (``OPS = {"r": torch.relu}``)."""
        for node in ast.walk(self.tree):
            if not isinstance(node, ast.Assign):
                continue
            pairs: list[tuple[ast.AST, ast.AST]] = []
            for target in node.targets:
                if (isinstance(target, ast.Tuple | ast.List) and isinstance(node.value, ast.Tuple | ast.List)
                        and len(target.elts) == len(node.value.elts)):
                    pairs.extend(zip(target.elts, node.value.elts, strict=True))
                else:
                    pairs.append((target, node.value))
            for target, value in pairs:
                name = self.qual(value)
                if isinstance(target, ast.Name):
                    if name and name.split(".")[0] in _PROTECTED_ROOTS:
                        self.aliases.setdefault(target.id, name)
                    if name and _watched_function(name):
                        self.value_aliases.setdefault(target.id, name)
                    held = self._table_functions(value)
                    if held:
                        self.tables.setdefault(target.id, held)
                elif (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
                      and target.value.id == "self" and name and _watched_function(name)):
                    self.attr_aliases.setdefault(target.attr, name)
        for cls in (n for n in ast.walk(self.tree) if isinstance(n, ast.ClassDef)):
            for stmt in cls.body:
                if isinstance(stmt, ast.Assign):
                    name = self.qual(stmt.value)
                    if name and _watched_function(name):
                        for target in stmt.targets:
                            if isinstance(target, ast.Name):
                                self.attr_aliases.setdefault(target.id, name)

    def _table_functions(self, node: ast.AST) -> list[str]:
        """Watched functions held by a dict/list/tuple/set literal (one level deep)."""
        if isinstance(node, ast.Dict):
            items = [*node.keys, *node.values]
        elif isinstance(node, ast.List | ast.Tuple | ast.Set):
            items = list(node.elts)
        else:
            return []
        names = [self.qual(item) for item in items if item is not None]
        return [n for n in names if n and _watched_function(n)]

    def add(self, line: int, message: str, rule_id: str) -> None:
        """Record a finding of rule ``rule_id`` (an id of :data:`RULES`), once per line
        and message."""
        if (line, message) not in self._seen:
            self._seen.add((line, message))
            self.findings.append(Finding(line, message, RULES_BY_ID[rule_id].tag, rule_id))

    def qual(self, node: ast.AST) -> str | None:
        return _qualname(node, self.aliases)

    # ------------------------------------------------------------ whole module

    def check_module(self) -> None:
        # Nodes that are called, or are the base of a longer dotted name: the rest of
        # the names that load a watched function use it as a value (S017, S019).
        called = set(self.callees)
        called |= {id(n.value) for n in ast.walk(self.tree) if isinstance(n, ast.Attribute)}
        for node in ast.walk(self.tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and (
                    node.name in _INSTRUMENT_ATTRS or node.name in _HOST_READ_ATTRS):
                self.add(node.lineno, f"{node.name} defined (numpy or torch would call it "
                         "on the candidate's objects, past the op record and the host-read "
                         "guard)", "S023")
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                self._check_import(node)
            elif isinstance(node, ast.Call):
                self._check_call(node)
                self._check_computed_name(node)
            elif isinstance(node, ast.Attribute):
                self._check_attribute(node)
            elif isinstance(node, ast.Name):
                if node.id == "__builtins__":
                    self.add(node.lineno, "__builtins__ used (access to builtins is not "
                             "allowed)", "S013")
            elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
                self._check_patch(node)
            elif isinstance(node, ast.Subscript):
                self._check_namespace_subscript(node)
            elif isinstance(node, ast.Constant) and node.value == TASK_MODULE:
                self.add(node.lineno, f"the task's module name {TASK_MODULE!r} used (a "
                         "candidate must compute its output, not reach the reference it is "
                         "checked against)", "S020")
            if (isinstance(node, ast.Name | ast.Attribute) and isinstance(node.ctx, ast.Load)
                    and id(node) not in called):
                self._check_value_use(node)

    def _check_value_use(self, node: ast.Name | ast.Attribute) -> None:
        """A watched function or dynamic builtin loaded as a value, not called."""
        name = self.qual(node)
        if not name:
            return
        if name in _DYNAMIC_BUILTINS and (isinstance(node, ast.Attribute)
                                          or node.id not in self.aliases):
            self.add(node.lineno, f"{name} used as a value (an alias of {name} hides a dynamic "
                     "call or attribute lookup; call it by name with literal arguments, or "
                     "not at all)", "S019")
        elif _watched_function(name):
            self.add(node.lineno, f"{name} used as a value (stored in a table, aliased, passed "
                     "or returned); torch compute functions, timers and harness functions "
                     "must not be reachable indirectly", "S017")

    def _check_computed_name(self, node: ast.Call) -> None:
        """getattr/setattr/delattr with a non-literal name on a watched root (S016);
        operator.attrgetter/methodcaller with a non-literal name; literal
        methodcaller of a compute method; frame and object-graph walks (S021)."""
        name = self.qual(node.func)
        if name in ("getattr", "setattr", "delattr") and len(node.args) >= 2:
            literal = _literal_str(node.args[1])
            target = self.qual(node.args[0])
            if literal is None and target and target.split(".")[0] in _INDIRECTION_ROOTS:
                self.add(node.lineno, f"{name}({target}, <computed name>) looks up an "
                         f"attribute of {target} by a name built at run time (name "
                         "torch/triton/time attributes literally)", "S016")
            elif literal is None:
                self.add(node.lineno, f"{name}({target or '<object>'}, <computed name>) looks "
                         "up an attribute by a name built at run time (name attributes "
                         "literally)", "S022")
            elif literal in _HOST_READ_ATTRS:
                self.add(node.lineno, f"{name}(..., {literal!r}) reaches .{literal}"
                         f"{_host_read_why(literal)}", "S022")
        elif name in ("operator.attrgetter", "operator.methodcaller") and node.args:
            literal = _literal_str(node.args[0])
            if literal is None:
                self.add(node.lineno, f"{name}(<computed name>) looks up an attribute by a "
                         "name built at run time", "S016")
            elif literal.split(".")[0] in _HOST_READ_ATTRS | _INSTRUMENT_ATTRS:
                self.add(node.lineno, f"{name}({literal!r}) reaches .{literal}"
                         f"{_host_read_why(literal.split('.')[0])}", "S022")
            elif name == "operator.methodcaller" and literal.rstrip("_") in COMPUTE_METHODS:
                self.add(node.lineno, f"operator.methodcaller({literal!r}) calls the tensor "
                         "compute method ." + literal + "() indirectly (do the work in a "
                         "Triton kernel)", "S018")
        elif name in _INTROSPECTION_CALLS:
            self.add(node.lineno, f"{name}() called (walking frames or the garbage "
                     "collector's objects reaches the harness and the task)", "S021")

    def _check_namespace_subscript(self, node: ast.Subscript) -> None:
        """``torch.__dict__[name]`` / ``vars(torch)[name]`` with a computed name (S016),
        and ``sys.modules["aikg_task"]`` (S020, through the literal)."""
        base = node.value
        target = None
        if isinstance(base, ast.Attribute) and base.attr == "__dict__":
            target = self.qual(base.value)
        elif (isinstance(base, ast.Call) and self.qual(base.func) == "vars" and base.args):
            target = self.qual(base.args[0])
        if (target and target.split(".")[0] in _INDIRECTION_ROOTS
                and _literal_str(node.slice) is None):
            self.add(node.lineno, f"{target}'s namespace indexed by a computed name (looks up "
                     f"an attribute of {target} by a name built at run time)", "S016")

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
                                 "S010")
        for module in modules:
            root = module.split(".")[0]
            if module in _INSTRUMENT_SPACES or module.startswith(
                    tuple(p + "." for p in _INSTRUMENT_SPACES)):
                self.add(node.lineno, f"import of {module} is not allowed (torch's dispatch "
                         "machinery and Triton's interpreter internals run work past the op "
                         "record)", "S023")
            if root in _HARNESS_MODULES:
                what = ("the task's module (the reference the candidate is checked against)"
                        if root == TASK_MODULE else "a module of the verification harness")
                self.add(node.lineno, f"import of {module} is not allowed: it is {what}; a "
                         "candidate must compute its output itself", "S020")
            if root in FORBIDDEN_MODULES:
                self.add(node.lineno, f"import of {module} is not allowed (candidates must "
                         "not start threads or processes, load native code, handle signals, "
                         "use the network or files, or import dynamically)", "S009")

    def _os_finding(self, line: int, name: str) -> None:
        attr = name.split(".", 1)[1]
        if attr in ("environ", "environb", "getenv", "getenvb", "putenv", "unsetenv"):
            self.add(line, f"{name} used (candidates must not read or change the "
                     "environment)", "S011")
        elif attr in ("open", "remove", "unlink", "rename", "renames", "replace", "mkdir",
                      "makedirs", "rmdir", "removedirs", "chmod", "chown", "symlink", "link",
                      "truncate", "write", "chdir", "fchdir", "chroot", "dup2"):
            self.add(line, f"{name} used (candidates must not touch files)", "S014")
        else:
            self.add(line, f"{name} used (candidates must not start, replace or end "
                     "processes)", "S010")

    def _check_call(self, node: ast.Call) -> None:
        name = self.qual(node.func)
        if name is None:
            return
        if name == "super" and node.args and (self.qual(node.args[0]) or "").startswith("torch"):
            self.add(node.lineno, f"super({self.qual(node.args[0])}, ...) called (it reaches "
                     "torch's C tensor methods past the sandbox's host-read guard)", "S022")
        if name in _BUILTIN_FORBIDDEN and name not in self.aliases:
            rule = "S014" if name == "open" else "S012"
            why = ("candidates must not open files" if name == "open"
                   else "candidates must not run dynamic code or reach into namespaces")
            self.add(node.lineno, f"{name}() called ({why})", rule)
        elif name in ("setattr", "delattr") and node.args:
            target = self.qual(node.args[0])
            if target and target.split(".")[0] in _PROTECTED_ROOTS:
                self.add(node.lineno, f"{name}({target}, ...) patches a library (timers and "
                         "torch/triton functions must not be replaced)", "S015")
        elif name in _STREAM_CALLS:
            self.add(node.lineno, f"{name} called (candidates must not create or switch "
                     "streams; work runs on the current stream, which the profiler times)",
                     "S008")
        elif name in ("torch.load", "torch.save", "io.open", "numpy.load", "numpy.save"):
            self.add(node.lineno, f"{name} called (candidates must not touch files)", "S014")

    def _check_attribute(self, node: ast.Attribute) -> None:
        name = self.qual(node)
        if name and name.startswith("os.") and name.split(".")[1] in _OS_FORBIDDEN:
            self._os_finding(node.lineno, ".".join(name.split(".")[:2]))
        elif name and name.startswith("sys.") and name.split(".")[1] in _SYS_FORBIDDEN:
            self.add(node.lineno, f"{'.'.join(name.split('.')[:2])} used (candidates must not "
                     "exit, trace, or reach into loaded modules)", "S010")
        elif node.attr in _HOST_READ_ATTRS:
            self.add(node.lineno, f".{node.attr} used{_host_read_why(node.attr)}", "S022")
        elif node.attr in _INSTRUMENT_ATTRS or (name and name.startswith(
                tuple(p + "." for p in _INSTRUMENT_SPACES))):
            self.add(node.lineno, f"{name or '.' + node.attr} used (torch's dispatch and "
                     "subclass machinery hides work from the op record; do the work in a "
                     "Triton kernel)", "S023")
        elif node.attr in _DUNDER_FORBIDDEN:
            self.add(node.lineno, f"{node.attr} accessed (reaching into module or function "
                     "internals is not allowed)", "S013")
        elif node.attr in _FRAME_ATTRS:
            self.add(node.lineno, f".{node.attr} accessed (walking frames reaches the "
                     "harness and the task)", "S021")

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
                                 "S015")
                        break

    # ------------------------------------------------------------ kernels and forward

    def kernels(self) -> dict[str, int]:
        """Triton kernels, module-level or defined inside a function (a kernel factory,
        or a kernel written inside ``forward``): name -> line."""
        found: dict[str, int] = {}
        for node in ast.walk(self.tree):
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

    def kernel_holders(self, kernels: dict[str, int]) -> tuple[set[str], set[str]]:
        """Names and ``self`` attributes that hold a kernel: bound to a kernel's name
        (``k = relu_kernel``) or to what a kernel factory returns (``self.k =
        make_kernel(...)``, where ``make_kernel`` defines a jit kernel and returns it)."""
        factories = set()
        for node in ast.walk(self.tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for sub in _walk_body(node):
                    if (isinstance(sub, ast.Return) and isinstance(sub.value, ast.Name)
                            and sub.value.id in kernels):
                        factories.add(node.name)
        names: set[str] = set()
        attrs: set[str] = set()
        for node in ast.walk(self.tree):
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

    def check_model(self) -> None:
        classes = {n.name: n for n in self.tree.body if isinstance(n, ast.ClassDef)}
        functions: dict[str, ast.AST] = {
            n.name: n for n in self.tree.body
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        # ``act = lambda t: ...`` at module level is called like a function.
        for n in self.tree.body:
            if isinstance(n, ast.Assign) and isinstance(n.value, ast.Lambda):
                for t in n.targets:
                    if isinstance(t, ast.Name):
                        functions.setdefault(t.id, n.value)
        kernels = self.kernels()
        model = classes.get("ModelNew")
        if model is None:
            self.add(1, "class ModelNew is not defined (define class ModelNew(nn.Module) with "
                     "the task Model's constructor and forward signature)", "S003")
            return
        methods = _methods(model)
        forward = methods.get("forward")
        if forward is None:
            self.add(model.lineno, "ModelNew has no forward method", "S004")
            return
        if not kernels:
            self.add(model.lineno, "no @triton.jit kernel is defined (write the computation as "
                     "a Triton kernel and launch it from ModelNew.forward)", "S005")
        submodules = self._submodules(methods.get("__init__"))
        holder_names, holder_attrs = self.kernel_holders(kernels)
        launched = False
        # Breadth-first over forward and the helpers it calls in this module; a module
        # function used as a value (stored on self in __init__, passed, put in a
        # table) may be called from forward under another name, so it counts as called.
        queue: deque[tuple[ast.AST, str, ast.ClassDef | None]] = deque(
            [(forward, "ModelNew.forward", model)])
        visited = {id(forward)}
        for node in ast.walk(self.tree):
            if (isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)
                    and id(node) not in self.callees and node.id in functions
                    and node.id not in kernels and id(functions[node.id]) not in visited):
                visited.add(id(functions[node.id]))
                queue.append((functions[node.id], f"{node.id} (a function used as a value)",
                              None))
        while queue:
            func, where, owner = queue.popleft()
            for node in _walk_body(func, skip=_off_gpu_branches):
                if isinstance(node, ast.BinOp) and isinstance(node.op, ast.MatMult):
                    self.add(node.lineno, f"matrix multiply operator @ used in {where} (torch "
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
                    elif isinstance(base, ast.Name) and base.id in self.tables:
                        held = ", ".join(self.tables[base.id])
                        self.add(node.lineno, f"{base.id}[...] (a table of {held}) called in "
                                 f"{where} (torch compute ops are not allowed; do the work "
                                 "in a Triton kernel)", "S018")
                    continue
                self._check_compute(node, where, submodules if owner is model else {})
                # Functions defined inside this one (not kernels) are helpers too.
                local = {n.name: n for n in _walk_body(func)
                         if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                         and n.name not in kernels}
                for callee, callee_where, callee_owner in self._callees(
                        node, owner, classes, {**functions, **local}, kernels, submodules):
                    if id(callee) not in visited:
                        visited.add(id(callee))
                        queue.append((callee, f"{callee_where} (called from ModelNew.forward)",
                                      callee_owner))
        if kernels and not launched:
            self.add(forward.lineno, "ModelNew.forward never launches a Triton kernel (expected "
                     "kernel[grid](...) in forward or in a helper it calls)", "S006")

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
        if isinstance(func, ast.Name) and func.id in self.value_aliases:
            self.add(node.lineno, f"{func.id} (an alias of {self.value_aliases[func.id]}) "
                     f"called in {where} ({why})", "S018")
            return
        if (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name)
                and func.value.id == "self" and func.attr in self.attr_aliases):
            self.add(node.lineno, f"self.{func.attr} ({self.attr_aliases[func.attr]}) called "
                     f"in {where} ({why})", "S018")
            return
        literal = _literal_getattr(func)
        if literal is not None:
            if name and name.startswith("torch."):
                if name[len("torch."):] not in ALLOWED_TORCH_CALLS:
                    self.add(node.lineno, f"getattr(..., {literal[1]!r}) reaches {name}, "
                             f"called in {where} ({why})", "S018")
            elif literal[1].rstrip("_") in COMPUTE_METHODS:
                self.add(node.lineno, f"getattr(..., {literal[1]!r}) reaches the tensor "
                         f"method .{literal[1]}(), called in {where} ({why})", "S018")
            return
        if name and name.startswith("torch."):
            short = name[len("torch."):]
            if short not in ALLOWED_TORCH_CALLS and name not in _STREAM_CALLS:
                self.add(node.lineno, f"{name} called in {where} ({why})", "S007")
            return
        if not isinstance(func, ast.Attribute):
            return
        base = func.value
        if (isinstance(base, ast.Name) and base.id == "self" and func.attr in submodules):
            self.add(node.lineno, f"self.{func.attr} ({submodules[func.attr]}) called in {where} "
                     "(torch modules compute in PyTorch; keep its parameters but do the work "
                     "in a Triton kernel)", "S007")
            return
        base_name = self.qual(base)
        if base_name and base_name.split(".")[0] in self.aliases:
            return  # a module function (math.exp, triton.cdiv), not a tensor method
        method = func.attr
        if method.endswith("_") and not method.endswith("__"):
            method = method[:-1]
        if method in COMPUTE_METHODS:
            self.add(node.lineno, f".{func.attr}() called in {where} ({why})", "S007")

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


def _walk_body(func: ast.AST, skip: Any = None):
    """Nodes of a function (or lambda) body, not descending into nested functions or
    classes; ``skip(node)`` names child statements not to descend into."""
    body = getattr(func, "body", [])
    stack = list(body) if isinstance(body, list) else [body]
    while stack:
        node = stack.pop()
        yield node
        skipped = skip(node) if skip is not None else ()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            if any(child is s for s in skipped):
                continue
            stack.append(child)


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
                           "kernels)", "dsl", "S002")]
    try:
        tree = ast.parse(code)
    except SyntaxError as exc:
        text = f": {exc.text.strip()}" if exc.text and exc.text.strip() else ""
        return [Finding(exc.lineno or 1, f"SyntaxError: {exc.msg}{text}", "syntax", "S001")]
    checker = _Checker(tree)
    checker.check_module()
    checker.check_model()
    return sorted(checker.findings, key=lambda f: f.line)
