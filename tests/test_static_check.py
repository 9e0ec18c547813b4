"""Static checks of candidate sources (no processes, no torch)."""

from __future__ import annotations

import textwrap

import pytest

from services.worker.static_check import Finding, check_candidate

HEADER = """\
import torch
import torch.nn as nn
import torch.nn.functional as F
import triton
import triton.language as tl


@triton.jit
def relu_kernel(x_ptr, out_ptr, n, BLOCK_SIZE: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    m = offs < n
    x = tl.load(x_ptr + offs, mask=m)
    tl.store(out_ptr + offs, tl.maximum(x, 0.0), mask=m)
"""

GOOD_FORWARD = """
class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        x = x.contiguous()
        out = torch.empty_like(x)
        n = x.numel()
        relu_kernel[(triton.cdiv(n, 1024),)](x, out, n, BLOCK_SIZE=1024)
        return out.view(x.shape)
"""


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
