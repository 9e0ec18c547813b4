"""The evolve search without NATS: real built-in coder, real sandboxed verifier."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import pytest

from schemas import JobSubmit, VerifyResult
from services.common.verify_client import build_request
from services.generator.coders.base import CPU_BLOCK_SIZE, CPU_TILES, BuiltinCoder, Candidate
from services.generator.evolve import EvolveSearch, EvolveState, normalised_hash
from services.generator.mutators import DEFAULT_PARAMS, BuiltinMutator, retune
from services.worker.verifier import Verifier
from tests.helpers import BUNDLED_RELU_TASK

TASK = BUNDLED_RELU_TASK


@pytest.fixture
def verifier(shared_verifier):
    """The session's started cpu verifier (64 MiB input limit, tests/conftest.py)."""
    return shared_verifier


@pytest.fixture(scope="module")
def coder(lowering_sandbox):
    return BuiltinCoder(lowering_sandbox)


def make_submit(**kw) -> JobSubmit:
    base = dict(op_name="relu", task_desc=TASK, job_type="evolve", job_id="evo-test",
                max_rounds=3, parallel_num=4, num_islands=2, migration_interval=1,
                elite_size=4, parent_selection_prob=0.5,
                shape_overrides={"batch_size": 4, "dim": 256}, trials=1)
    base.update(kw)
    return JobSubmit(**base)


class Recorder:
    """The verify and checkpoint callables a service would pass, recording calls."""

    def __init__(self, verifier: Verifier, submit: JobSubmit) -> None:
        self.verifier = verifier
        self.submit = submit
        self.verified: list[str] = []
        self.codes: dict[str, str] = {}
        self.checkpoints: list[bytes] = []
        self.events: list[str] = []

    async def verify(self, candidate: Candidate, candidate_id: str) -> VerifyResult:
        self.verified.append(candidate_id)
        self.codes[candidate_id] = candidate.code
        request = build_request(
            request_id=f"req-{candidate_id}", job_id=self.submit.job_id or "j",
            candidate_id=candidate_id, op_name="relu", task_desc=self.submit.task_desc,
            code=candidate.code, backend="cpu", arch="x86_64",
            shape_overrides=self.submit.shape_overrides, trials=1, timeout_s=60)
        return await self.verifier.verify(request, device="0")

    async def report(self, event: str, **fields) -> None:
        self.events.append(event)

    async def checkpoint(self, state: EvolveState) -> None:
        self.checkpoints.append(msgspec.json.encode(state))


def test_retune_rewrites_only_the_launch_parameters() -> None:
    code = "grid = (triton.cdiv(n_elements, 1024),)\nk[grid](x, BLOCK_SIZE=1024, num_warps=4, num_stages=1,)\n"
    out = retune(code, {"block_size": 256, "num_warps": 2, "num_stages": 3})
    assert out is not None
    assert "triton.cdiv(n_elements, 256)" in out
    assert "BLOCK_SIZE=256, num_warps=2, num_stages=3" in out
    assert retune("no launch here", {"block_size": 256, "num_warps": 2, "num_stages": 3}) is None


def test_normalised_hash_ignores_comments_and_formatting() -> None:
    assert normalised_hash("x = 1  # one\n\n") == normalised_hash("x=1")
    assert normalised_hash("x = 1") != normalised_hash("x = 2")


@pytest.mark.slow
async def test_islands_migration_and_elites_on_cpu(verifier, coder) -> None:
    submit = make_submit()
    rec = Recorder(verifier, submit)
    search = EvolveSearch(submit, BuiltinMutator(coder), rec.verify, rec.report, rec.checkpoint,
                          concurrency=2, fitness="correctness")
    result = await search.run()
    s = search.summary
    assert len(s.candidates) == 12
    assert result.passed and result.best and result.best[0].code
    assert {c.island for c in s.candidates} == {0, 1}
    assert [len([c for c in s.candidates if c.round == r]) for r in range(3)] == [4, 4, 4]
    # Each candidate's island population lists it; migrants are added on top.
    for island, members in enumerate(s.islands):
        own = [c.candidate_id for c in s.candidates if c.island == island]
        assert set(own) <= set(members)
    assert s.migrations, "migration_interval=1 with 2 islands must migrate"
    assert any(p.migrant for p in s.parent_choices), "a migrant must have been chosen as parent"
    assert 1 <= len(s.elites) <= 4
    # Distinct launch parameters: no duplicate work in the built-in search.
    params = [tuple(sorted(c.params.items())) for c in s.candidates]
    assert len(set(params)) == len(params)
    assert len(rec.checkpoints) == 12
    for best in result.best:
        assert best.round >= 0 and best.island in (0, 1)
        assert best.candidate_id in {c.candidate_id for c in s.candidates}


async def test_resume_keeps_every_verified_candidate(verifier, coder) -> None:
    submit = make_submit(job_id="evo-resume", max_rounds=2, parallel_num=3)
    rec = Recorder(verifier, submit)
    first = EvolveSearch(submit, BuiltinMutator(coder), rec.verify, rec.report, rec.checkpoint,
                         concurrency=1, fitness="correctness")
    task = asyncio.create_task(first.run())
    while len(rec.checkpoints) < 3:
        await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    saved = msgspec.json.decode(rec.checkpoints[-1], type=EvolveState)
    done = {c.candidate_id for c in saved.summary.candidates if c.passed is not None}
    assert len(done) >= 3
    before = list(rec.verified)

    second = EvolveSearch(submit, BuiltinMutator(coder), rec.verify, rec.report, rec.checkpoint,
                          concurrency=1, fitness="correctness", state=saved)
    result = await second.run()
    again = rec.verified[len(before):]
    assert not done & set(again), "a verified candidate was verified again after resume"
    assert len(second.summary.candidates) == 6
    assert result.passed


async def test_duplicate_code_reuses_the_verdict(verifier, lowering_sandbox) -> None:
    submit = make_submit(job_id="evo-dup", max_rounds=2, parallel_num=2, num_islands=1)
    rec = Recorder(verifier, submit)

    class SameCode:
        name = "fixed"

        def __init__(self) -> None:
            self.code = None

        async def seed(self, submit, index, rng):
            return Candidate(code=self.code, coder=self.name)

        async def mutate(self, submit, parent, parent_code, inspirations, rng):
            # Same code, other formatting: the normalised hash matches.
            return Candidate(code=parent_code + "\n# reformatted\n", coder=self.name)

    seed = await BuiltinCoder(lowering_sandbox).generate(submit)
    mutator = SameCode()
    mutator.code = seed.code
    search = EvolveSearch(submit, mutator, rec.verify, rec.report, rec.checkpoint,
                          concurrency=1, fitness="correctness")
    await search.run()
    dups = [c for c in search.summary.candidates if c.duplicate_of]
    assert dups, "identical code must reuse the earlier verdict"
    assert len(rec.verified) == len(search.summary.candidates) - len(dups)


async def test_a_point_with_other_fusion_choices_is_lowered_again(coder) -> None:
    """A retune rewrites only the launch line: a point whose fusion choice differs from
    every point lowered so far gets its own lowering, not the other's kernels."""
    from tests.sandbox.test_fused_rows import task

    submit = make_submit(task_desc=task("softmax"), op_name="softmax",
                         shape_overrides={"batch": 2, "dim": 256})
    mutator = BuiltinMutator(coder)
    point = {"block_size": 256, "num_warps": 4, "num_stages": 1, "row_fusion": 0}
    unfused = await mutator._render(submit, point)
    fused = await mutator._render(submit, {**point, "row_fusion": 1})
    retuned = await mutator._render(submit, {**point, "row_fusion": 1, "block_size": 512})
    assert unfused.code.count("@triton.jit") == 3
    assert fused.code.count("@triton.jit") == 1
    assert retuned.code.count("@triton.jit") == 1 and retuned.code != fused.code


def test_builtin_mutator_tunes_reduction_and_matmul_tiles(coder) -> None:
    """Seeds of a matmul task carry different matmul tiles and warps into the code."""
    import random

    task = (Path(__file__).resolve().parents[2] / "tasks" / "matmul.py").read_text()
    submit = make_submit(task_desc=task, op_name="matmul", shape_overrides={})
    mutator = BuiltinMutator(coder)
    rng = random.Random(7)
    seeds = [asyncio.run(mutator.seed(submit, index, rng)) for index in range(3)]
    tiles = set()
    for candidate in seeds:
        p = candidate.meta
        assert f"BLOCK_M={p['block_m']}, BLOCK_N={p['block_n']}, BLOCK_K={p['block_k']}" in candidate.code
        tiles.add((p["block_m"], p["block_n"], p["block_k"], p["num_warps"]))
    assert len(tiles) == 3


async def test_a_single_jobs_launch_parameters_follow_its_backend(coder) -> None:
    # cpu runs Triton's interpreter: larger blocks (fewer programs); on a GPU every
    # kernel is autotuned over the launch-configuration table of its arch's family.
    cpu = await coder.generate(make_submit(job_type="single", backend="cpu"))
    assert cpu.meta == {"block_size": CPU_BLOCK_SIZE, **CPU_TILES}
    assert f"BLOCK_SIZE={CPU_BLOCK_SIZE}," in cpu.code
    assert f"triton.cdiv(n, {CPU_BLOCK_SIZE})" in cpu.code
    submit = make_submit(job_type="single", backend="cuda")
    cuda = await coder.generate(submit)
    assert cuda.meta == {"arch": submit.arch or "sm_90"}
    assert "@triton.autotune(" in cuda.code and "key=['n_elements']" in cuda.code
    assert "BLOCK_SIZE=" not in cuda.code.split("class ModelNew")[1]
    # A job's own parameters win over the backend's defaults.
    tuned = await coder.generate(make_submit(job_type="single", backend="cpu"), block_size=256)
    assert tuned.meta == {"block_size": 256, **CPU_TILES} and "BLOCK_SIZE=256," in tuned.code


@pytest.mark.slow  # three interpreted convolution verifications: ~50 s
async def test_an_evolve_job_on_a_convolution_tunes_its_tiles(verifier, coder) -> None:
    """A conv task's evolve search verifies candidates at several tile sizes: the conv
    kernel's BLOCK_M / BLOCK_N / BLOCK_K follow each candidate's point (BLOCK_N capped
    by the output channels), every one passes,
    and the fitness is the modeled time (the cpu backend's)."""
    from tests.sandbox.test_conv_lowering import conv_task

    submit = make_submit(task_desc=conv_task("conv2d_relu_epilogue"), op_name="conv",
                         job_id="evo-conv", max_rounds=1, parallel_num=3, num_islands=1,
                         shape_overrides={"batch": 1, "height": 6, "width": 7})
    rec = Recorder(verifier, submit)
    search = EvolveSearch(submit, BuiltinMutator(coder), rec.verify, rec.report, rec.checkpoint,
                          concurrency=1, fitness="modeled_time")
    result = await search.run()
    s = search.summary
    assert result.passed and s.fitness == "modeled_time"
    tiles = set()
    for c in s.candidates:
        assert c.passed, c
        assert c.modeled_time_us is not None, c
        p = {**DEFAULT_PARAMS, **c.params}
        tile = (p["block_m"], p["block_n"], p["block_k"])
        code = rec.codes[c.candidate_id]
        assert "conv_kernel_" in code
        # BLOCK_N: the point's, or the output channels' power of two when fewer
        assert f"min({tile[1]}, triton.next_power_of_2(" in code, code
        assert f"BLOCK_M={tile[0]}, BLOCK_N=block_n" in code and f"BLOCK_K={tile[2]}," in code
        tiles.add(tile)
    assert len(s.candidates) == 3 and len(tiles) == 3, tiles
