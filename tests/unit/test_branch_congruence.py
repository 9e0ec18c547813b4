"""The branch rule of size congruence (rule D025): each condition of a kernel on program
ids, scalar arguments, constexprs and module constants holds for every program and lane,
for none or for some alike at a checked size and at the task's own; conditions on
loaded values are not compared. From the corpus's candidates and launches as a dry run
records them (no sandbox, no Triton)."""

from __future__ import annotations

from services.worker import index_ranges, kernel_source, sizes
from tests.corpus import CORPUS, load

N_REAL, N_SMALL = 4096 * 4096, 16 * 4096  # tasks big_relu at its own sizes, at batch 16


def _tensor(n: int) -> dict:
    return {"~": "T", "s": 0, "o": 0, "z": [n // 4096, 4096], "r": [4096, 1], "d": "float32"}


def _launch(n: int, grid: int | None = None, **extra: object) -> dict:
    return {"launch": "relu_kernel", "grid": [grid if grid is not None else -(-n // 1024), 1, 1],
            "args": {"x_ptr": _tensor(n), "out_ptr": _tensor(n), "n": n, "BLOCK": 1024,
                     **extra}}


def _check(name: str, real: dict, small: dict) -> str | None:
    module = kernel_source.kernel_module(load(CORPUS / name)[0])
    return sizes.congruent([real], [small], module.constexpr_params,
                           sizes.KernelSource.of(module.source))


def test_a_branch_on_a_size_argument_is_not_congruent_across_its_threshold():
    name = "hostile/kernel_branches_on_size_argument.py"
    reason = _check(name, _launch(N_REAL), _launch(N_SMALL))
    assert reason is not None and reason.startswith(
        "relu_kernel's condition `n > 8000000` (line 16) holds for every program and lane "
        "at the task's own sizes and holds for no program or lane at the checked sizes"), reason
    # above the threshold at both sizes, the same branch is taken: congruent
    assert _check(name, _launch(N_REAL), _launch(8192 * 1024)) is None


def test_a_where_on_the_program_id_is_not_congruent_when_only_the_task_grid_crosses_it():
    name = "hostile/where_on_program_id.py"
    reason = _check(name, _launch(N_REAL), _launch(N_SMALL))
    assert reason is not None and "relu_kernel's condition `pid < 8192` (line 17) holds for " \
        "some programs or lanes and not for others at the task's own sizes and holds for " \
        "every program and lane at the checked sizes" in reason, reason
    # a checked grid that crosses 8192 too runs both sides of the where
    assert _check(name, _launch(N_REAL), _launch(9000 * 1024)) is None


def test_an_early_return_on_a_module_constexpr_threshold_is_found():
    name = "hostile/program_id_branch_returns_early.py"
    reason = _check(name, _launch(N_REAL), _launch(N_SMALL))
    assert reason is not None and "condition `pid >= THRESHOLD` (line 16)" in reason, reason


def test_masks_and_data_dependent_branches_are_congruent():
    for name in ("honest/elementwise_relu.py", "honest/data_dependent_branches.py"):
        extra = {"CLAMP": True} if "data_dependent" in name else {}
        assert _check(name, _launch(N_REAL, **extra), _launch(N_SMALL, **extra)) is None, name


def test_each_condition_is_classed_by_its_truth_over_the_launch():
    module = kernel_source.kernel_module(load(CORPUS / "honest/data_dependent_branches.py")[0])
    fn = index_ranges.kernel_defs(module.source)["relu_kernel"]
    found = {b.text: b.truth for b in index_ranges.evaluate(
        fn, _launch(1000, grid=1, CLAMP=True)).branches}
    # one program, 1000 of its 1024 lanes in bounds: the mask mixes lanes
    assert found["offs < n"] == index_ranges.SOME
    assert found["pid == 0"] == index_ranges.ALL
    assert found["CLAMP"] == index_ranges.ALL
    # conditions on loaded values are unknown: not recorded, never compared
    assert "tl.max(x, axis=0) > 0.0" not in found and "x > 0.0" not in found
    whole = {b.text: b.truth for b in index_ranges.evaluate(
        fn, _launch(N_SMALL, CLAMP=True)).branches}
    assert whole["offs < n"] == index_ranges.ALL and whole["pid == 0"] == index_ranges.SOME


def test_a_chained_comparison_records_each_pair():
    source = ("import triton\nimport triton.language as tl\n\n\n@triton.jit\n"
              "def k(x_ptr, n, BLOCK: tl.constexpr):\n"
              "    pid = tl.program_id(0)\n"
              "    if 0 <= pid < n - 4:\n"
              "        tl.store(x_ptr + pid, 1.0)\n")
    fn = index_ranges.kernel_defs(source)["k"]
    launch = {"grid": [8], "args": {"x_ptr": _tensor(4096), "n": 100, "BLOCK": 64}}
    found = [(b.text, b.truth) for b in index_ranges.evaluate(fn, launch).branches]
    assert found == [("0 <= pid", index_ranges.ALL), ("pid < n - 4", index_ranges.ALL)]
    short = {**launch, "args": {**launch["args"], "n": 8}}
    assert [b.truth for b in index_ranges.evaluate(fn, short).branches] == [
        index_ranges.ALL, index_ranges.SOME]


def test_a_condition_inside_an_unmodelled_call_is_still_seen():
    source = ("import triton\nimport triton.language as tl\n\n\n@triton.jit\n"
              "def k(x_ptr, out_ptr, BLOCK: tl.constexpr):\n"
              "    pid = tl.program_id(0)\n"
              "    x = tl.load(x_ptr + tl.arange(0, BLOCK))\n"
              "    tl.store(out_ptr + pid, tl.sum(tl.where(pid < 8192, x, 0.0), axis=0))\n")
    fn = index_ranges.kernel_defs(source)["k"]
    found = index_ranges.evaluate(fn, {"grid": [16384], "args": {"BLOCK": 64}}).branches
    assert [(b.text, b.truth) for b in found] == [("pid < 8192", index_ranges.SOME)]


def test_a_condition_in_a_jit_helper_is_followed_into_the_helper():
    name = "hostile/branch_in_jit_helper.py"
    reason = _check(name, _launch(N_REAL), _launch(N_SMALL))
    assert reason is not None and reason.startswith(
        "relu_kernel's condition `pid < 8192` (line 13) holds for some programs"), reason
    assert _check(name, _launch(N_REAL), _launch(9000 * 1024)) is None


def test_a_float_threshold_holding_an_integer_is_compared():
    source = ("import triton\nimport triton.language as tl\n\n\n@triton.jit\n"
              "def relu_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):\n"
              "    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)\n"
              "    x = tl.load(x_ptr + offs, mask=offs < n)\n"
              "    if n > 8e6:\n"
              "        x = tl.maximum(x, 0.0)\n"
              "    tl.store(out_ptr + offs, x, mask=offs < n)\n")
    reason = sizes.congruent([_launch(N_REAL)], [_launch(N_SMALL)], {"relu_kernel": {"BLOCK"}},
                             sizes.KernelSource.of(source))
    assert reason is not None and "condition `n > 8000000.0` (line 9)" in reason, reason
