"""Hostile and honest candidates as files, one per file (tests/corpus/), discovered here.

``tests/corpus/hostile/``: each file a candidate that tries to buy a passing verdict
(or has a bug that used to pass on the cpu backend), in five classes: work outside the
recorded window (1), work the in-process instruments cannot see (2), telling the
ghost run from a real one (3), ordinary bugs (4), side effects (5). Each must fail
with the stage its first line names and a message naming what was found, with the
static check off (the dynamic defences alone), and the worker must serve an honest
candidate next. ``tests/corpus/honest/``: candidates that must pass, with what their
result says about shape generality.

A file's first line is ``# corpus: {json}``: ``task`` (a key of :data:`TASKS`),
``class``, ``stage`` (allowed stages), ``error`` (a substring of the error),
``shape_overrides``, ``trials``, ``arch``, ``shape_generic``, ``note`` (a substring of
a note), ``unchecked_or_fail`` (passes only with an ``unchecked`` entry naming a
kernel). A new defence comes with the file that beat the old one.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

from schemas.events import VerifyRequest
from tests.helpers import RELU_KERNEL, RELU_TASK
from tests.test_verdict_integrity import MATMUL_TASK, SOFTMAX_TASK

CORPUS = Path(__file__).parent / "corpus"

ROWSUM_TASK = """\
import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, x):
        return x.sum(dim=1)


rows = 8
cols = 1000


def get_inputs():
    return [torch.randn(rows, cols)]


def get_init_inputs():
    return []
"""

# The task's own sizes (64 MiB of inputs) are far beyond the cpu worker's check budget:
# checked at shape_overrides, dry-run at its own sizes.
BIG_RELU_TASK = RELU_TASK.replace("batch_size = 16", "batch_size = 4096").replace(
    "dim = 1024", "dim = 4096")

LINEAR_TASK = """\
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, in_features, out_features):
        super().__init__()
        self.fc = nn.Linear(in_features, out_features)

    def forward(self, x):
        return self.fc(x)


batch_size = 8
in_features = 64
out_features = 48


def get_inputs():
    return [torch.randn(batch_size, in_features)]


def get_init_inputs():
    return [in_features, out_features]
"""

TASKS = {"relu": RELU_TASK, "softmax": SOFTMAX_TASK, "matmul": MATMUL_TASK,
         "rowsum": ROWSUM_TASK, "big_relu": BIG_RELU_TASK, "linear": LINEAR_TASK}


def load(path: Path) -> tuple[str, dict]:
    code = path.read_text()
    first = code.splitlines()[0]
    assert first.startswith("# corpus: "), f"{path.name}: no '# corpus:' first line"
    return code, json.loads(first.removeprefix("# corpus: "))


def request(code: str, meta: dict) -> VerifyRequest:
    return VerifyRequest(
        request_id=f"corpus-{uuid.uuid4().hex[:10]}", job_id="job-corpus",
        candidate_id="cand-corpus", op_name="op", task_desc=TASKS[meta["task"]], code=code,
        backend="cpu", arch=meta.get("arch", "x86_64"), timeout_s=120.0,
        trials=meta.get("trials", 3), shape_overrides=meta.get("shape_overrides", {}))


def files(kind: str) -> list[Path]:
    return sorted((CORPUS / kind).glob("*.py"))


@pytest.fixture
def verifier(shared_verifier):
    return shared_verifier


async def serves_next(verifier) -> None:
    result = await verifier.verify(request(RELU_KERNEL, {"task": "relu", "trials": 1}),
                                   device="0")
    assert result.passed, result


def test_every_class_has_two_spellings_at_least():
    classes: dict[int, int] = {}
    for path in files("hostile"):
        _, meta = load(path)
        classes[meta["class"]] = classes.get(meta["class"], 0) + 1
    assert all(classes.get(c, 0) >= 2 for c in range(1, 6)), classes


@pytest.mark.parametrize("path", files("hostile"), ids=lambda p: p.stem)
async def test_hostile_candidate_fails(verifier, dynamic_only, path):
    code, meta = load(path)
    result = await verifier.verify(request(code, meta), device="0")
    if meta.get("unchecked_or_fail") and result.passed:
        assert any("fast_relu_kernel" in u for u in result.unchecked), result
        return
    assert not result.passed, (path.name, result)
    assert result.stage in meta["stage"], (path.name, result.stage, result.error)
    assert meta["error"] in (result.error or ""), (path.name, result.error)
    await serves_next(verifier)


@pytest.mark.parametrize("path", files("honest"), ids=lambda p: p.stem)
async def test_honest_candidate_passes(verifier, path):
    code, meta = load(path)
    result = await verifier.verify(request(code, meta), device="0")
    assert result.passed, (path.name, result.stage, result.error, result.log[-3000:])
    assert result.shape_generic is meta["shape_generic"], (path.name, result.notes)
    if "note" in meta:
        assert any(meta["note"] in n for n in result.notes), result.notes
    assert not result.unchecked, result.unchecked


FIXED = {
    "kernel_with_break.py": [("        if (tl.program_id(0) * 4 + step + 1) * BLOCK >= n:\n"
                              "            break\n", "")],
    "kernel_calls_numpy_helper.py": [("helper(tl.load(x_ptr + offs, mask=m))",
                                      "tl.maximum(tl.load(x_ptr + offs, mask=m), 0.0)")],
    "shared_memory_beyond_sm89.py": [("BLOCK_M=128, BLOCK_N=64, BLOCK_K=64",
                                      "BLOCK_M=32, BLOCK_N=32, BLOCK_K=32"),
                                     ("num_stages=4", "num_stages=3"),
                                     ("triton.cdiv(M, 128), triton.cdiv(N, 64)",
                                      "triton.cdiv(M, 32), triton.cdiv(N, 32)")],
}


@pytest.mark.parametrize("name", sorted(FIXED))
async def test_what_a_gpu_cannot_compile_passes_once_fixed(verifier, name):
    code, meta = load(CORPUS / "hostile" / name)
    assert meta["stage"] == ["compile"]
    for old, new in FIXED[name]:
        assert old in code
        code = code.replace(old, new)
    result = await verifier.verify(request(code, meta), device="0")
    assert result.passed, (name, result.stage, result.error)
    assert any("compiled for sm_" in n for n in result.notes), result.notes
