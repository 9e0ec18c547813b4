"""Races, fills and the autotune count of the replay (rules D021, D022, D023), on the
cpu backend: the real sandbox and Triton's interpreter.

A launch's programs run in program order, in reverse, in an order drawn from a secret
seed and concurrently (each program seeing memory as the launch began, other programs'
stores only after an acquiring atomic): a kernel right only in program order fails
(``services/worker/replay.py``). Fresh allocations are filled from a secret seed,
twice differently for the first call: outputs that depend on the fill fail
(``services/worker/trace.py`` ``Fill``). Each config of a multi-config autotuned
launch runs a secret number of times.
"""

from __future__ import annotations

import pytest
import torch

from schemas.events import VerifyRequest
from services.worker.procedure.replays import draw_autotune_runs
from services.worker.trace import FILL_KINDS, PLAUSIBLE_FILLS, Fill, fill_undefined
from tests.corpus import CORPUS, TASKS, load
from tests.helpers import RELU_TASK, cpu_request

RACE = "outputs depend on the order its programs ran: a race"
FILLED = "was not written by the kernels (it depends on what the fresh allocation held)"


def request(code: str, task: str, trials: int = 2) -> VerifyRequest:
    return cpu_request(code, task, trials=trials, job_id="job-orders")


@pytest.fixture
def verifier(shared_verifier):
    return shared_verifier


# ------------------------------------------------------------------ races (D021)

READ_MODIFY_WRITE = """    total = tl.load(out_ptr + row)
    tl.store(out_ptr + row, total + tl.sum(x, axis=0))
"""


async def test_a_race_fails_and_the_same_sum_with_atomics_passes(verifier, dynamic_only):
    code, meta = load(CORPUS / "hostile" / "race_read_modify_write.py")
    result = await verifier.verify(request(code, TASKS[meta["task"]]), device="0")
    assert result.stage == "mismatch", result
    assert "kernel rowsum_kernel: " + RACE in result.error, result.error
    assert READ_MODIFY_WRITE in code
    atomic = code.replace(READ_MODIFY_WRITE, "    tl.atomic_add(out_ptr + row, "
                                             "tl.sum(x, axis=0))\n")
    result = await verifier.verify(request(atomic, TASKS[meta["task"]]), device="0")
    assert result.passed, (result.stage, result.error)


INT_TASK = """
import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, x):
        return x.sum(dim=1)


def get_inputs():
    return [torch.randint(-100, 100, (8, 1000), dtype=torch.int32)]


def get_init_inputs():
    return []
"""

INT_ROWSUM = """
import torch
import torch.nn as nn
import triton
import triton.language as tl


@triton.jit
def rowsum_kernel(x_ptr, out_ptr, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    part = tl.program_id(1)
    offs = part * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * n_cols + offs, mask=offs < n_cols, other=0)
    UPDATE


class ModelNew(nn.Module):
    def forward(self, x):
        x = x.contiguous()
        rows, cols = x.shape
        out = torch.zeros(rows, device=x.device, dtype=torch.int64)
        rowsum_kernel[(rows, triton.cdiv(cols, 128))](x, out, cols, BLOCK=128)
        return out
"""


async def test_lost_updates_show_only_when_programs_run_at_once(verifier, dynamic_only):
    # Integer sums are the same in every sequential order: only the concurrent model
    # (each program reading memory as the launch began) loses the updates.
    racy = INT_ROWSUM.replace("UPDATE", "total = tl.load(out_ptr + row)\n    "
                              "tl.store(out_ptr + row, total + tl.sum(x.to(tl.int64), axis=0))")
    result = await verifier.verify(request(racy, INT_TASK), device="0")
    assert result.stage == "mismatch", result
    assert RACE in result.error and "running concurrently" in result.error, result.error
    atomic = INT_ROWSUM.replace("UPDATE", "tl.atomic_add(out_ptr + row, "
                                "tl.sum(x.to(tl.int64), axis=0))")
    result = await verifier.verify(request(atomic, INT_TASK), device="0")
    assert result.passed, (result.stage, result.error)


async def test_reading_the_previous_programs_output_fails_and_two_launches_pass(
        verifier, dynamic_only):
    for name in ("race_reads_previous_program.py", "race_last_program_reduces.py"):
        code, meta = load(CORPUS / "hostile" / name)
        result = await verifier.verify(request(code, TASKS[meta["task"]]), device="0")
        assert result.stage == "mismatch", (name, result)
        assert RACE in result.error and "reverse order" in result.error, result.error
    code, meta = load(CORPUS / "honest" / "two_launch_rowsum.py")
    result = await verifier.verify(request(code, TASKS[meta["task"]]), device="0")
    assert result.passed, (result.stage, result.error)


LAST_BLOCK = """
import torch
import torch.nn as nn
import triton
import triton.language as tl


@triton.jit
def rowsum_kernel(x_ptr, part_ptr, count_ptr, out_ptr, n_cols, PARTS: tl.constexpr,
                  BLOCK: tl.constexpr):
    row = tl.program_id(0)
    part = tl.program_id(1)
    offs = part * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * n_cols + offs, mask=offs < n_cols, other=0.0)
    tl.store(part_ptr + row * PARTS + part, tl.sum(x, axis=0))
    done = tl.atomic_add(count_ptr + row, 1, SEM)
    if done == PARTS - 1:
        partials = tl.load(part_ptr + row * PARTS + tl.arange(0, PARTS))
        tl.store(out_ptr + row, tl.sum(partials, axis=0))


class ModelNew(nn.Module):
    def forward(self, x):
        x = x.contiguous()
        rows, cols = x.shape
        parts = triton.next_power_of_2(triton.cdiv(cols, 128))
        partials = torch.zeros(rows * parts, device=x.device, dtype=x.dtype)
        count = torch.zeros(rows, device=x.device, dtype=torch.int32)
        out = torch.empty(rows, device=x.device, dtype=x.dtype)
        rowsum_kernel[(rows, parts)](x, partials, count, out, cols, PARTS=parts, BLOCK=128)
        return out
"""


async def test_the_last_block_reduces_after_an_acquiring_counter_only(verifier, dynamic_only):
    # The counter's acq_rel atomic publishes each block's partial and lets the block
    # that counts last see them all (the threadFenceReduction pattern); a relaxed
    # counter promises neither.
    task = TASKS["rowsum"]
    result = await verifier.verify(request(LAST_BLOCK.replace("SEM", 'sem="acq_rel"'), task),
                                   device="0")
    assert result.passed, (result.stage, result.error)
    result = await verifier.verify(request(LAST_BLOCK.replace("SEM", 'sem="relaxed"'), task),
                                   device="0")
    assert result.stage == "mismatch", result
    assert RACE in result.error and "concurrently" in result.error, result.error


# ------------------------------------------------------------------ fills (D022)


@pytest.mark.parametrize("name", ["fill_nan_left_in_place.py", "fill_tells_verification.py",
                                  "fill_as_initial_value.py", "fill_bool_lanes_unwritten.py"])
async def test_outputs_that_depend_on_the_fill_fail(verifier, dynamic_only, name):
    code, meta = load(CORPUS / "hostile" / name)
    result = await verifier.verify(request(code, TASKS[meta["task"]]), device="0")
    assert result.stage == "mismatch", result
    assert "output 0 " + FILLED in result.error, result.error


SENTINEL = """
import torch
import torch.nn as nn
import triton
import triton.language as tl


@triton.jit
def relu_kernel(x_ptr, seen_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(x_ptr + offs, mask=m)
    seen = tl.load(seen_ptr + tl.program_id(0))
    if seen == 2147483647:
        x = tl.maximum(x, 0.0)
    tl.store(out_ptr + offs, x, mask=m)


class ModelNew(nn.Module):
    def forward(self, x):
        x = x.contiguous()
        n = x.numel()
        seen = torch.empty(triton.cdiv(n, 1024), device=x.device, dtype=torch.int32)
        out = torch.empty_like(x)
        relu_kernel[(triton.cdiv(n, 1024),)](x, seen, out, n, BLOCK=1024)
        return out
"""


async def test_a_kernel_branching_on_an_integer_sentinel_fails(verifier, dynamic_only):
    # INT_MAX was the integer fill: a kernel computing right only where it reads it.
    result = await verifier.verify(request(SENTINEL, RELU_TASK), device="0")
    assert not result.passed, result
    assert result.stage == "mismatch", result


def test_every_dtype_is_filled_by_every_kind_and_seeds_differ():
    dtypes = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8,
              torch.int32, torch.int64, torch.uint8, torch.bool, torch.complex64]
    for dtype in dtypes:
        for kind in FILL_KINDS:
            first, second = torch.zeros(257, dtype=dtype), torch.zeros(257, dtype=dtype)
            fill_undefined(first, Fill(kind, 1))
            fill_undefined(second, Fill(kind, 2))
            if kind == "zero":
                assert not first.any() and not second.any(), (dtype, kind)
                continue
            if dtype.is_floating_point and kind in ("nan", "snan"):
                assert torch.isnan(first).all(), (dtype, kind)
            if dtype.is_floating_point and kind in PLAUSIBLE_FILLS:
                assert torch.isfinite(first).all(), (dtype, kind)
            raw = (first.view(torch.uint8) if dtype.itemsize == 1 else first).reshape(-1)
            if dtype == torch.bool:
                assert raw.any(), (dtype, kind)  # bool allocations are filled
            drawn = ("random", "mixed", "snan") if dtype == torch.bool else \
                ("random", "mixed", "large") + (("snan",) if dtype.is_floating_point else ())
            if kind in drawn:
                # Values drawn from the seed: another seed, other values.
                same = first.view(torch.uint8) == second.view(torch.uint8)
                assert not same.all(), (dtype, kind)


def test_the_ghost_runs_bool_fill_is_one_value():
    # The planner's ghost outputs are compared with the reference's at the decoys: a
    # constant bool fill cannot equal a non-constant output by chance.
    t = torch.zeros(64, dtype=torch.bool)
    for seed in range(8):
        fill_undefined(t, Fill("random", seed, constant_bool=True))
        assert bool((t == t[0]).all())


# ------------------------------------------------------------------ autotune (D023)

COUNTED = """
import torch
import torch.nn as nn
import triton
import triton.language as tl


@triton.autotune(configs=[triton.Config({}, num_warps=4), triton.Config({}, num_warps=8)],
                 key=["n"])
@triton.jit
def relu_kernel(x_ptr, count_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    m = offs < n
    runs = tl.atomic_add(count_ptr, 1)
    x = tl.load(x_ptr + offs, mask=m)
    tl.store(out_ptr + offs, tl.maximum(x, 0.0) + runs.to(tl.float32) * 1000.0, mask=m)


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("count", torch.zeros(1, dtype=torch.int32))

    def forward(self, x):
        x = x.contiguous()
        out = torch.empty_like(x)
        n = x.numel()
        relu_kernel[(1,)](x, self.count, out, n, BLOCK=triton.next_power_of_2(n))
        return out
"""


async def test_each_autotune_config_runs_a_secret_number_of_times(verifier, dynamic_only):
    # The kernel adds 1000 x (its runs before this one) to the relu: the error of the
    # first trial is 1000 x (the runs of the chosen config - 1).
    result = await verifier.verify(request(COUNTED, RELU_TASK, trials=1), device="0")
    assert result.stage == "mismatch", result
    runs = round(result.max_abs_error / 1000) + 1
    assert 2 <= runs <= 4, result.max_abs_error
    counts = {draw_autotune_runs() for _ in range(300)}
    assert counts == {2, 3, 4}, counts
