"""Offsets past int32 at the task's own sizes (rule D026) and the grid and loop rules
of size congruence, from kernels' source and recorded launches alone: the corpus's
candidates, their kernel modules as the worker builds them, launches as a dry run
records them (no sandbox, no Triton)."""

from __future__ import annotations

import random

import pytest

from services.worker import index_ranges, kernel_source, overflow, sizes
from tests.corpus import CORPUS, load

ROWS, COLS = 32768, 131072  # tasks/huge_relu.py: 2**32 elements


def _tensor(*shape: int) -> dict:
    return {"~": "T", "s": 0, "o": 0, "z": list(shape), "r": [1] * len(shape), "d": "float32"}


def _kernels(name: str) -> kernel_source.KernelModule:
    return kernel_source.kernel_module(load(CORPUS / name)[0])


def _relu_launch(kernel: str, n: int, block: int = 1024, grid: int | None = None) -> dict:
    x = _tensor(n // COLS or 1, min(n, COLS))
    return {"launch": kernel, "grid": [grid if grid is not None else -(-n // block), 1, 1],
            "args": {"x_ptr": x, "out_ptr": x, "n": n, "BLOCK": block}}


def _rows_launch(kernel: str, rows: int, cols: int, block: int = 256) -> dict:
    x = _tensor(rows, cols)
    return {"launch": kernel, "grid": [rows, 1, 1],
            "args": {"x_ptr": x, "out_ptr": x, "stride": cols, "n_cols": cols, "BLOCK": block}}


def test_int32_program_offset_past_int32_names_kernel_and_expression():
    module = _kernels("hostile/int32_offset_at_task_size.py")
    found = overflow.find([_relu_launch("relu_kernel", ROWS * COLS)], module.source)
    assert len(found) == 1
    text = found[0].message()
    assert text.startswith("kernel relu_kernel: offset `pid * BLOCK` reaches 4.29e9 at the "
                           "task's own sizes, beyond int32"), text
    assert "tl.int64" in text


def test_the_same_kernel_is_fine_below_int32():
    module = _kernels("hostile/int32_offset_at_task_size.py")
    assert overflow.find([_relu_launch("relu_kernel", 4096 * 4096)], module.source) == []


def test_int64_program_id_passes_at_the_same_sizes():
    module = _kernels("honest/int64_offsets.py")
    assert overflow.find([_relu_launch("relu_kernel", ROWS * COLS)], module.source) == []


def test_a_cast_after_the_int32_product_is_too_late():
    module = _kernels("hostile/int64_cast_after_the_product.py")
    found = overflow.find([_rows_launch("relu_rows", ROWS, COLS)], module.source)
    assert [f.expression for f in found] == ["row * stride"]
    assert found[0].reaches == (ROWS - 1) * COLS


def test_a_scalar_argument_from_2_31_is_int64_as_triton_specialises_it():
    source = ("import triton\nimport triton.language as tl\n\n\n@triton.jit\n"
              "def k(x_ptr, start, BLOCK: tl.constexpr):\n"
              "    offs = start + tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)\n"
              "    tl.store(x_ptr + offs, 0.0)\n")
    launch = {"launch": "k", "grid": [4, 1, 1],
              "args": {"x_ptr": _tensor(8), "start": 2**31, "BLOCK": 64}}
    assert overflow.find([launch], source) == []
    narrow = {**launch, "args": {**launch["args"], "start": 2**31 - 10}}
    assert [f.expression for f in overflow.find([narrow], source)] == [
        "start + tl.program_id(0) * BLOCK"]


def test_a_pointer_advanced_in_a_loop_accumulates_its_increments():
    source = ("import triton\nimport triton.language as tl\n\n\n@triton.jit\n"
              "def k(x_ptr, n, step, BLOCK: tl.constexpr):\n"
              "    offs = tl.arange(0, BLOCK)\n"
              "    for i in range(0, n, BLOCK):\n"
              "        offs += step\n"
              "        tl.load(x_ptr + offs)\n")
    launch = {"launch": "k", "grid": [1, 1, 1],
              "args": {"x_ptr": _tensor(8), "n": 1 << 20, "step": 1 << 20, "BLOCK": 256}}
    found = overflow.find([launch], source)
    assert len(found) == 1 and found[0].reaches > 2**31, found


def test_loaded_values_are_unknown_and_never_reported():
    source = ("import triton\nimport triton.language as tl\n\n\n@triton.jit\n"
              "def k(x_ptr, idx_ptr, BLOCK: tl.constexpr):\n"
              "    i = tl.load(idx_ptr + tl.arange(0, BLOCK))\n"
              "    tl.store(x_ptr + i * 1000000000, 0.0)\n")
    launch = {"launch": "k", "grid": [1, 1, 1],
              "args": {"x_ptr": _tensor(8), "idx_ptr": _tensor(8), "BLOCK": 8}}
    assert overflow.find([launch], source) == []


def test_trip_counts_come_from_the_launch_values():
    module = _kernels("honest/reduction_loop.py")
    fn = index_ranges.kernel_defs(module.source)["rowsum_kernel"]
    long = index_ranges.evaluate(fn, {"grid": [4097], "args": {"n_cols": 65536, "BLOCK": 256}})
    short = index_ranges.evaluate(fn, {"grid": [8], "args": {"n_cols": 256, "BLOCK": 256}})
    assert [loop.trips for loop in long.loops] == [(256, 256)]
    assert [loop.trips for loop in short.loops] == [(1, 1)]
    assert index_ranges.trip_class((1, 1)) == "once"
    assert index_ranges.trip_class((0, 5)) == "several"


def _row_launch(rows: int, cols: int) -> dict:
    x = _tensor(rows, cols)
    return {"launch": "rowsum_kernel", "grid": [rows, 1, 1],
            "args": {"x_ptr": x, "out_ptr": _tensor(rows), "n_cols": cols, "BLOCK": 256}}


def test_a_loop_run_once_is_not_congruent_with_one_run_many_times():
    module = _kernels("hostile/reduction_keeps_last_block.py")
    source = sizes.KernelSource.of(module.source)
    constexprs = module.constexpr_params
    real = [_row_launch(4097, 65536)]
    # 256 is congruent with 65536 modulo the block: only the loop rule tells them apart.
    assert sizes.congruent(real, [_row_launch(8, 256)], constexprs) is None
    reason = sizes.congruent(real, [_row_launch(8, 256)], constexprs, source)
    assert reason is not None and "rowsum_kernel's loop `for start in range(0, n_cols, " \
        "BLOCK)` (line 15) runs 256 times at the task's own sizes and 1 time" in reason
    assert sizes.congruent(real, [_row_launch(257, 512)], constexprs, source) is None


def test_a_grid_halved_at_the_task_sizes_is_not_congruent():
    module = _kernels("hostile/grid_halved_at_task_size.py")
    constexprs = module.constexpr_params
    n_real, n_small = 4096 * 4096, 16 * 4096
    real = [_relu_launch("relu_kernel", n_real, grid=n_real // 1024 // 2)]
    reason = sizes.congruent(real, [_relu_launch("relu_kernel", n_small)], constexprs)
    assert reason is not None and "grid axis 0 is cdiv(" in reason and "8192" in reason
    whole = [_relu_launch("relu_kernel", n_real)]
    assert sizes.congruent(whole, [_relu_launch("relu_kernel", n_small)], constexprs) is None


def test_one_program_is_not_congruent_with_several():
    module = _kernels("honest/elementwise_relu.py")
    real = [_relu_launch("relu_kernel", 1024)]
    reason = sizes.congruent(real, [_relu_launch("relu_kernel", 4096)],
                             module.constexpr_params)
    assert reason is not None and "runs 1 program on grid axis 0" in reason


@pytest.mark.parametrize("seed", range(20))
def test_shape_generality_sizes_are_drawn_odd_and_below_the_checked_ones(seed):
    base = {"batch_size": 16, "dim": 1024, "kernel_size": 3}
    drawn = sizes.awkward_sizes(base, 1.0, random.Random(seed))
    assert drawn["kernel_size"] == 3
    for name in ("batch_size", "dim"):
        assert drawn[name] % 2 == 1 and base[name] // 2 <= drawn[name] < base[name], drawn


def test_shape_generality_sizes_differ_between_seeds():
    base = {"batch_size": 16, "dim": 1024}
    draws = {tuple(sizes.awkward_sizes(base, 1.0, random.Random(s)).values())
             for s in range(20)}
    assert len(draws) > 10, draws


_ROWS_SOURCE = (
    "import triton\nimport triton.language as tl\n\n\n@triton.jit\n"
    "def scale_kernel(x_ptr, out_ptr, n, rows, BLOCK: tl.constexpr):\n"
    "    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)\n"
    "    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * 2.0, "
    "mask=offs < {bound})\n")


def _scale_launch(rows: int, cols: int) -> dict:
    return {"launch": "scale_kernel", "grid": [rows * cols // 1024, 1, 1],
            "args": {"x_ptr": _tensor(rows, cols), "out_ptr": _tensor(rows, cols),
                     "n": rows * cols, "rows": rows, "BLOCK": 1024}}


def test_an_argument_the_kernel_never_reads_needs_no_congruence():
    constexprs = {"scale_kernel": {"BLOCK"}}
    real, small = [_scale_launch(4096, 4096)], [_scale_launch(16, 4096)]
    # rows (4096 against 16) is not congruent modulo 1024, but the body never reads it
    unread = sizes.KernelSource.of(_ROWS_SOURCE.format(bound="n"))
    assert sizes.congruent(real, small, constexprs, unread) is None
    # once the body reads it, its boundary tiles matter again
    read = sizes.KernelSource.of(_ROWS_SOURCE.format(bound="rows * 4096"))
    reason = sizes.congruent(real, small, constexprs, read)
    assert reason is not None and "argument rows is 4096" in reason, reason
