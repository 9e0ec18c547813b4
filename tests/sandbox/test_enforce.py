"""Enforcement below Python (services/worker/enforce.py), in a real subprocess of its own.

The dispatcher-level refusal of compute operators must not depend on any Python mode:
a compute op reached from a thread, under ``_DisableTorchDispatch``, after every
dispatch mode was popped, or through ``torch.ops.aten`` directly still raises, while
the allowlisted allocation/view/copy operators keep working. Threads and processes
are refused below Python on cpu (seccomp), whatever module asks.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import textwrap

import pytest

from tests.helpers import scaled

COMPUTE_SCRIPT = textwrap.dedent("""
    import json, threading
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode, _pop_mode, _len_torch_dispatch_stack
    from services.worker import enforce

    x = torch.randn(64)
    outcome = {}

    def attempt(name, fn):
        try:
            fn()
            outcome[name] = "ran"
        except Exception as exc:  # the refusal is a RuntimeError from the dispatcher
            outcome[name] = f"refused: {exc}"

    outcome["registrations"] = enforce.block_compute("cpu")

    attempt("mul", lambda: x * 2)
    attempt("aten.mul", lambda: torch.ops.aten.mul.Tensor(x, x))
    attempt("relu_inplace", lambda: x.clone().relu_())
    attempt("matmul", lambda: torch.randn(4, 4) @ torch.randn(4, 4))

    def disabled():
        with torch._C._DisableTorchDispatch():
            x.sin()
    attempt("disable_torch_dispatch", disabled)

    def inference():
        with torch.inference_mode():
            x.exp()
    attempt("inference_mode", inference)

    class Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    def cleared():
        Recorder().__enter__()  # a recorder the candidate then takes off the stack
        while _len_torch_dispatch_stack():
            _pop_mode()
        x.cos()
    attempt("recorder_cleared", cleared)

    result = {}
    def in_thread():
        try:
            x.tanh()
            result["thread"] = "ran"
        except Exception as exc:
            result["thread"] = f"refused: {exc}"
    t = threading.Thread(target=in_thread)
    t.start()
    t.join()
    outcome["thread"] = result["thread"]

    # What a plan may still use: allocation, views, copies.
    y = torch.empty_like(x).fill_(1.0)
    z = x.view(8, 8).t().contiguous().clone().to(torch.float64)
    outcome["allowed"] = [tuple(y.shape), tuple(z.shape), str(z.dtype)]
    print(json.dumps(outcome))
""")

THREADS_SCRIPT = textwrap.dedent("""
    import ctypes.util, json, os, subprocess, sys, threading
    from services.worker import enforce

    refused = []
    notes = enforce.refuse_threads_and_processes("cpu", refused)
    outcome = {"notes": notes}

    def attempt(name, fn):
        try:
            fn()
            outcome[name] = "ran"
        except Exception as exc:
            outcome[name] = f"refused: {type(exc).__name__}: {exc}"

    attempt("threading", lambda: threading.Thread(target=lambda: None).start())
    attempt("fork", os.fork)
    attempt("subprocess", lambda: subprocess.run(["true"]))
    # Below Python: the original C function behind os.fork, reached through ctypes.
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    pid = libc.fork()
    if pid == 0:
        os._exit(0)
    outcome["libc_fork"] = {"pid": pid, "errno": ctypes.get_errno()}
    outcome["refused"] = len(refused)
    print(json.dumps(outcome))
""")


def run(script: str) -> dict:
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=scaled(300), check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_compute_is_refused_below_python():
    outcome = run(COMPUTE_SCRIPT)
    assert outcome["registrations"] > 500, outcome["registrations"]
    for name in ("mul", "aten.mul", "relu_inplace", "matmul", "disable_torch_dispatch",
                 "inference_mode", "recorder_cleared", "thread"):
        assert outcome[name].startswith("refused:"), (name, outcome[name])
        assert "aten." in outcome[name], (name, outcome[name])
    assert outcome["allowed"] == [[64], [8, 8], "torch.float64"]


@pytest.mark.skipif(importlib.util.find_spec("pyseccomp") is None,
                    reason="pyseccomp is not installed")
def test_threads_and_processes_are_refused_below_python():
    outcome = run(THREADS_SCRIPT)
    assert outcome["notes"] == []
    for name in ("threading", "fork", "subprocess"):
        assert outcome[name].startswith("refused: PermissionError"), (name, outcome[name])
    # The C library's fork, past every Python patch, gets EPERM from the kernel.
    assert outcome["libc_fork"] == {"pid": -1, "errno": 1}
    assert outcome["refused"] >= 3  # each refused attempt is counted (some twice)
