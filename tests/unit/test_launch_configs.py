"""The built-in coder's launch-configuration table (services/generator/launch_configs.py):
GPU kernels carry @triton.autotune over their schedule's list for the arch's family,
they compile for sm_90 without a GPU, the cpu emission keeps its one configuration,
and evolve's GPU space is the table's."""

from __future__ import annotations

import json
import random
import re

import pytest

from schemas import JobSubmit
from services.generator.coders.base import Candidate, launch_defaults
from services.generator.launch_configs import (
    FACTS_CACHE,
    SHARED_BYTES,
    TABLE,
    configs_for,
    facts_ok,
    family_of,
    shared_bytes,
)
from services.generator.lowering import lower_task
from services.generator.mutators import BuiltinMutator, gpu_point, gpu_space

GEMM_TASK = """\
import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, a, b):
        return torch.matmul(a, b)


def get_inputs():
    return [torch.randn(64, 48), torch.randn(48, 32)]


def get_init_inputs():
    return []
"""

EW_TASK = """\
import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, x, y):
        return torch.relu(x) * y + 1.0


def get_inputs():
    return [torch.randn(16, 100), torch.randn(16, 100)]


def get_init_inputs():
    return []
"""

MM = ("BLOCK_M", "BLOCK_N", "BLOCK_K")


def _decorated(source: str, kernel: str) -> tuple[list[str], str]:
    """The triton.Config(...) lines and the key of ``kernel``'s @triton.autotune."""
    match = re.search(r"@triton\.autotune\(\n    configs=\[\n(.*?)    \],\n"
                      rf"    key=(.*?),\n\)\n@triton\.jit\ndef {kernel}", source, re.S)
    assert match, f"{kernel} carries no @triton.autotune"
    return [line.strip() for line in match.group(1).splitlines()], match.group(2)


def _config_lines(configs, names) -> list[str]:
    return [f"triton.Config({c.constexprs(names)!r}, num_warps={c.num_warps}, "
            f"num_stages={c.num_stages})," for c in configs]


@pytest.mark.parametrize("arch, family", [("h100", "sm_90"), ("mi300x", "gfx942")])
def test_gemm_kernel_is_autotuned_over_the_table(arch, family):
    source = lower_task(GEMM_TASK, arch=arch)
    configs, key = _decorated(source, "matmul_kernel_1")
    assert key == "['M', 'N', 'K']"
    expected = configs_for("matmul", arch, MM)
    assert configs == _config_lines(expected, MM)
    assert 4 <= len(configs) <= 8
    assert family_of(arch) == family and all(c in TABLE[family]["matmul"] for c in expected)
    # the grid reads the chosen tile; no launch parameter is fixed
    assert "META['BLOCK_M']" in source and "num_warps=" not in source.split("class ModelNew")[1]


@pytest.mark.parametrize("arch", ["h100", "mi300x"])
def test_elementwise_kernel_is_autotuned_on_n_elements(arch):
    source = lower_task(EW_TASK, arch=arch)
    configs, key = _decorated(source, r"pointwise_kernel_\d+")
    assert key == "['n_elements']"
    assert configs == _config_lines(configs_for("elementwise", arch, ("BLOCK_SIZE",)),
                                    ("BLOCK_SIZE",))
    if arch == "mi300x":  # wave64: at most 8 waves of 64 lanes, as Inductor halves them
        assert "num_warps=16" not in source


def test_cpu_emission_keeps_its_one_configuration():
    for task in (GEMM_TASK, EW_TASK):
        source = lower_task(task, **launch_defaults("cpu"))
        assert "triton.autotune" not in source and "META" not in source
        assert source == lower_task(task, **launch_defaults("cpu"), arch="")
    assert "BLOCK_SIZE=4096, num_warps=4, num_stages=1)" in lower_task(
        EW_TASK, **launch_defaults("cpu"))
    assert "BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=1)" in lower_task(
        GEMM_TASK, **launch_defaults("cpu"))
    assert launch_defaults("cuda", "h100") == {"arch": "h100"}


def test_one_config_of_each_emitted_kernel_compiles_for_sm_90():
    from services.worker.gpu_facts import config_ok

    for task, kernel, names in ((GEMM_TASK, "matmul_kernel_1", MM),
                                (EW_TASK, None, ("BLOCK_SIZE",))):
        source = lower_task(task, arch="sm_90")
        plain = re.sub(r"@triton\.autotune\(\n.*?\n\)\n", "", source, flags=re.S)
        match = re.search(r"^def (\w+_kernel_\d+)\((.*?)\):", plain, re.M)
        name, params = match.group(1), [p.strip() for p in match.group(2).split(",")]
        assert kernel is None or name == kernel
        config = configs_for("matmul" if names == MM else "elementwise", "sm_90", names)[-1]
        constexprs = {**config.constexprs(names), **({"FLAT": True} if "FLAT: tl.constexpr"
                                                       in params else {})}
        signature = {p.split(":")[0]: "constexpr" if p.endswith("tl.constexpr") else
                     "*fp32" if p.endswith("_ptr") else "i32" for p in params}
        facts = config_ok(plain, name, signature, constexprs,
                          {"num_warps": config.num_warps, "num_stages": config.num_stages},
                          "sm_90")
        assert facts.ok, facts.error
        assert facts.arch == "sm_90" and facts.registers > 0


def test_lists_fit_the_familys_shared_memory():
    for family in TABLE:
        for schedule in TABLE[family]:
            kept = configs_for(schedule, family, MM if schedule in ("matmul", "conv")
                               else ("BLOCK_SIZE",) if schedule == "elementwise" else ())
            assert 2 <= len(kept) <= 8, (family, schedule)
            assert all(shared_bytes(c) <= SHARED_BYTES[family] for c in kept)
    # 128x128x64 in 3 float32 stages is 192 KiB: beyond sm_80's 163 KB, within sm_90's
    big = [c for c in TABLE["sm_90"]["matmul"] if (c.block_m, c.block_k) == (128, 64)][0]
    assert shared_bytes(big) == 196608
    assert SHARED_BYTES["sm_80"] < shared_bytes(big) <= SHARED_BYTES["sm_90"]
    assert big in configs_for("matmul", "sm_90", MM)


def test_configs_the_compiler_says_spill_are_dropped():
    # the checked-in facts cache, measured with Triton's compiler for sm_90 without a
    # GPU: the float32 128x128x32/4 warps/4 stages GEMM spills 264 bytes a thread,
    # 64x128x32 none
    spilling = [c for c in TABLE["sm_90"]["matmul"]
                if (c.block_m, c.block_n, c.block_k, c.num_warps) == (128, 128, 32, 4)][0]
    assert not facts_ok("matmul", "float32", "sm_90", spilling)
    names = [(c.block_m, c.block_n, c.block_k, c.num_warps)
             for c in configs_for("matmul", "sm_90", MM)]
    assert (128, 128, 32, 4) not in names and (64, 128, 32, 4) in names
    source = lower_task(GEMM_TASK, arch="h100")
    assert "{'BLOCK_M': 128, 'BLOCK_N': 128, 'BLOCK_K': 32}, num_warps=4" not in source


class InProcessCoder:
    """The built-in coder's lowering run here (the tasks are ours): what evolve asked."""

    name = "builtin"

    def __init__(self) -> None:
        self.asked: list[dict] = []

    async def generate(self, submit: JobSubmit, **params) -> Candidate:
        self.asked.append(dict(params))
        params = {**launch_defaults(submit.backend, submit.arch), **params}
        return Candidate(code=lower_task(submit.task_desc, **params), coder=self.name,
                         meta=params)


async def test_evolve_gpu_space_is_the_table():
    space = gpu_space("h100")
    mm = TABLE["sm_90"]["matmul"]
    assert set(space["block_m"]) <= {c.block_m for c in mm + TABLE["sm_90"]["conv"]}
    assert space["block_size"] == sorted(c.block_size for c in TABLE["sm_90"]["elementwise"])
    coder = InProcessCoder()
    mutator = BuiltinMutator(coder)
    submit = JobSubmit(task_desc=EW_TASK, op_name="ew", backend="cuda", arch="h100")
    rng = random.Random(0)
    first = await mutator.seed(submit, 0, rng)
    assert first.meta["tune"] == 1 and "@triton.autotune" in first.code
    second = await mutator.seed(submit, 1, rng)
    assert second.meta == gpu_point("h100", 0)
    assert second.code.count("triton.Config(") == 1  # the table's first configuration alone
    child = await mutator.mutate(submit, _parent(second.meta), second.code, [], rng)
    for name, value in child.meta.items():
        if name in space:
            assert value in space[name], (name, value)
    cpu = BuiltinMutator(InProcessCoder())
    seed = await cpu.seed(JobSubmit(task_desc=EW_TASK, op_name="ew"), 0, rng)
    assert "tune" not in seed.meta and "triton.autotune" not in seed.code


def _parent(params: dict):
    from schemas import EvolveCandidate

    return EvolveCandidate(candidate_id="p", island=0, round=0, coder="builtin",
                           code_hash="h", params=dict(params))


def test_every_tile_list_keeps_a_config_the_compiler_says_does_not_spill():
    # The checked-in facts (services.generator.lowering.launch_facts): each family's
    # matmul and conv list holds at least one configuration that compiled without
    # spilling, so an autotuner always has one to fall back on (a fused convolution's
    # 4-warp tiles all spill on sm_90; 64x64x32 over 8 warps does not).
    from services.generator.launch_configs import config_id, facts_key

    cache = json.loads(FACTS_CACHE.read_text())
    for family in TABLE:
        for schedule in ("matmul", "conv"):
            kept = configs_for(schedule, family, MM)
            clean = [c for c in kept
                     if cache.get(facts_key(schedule, "float32", family, c), {}).get(
                         "spill_bytes", 1) == 0]
            assert clean, (family, schedule, [config_id(c) for c in kept])
    assert (64, 64, 32, 8) in [(c.block_m, c.block_n, c.block_k, c.num_warps)
                               for c in configs_for("conv", "sm_90", MM)]
