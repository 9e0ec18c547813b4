"""Values torch computed before forward (rule D030), on the cpu backend: the real
sandbox and Triton's interpreter.

The planner records where each storage's bytes came from while the candidate's module
is imported and ModelNew is built (``services/worker/init_compute.py``); a captured
storage that torch computed, and that equals no tensor of the task's Model, is named
in the verdict, and the first call is replayed with it perturbed: outputs that change
fail at ``audit``.
"""

from __future__ import annotations

import math

import pytest
import torch

from schemas.events import VerifyRequest
from services.worker import init_compute
from tests.corpus import CORPUS, TASKS, load
from tests.helpers import cpu_request

DEPENDS = "outputs depend on buffer `lut` (shape [4096], float32), computed with aten.div"


def request(code: str, task: str, trials: int = 2) -> VerifyRequest:
    return cpu_request(code, task, trials=trials, job_id="job-init")


@pytest.fixture
def verifier(shared_verifier):
    return shared_verifier


class _Init(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 4)
        self.wt = self.fc.weight.detach().t().contiguous()
        self.half = self.fc.weight.detach().half()
        self.fused = torch.cat([self.fc.weight.detach(), self.fc.weight.detach()])
        self.ar = torch.arange(10)
        self.full = torch.full((3,), 0.5)
        self.register_buffer("lut", torch.exp(torch.linspace(-10, 10, 64)))
        self.register_buffer("mask", torch.tril(torch.ones(4, 4)))
        self.host = torch.tensor([math.exp(i) for i in range(5)])
        value = torch.exp(torch.tensor(1.0)).item()
        self.laundered = torch.full((3,), value)


def test_what_counts_as_computed_before_forward():
    """Random init fills, allocations and copies are clean; compute operators, host
    values and fills from a computed .item() are not (no sandbox: the recorder alone)."""
    recorder = init_compute.InitRecorder()
    with recorder:
        model = _Init()
    recorder.retire_dead()
    names = init_compute.named_tensors([("", model)])
    ops = {name: (recorder.computed(t.untyped_storage(), names) or {}).get("ops")
           for name, t in (v for v in names.values())}
    for clean in ("fc.weight", "fc.bias", "wt", "half", "fused", "ar", "full"):
        assert ops[clean] is None, (clean, ops[clean])
    assert ops["lut"] == ["aten.exp", "aten.linspace"]
    assert ops["mask"] == ["aten.tril"]
    assert ops["host"] == [init_compute.HOST]
    assert init_compute.ITEM in ops["laundered"] and "aten.exp" in ops["laundered"]


def test_value_digests_and_perturbation():
    """A bool or half copy of a float mask has a digest of the float one's; a transposed
    copy of the task's weight matches through the task's digests; a perturbation keeps
    the size and changes a non-constant table."""
    mask = torch.tril(torch.ones(5, 5))
    task = set(init_compute.value_digests(mask))
    assert init_compute.value_digests(mask.bool(), casts=False) <= task
    assert init_compute.value_digests(mask.half(), casts=False) <= task
    weight = torch.randn(3, 7)
    assert init_compute.value_digests(weight.t().contiguous(), casts=False) <= \
        init_compute.value_digests(weight)
    assert init_compute.value_digests(weight.half(), casts=False) <= \
        init_compute.value_digests(weight)
    lut = torch.exp(torch.linspace(-4, 4, 256))
    data = lut.numpy().tobytes()
    out = init_compute.perturb(data, "float32", 7)
    assert len(out) == len(data) and out != data
    assert init_compute.perturb(data, "float32", 7) == out


async def test_a_table_torch_computed_in_init_fails_and_a_kernel_computing_it_passes(
        verifier, dynamic_only):
    code, meta = load(CORPUS / "hostile" / "init_exp_lut.py")
    result = await verifier.verify(request(code, TASKS[meta["task"]]), device="0")
    assert result.stage == "audit", result
    assert DEPENDS in result.error and "(rule D030)" in result.error, result.error
    gather = "tl.store(out_ptr + offs, tl.load(lut_ptr + code, mask=m), mask=m)"
    assert gather in code
    # The same module, its table still built and passed, the kernel computing exp: the
    # buffer is named in the notes, and the outputs do not depend on it.
    computing = code.replace(gather, "v = tl.load(lut_ptr + code, mask=m) * 0.0\n"
                             "    tl.store(out_ptr + offs, tl.exp(code.to(tl.float32) / 512.0"
                             " - 4.0) + tl.where(v == v, 0.0, v), mask=m)")
    result = await verifier.verify(request(computing, TASKS[meta["task"]]), device="0")
    assert result.passed, (result.stage, result.error)
    assert any("ModelNew computed buffer `lut`" in n for n in result.notes), result.notes
    assert any("the outputs do not depend on" in n for n in result.notes), result.notes


async def test_a_mask_the_task_builds_too_passes_without_a_note(verifier):
    code, meta = load(CORPUS / "honest" / "causal_mask_buffer.py")
    result = await verifier.verify(request(code, TASKS[meta["task"]]), device="0")
    assert result.passed, (result.stage, result.error)
    assert not any("ModelNew computed" in n for n in result.notes), result.notes


def test_a_tensor_whose_storage_cannot_be_told_is_not_clean():
    recorder = init_compute.InitRecorder()
    assert recorder.labels_of(torch.eye(2).to_sparse()) == {init_compute.OUTSIDE}
    assert recorder.labels_of(torch.empty(2, device="meta")) == set()
