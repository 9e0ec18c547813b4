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
