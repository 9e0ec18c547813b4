"""Verdicts a person can act on (issue 43, item 4, worker side): an out-of-bounds
access counted exactly, per argument, with the kernel's line; errors naming the user's
file (the request's ``source_name``) at the user's line; a task too big for the worker
is stage ``task`` with the ``--shape`` hint, while a real worker fault stays
``infrastructure``.

One started cpu verifier for the module (tests/conftest.py, 64 MiB input limit).
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from schemas.events import VerifyRequest, VerifyResult
from services.cli import app
from services.common.verify_client import build_request, source_name
from services.sandbox.errors import PoolBroken
from services.sdk import LocalWorker
from tests.helpers import RELU_KERNEL, RELU_TASK, TASKS

# A relu whose load and store have no tail mask (line numbers below are this source's).
NO_TAIL_MASK = """\
import torch
import torch.nn as nn
import triton
import triton.language as tl


@triton.jit
def relu_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs)
    tl.store(out_ptr + offs, tl.maximum(x, 0.0))


class ModelNew(nn.Module):
    def forward(self, x):
        out = torch.empty_like(x)
        n = x.numel()
        relu_kernel[(triton.cdiv(n, 1024) + EXTRA,)](x, out, n, BLOCK=1024)
        return out
"""
LOAD_LINE, STORE_LINE = 10, 11
# A forward that raises on line 17 (the line of ``n = ...``).
RAISES_IN_FORWARD = NO_TAIL_MASK.replace("n = x.numel()", "n = x.numel() + undefined_name")
RAISE_LINE = 17


def _request(code: str, **fields) -> VerifyRequest:
    return build_request(**{"task_desc": RELU_TASK, "code": code, "op_name": "relu",
                            "backend": "cpu", "arch": "x86_64", "timeout_s": 60.0, **fields})


def test_the_line_numbers_above_are_the_sources():
    lines = NO_TAIL_MASK.splitlines()
    assert "tl.load(x_ptr + offs)" in lines[LOAD_LINE - 1]
    assert "tl.store(out_ptr + offs" in lines[STORE_LINE - 1]
    assert "undefined_name" in RAISES_IN_FORWARD.splitlines()[RAISE_LINE - 1]


@pytest.mark.parametrize("extra", [0, 1], ids=["tail", "tail-and-a-whole-program"])
async def test_out_of_bounds_lanes_are_counted_exactly_with_their_line(shared_verifier, extra):
    """Every out-of-bounds lane of the launch is counted, not the first block's: at two
    sizes (and again at the first, the same), with one program wholly past the end
    too; by argument and access, naming the kernel's line in the user's file."""
    code = NO_TAIL_MASK.replace("EXTRA", str(extra))
    for batch, dim in [(1, 4864), (3, 1000), (1, 4864)]:
        n = batch * dim
        past = -(-n // 1024) * 1024 - n + extra * 1024
        result = await shared_verifier.verify(
            _request(code, shape_overrides={"batch_size": batch, "dim": dim},
                     source="kernels/kernel.py"), device="0")
        assert result.stage == "runtime", result
        assert result.error.startswith("kernel relu_kernel accessed memory out of bounds: ")
        span = f"elements {n}..{n + past - 1}"
        assert f"x_ptr: {past} loads past the end ({span}), line {LOAD_LINE} of kernel.py" \
            in result.error, result.error
        assert f"out_ptr: {past} stores past the end ({span}), line {STORE_LINE} of " \
               "kernel.py" in result.error, result.error
        assert "candidate.py" not in result.error


async def test_an_access_before_the_start_is_counted_as_such(shared_verifier):
    code = NO_TAIL_MASK.replace("EXTRA", "0").replace(
        "x = tl.load(x_ptr + offs)", "x = tl.load(x_ptr + offs - 8, mask=offs < n)").replace(
        "tl.store(out_ptr + offs, tl.maximum(x, 0.0))",
        "tl.store(out_ptr + offs, tl.maximum(x, 0.0), mask=offs < n)")
    result = await shared_verifier.verify(
        _request(code, shape_overrides={"batch_size": 1, "dim": 4096}), device="0")
    assert result.stage == "runtime", result
    assert f"x_ptr: 8 loads before the start (elements -8..-1), line {LOAD_LINE} of " \
           "candidate.py" in result.error, result.error
    assert "out_ptr" not in result.error


async def test_errors_name_the_users_file_and_line(shared_verifier):
    code = RAISES_IN_FORWARD.replace("EXTRA", "0")
    named = await shared_verifier.verify(_request(code, source="/home/me/my kernel.py"),
                                         device="0")
    assert named.stage == "runtime", named
    assert named.error.endswith(f"(my_kernel.py line {RAISE_LINE})"), named.error
    assert f'File "my_kernel.py", line {RAISE_LINE}, in forward' in named.log, named.log
    assert "candidate.py" not in named.error + named.log
    # Without a name: candidate.py, and no scratch directory in the traceback.
    plain = await shared_verifier.verify(_request(code), device="0")
    assert plain.error.endswith(f"(candidate.py line {RAISE_LINE})"), plain.error
    assert f'File "candidate.py", line {RAISE_LINE}, in forward' in plain.log, plain.log
    assert str(shared_verifier.scratch_root) not in plain.log


async def test_a_kernel_error_names_the_users_file_and_line(shared_verifier):
    code = NO_TAIL_MASK.replace("EXTRA", "0").replace("tl.maximum(x, 0.0)",
                                                      "tl.no_such_function(x)")
    result = await shared_verifier.verify(_request(code, source="relu_kernel.py"),
                                          device="0")
    assert result.stage == "compile", result
    assert f"(relu_kernel.py line {STORE_LINE})" in result.error, result.error
    assert f'File "relu_kernel.py", line {STORE_LINE}, in relu_kernel' in result.log


def test_the_source_name_is_a_bounded_file_name_only():
    assert source_name("kernels/my kernel.py") == "my_kernel.py"
    assert source_name("C:\\work\\k.py") == "k.py"
    assert source_name("../..") == source_name("") == "candidate.py"
    assert source_name(".hidden.py") == "hidden.py"
    long = source_name("a" * 300 + ".py")
    assert len(long) == 64 and long.endswith(".py")
    for path in ("kernels/my kernel.py", "../..", "a" * 300, "é/ü.py", "-x.py"):
        request = _request(RELU_KERNEL, source=path, validate=True)
        assert re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.+-]{0,63}", request.source_name)
    with pytest.raises(ValueError, match="source_name"):
        _request(RELU_KERNEL, source_name="../etc/passwd", validate=True)
    assert _request(RELU_KERNEL).source_name == "candidate.py"


def test_aikg_verify_sends_the_kernels_file_name(tmp_path: Path, monkeypatch):
    """The CLI's local verify names the kernel's file in its request (the worker then
    names it in the verdict: the tests above)."""
    seen: list[VerifyRequest] = []

    class Recorder:
        async def verify(self, request: VerifyRequest, *, device: str,
                         **_: object) -> VerifyResult:
            seen.append(request)
            return VerifyResult(request_id=request.request_id, job_id=request.job_id,
                                candidate_id=request.candidate_id, worker_id="w",
                                device=device, passed=True)

        def close(self) -> None:
            pass

    async def start(self) -> None:
        self._verifier = Recorder()

    monkeypatch.setattr(LocalWorker, "start", start)
    kernel = tmp_path / "relu kernel.py"
    kernel.write_text(RELU_KERNEL)
    result = CliRunner().invoke(app, ["verify", str(TASKS / "relu.py"), str(kernel),
                                      "--json"], env={"COLUMNS": "100"})
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["passed"] is True
    assert [r.source_name for r in seen] == ["relu_kernel.py"]


BIG_TASK = RELU_TASK.replace("batch_size = 16", "batch_size = 4096").replace(
    "dim = 1024", "dim = 65536")


async def test_a_task_too_big_for_the_worker_is_the_users_to_shrink(shared_verifier):
    started = time.monotonic()
    result = await shared_verifier.verify(_request(RELU_KERNEL, task_desc=BIG_TASK),
                                          device="0")
    assert result.stage == "task", result
    assert "the task is too big for this worker" in result.error
    assert "--shape batch_size=" in result.error
    assert result.error.endswith("the task's largest sizes: dim=65536, batch_size=4096")
    assert time.monotonic() - started < 5


async def test_the_sandbox_failing_stays_infrastructure(shared_verifier, monkeypatch):
    """The worker's own faults are still ``infrastructure``: a sandbox that cannot fork,
    and a reference child that dies (here: the task's code ends its process)."""
    async def broken(*args, **kwargs):
        raise PoolBroken("the fork server died")

    with monkeypatch.context() as patch:
        patch.setattr(shared_verifier.sandbox, "spawn", broken)
        result = await shared_verifier.verify(_request(RELU_KERNEL), device="0")
    assert result.stage == "infrastructure", result
    assert "the fork server died" in result.error
    dying = RELU_TASK.replace("return torch.relu(x)", "import os; os._exit(3)")
    result = await shared_verifier.verify(_request(RELU_KERNEL, task_desc=dying), device="0")
    assert result.stage == "infrastructure", result
    assert "exited with code 3" in result.error
