"""The compile check's facts reach the verdict's tile model
(services/worker/procedure/core.py ``_traffic``, compile_check.worst_facts).

The traffic summary of a verdict models each counted launch with the GPU compiler's
facts of its kernel on the request's arch family (resident warps, spills), the worst
specialisation of each kernel, instead of the model's own occupancy estimate.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from schemas.events import CompileFact, LaunchTraffic
from services.common.verify_client import build_request
from services.worker import traffic
from services.worker.procedure.compile_check import worst_facts
from services.worker.targets import TARGETS
from tests.corpus import TASKS

TILED = (Path(__file__).parents[1] / "corpus" / "honest" / "tiled_matmul.py").read_text()
# 128 x 128 fp32 tiles on 4 warps: ptxas spills on sm_90 (test_gpu_facts_verdict.py).
SPILLING = TILED.replace("grid = (triton.cdiv(M, 32), triton.cdiv(N, 32))",
                         "grid = (triton.cdiv(M, 128), triton.cdiv(N, 128))").replace(
    "BLOCK_M=32, BLOCK_N=32", "BLOCK_M=128, BLOCK_N=128")


def _fact(kernel: str, arch: str, occupancy: int, spill: int = 0, ok: bool = True,
          config: str = "") -> CompileFact:
    return CompileFact(kernel=kernel, target="h100" if arch == "sm_90" else "mi300x",
                       arch=arch, config=config, occupancy_warps=occupancy,
                       spill_bytes=spill, num_warps=4, max_warps=64, ok=ok)


def test_the_worst_launching_specialisation_of_the_arch_family_is_taken():
    facts = [_fact("k", "sm_90", 32, config="a"), _fact("k", "sm_90", 16, 8, config="b"),
             _fact("k", "sm_90", 16, 64, config="c"), _fact("k", "sm_90", 4, ok=False),
             _fact("k", "gfx942", 2, config="amd"), _fact("other", "sm_90", 48)]
    worst = worst_facts(facts, "sm_90")
    # Fewest resident warps, then most spill; a config that cannot launch is not one.
    assert worst["k"].config == "c" and worst["other"].occupancy_warps == 48
    assert worst_facts(facts, "gfx942")["k"].config == "amd"
    assert worst_facts(facts, "sm_80") == {}


def test_facts_change_the_tile_time_of_a_launch():
    launch = LaunchTraffic(kernel="k", loaded=64 << 20, stored=16 << 20, programs=4096,
                           unique_loaded=32 << 20, num_warps=4, num_stages=3)
    h100 = TARGETS["h100"]
    estimated = traffic.summarize([launch], 80 << 20, None, h100)
    facts = worst_facts([_fact("k", "sm_90", 4, 512)], "sm_90")
    modeled = traffic.summarize([launch], 80 << 20, None, h100, facts=facts)
    # One resident block per SM and 512 spill bytes a thread: slower than the estimate.
    assert modeled.tile_time_us > estimated.tile_time_us
    assert modeled.tile_dram_bytes > estimated.tile_dram_bytes
    assert modeled.modeled_time_us == estimated.modeled_time_us  # the roofline: no facts


@pytest.mark.slow
async def test_a_verdicts_tile_time_uses_the_compile_facts(shared_verifier):
    request = build_request(request_id=f"tf-{uuid.uuid4().hex[:10]}", job_id="job-tf",
                            candidate_id="cand-tf", op_name="matmul",
                            task_desc=TASKS["matmul"], code=SPILLING, backend="cpu",
                            arch="h100", timeout_s=300.0, trials=1)
    result = await shared_verifier.verify(request, device="0")
    assert result.passed, (result.stage, result.error)
    assert result.traffic is not None and result.traffic.tile_time_us, result.traffic
    h100 = TARGETS["h100"]
    facts = worst_facts(result.compile_facts, h100.sm)
    assert facts["matmul_kernel"].spill_bytes > 0, result.compile_facts
    launches = result.traffic.per_launch
    with_facts = traffic.summarize(launches, result.traffic.bytes_min, None, h100, facts=facts)
    without = traffic.summarize(launches, result.traffic.bytes_min, None, h100)
    assert result.traffic.tile_time_us == with_facts.tile_time_us
    assert with_facts.tile_time_us != without.tile_time_us
    assert result.traffic.tile_dram_bytes == with_facts.tile_dram_bytes
