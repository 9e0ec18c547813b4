"""The table of static rules and the finding they report.

:data:`RULES` lists every rule once: its id (``S001`` ...), the :attr:`Finding.rule`
tag it reports under, what it catches, the public report it comes from and the test
that covers it. The rules table of docs/verification.md is rendered from it
(:func:`services.worker.rules.rules_markdown`); the checker modules report by id
(:meth:`services.worker.static_check.checker.Checker.add`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StaticRule:
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

# The single table of static rules; docs/verification.md's rules table is rendered from it.
RULES: tuple[StaticRule, ...] = (
    StaticRule("S001", "syntax", "source that does not parse as Python (stage compile)",
         "Python ast.parse (docs.python.org/3/library/ast.html)",
         _T + "test_syntax_error_reports_line"),
    StaticRule("S002", "dsl", "a request for a DSL other than Triton",
         "Triton language (triton-lang.org)", _T + "test_unsupported_dsl"),
    StaticRule("S003", "no-model", "no class ModelNew", f"{_KB}: solution format (ModelNew)",
         _T + "test_missing_model_new"),
    StaticRule("S004", "no-forward", "ModelNew without a forward method",
         f"{_KB}: solution format (ModelNew.forward)", _T + "test_model_without_forward"),
    StaticRule("S005", "no-kernel", "no @triton.jit kernel defined anywhere in the module",
         f"{_KB_SCOPE}; {_KB_CHECKER}", _T + "test_no_kernel_defined_and_torch_op"),
    StaticRule("S006", "no-launch",
         "kernels defined but ModelNew.forward (or a helper it calls) never launches one",
         _KB_CHECKER, _T + "test_kernel_defined_but_never_launched"),
    StaticRule("S007", "torch-op",
         "torch compute call, tensor compute method, @, or torch.nn submodule call in "
         "forward or the helpers it calls", f"{_KB_SCOPE}; {_WAFER} (benign shortcuts)",
         _T + "test_torch_compute_in_forward_is_rejected"),
    StaticRule("S008", "stream", "creating or switching CUDA/NPU streams",
         f"{_WAFER} (stream injection); {_KGUARD}", _T + "test_forbidden_constructs"),
    StaticRule("S009", "forbidden-import",
         "importing threading, multiprocessing, subprocess, ctypes, socket, importlib, "
         "pickle ... (threads, processes, native code, network, dynamic import)",
         f"{_WAFER} (background thread injection); {_KGUARD}",
         _T + "test_forbidden_constructs"),
    StaticRule("S010", "forbidden-call",
         "os process control (fork, system, exec*, _exit, kill ...) and sys.exit, "
         "sys.modules, sys.settrace, sys._getframe ...",
         f"{_KGUARD} (harness manipulation); {_METR}", _T + "test_forbidden_constructs"),
    StaticRule("S011", "environment", "reading or changing the environment (os.environ, os.getenv ...)",
         "CWE-526, sensitive information in environment variables "
         "(cwe.mitre.org/data/definitions/526.html)", _T + "test_forbidden_constructs"),
    StaticRule("S012", "dynamic-code",
         "calling eval, exec, compile, __import__, globals, vars, breakpoint or input",
         f"{_KGUARD} (obfuscated exec)", _T + "test_forbidden_constructs"),
    StaticRule("S013", "dynamic-code",
         "__builtins__ or module/function internals (__globals__, __dict__, __code__, "
         "__subclasses__ ...)", f"{_KGUARD} (obfuscated exec)", _T + "test_forbidden_constructs"),
    StaticRule("S014", "file-io",
         "open(), os file functions, io.open, torch.load/save, numpy.load/save",
         f"{_KGUARD} (result replay)", _T + "test_forbidden_constructs"),
    StaticRule("S015", "patch",
         "assigning, deleting or setattr-ing attributes of torch, triton, time, os, sys, "
         "gc ... (timers, synchronize, comparison functions)",
         f"{_METR} (monkey-patched timers); {_METR_O3}", _T + "test_findings_say_what_and_where"),
    StaticRule("S016", "indirection",
         "a computed attribute name on torch, triton, time, os, sys or the harness's "
         "modules: getattr/setattr/delattr with a non-literal name, X.__dict__[...], "
         "vars(X)[...], operator.attrgetter/methodcaller with a non-literal name",
         f"{_KGUARD} (obfuscation)", _T + "test_computed_attribute_names"),
    StaticRule("S017", "indirection",
         "a torch compute function, timer or harness function used as a value: stored in "
         "a table ({'r': torch.relu}, [torch.relu][0]), aliased, passed or returned",
         f"{_KGUARD} (obfuscation); {_KB_CHECKER}", _T + "test_function_tables_and_references"),
    StaticRule("S018", "torch-op",
         "a torch function called in forward through an alias (f = torch.relu; f(x)), an "
         "attribute (self.act = F.relu), a table (OPS['r'](x)) or a literal getattr",
         f"{_KB_SCOPE}; {_KGUARD} (obfuscation)", _T + "test_torch_calls_through_aliases"),
    StaticRule("S019", "dynamic-code",
         "eval, exec, compile, __import__, importlib.import_module, getattr, setattr, "
         "delattr, globals or vars referenced as a value (an alias hides the call)",
         f"{_KGUARD} (obfuscated exec)", _T + "test_aliases_of_dynamic_builtins"),
    StaticRule("S020", "harness",
         "importing or naming the task's module (aikg_task: the reference the candidate "
         "is checked against) or the harness's own modules (__main__, services, schemas)",
         f"{_METR} (reaching the grader's reference answer)", _T + "test_task_and_harness_imports"),
    StaticRule("S021", "harness",
         "walking frames or the object graph: gc.get_objects/get_referrers/get_referents, "
         "inspect.currentframe/stack/getouterframes/getmembers, sys._current_frames, "
         "f_back/f_globals/f_locals/tb_frame",
         f"{_METR} (tracing call stacks to find the grader's answer)",
         _T + "test_frame_and_object_graph_walks"),
    StaticRule("S022", "host-read",
         "the tensor methods that hand data to numpy or Python (.numpy, .tolist, "
         "__array__, __dlpack__, untyped_storage, storage) and the type-hierarchy "
         "attributes that reach torch's C tensor type past the sandbox's guards "
         "(__base__, __bases__, __mro__, mro), anywhere in the module; getattr, setattr or "
         "delattr with a computed name on any object but self",
         "this project's red-team: a relu computed by numpy through a tensor's numpy view "
         "passed with the ghost replay dodged", _T + "test_host_reads_and_type_walks"),
    StaticRule("S023", "instruments",
         "torch's dispatch and override machinery, which hides ops from the op record or "
         "reaches the recorder (torch._C, torch.utils._python_dispatch, torch.overrides, "
         "torch._subclasses, triton._C, triton.runtime.interpreter ...), tensor "
         "subclasses (__torch_function__, "
         "__torch_dispatch__, .as_subclass, _make_subclass) and __array_interface__-style "
         "methods defined by the candidate",
         "this project's red-team: torch.relu under _DisableTorchDispatch, the recorder's "
         "counts cleared, a lazy output subclass computing after forward",
         _T + "test_instrument_tampering"),
    StaticRule("S024", "too-deep",
         "source nested more deeply than Python's recursion limit lets the checker walk "
         "(a chain of thousands of operators in one expression): a candidate that cannot "
         "be checked is refused rather than failed as the worker's fault",
         "this project's red-team: a 1,000-term sum made every verification an "
         "infrastructure failure", _T + "test_source_too_deep_to_walk_is_refused"),
)
RULES_BY_ID: dict[str, StaticRule] = {r.id: r for r in RULES}


@dataclass(frozen=True)
class Finding:
    """One rejection: what was found and on which line (1-based).

    ``rule`` is a stable tag (``syntax``, ``dsl``, ``no-model``, ``no-forward``,
    ``no-kernel``, ``no-launch``, ``torch-op``, ``stream``, ``forbidden-import``,
    ``forbidden-call``, ``environment``, ``dynamic-code``, ``file-io``, ``patch``,
    ``indirection``, ``harness``, ``host-read``, ``instruments``); ``rule_id`` the
    rule's id in :data:`RULES` (``S001`` ...), empty only for findings made outside
    this package.
    """

    line: int
    message: str
    rule: str
    rule_id: str = ""

    def __str__(self) -> str:
        return f"line {self.line}: {self.message}"

