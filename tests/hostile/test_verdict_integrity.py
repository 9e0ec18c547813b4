"""Verdicts an adversary cannot game, on the cpu backend.

Hostile candidates that get past the static check (so that the dynamic checks are
tested on their own, the ``dynamic_only`` fixture turns the static check off for a
test), honest candidates that must keep passing, and honest failures that must be
reported as what they are. One Verifier serves the module; after each hostile
candidate it must still pass an honest one.
"""

from __future__ import annotations

import textwrap
import time
import uuid
from pathlib import Path

import pytest
import torch

from schemas.events import VerifyRequest
from services.common.verify_client import build_request
from services.sandbox import child as _child
from services.worker import correctness, rules, wire
from services.worker import verifier as verifier_module
from services.worker.procedure import Verdict as _Verdict
from services.worker.procedure.profile import check_timing
from services.worker.verifier import Verifier
from tests.corpus import CORPUS, TASKS
from tests.helpers import RELU_TASK
from tests.support_candidates import (
    RELU_LAUNCHER,
    TRITON_IMPORTS,
    forged_frames,
    relu_jit,
    relu_model,
)

SOFTMAX_TASK = TASKS["softmax"]
# Wide rows of small inputs: every softmax output is below float32's atol (1e-4) for any
# inputs the verifier draws (its seeds are secret; at scale 0.1 one element of 65,536
# rose above it in ~1% of draws).
WIDE_SOFTMAX_TASK = SOFTMAX_TASK.replace("dim = 1024", "dim = 16384").replace(
    "torch.randn(batch_size, dim)", "0.05 * torch.randn(batch_size, dim)")

MATMUL_TASK = TASKS["matmul"]
HEADER = TRITON_IMPORTS

RELU_KERNEL = ("\n" + relu_jit() + """

@triton.jit
def scratch_kernel(out_ptr, n, BLOCK_SIZE: tl.constexpr):
    offs = tl.program_id(0) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    tl.store(out_ptr + offs, offs.to(tl.float32), mask=offs < n)


""" + RELU_LAUNCHER)


def relu_candidate(forward: str, module: str = "") -> str:
    body = textwrap.indent(textwrap.dedent(forward).strip(), " " * 8)
    return (HEADER + textwrap.dedent(module) + RELU_KERNEL + "\n\nclass ModelNew(nn.Module):\n"
            f"    def forward(self, x):\n{body}\n")


HONEST_RELU = relu_candidate("return relu(x.contiguous())")

# The honest two-pass softmax of the corpus.
SOFTMAX_CANDIDATE = (CORPUS / "honest" / "softmax_two_pass.py").read_text()


def matmul_candidate(advance_k: bool = True, all_tiles: bool = True) -> str:
    """The corpus's tiled matmul with a zeroing kernel; the flags write the bugs of real
    LLM kernels in."""
    code = (CORPUS / "honest" / "tiled_matmul_zeroed_first.py").read_text()
    if not advance_k:
        code = code.replace("for k in range(0, K, BLOCK_K):", "for k in range(0, 1):")
    if not all_tiles:
        code = code.replace("pid_m = tl.program_id(0)", "pid_m = 0").replace(
            "pid_n = tl.program_id(1)", "pid_n = 0")
    return code


def request(code: str, task: str = RELU_TASK, **kwargs) -> VerifyRequest:
    fields = {"request_id": f"req-{uuid.uuid4().hex[:12]}", "job_id": "job-integrity",
              "candidate_id": "cand-integrity", "op_name": "op", "task_desc": task,
              "code": code, "backend": "cpu", "arch": "x86_64", "timeout_s": 60.0}
    fields.update(kwargs)
    return build_request(**fields)


@pytest.fixture
def verifier(shared_verifier):
    """The session's started cpu verifier (64 MiB input limit, tests/conftest.py)."""
    return shared_verifier




async def still_serves(verifier: Verifier) -> None:
    result = await verifier.verify(request(HONEST_RELU, trials=1), device="0")
    assert result.passed, result


# ------------------------------------------------------------------ honest candidates


async def test_honest_relu_passes_every_check(verifier):
    result = await verifier.verify(request(HONEST_RELU), device="0")
    assert result.passed, result
    assert result.ghost_replay == "outputs depend on the Triton kernels"
    assert result.sizes_checked == [{"batch_size": 16, "dim": 1024}]
    assert result.task_sizes_checked is True and not result.unchecked
    # Shape generality at odd extents, multiples of no block size.
    assert result.shape_generic is True
    assert all(v % 2 for v in result.shape_generic_sizes.values()), result.shape_generic_sizes
    # Trial 0 the task's own, then mixes: every distribution reached in three trials.
    note = next(n for n in result.notes if n.startswith("inputs: trial 0: task; trial 1: mix: "))
    assert all(d in note for d in ("normal x10000", "normal x0.001", "zeros", "ties")), note


async def test_honest_softmax_passes(verifier):
    result = await verifier.verify(request(SOFTMAX_CANDIDATE, task=SOFTMAX_TASK), device="0")
    assert result.passed, result


async def test_honest_matmul_passes(verifier):
    result = await verifier.verify(request(matmul_candidate(), task=MATMUL_TASK, trials=1),
                                   device="0")
    assert result.passed, result


async def test_unused_fallback_branch_is_not_a_finding(verifier, dynamic_only):
    code = relu_candidate("""
        if x.device.type == "npu":
            return torch.relu(x)
        return relu(x.contiguous())
    """)
    result = await verifier.verify(request(code), device="0")
    assert result.passed, result


# ------------------------------------------------------------------ hostile candidates


async def test_torch_operators_behind_a_scratch_kernel_fail_the_audit(verifier):
    code = relu_candidate("""
        scratch = torch.empty(1024, device=x.device)
        scratch_kernel[(1,)](scratch, 1024, BLOCK_SIZE=1024)
        return x * (x > 0)
    """)
    result = await verifier.verify(request(code), device="0")
    assert result.stage == "audit", result
    assert "called aten.gt.Scalar, a PyTorch compute operator" in result.error, result.error
    await still_serves(verifier)


@pytest.mark.parametrize("static", [True, False], ids=["as-written", "dynamic-only"])
async def test_computed_torch_name_fails(verifier, monkeypatch, static):
    if not static:
        monkeypatch.setattr(verifier_module, "check_candidate", lambda code, dsl="triton": [])
    code = relu_candidate("""
        scratch = torch.empty(1024, device=x.device)
        scratch_kernel[(1,)](scratch, 1024, BLOCK_SIZE=1024)
        return getattr(torch, "r" + "elu")(x)
    """)
    result = await verifier.verify(request(code), device="0")
    assert result.stage in (("static", "audit") if static else ("audit",)), result
    if result.stage == "audit":
        assert "called aten.relu.default, a PyTorch compute operator" in result.error
    await still_serves(verifier)


# At import time the candidate rewrites what the harness in its process relies on:
# the digest and aliasing helpers of the child module (when it can reach it), and
# torch.Tensor methods those helpers call, so that in-process checks see the input as
# it was before forward.
HARNESS_PATCH = """
SNAPSHOTS = {}
# Set at the end of forward: Triton's launcher must see the real storage.
ARMED = [False]
KEEP = []
_real_contiguous = torch.Tensor.contiguous
_real_storage = torch.Tensor.untyped_storage


def _fake_contiguous(self, *args, **kwargs):
    return _real_contiguous(SNAPSHOTS.get(self.data_ptr(), self), *args, **kwargs)


def _fake_storage(self):
    if ARMED[0] and self.data_ptr() in SNAPSHOTS:
        # Kept alive, so that two calls never get the same (reused) address.
        KEEP.append(_real_contiguous(self).clone())
        return _real_storage(KEEP[-1])
    return _real_storage(self)


torch.Tensor.contiguous = _fake_contiguous
torch.Tensor.untyped_storage = _fake_storage
_harness = getattr(torch, "sy" + "s").modules.get("services.sandbox.child")
if _harness is not None:
    _real_digest = _harness._digest
    _harness._digest = lambda value: _real_digest(SNAPSHOTS.get(value.data_ptr(), value))
    _harness._aliasing = lambda outputs, args: []
"""


@pytest.mark.parametrize("forward", [
    "ARMED[0] = False\nout = relu(x)\nSNAPSHOTS[x.data_ptr()] = x.clone()\n"
    "scratch_kernel[(1,)](x, x.numel(), BLOCK_SIZE=1024)\nARMED[0] = True\nreturn out",
    "ARMED[0] = False\nSNAPSHOTS[x.data_ptr()] = x.clone()\n"
    "relu_kernel[(triton.cdiv(x.numel(), 1024),)](x, x, x.numel(), BLOCK_SIZE=1024)\n"
    "ARMED[0] = True\nreturn x",
], ids=["overwrites-its-input", "returns-its-input"])
async def test_rewriting_the_harness_does_not_hide_input_mutation(
        verifier, dynamic_only, forward):
    code = relu_candidate(forward, module=HARNESS_PATCH)
    result = await verifier.verify(request(code), device="0")
    assert not result.passed, result
    # The patch of torch.Tensor is seen at import (D017); without it, the replay's
    # inputs show the mutation (D001).
    assert result.stage == "audit", result
    assert "torch.Tensor.contiguous" in result.error, result.error
    unpatched = relu_candidate(forward, module=HARNESS_PATCH.replace(
        "torch.Tensor.contiguous = _fake_contiguous\ntorch.Tensor.untyped_storage = _fake_storage\n",
        ""))
    result = await verifier.verify(request(unpatched), device="0")
    assert result.stage == "mismatch", result
    assert result.error.startswith("candidate modified input 0 in place"), result.error
    await still_serves(verifier)


async def test_numpy_doing_the_work_fails_the_ghost_replay(verifier, dynamic_only):
    # numpy computes the relu of the decoys in the candidate's own (ghost) run; the plan
    # replayed on the real inputs returns those decoy answers.
    code = relu_candidate("""
        scratch = torch.empty(1024, device=x.device)
        scratch_kernel[(1,)](scratch, 1024, BLOCK_SIZE=1024)
        return torch.from_numpy(numpy.maximum(x.numpy(), 0))
    """, module="import numpy\n")
    result = await verifier.verify(request(code), device="0")
    assert result.stage == "audit", result
    assert "computed outside the Triton kernels" in result.error
    await still_serves(verifier)


# Forward bodies that compute the relu on the host, each telling a ghost run by
# reading one fresh allocation first, NaN under the old fixed fill (and returning it
# untouched then). The
# candidate's process only ever runs as a ghost, on decoys: they return garbage.
HOST_COMPUTE = {
    "numpy-view": """
        scratch = torch.empty(1024, device=x.device)
        scratch_kernel[(1,)](scratch, 1024, BLOCK_SIZE=1024)
        probe = getattr(torch.empty(64), "nu" + "mpy")()
        if all(probe != probe):
            return torch.empty_like(x)
        arr = getattr(x, "nu" + "mpy")()
        out = torch.empty_like(x)
        view = getattr(out, "nu" + "mpy")()
        view[...] = arr * (arr > 0)
        return out
    """,
    "array-protocol": """
        scratch = torch.empty(1024, device=x.device)
        scratch_kernel[(1,)](scratch, 1024, BLOCK_SIZE=1024)
        probe = numpy.asarray(torch.empty(64))
        if all(probe != probe):
            return torch.empty_like(x)
        out = torch.empty_like(x)
        numpy.asarray(out)[...] = numpy.maximum(numpy.asarray(x), 0)
        return out
    """,
    "item-reads": """
        scratch = torch.empty(1024, device=x.device)
        scratch_kernel[(1,)](scratch, 1024, BLOCK_SIZE=1024)
        first = torch.empty(1)[0].item()
        if first != first:
            return torch.empty_like(x)
        out = torch.empty_like(x)
        src, dst = x.reshape(-1), out.reshape(-1)
        for i in range(src.shape[0]):
            v = src[i].item()
            dst[i] = v if v > 0 else 0.0
        return out
    """,
}


@pytest.mark.parametrize("name", list(HOST_COMPUTE))
async def test_host_reads_of_tensor_data_fail(verifier, dynamic_only, name):
    # With the static check on, S022 refuses the first two by name; without it the
    # candidate's host code only ever sees decoys, and its plan wrote no output. The
    # planner's fill is drawn from a secret seed: where the probe reads no NaN, the host
    # computes on the decoys, and the plan's copies of those answers are found out.
    code = relu_candidate(HOST_COMPUTE[name], module="import numpy\n")
    # 2 x 96 elements: the element-by-element loop stays short.
    result = await verifier.verify(request(code, shape_overrides={"batch_size": 2, "dim": 96}),
                                   device="0")
    assert result.stage in ("mismatch", "audit"), result
    assert "was never written: no kernel launch wrote it" in result.error or \
        "computed outside the Triton kernels" in result.error, result.error
    await still_serves(verifier)


async def test_a_few_scalar_reads_stay_allowed(verifier):
    code = relu_candidate("""
        scale = float(torch.ones(1)[0].item())
        out = relu(x.contiguous())
        return out if scale == 1.0 else out
    """)
    result = await verifier.verify(request(code), device="0")
    assert result.passed, result


FORGE_TIMING = "\ndef forge():\n    import msgspec\n" + textwrap.indent(forged_frames(
    'msgspec.msgpack.encode({"type": "timing", "median_us": 0.5,\n'
    '                        "samples_us": [0.5] * 20, "wall_s": 0.001})'), "    ")


@pytest.mark.parametrize("mode", ["verify", "profile"])
async def test_forged_timing_frame_is_detected(verifier, dynamic_only, mode):
    code = relu_candidate("forge()\nreturn relu(x.contiguous())", module=FORGE_TIMING)
    result = await verifier.verify(request(code, mode=mode), device="0")
    assert result.gen_time_us is None and result.speedup is None, result
    assert result.stage in ("audit", "crash"), result
    await still_serves(verifier)


async def test_finding_the_channel_through_gc_is_refused(verifier, dynamic_only):
    code = relu_candidate("""
        import gc
        for obj in gc.get_objects():
            if type(obj).__name__ == "Channel":
                harness = type(obj).send.__globals__
                obj.send(harness["Timing"](median_us=0.5, samples_us=[0.5] * 20, wall_s=0.001))
        return relu(x.contiguous())
    """)
    result = await verifier.verify(request(code, mode="profile"), device="0")
    assert result.stage == "audit", result
    assert "gc.get_objects" in result.error
    assert result.gen_time_us is None
    await still_serves(verifier)


async def test_first_tile_matmul_fails_at_the_task_sizes(verifier):
    # At N=64 one 64 x 64 tile is the whole output; the task's own N=96 needs four.
    code = matmul_candidate(advance_k=False, all_tiles=False)
    result = await verifier.verify(
        request(code, task=MATMUL_TASK, shape_overrides={"N": 64}, trials=1), device="0")
    assert not result.passed, result
    assert result.stage == "mismatch", result
    assert result.error.startswith("at the task's own sizes (N=96)"), result.error
    assert result.sizes_checked == [{"N": 64}, {"N": 96}]


DECLARED_RELU_TASK = RELU_TASK + """

def get_inputs_dyn_list():
    return [[torch.randn(batch_size, dim)], [torch.randn(2, 3, 1000)]]
"""


async def test_declared_shapes_must_all_pass(verifier):
    # Right at every 2-D size, zeros for anything else: the declared 3-D shape fails it.
    only_2d = relu_candidate("""
        if x.dim() != 2:
            return torch.zeros_like(x)
        return relu(x.contiguous())
    """)
    result = await verifier.verify(request(only_2d, task=DECLARED_RELU_TASK, trials=1),
                                   device="0")
    assert not result.passed, result
    assert result.stage == "mismatch", result
    assert result.error.startswith("at the task's declared shape 1"), result.error
    honest = await verifier.verify(request(HONEST_RELU, task=DECLARED_RELU_TASK, trials=1),
                                   device="0")
    assert honest.passed, honest


async def test_constant_output_against_a_small_scale_reference_fails(verifier, dynamic_only):
    code = HEADER + RELU_KERNEL + """

class ModelNew(nn.Module):
    def forward(self, x):
        out = torch.zeros_like(x)
        scratch_kernel[(1,)](torch.empty(16, device=x.device), 16, BLOCK_SIZE=16)
        return out
"""
    result = await verifier.verify(request(code, task=WIDE_SOFTMAX_TASK, trials=1), device="0")
    assert result.stage == "mismatch", result
    assert "relative L2 error" in result.error or "constant" in result.error


# ------------------------------------------------------------------ honest failures


async def test_zero_size_inputs_never_pass(verifier):
    result = await verifier.verify(request(HONEST_RELU, shape_overrides={"batch_size": 0}),
                                   device="0")
    assert not result.passed, result
    assert "(0, 1024)" in result.error and "no elements" in result.error


async def test_huge_exception_message_is_a_runtime_error(verifier):
    code = relu_candidate("""
        out = relu(x.contiguous())
        raise ValueError("x" * (10 << 20) + "TAIL")
        return out
    """)
    result = await verifier.verify(request(code), device="0")
    assert result.stage == "runtime", result
    assert result.error.startswith("ModelNew.forward raised ValueError: xxx")
    assert "TAIL" in result.error and "characters cut" in result.error
    assert len(result.error) < 10_000
    await still_serves(verifier)


async def test_interpreter_runtime_error_is_runtime(verifier):
    # A load masked by the offsets themselves, not by a comparison.
    kernel = relu_jit("x", pid=False)
    assert "x = tl.load(x_ptr + offs, mask=m)" in kernel
    code = (HEADER + "\n\n" + kernel.replace("mask=m)\n    tl.store", "mask=offs)\n    tl.store")
            + "\n\n" + relu_model())
    result = await verifier.verify(request(code), device="0")
    assert result.stage == "runtime", result
    assert "mask" in result.error


# ------------------------------------------------------------------ pure rules


def test_roofline_floor():
    # 8 MB of inputs + outputs on an H200 (4.8 TB/s) take at least ~1.67 us.
    assert rules.roofline_floor_us(8_000_000, "h200") == pytest.approx(8e6 / 4.8e12 * 1e6)
    assert rules.roofline_floor_us(8_000_000, "H100") == pytest.approx(8e6 / 3.35e12 * 1e6)
    assert rules.roofline_floor_us(8_000_000, "x86_64") is None
    assert rules.impossible_timing(2.0, 8_000_000, "h200") is None
    message = rules.impossible_timing(0.5, 8_000_000, "h200")
    assert message.startswith("impossible timing: 0.5 us for 8.0 MB")
    assert "16.0 TB/s, above the h200's peak memory bandwidth of 4.80 TB/s" in message
    assert rules.impossible_timing(0.5, 8_000_000, "a100") is not None


def test_audit_allowlist():
    assert {rules.op_packet(n) for n in ("aten.empty_like.default", "aten.view.default",
                                         "aten.clone.default")} <= rules.ALLOWED_OPS
    assert not {rules.op_packet(n) for n in ("aten.mul.Tensor", "aten.gt.Scalar",
                                             "aten.relu.default", "aten.set_.source_Storage")
                } & rules.ALLOWED_OPS
    assert len({r.id for r in rules.DYNAMIC_RULES}) == len(rules.DYNAMIC_RULES)


def test_error_text_is_clipped_head_and_tail():
    text = "ValueError: " + "x" * 100_000 + "TAIL"
    clipped = _child.clip(text, 2000)
    assert clipped.startswith("ValueError: xxx") and clipped.endswith("xTAIL")
    assert "[98016 characters cut]" in clipped and len(clipped) < 2100
    assert _child.clip("short", 2000) == "short"


def test_timing_sample_count_and_wall_time(verifier):
    timing = wire.Timing(median_us=0.5, samples_us=[0.5] * 19, wall_s=0.001)
    with pytest.raises(_Verdict) as info:
        check_timing(timing, time.monotonic() - 1.0, "the candidate", repeats=20,
                     stage="audit")
    assert info.value.outcome.fields.stage == "audit"
    assert "19 samples; 20 were asked for" in info.value.outcome.fields.error
    # No profiling phase observed by the parent: no timing is consistent.
    timing = wire.Timing(median_us=0.5, samples_us=[0.5] * 20, wall_s=0.001)
    with pytest.raises(_Verdict):
        check_timing(timing, None, "the candidate", repeats=20, stage="audit")
    check_timing(timing, time.monotonic() - 0.01, "the candidate", repeats=20)


def test_scale_aware_comparison_numbers():
    expected = torch.softmax(0.05 * torch.randn(4, 16384, generator=torch.Generator()
                                               .manual_seed(0)), dim=1)
    assert float(expected.max()) < 1e-4  # every element within atol of zero
    zeros = correctness.compare_output(0, expected, torch.zeros_like(expected))
    assert not zeros.passed and "is constant" in zeros.message
    half = correctness.compare_output(0, expected, expected * 0.5)
    assert not half.passed and "relative L2 error 0.5 exceeds 0.0005" in half.message
    honest = correctness.compare_output(0, expected, expected * (1 + 1e-6))
    assert honest.passed and honest.rel_l2_error < 1e-5
    # A reference that is constant up to rounding: an exact constant passes.
    flat = torch.full((8,), 0.25) + torch.tensor([0, 1e-9, 0, 0, 0, 0, 0, 0])
    assert correctness.compare_output(0, flat, torch.full((8,), 0.25)).passed
    assert correctness.compared_elements([torch.zeros(0, 1024)]) == (0, "output 0 has shape "
                                                                       "(0, 1024)")


def test_docs_list_every_rule() -> None:
    """docs/verification.md's rules table is exactly what the code's rule tables render."""
    from services.worker.rules import rules_markdown

    page = (Path(__file__).resolve().parents[2] / "docs" / "verification.md").read_text()
    table = page.split("<!-- rules:start -->\n", 1)[1].split("<!-- rules:end -->", 1)[0]
    assert table == rules_markdown(), \
        "docs/verification.md's rules table is stale: paste rules_markdown()"
