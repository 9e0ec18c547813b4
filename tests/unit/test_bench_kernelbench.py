"""``bench.kernelbench``'s size reduction: what it halves and what it leaves."""

from __future__ import annotations

import pytest

from bench.kernelbench import reduce_sizes, refused_op

TASK = """
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, channels, features):
        super().__init__()
        self.conv = nn.Conv3d(channels, channels, 3, padding=1)
        self.norm = nn.LayerNorm(features)

    def forward(self, x):
        return self.norm(self.conv(x))


batch_size = 16
channels = 8
depth, height, width = 16, 32, 64
features = 64


def get_inputs():
    return [torch.rand(batch_size, channels, depth, height, width)]


def get_init_inputs():
    return [channels, features]
"""


def test_sizes_are_halved_tuple_targets_included_until_the_task_fits():
    text, sizes = reduce_sizes(TASK, max_elements=1 << 15)
    values = dict(item.split("=") for item in sizes.split(", "))
    namespace: dict = {}
    exec(compile(text, "<reduced>", "exec"), namespace)
    # each of `depth, height, width = ...` is a size of its own
    assert {"depth", "height", "width"} <= set(values)
    assert (namespace["depth"], namespace["height"]) == (int(values["depth"]),
                                                         int(values["height"]))
    assert namespace["depth"] < 16 and namespace["height"] < 32
    # LayerNorm(features) normalizes the last dim: halving one of the two without the
    # other breaks the Model, so the reduction keeps them equal
    assert namespace["width"] == namespace["features"]
    x = namespace["get_inputs"]()[0]
    assert x.numel() <= 1 << 15
    namespace["Model"](*namespace["get_init_inputs"]())(x)


def test_a_task_that_does_not_run_is_a_value_error():
    with pytest.raises(ValueError, match="the task does not run"):
        reduce_sizes(TASK.replace("[channels, features]", "[channels, features + 1]"))


def test_refusals_name_the_operator():
    assert refused_op("cannot lower aten.rand_like.default: random") == "aten.rand_like.default"


def test_size_overrides_give_the_reduced_sizes_lists_whole():
    from bench.kernelbench import size_overrides

    task = TASK.replace("features = 64", "features = 64\nlayer_sizes = [400, 800]\n"
                        "bias_shape = (depth, 1, 1)")
    reduced, _ = reduce_sizes(task, max_elements=1 << 15)
    overrides = size_overrides(task, reduced)
    namespace: dict = {}
    exec(compile(reduced, "<reduced>", "exec"), namespace)
    assert overrides["depth"] == namespace["depth"] < 16
    assert overrides["layer_sizes"] == list(namespace["layer_sizes"])
    # a name derived from a size follows it (a worker rebinds names after the module ran)
    assert overrides["bias_shape"] == [namespace["depth"], 1, 1]
    assert "channels" not in overrides or overrides["channels"] == namespace["channels"]


def test_compile_summary_picks_the_first_clean_config_and_names_lists_without_one():
    from bench.kernelbench import Row, compile_summary, facts_summary, facts_table
    from schemas.events import CompileFact

    def fact(kernel, n, spill, ok=True, regs=100, target="h100"):
        return CompileFact(kernel=kernel, target=target, arch="sm_90",
                           where=f"trial 1, config {n}", registers=regs, spill_bytes=spill,
                           occupancy_warps=16, max_warps=64, ok=ok)

    rows = [fact("mm", 0, 512, regs=255), fact("mm", 1, 0, regs=128), fact("mm", 2, 0),
            fact("relu", 0, 64, regs=40), fact("relu", 1, 32, regs=40),
            fact("bad", 0, 0, ok=False), fact("other", 0, 0, target="mi300x")]
    s = compile_summary(rows, "h100")
    assert s["kernels"] == 3
    assert s["no_clean"] == ["bad", "relu"] and s["failed"] == ["bad"]
    # mm: config 1 (the first that does not spill), relu: the least spilling
    assert s["registers"] == [128, 40] and s["spill_bytes"] == [0, 32]
    assert s["occupancy"] == [0.25, 0.25]
    row = Row("1_mm", "matmul", "failed", facts={"sm_90": s})
    summary = facts_summary([row])
    assert summary["matmul"]["sm_90"]["no_clean"] == 2
    assert summary["overall"]["sm_90"]["median_registers"] == 84.0
    assert "sm_90" in facts_table([row]) and "1_mm" in facts_table([row])
