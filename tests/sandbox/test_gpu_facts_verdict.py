"""The GPU compiler's facts in the verdict, and AMD as a second target
(services/worker/gpu_facts.py, services/worker/procedure/compile_check.py).

A cpu verification compiles every kernel specialisation for the request's GPU and for
the other vendor's (``worker_compile_extra_targets``, default ``auto``: ``mi300x``
beside an NVIDIA target); ``VerifyResult.compile_facts`` carries registers, spills,
shared memory and occupancy per target and config, and a config that spills is named
in the notes. A kernel that compiles for NVIDIA but not for AMD fails at ``compile``
naming the target when the request names AMD (or the extra target is required), and
is a note otherwise. Real verifications: the Triton interpreter and Triton's compiler.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from schemas.events import VerifyRequest
from services.common.verify_client import build_request
from tests.corpus import TASKS

pytestmark = pytest.mark.slow

TILED = (Path(__file__).parents[1] / "corpus" / "honest" / "tiled_matmul.py").read_text()
# 128 x 128 fp32 tiles on 4 warps: 128 accumulator registers per thread before the
# operands; ptxas spills on sm_90 (measured: 255 registers, 872 bytes of stack at one
# stage), gfx942's 512 VGPRs hold it.
SPILLING = TILED.replace("grid = (triton.cdiv(M, 32), triton.cdiv(N, 32))",
                         "grid = (triton.cdiv(M, 128), triton.cdiv(N, 128))").replace(
    "BLOCK_M=32, BLOCK_N=32", "BLOCK_M=128, BLOCK_N=128")
# tf32x3 (three TF32 products) is a precision Triton's NVIDIA backend offers and its
# AMD backend refuses (gfx942 allows bf16x3, bf16x6, ieee, tf32); the interpreter
# computes it exactly.
TF32X3 = TILED.replace('input_precision="ieee"', 'input_precision="tf32x3"')


def _request(code: str, arch: str) -> VerifyRequest:
    return build_request(request_id=f"facts-{uuid.uuid4().hex[:10]}", job_id="job-facts",
                         candidate_id="cand-facts", op_name="matmul",
                         task_desc=TASKS["matmul"], code=code, backend="cpu", arch=arch,
                         timeout_s=300.0, trials=1)


async def test_every_specialisation_has_facts_per_target_and_a_spill_is_named(shared_verifier):
    assert SPILLING != TILED
    result = await shared_verifier.verify(_request(SPILLING, "h100"), device="0")
    assert result.passed, (result.stage, result.error)
    by_arch = {f.arch: f for f in result.compile_facts}
    assert set(by_arch) == {"sm_90", "gfx942"}, result.compile_facts
    nv, amd = by_arch["sm_90"], by_arch["gfx942"]
    for fact in (nv, amd):
        assert fact.kernel == "matmul_kernel" and fact.ok
        assert fact.config == "BLOCK_M=128, BLOCK_N=128, BLOCK_K=32, num_warps=4, num_stages=3"
        assert 0 < fact.occupancy_warps <= fact.max_warps and fact.limiter
    assert (nv.target, nv.max_warps, nv.registers) == ("h100", 64, 255)
    assert nv.spill_bytes > 0 and amd.spill_bytes == 0
    assert (amd.target, amd.max_warps) == ("mi300x", 32)
    notes = " | ".join(result.notes)
    assert (f"compile facts: matmul_kernel [{nv.config}] on sm_90 (h100) spills "
            f"{nv.spill_bytes} bytes per thread") in notes, notes
    assert "on gfx942 (mi300x) spills" not in notes
    assert "1 kernel specialisation(s) compiled for sm_90 (h100), 1 for gfx942 (mi300x)" \
        in notes


async def test_an_amd_only_compile_failure_is_named(shared_verifier):
    # The request names the AMD part: its compile failure is the verdict, target named.
    result = await shared_verifier.verify(_request(TF32X3, "mi300x"), device="0")
    assert not result.passed and result.stage == "compile", (result.stage, result.error)
    assert result.error.startswith("the Triton kernel matmul_kernel does not compile for "
                                   "gfx942 (mi300x)"), result.error
    assert "tf32x3" in result.error and "candidate.py line" in result.error
    # An NVIDIA request: advisory, a note naming both targets; the verdict passes.
    result = await shared_verifier.verify(_request(TF32X3, "h100"), device="0")
    assert result.passed, (result.stage, result.error)
    assert any(n.startswith("compile: the Triton kernel matmul_kernel compiles for sm_90 "
                            "(h100) but not for gfx942 (mi300x)") for n in result.notes), \
        result.notes
    assert [f.arch for f in result.compile_facts] == ["sm_90"]
    # Required extra targets: the same failure is the verdict.
    shared_verifier.extra_targets_required = True
    try:
        result = await shared_verifier.verify(_request(TF32X3, "h100"), device="0")
    finally:
        shared_verifier.extra_targets_required = False
    assert not result.passed and result.stage == "compile", (result.stage, result.error)
    assert "compiles for sm_90 (h100) but not for gfx942 (mi300x)" in result.error


async def test_an_honest_kernel_compiles_for_both_vendors(shared_verifier):
    result = await shared_verifier.verify(_request(TILED, "mi300x"), device="0")
    assert result.passed, (result.stage, result.error)
    assert {(f.target, f.arch) for f in result.compile_facts} == {("mi300x", "gfx942"),
                                                                   ("h100", "sm_90")}
    assert not any("spills" in n for n in result.notes), result.notes
