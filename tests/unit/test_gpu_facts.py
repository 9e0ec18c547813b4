"""The GPU compiler's facts of a kernel, read without a GPU (services/worker/gpu_facts.py):
real Triton compiles for sm_90 and gfx942, compared with what the compiler itself reports
(the bundled cuobjdump on the cubin; the AMDGPU metadata and LLVM's occupancy line)."""

from __future__ import annotations

import importlib.util
import re
import subprocess

import pytest

from services.worker import gpu_facts
from services.worker.gpu_facts import KernelFacts, config_ok, facts_of, occupancy
from services.worker.targets import TARGETS

GEMM = '''
import triton
import triton.language as tl


@triton.jit
def gemm(a, b, c, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
         BLOCK_K: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        x = tl.load(a + rm[:, None] * K + (k + rk)[None, :])
        y = tl.load(b + (k + rk)[:, None] * N + rn[None, :])
        acc += tl.dot(x, y)
    tl.store(c + rm[:, None] * N + rn[None, :], acc.to(tl.float16))
'''
SIG = {"a": "*fp16", "b": "*fp16", "c": "*fp16", "M": "i32", "N": "i32", "K": "i32",
       "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr"}
SMALL = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32}
OPTIONS = {"num_warps": 4, "num_stages": 2}


def _compiled(tmp_path, target: str):
    """The small GEMM compiled directly with triton.compile (not through config_ok)."""
    path = tmp_path / "gemm_kernels.py"
    path.write_text(GEMM)
    with gpu_facts.compiler_mode():
        spec = importlib.util.spec_from_file_location(f"gemm_kernels_{target}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return gpu_facts.compile_for(module.gemm, SIG, SMALL, OPTIONS, TARGETS[target])


def test_sm90_facts_match_cuobjdump(tmp_path):
    compiled = _compiled(tmp_path, "sm_90")
    cubin = tmp_path / "k.cubin"
    cubin.write_bytes(compiled.asm["cubin"])
    out = subprocess.run([gpu_facts.cuobjdump_path(), "--dump-resource-usage", str(cubin)],
                         capture_output=True, text=True, check=True).stdout
    reg, stack, static = (int(x) for x in re.search(
        r"REG:(\d+) STACK:(\d+) SHARED:(\d+)", out).groups())
    facts = facts_of(compiled, "sm_90")
    assert (facts.registers, facts.spill_bytes) == (reg, stack)
    assert facts.shared_bytes == compiled.metadata.shared + static
    assert facts.ok and not facts.spills and facts.arch == "sm_90" and facts.max_warps == 64
    # 96-ish registers x 32 threads, in units of 256 per warp, of 65536 per SM.
    per_warp = -(-reg * 32 // 256) * 256
    assert facts.occupancy_warps == (65536 // per_warp) // 4 * 4
    assert facts.limiter == "registers"
    # config_ok reads the same facts from source.
    same = config_ok(GEMM, "gemm", SIG, SMALL, OPTIONS, "h100")
    assert (same.registers, same.spill_bytes, same.shared_bytes, same.occupancy_warps) == (
        facts.registers, facts.spill_bytes, facts.shared_bytes, facts.occupancy_warps)
    assert same.usable()


def test_gfx942_facts_match_amdgpu_metadata(tmp_path):
    compiled = _compiled(tmp_path, "gfx942")
    asm = compiled.asm["amdgcn"]

    def field(name):
        return int(re.search(rf"\.{name}:\s*(\d+)", asm).group(1))

    facts = facts_of(compiled, "mi300x")
    assert facts.registers == field("vgpr_count") + field("agpr_count")
    assert facts.sgprs == field("sgpr_count")
    assert facts.spilled_registers == field("vgpr_spill_count") + field("sgpr_spill_count")
    assert facts.spill_bytes == field("private_segment_fixed_size") == 0
    assert facts.arch == "gfx942" and facts.max_warps == 32
    # LLVM's own occupancy (waves per SIMD): 4 waves per workgroup, one per SIMD.
    llvm = int(re.search(r";\s*Occupancy:\s*(\d+)", asm).group(1))
    assert facts.occupancy_warps == 4 * llvm
    same = config_ok(GEMM, "gemm", SIG, SMALL, OPTIONS, "gfx942")
    assert (same.registers, same.occupancy_warps) == (facts.registers, facts.occupancy_warps)


def test_config_ok_is_cached_and_reports_compile_errors(tmp_path, monkeypatch):
    monkeypatch.setenv("AIKG_GPU_FACTS_CACHE_DIR", str(tmp_path / "facts"))
    broken = GEMM.replace("acc += tl.dot(x, y)", "acc += tl.dot(x, y, no_such_argument=1)")
    facts = config_ok(broken, "gemm", SIG, SMALL, OPTIONS, "h100")
    assert not facts.ok and not facts.usable() and "no_such_argument" in facts.error
    first = config_ok(GEMM, "gemm", SIG, {**SMALL, "BLOCK_K": 16}, OPTIONS, "h100")
    assert first.ok and len(list((tmp_path / "facts").glob("*.json"))) == 2
    gpu_facts._MEMORY.clear()  # the disk copy answers a fresh process
    again = config_ok(GEMM, "gemm", SIG, {**SMALL, "BLOCK_K": 16}, OPTIONS, "h100")
    assert again == first
    with pytest.raises(KeyError, match="unknown GPU target"):
        config_ok(GEMM, "gemm", SIG, SMALL, OPTIONS, "tpu")


def test_config_ok_leaves_the_interpreter_as_it_found_it():
    import triton
    from triton.runtime import interpreter

    was = triton.knobs.runtime.interpret
    sigmoid = triton.language.sigmoid
    triton.knobs.runtime.interpret = True
    # As in a fork server that imported Triton for its interpreter.
    triton.language.sigmoid = interpreter.InterpretedFunction(sigmoid.fn)
    try:
        facts = config_ok(GEMM.replace("acc.to(tl.float16)", "tl.sigmoid(acc).to(tl.float16)"),
                          "gemm", SIG, SMALL, OPTIONS, "sm_90")
        assert facts.ok, facts.error
        assert triton.knobs.runtime.interpret is True
        assert isinstance(triton.language.sigmoid, interpreter.InterpretedFunction)
    finally:
        triton.knobs.runtime.interpret = was
        triton.language.sigmoid = sigmoid


def test_occupancy_limits():
    # sm_90: 255 registers x 32 = 8160 -> 8192 per warp: 8 warps per SM, 2 blocks of 4.
    assert occupancy("h100", 255, 0, 4) == (8, 2, "registers")
    # Shared memory binds: 100 KB + 1 KB reserved per block of 232448 B... two fit.
    assert occupancy("h100", 32, 100 * 1024, 4)[1:] == (2, "shared")
    # 4090 (sm_89): 48 warps per SM; 16 warps per block leave 3 blocks.
    assert occupancy("4090", 16, 0, 16) == (48, 3, "warps")
    # Over the per-block shared limit: nothing launches.
    assert occupancy("h100", 32, 240000, 4)[:2] == (0, 0)
    # gfx942: 128 VGPRs -> 4 waves per SIMD; 8 waves per workgroup, 2 per SIMD: 2 groups.
    assert occupancy("mi300x", 128, 0, 8) == (16, 2, "registers")
    assert occupancy("mi300x", 512, 0, 4) == (4, 1, "registers")
    assert occupancy("mi300x", 32, 40000, 4)[1:] == (1, "shared")
    facts = KernelFacts(target="h100", spill_bytes=300, blocks=1)
    assert facts.spills and facts.heavy_spill and not facts.usable()
    assert facts.usable(max_spill_bytes=512)
