"""Static checks of candidate sources (no processes, no torch)."""

from __future__ import annotations

import textwrap

import pytest

from services.worker.static_check import RULES, RULES_BY_ID, Finding, check_candidate
from tests.corpus import CORPUS
from tests.support_candidates import TRITON_IMPORTS, relu_jit, relu_model

HEADER = (TRITON_IMPORTS.replace("import triton\n", "import torch.nn.functional as F\nimport triton\n")
          + "\n\n" + relu_jit())

GOOD_FORWARD = "\n" + relu_model(returns="out.view(x.shape)")


def candidate(body: str, header: str = HEADER) -> str:
    return header + textwrap.dedent(body)


def rules(findings: list[Finding]) -> set[str]:
    return {f.rule for f in findings}


def test_good_candidate_passes():
    assert check_candidate(candidate(GOOD_FORWARD), "triton") == []
    assert check_candidate(candidate(GOOD_FORWARD), "triton_cuda") == []


def test_helper_function_and_method_launch_count():
    code = candidate("""
    def launch(x, out):
        n = x.numel()
        relu_kernel[(triton.cdiv(n, 1024),)](x, out, n, BLOCK_SIZE=1024)

    class ModelNew(nn.Module):
        def _run(self, x):
            out = torch.empty_like(x)
            launch(x, out)
            return out

        def forward(self, x):
            return self._run(x.contiguous())
    """)
    assert check_candidate(code) == []


def test_autotune_and_call_form_kernels():
    code = candidate("""
    def _body(x_ptr, n, BLOCK: tl.constexpr):
        pass

    body_kernel = triton.autotune(configs=[], key=["n"])(triton.jit(_body))

    class ModelNew(nn.Module):
        def forward(self, x):
            body_kernel[lambda meta: (1,)](x, x.numel())
            out = torch.empty_like(x)
            return out
    """, header="import torch\nimport torch.nn as nn\nimport triton\nimport triton.language as tl\n")
    assert check_candidate(code) == []


def test_syntax_error_reports_line():
    findings = check_candidate("import torch\n\ndef broken(:\n    pass\n")
    assert len(findings) == 1
    assert findings[0].rule == "syntax"
    assert findings[0].line == 3
    assert str(findings[0]).startswith("line 3: SyntaxError")


def test_missing_model_new():
    findings = check_candidate(HEADER)
    assert rules(findings) == {"no-model"}
    assert "class ModelNew is not defined" in findings[0].message


def test_no_kernel_defined_and_torch_op():
    code = """\
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def forward(self, x):
        return torch.relu(x)
"""
    findings = check_candidate(code)
    assert rules(findings) == {"no-kernel", "torch-op"}
    torch_op = next(f for f in findings if f.rule == "torch-op")
    assert str(torch_op) == ("line 7: torch.relu called in ModelNew.forward (torch compute ops "
                             "are not allowed; do the work in a Triton kernel)")


def test_kernel_defined_but_never_launched():
    code = candidate("""
    class ModelNew(nn.Module):
        def forward(self, x):
            out = torch.empty_like(x)
            return out
    """)
    assert rules(check_candidate(code)) == {"no-launch"}


@pytest.mark.parametrize("expr, shown", [
    ("F.relu(x)", "torch.nn.functional.relu called"),
    ("torch.nn.functional.gelu(x)", "torch.nn.functional.gelu called"),
    ("torch.matmul(x, x)", "torch.matmul called"),
    ("x.relu()", ".relu() called"),
    ("x.sum(dim=0)", ".sum() called"),
    ("x.exp_()", ".exp_() called"),
    ("x @ x", "matrix multiply operator @"),
])
def test_torch_compute_in_forward_is_rejected(expr, shown):
    code = candidate(f"""
    class ModelNew(nn.Module):
        def forward(self, x):
            out = torch.empty_like(x)
            relu_kernel[(1,)](x, out, x.numel(), BLOCK_SIZE=1024)
            y = {expr}
            return out
    """)
    findings = check_candidate(code)
    assert rules(findings) == {"torch-op"}, findings
    assert shown in findings[0].message
    assert "in ModelNew.forward" in findings[0].message


def test_torch_compute_in_helper_is_attributed():
    code = candidate("""
    def finish(out):
        return torch.tanh(out)

    class ModelNew(nn.Module):
        def forward(self, x):
            out = torch.empty_like(x)
            relu_kernel[(1,)](x, out, x.numel(), BLOCK_SIZE=1024)
            return finish(out)
    """)
    findings = check_candidate(code)
    assert len(findings) == 1
    assert "torch.tanh called in finish (called from ModelNew.forward)" in findings[0].message


def test_calling_nn_submodule_in_forward_is_rejected_but_parameters_are_fine():
    code = candidate("""
    class ModelNew(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(4, 4)
            self.scale = nn.Parameter(torch.ones(4))

        def forward(self, x):
            out = torch.empty_like(x)
            relu_kernel[(1,)](x, self.linear.weight, x.numel(), BLOCK_SIZE=1024)
            return self.linear(out)
    """)
    findings = check_candidate(code)
    assert len(findings) == 1
    assert "self.linear (torch.nn.Linear) called in ModelNew.forward" in findings[0].message


def test_torch_ops_outside_forward_are_allowed():
    code = candidate(GOOD_FORWARD + """
def make_weights():
    return torch.randn(4, 4).relu()
""")
    assert check_candidate(code) == []


@pytest.mark.parametrize("snippet, rule", [
    ("stream = torch.cuda.Stream()", "stream"),
    ("with torch.cuda.stream(torch.cuda.Stream()):\n    pass", "stream"),
    ("import threading", "forbidden-import"),
    ("from multiprocessing import Pool", "forbidden-import"),
    ("import subprocess", "forbidden-import"),
    ("import concurrent.futures", "forbidden-import"),
    ("import ctypes", "forbidden-import"),
    ("import cffi", "forbidden-import"),
    ("import signal", "forbidden-import"),
    ("import socket", "forbidden-import"),
    ("import os\nos.fork()", "forbidden-call"),
    ("import os\nos.system('ls')", "forbidden-call"),
    ("import os\nos.execv('/bin/sh', ['sh'])", "forbidden-call"),
    ("import os\nos._exit(0)", "forbidden-call"),
    ("from os import _exit", "forbidden-call"),
    ("import os\nkey = os.environ['AIKG_LLM_API_KEY']", "environment"),
    ("import os\nkey = os.getenv('HOME')", "environment"),
    ("from os import environ", "environment"),
    ("import time\ntime.perf_counter = lambda: 0.0", "patch"),
    ("torch.cuda.Event = object", "patch"),
    ("torch.cuda.Event.elapsed_time = lambda self, other: 0.001", "patch"),
    ("setattr(torch, 'relu', lambda x: x)", "patch"),
    ("torch.testing.assert_close = lambda *a, **k: None", "patch"),
    ("import builtins", "forbidden-import"),
    ("torch.nn.functional.__dict__['relu'] = None", "patch"),
    ("cuda = torch.cuda\ncuda.synchronize = lambda: None", "patch"),
    ("eval('1')", "dynamic-code"),
    ("exec('x = 1')", "dynamic-code"),
    ("m = __import__('os')", "dynamic-code"),
    ("import importlib", "forbidden-import"),
    ("code = compile('1', 'f', 'eval')", "dynamic-code"),
    ("f = open('/tmp/aikg-escape', 'w')", "file-io"),
    ("data = open('notes.txt').read()", "file-io"),
    ("import sys\nsys.exit(0)", "forbidden-call"),
    ("import sys\nsys.modules['torch'].relu = None", "forbidden-call"),
])
def test_forbidden_constructs(snippet, rule):
    code = candidate(GOOD_FORWARD + "\n" + snippet + "\n")
    findings = check_candidate(code)
    assert rule in rules(findings), findings
    line = len(candidate(GOOD_FORWARD).splitlines()) + 2
    assert any(f.line >= line for f in findings), findings


def test_findings_say_what_and_where():
    code = candidate(GOOD_FORWARD + "\nimport time\ntime.perf_counter = lambda: 0.0\n")
    findings = check_candidate(code)
    patch = next(f for f in findings if f.rule == "patch")
    assert str(patch).startswith(f"line {patch.line}: assignment to time.perf_counter patches")


def test_forbidden_inside_forward_too():
    code = candidate("""
    import os

    class ModelNew(nn.Module):
        def forward(self, x):
            out = torch.empty_like(x)
            relu_kernel[(1,)](x, out, x.numel(), BLOCK_SIZE=1024)
            os._exit(0)
            return out
    """)
    findings = check_candidate(code)
    assert rules(findings) == {"forbidden-call"}
    assert "os._exit used" in findings[0].message


def test_unsupported_dsl():
    assert rules(check_candidate(candidate(GOOD_FORWARD), "cuda_c")) == {"dsl"}


def test_model_without_forward():
    code = candidate("""
    class ModelNew(nn.Module):
        def __init__(self):
            super().__init__()
    """)
    findings = check_candidate(code)
    assert [(f.rule, f.rule_id) for f in findings] == [("no-forward", "S004")]
    assert "ModelNew has no forward method" in findings[0].message


@pytest.mark.parametrize("terms", [1_000, 20_000])
def test_source_too_deep_to_walk_is_refused(terms):
    """A sum of 1,000 terms parses but is too deep for the checker's walk; of 20,000,
    too deep for ast.parse itself. Either is refused (S024), not raised: raised, it made
    the verification the worker's fault (stage infrastructure)."""
    code = (candidate(GOOD_FORWARD) + "\n\ndef chain(x):\n    return "
            + "+".join(["x"] * terms) + "\n")
    findings = check_candidate(code)
    assert [(f.rule, f.rule_id) for f in findings] == [("too-deep", "S024")], findings
    assert "nested too deeply" in str(findings[0])
    # the same candidate with the sum in steps is fine
    steps = candidate(GOOD_FORWARD) + "\n\ndef chain(x):\n    y = x + x\n    return y + x\n"
    assert check_candidate(steps) == []


# --- indirection -----------------------------------------------------------------------


def in_forward(snippet: str, module: str = "") -> str:
    """A correct relu candidate with ``module`` code before ModelNew and ``snippet`` in
    its forward (after the launch)."""
    body = textwrap.indent(textwrap.dedent(snippet).strip(), " " * 8)
    return (HEADER + textwrap.dedent(module) + "\n\nclass ModelNew(nn.Module):\n"
            "    def forward(self, x):\n        out = torch.empty_like(x)\n"
            "        relu_kernel[(1,)](x, out, x.numel(), BLOCK_SIZE=1024)\n"
            f"{body}\n        return out\n")


def only(findings: list[Finding], rule_id: str) -> list[Finding]:
    return [f for f in findings if f.rule_id == rule_id]


@pytest.mark.parametrize("snippet, module, shown", [
    ('y = getattr(torch, "r" + "elu")(x)', "", "getattr(torch, <computed name>)"),
    ("name = 'relu'\ny = getattr(F, name)(x)", "", "getattr(torch.nn.functional, <computed name>)"),
    ("setattr(time, NAME, lambda: 0.0)", "import time\nNAME = 'perf_counter'\n",
     "setattr(time, <computed name>)"),
    ("delattr(triton, ''.join(['c', 'div']))", "", "delattr(triton, <computed name>)"),
    ("y = vars(torch)['re' + 'lu'](x)", "", "torch's namespace indexed by a computed name"),
    ("y = torch.nn.functional.__dict__['ge' + 'lu'](x)", "",
     "torch.nn.functional's namespace indexed by a computed name"),
    ("y = operator.attrgetter('re' + 'lu')(torch)(x)", "import operator\n",
     "operator.attrgetter(<computed name>)"),
    ("v = getattr(verifier, 'check_' + 'candidate')", "from services.worker import verifier\n",
     "getattr(services.worker.verifier, <computed name>)"),
], ids=["getattr_torch", "getattr_F", "setattr_time", "delattr_triton", "vars_torch",
        "dict_F", "attrgetter", "getattr_harness"])
def test_computed_attribute_names(snippet, module, shown):
    findings = check_candidate(in_forward(snippet, module))
    found = only(findings, "S016")
    assert found, findings
    assert found[0].rule == "indirection"
    assert shown in found[0].message


@pytest.mark.parametrize("snippet, shown", [
    ("a = x.numpy()", ".numpy used (it hands tensor data to numpy or Python"),
    ("a = x.detach().tolist()", ".tolist used"),
    ("a = x.__array__()", ".__array__ used"),
    ("a = x.__dlpack__()", ".__dlpack__ used"),
    ("s = x.untyped_storage()", ".untyped_storage used"),
    ("a = getattr(x, 'numpy')()", "getattr(..., 'numpy') reaches .numpy"),
    ("a = getattr(x, 'nu' + 'mpy')()", "getattr(x, <computed name>) looks up an attribute"),
    ("n = 'tolist'\na = getattr(out, n)()", "getattr(out, <computed name>)"),
    ("b = type(x).__base__", ".__base__ used (walking a type's bases"),
    ("a = x.__class__.__mro__[1]", ".__mro__ used"),
    ("a = type(x).mro()[1]", ".mro used"),
    ("a = super(torch.Tensor, x).tolist()", ".tolist used"),
], ids=["numpy", "tolist", "array", "dlpack", "storage", "literal_getattr", "computed_getattr",
        "computed_getattr_variable", "base", "mro_attr", "mro_call", "super"])
def test_host_reads_and_type_walks(snippet, shown):
    findings = check_candidate(in_forward(snippet))
    found = only(findings, "S022")
    assert found, findings
    assert found[0].rule == "host-read" and shown in found[0].message, found[0].message


def test_computed_names_are_refused_on_self_too():
    # self may be any object a helper was handed (a parameter named self).
    found = only(check_candidate(in_forward("w = getattr(self, 'w' + '0', None)")), "S022")
    assert found and "getattr(self, <computed name>)" in found[0].message


@pytest.mark.parametrize("snippet, module, shown", [
    ("with torch._C._DisableTorchDispatch():\n    pass", "", "torch._C._DisableTorchDispatch used"),
    ("m = torch.utils._python_dispatch._get_current_dispatch_mode()", "",
     "torch.utils._python_dispatch._get_current_dispatch_mode used"),
    ("y = out.as_subclass(torch.Tensor)", "", ".as_subclass used"),
    ("pass", "class Lazy(torch.Tensor):\n    @classmethod\n    def __torch_function__(cls, f, t, a=(), k=None):\n        return f(*a)\n",
     "__torch_function__ defined"),
    ("pass", "class Raw:\n    @property\n    def __array_interface__(self):\n        return {}\n",
     "__array_interface__ defined"),
    ("f = operator.methodcaller('numpy')", "import operator\n",
     "operator.methodcaller('numpy') reaches .numpy"),
    ("b = inspect.getmro(torch.Tensor)[1]", "import inspect\n", ".getmro used"),
    ("a = super(torch.Tensor, x)", "", "super(torch.Tensor, ...) called"),
    ("v = ti.load", "from triton._C.libtriton import interpreter as ti\n",
     "import of triton._C.libtriton is not allowed"),
    ("v = interpreter.GridExecutor", "from triton.runtime import interpreter\n",
     "triton.runtime.interpreter.GridExecutor used"),
    ("m = m", "from torch.utils._python_dispatch import _get_current_dispatch_mode as m\n",
     "import of torch.utils._python_dispatch is not allowed"),
], ids=["disable_dispatch", "current_mode", "as_subclass", "torch_function",
        "array_interface", "methodcaller", "getmro", "super", "interpreter_import",
        "interpreter_attr", "dispatch_import"])
def test_instrument_tampering(snippet, module, shown):
    findings = check_candidate(in_forward(snippet, module))
    assert any(shown in f.message for f in findings), findings


def test_a_function_stored_on_self_counts_as_called_from_forward():
    module = "def helper(t, o):\n    o.copy_(torch.relu(t))\n    return o\n"
    code = in_forward("y = self.h(x, out)", module).replace(
        "class ModelNew(nn.Module):\n", "class ModelNew(nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n        self.h = helper\n\n")
    found = only(check_candidate(code), "S007")
    assert found and "torch.relu called in helper (a function used as a value)" in \
        found[0].message, check_candidate(code)


@pytest.mark.parametrize("snippet, module, shown", [
    ("y = OPS['r'](x)", "OPS = {'r': torch.relu, 'g': F.gelu}\n", "torch.relu used as a value"),
    ("y = [torch.relu][0](x)", "", "torch.relu used as a value"),
    ("y = (F.gelu, F.silu)[1](x)", "", "torch.nn.functional.gelu used as a value"),
    ("y = apply(torch.tanh, x)", "def apply(fn, t):\n    return fn(t)\n",
     "torch.tanh used as a value"),
    ("y = pick()(x)", "def pick():\n    return torch.sigmoid\n", "torch.sigmoid used as a value"),
    ("t = CLOCK()", "import time\nCLOCK = time.perf_counter\n", "time.perf_counter used as a value"),
    ("y = torch.ops.aten.relu.default", "", "torch.ops.aten.relu.default used as a value"),
], ids=["dict", "list", "tuple", "argument", "returned", "timer", "aten"])
def test_function_tables_and_references(snippet, module, shown):
    findings = check_candidate(in_forward(snippet, module))
    found = only(findings, "S017")
    assert found, findings
    assert found[0].rule == "indirection" and shown in found[0].message


@pytest.mark.parametrize("snippet, module, init, shown", [
    ("y = f(x)", "f = torch.relu\n", "", "f (an alias of torch.relu) called in ModelNew.forward"),
    ("y = g(x)", "g, h = torch.tanh, torch.exp\n", "",
     "g (an alias of torch.tanh) called in ModelNew.forward"),
    ("y = self.act(x)", "", "self.act = F.relu",
     "self.act (torch.nn.functional.relu) called in ModelNew.forward"),
    ("y = OPS['r'](x)", "OPS = {'r': torch.relu}\n", "",
     "OPS[...] (a table of torch.relu) called in ModelNew.forward"),
    ('y = getattr(torch, "relu")(x)', "", "",
     "getattr(..., 'relu') reaches torch.relu, called in ModelNew.forward"),
    ('y = getattr(x, "sum")()', "", "", "getattr(..., 'sum') reaches the tensor method .sum()"),
    ("y = operator.methodcaller('relu')(x)", "import operator\n", "",
     "operator.methodcaller('relu') calls the tensor compute method .relu()"),
], ids=["alias", "unpacked_alias", "attribute", "table", "literal_getattr", "tensor_getattr",
        "methodcaller"])
def test_torch_calls_through_aliases(snippet, module, init, shown):
    code = in_forward(snippet, module)
    if init:
        code = code.replace("class ModelNew(nn.Module):\n",
                            "class ModelNew(nn.Module):\n    def __init__(self):\n"
                            f"        super().__init__()\n        {init}\n\n")
    findings = check_candidate(code)
    found = only(findings, "S018")
    assert found, findings
    assert found[0].rule == "torch-op" and shown in found[0].message


def test_lambda_helper_is_followed_from_forward():
    findings = check_candidate(in_forward("y = act(x)", "act = lambda t: torch.relu(t)\n"))
    assert [(f.rule_id, f.message.split(" (")[0]) for f in findings] == [
        ("S007", "torch.relu called in act")]


@pytest.mark.parametrize("snippet, module, shown", [
    ("e('1 + 1')", "e = eval\n", "eval used as a value"),
    ("[exec][0]('z = 1')", "", "exec used as a value"),
    ("y = g(torch, 're' + 'lu')(x)", "g = getattr\n", "getattr used as a value"),
    ("c = {'c': compile}", "", "compile used as a value"),
    ("m = imp('os')", "imp = __import__\n", "__import__ used as a value"),
], ids=["eval", "exec", "getattr", "compile", "__import__"])
def test_aliases_of_dynamic_builtins(snippet, module, shown):
    findings = check_candidate(in_forward(snippet, module))
    found = only(findings, "S019")
    assert found, findings
    assert found[0].rule == "dynamic-code" and shown in found[0].message


def test_alias_of_importlib_import_module():
    findings = check_candidate(in_forward("m = load('os')", "import importlib\n"
                                          "load = importlib.import_module\n"))
    assert {"S009", "S019"} <= {f.rule_id for f in findings}, findings
    assert any("importlib.import_module used as a value" in f.message for f in findings)


@pytest.mark.parametrize("snippet, module, shown", [
    ("", "import aikg_task\n", "import of aikg_task is not allowed: it is the task's module"),
    ("", "from aikg_task import Model\n", "import of aikg_task is not allowed"),
    ("ref = sys.modules.get('aikg_task')", "import sys\n", "the task's module name 'aikg_task'"),
    ("", "import __main__\n", "import of __main__ is not allowed: it is a module of the "
     "verification harness"),
    ("", "from services.worker import correctness\n", "import of services.worker is not allowed"),
    ("", "import schemas.events\n", "import of schemas.events is not allowed"),
], ids=["import_task", "from_task", "sys_modules_task", "main", "services", "schemas"])
def test_task_and_harness_imports(snippet, module, shown):
    findings = check_candidate(in_forward(snippet or "pass", module))
    found = only(findings, "S020")
    assert found, findings
    assert found[0].rule == "harness" and shown in found[0].message


@pytest.mark.parametrize("snippet, module, shown", [
    ("objs = gc.get_objects()", "import gc\n", "gc.get_objects() called"),
    ("refs = gc.get_referrers(x)", "import gc\n", "gc.get_referrers() called"),
    ("frame = inspect.currentframe()", "import inspect\n", "inspect.currentframe() called"),
    ("stack = inspect.stack()", "import inspect\n", "inspect.stack() called"),
    ("try:\n    raise ValueError\nexcept ValueError as e:\n    g = e.__traceback__.tb_frame",
     "", ".tb_frame accessed"),
], ids=["gc_objects", "gc_referrers", "currentframe", "stack", "traceback_frame"])
def test_frame_and_object_graph_walks(snippet, module, shown):
    findings = check_candidate(in_forward(snippet, module))
    found = only(findings, "S021")
    assert found, findings
    assert found[0].rule == "harness" and shown in found[0].message


# --- honest kernels: no false positives --------------------------------------------------

TRITON_HEADER = "import torch\nimport torch.nn as nn\nimport triton\nimport triton.language as tl\n"


def test_nested_jit_kernel_inside_forward_counts_as_launched():
    code = TRITON_HEADER + textwrap.dedent("""
    class ModelNew(nn.Module):
        def forward(self, x):
            @triton.jit
            def relu_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
                offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
                m = offs < n
                v = tl.load(x_ptr + offs, mask=m)
                tl.store(out_ptr + offs, tl.where(v > 0, v, 0.0), mask=m)

            x = x.contiguous()
            out = torch.empty_like(x)
            n = x.numel()
            relu_kernel[(triton.cdiv(n, 1024),)](x, out, n, BLOCK=1024)
            return out.view(x.shape)
    """)
    assert check_candidate(code) == []


def test_kernel_from_a_factory_held_on_self_counts_as_launched():
    code = TRITON_HEADER + textwrap.dedent("""
    def make_kernel(scale):
        @triton.jit
        def scale_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
            offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            m = offs < n
            tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=m) * 2.0, mask=m)
        return scale_kernel

    class ModelNew(nn.Module):
        def __init__(self):
            super().__init__()
            self.kernel = make_kernel(2.0)

        def forward(self, x):
            out = torch.zeros(x.shape, device=x.device, dtype=x.dtype)
            n = x.numel()
            self.kernel[(triton.cdiv(n, 256),)](x.reshape(-1), out, n, BLOCK=256)
            return out
    """)
    assert check_candidate(code) == []


def test_timing_events_sync_dtype_tables_and_autotune_are_not_compute():
    code = TRITON_HEADER + textwrap.dedent("""
    DTYPES = {torch.float16: tl.float16, torch.float32: tl.float32}

    @triton.autotune(configs=[triton.Config({"BLOCK": 128}, num_warps=4),
                              triton.Config({"BLOCK": 256}, num_warps=8)], key=["n"])
    @triton.jit
    def relu_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        x = tl.load(x_ptr + offs, mask=m)
        tl.store(out_ptr + offs, tl.maximum(x, 0.0), mask=m)

    class ModelNew(nn.Module):
        def forward(self, x):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            x = x.contiguous()
            out = torch.empty(x.shape, device=x.device, dtype=x.dtype)
            n = x.numel()
            grid = lambda meta: (triton.cdiv(n, meta["BLOCK"]),)
            relu_kernel[grid](x, out, n)
            end.record()
            torch.cuda.synchronize()
            elapsed_ms = start.elapsed_time(end)
            return out.view(-1).reshape(x.shape)
    """)
    assert check_candidate(code) == []


def test_matmul_with_several_kernels_and_layout_helpers_passes():
    # The corpus's matmul with a zeroing kernel, its launch moved into a helper that reads
    # the sizes off the tensors, and its output cast back.
    code = (CORPUS / "honest" / "tiled_matmul_zeroed_first.py").read_text()
    launch = ("        grid = (triton.cdiv(M, 64), triton.cdiv(N, 64))\n"
              "        matmul_kernel[grid](A, B, C, M, N, K, BLOCK_M=64, BLOCK_N=64, BLOCK_K=64)\n"
              "        return C\n")
    assert launch in code
    helper = ("def launch(a, b, c):\n    M, K = a.shape\n    N = b.shape[1]\n"
              "    grid = (triton.cdiv(M, 64), triton.cdiv(N, 64))\n"
              "    matmul_kernel[grid](a, b, c, M, N, K, BLOCK_M=64, BLOCK_N=64, BLOCK_K=64)\n\n\n")
    code = code.replace(launch, "        launch(A, B, C)\n        return C.to(A.dtype)\n").replace(
        "class ModelNew", helper + "class ModelNew")
    assert check_candidate(code) == []


# --- the rules table -------------------------------------------------------------------


def test_every_rule_has_an_id_a_source_and_an_existing_test():
    import importlib
    import inspect
    import pkgutil
    import re
    import sys

    from services.worker import static_check

    ids = [r.id for r in RULES]
    assert len(ids) == len(set(ids)) and all(re.fullmatch(r"S\d{3}", i) for i in ids)
    here = sys.modules[__name__]
    for rule in RULES:
        assert rule.catches and rule.source and rule.tag, rule
        path, _, name = rule.test.partition("::")
        assert path == "tests/unit/test_static_check.py" and callable(getattr(here, name, None)), rule
    # The ids the rule modules report are exactly the table's: none missing, none unused.
    modules = [m.name for m in pkgutil.iter_modules(static_check.__path__) if m.name != "table"]
    assert {"checker", "model", "torch_ops"} <= set(modules)
    checker = "".join(
        inspect.getsource(importlib.import_module(f"{static_check.__name__}.{name}"))
        for name in modules)
    assert set(re.findall(r'"(S\d{3})"', checker)) == set(ids)


def test_findings_carry_their_rule_id_and_tag():
    for code in (candidate(GOOD_FORWARD + "\nimport time\ntime.perf_counter = lambda: 0.0\n"),
                 in_forward('y = getattr(torch, "r" + "elu")(x)'),
                 "import torch\n\ndef broken(:\n    pass\n"):
        for finding in check_candidate(code):
            assert RULES_BY_ID[finding.rule_id].tag == finding.rule, finding
