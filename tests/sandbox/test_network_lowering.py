"""Built-in coder on whole networks (KernelBench level 3's shapes of model): parameters
held by containers and custom submodules, concatenation, splits.

Each task is lowered once, at its own sizes, and verified end to end by the worker's
Verifier on cpu (op audit, ghost replay, a second and an awkward size) at its own sizes
and at shape_overrides of odd extents (the representatives also at powers of two,
:func:`tests.helpers.checked_sizes`), so the one candidate must follow sizes read at
run time. Kernels run in Triton's
interpreter (TRITON_INTERPRET=1).
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: kernels run on the CPU


import pytest  # noqa: E402

from services.generator.lowering import LoweringError  # noqa: E402
from tests.helpers import checked_sizes, representatives, verify_at_sizes  # noqa: E402
from tests.lowering_cache import lowered  # noqa: E402
from tests.sandbox.test_builtin_coder import (  # noqa: E402
    _assert_forward_only_launches,
    _assert_matches,
    _launches,
)

NETWORK_TASK = """
import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, features):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(features))
        self.fc = nn.Linear(features, features)

    def forward(self, x):
        return torch.relu(self.fc(x)) * self.scale


class Residual(nn.Module):
    def __init__(self, features, downsample):
        super().__init__()
        self.conv = nn.Conv2d(features, 6, 3, stride=2, padding=1)
        self.downsample = downsample

    def forward(self, x):
        return torch.relu(self.conv(x) + self.downsample(x))


class Model(nn.Module):
    def __init__(self, features, layer_sizes):
        super().__init__()
{init}
    def forward(self, x):
        return {body}


batch = 6
features = 12
layer_sizes = [10, 7]
{extents}

def get_inputs():
    return [{inputs}]


def get_init_inputs():
    return [features, layer_sizes]
"""

# name -> (__init__ body, forward body, get_inputs, extra module-level sizes)
NETWORKS = {
    # an MLP in an nn.Sequential: numbered children, widths from a list init argument
    "sequential_mlp": (
        "        layers, width = [], features\n"
        "        for size in layer_sizes:\n"
        "            layers += [nn.Linear(width, size), nn.ReLU()]\n"
        "            width = size\n"
        "        layers.append(nn.Linear(width, 3))\n"
        "        self.network = nn.Sequential(*layers)\n",
        "self.network(x)", "torch.randn(batch, features)", ""),
    # nn.ModuleList of custom blocks with direct parameters, and a nested Sequential
    "module_list_blocks": (
        "        self.blocks = nn.ModuleList([Block(features) for _ in range(2)])\n"
        "        self.head = nn.Sequential(nn.Identity(), nn.Sequential(\n"
        "            nn.Linear(features, layer_sizes[0]), nn.Tanh()))\n",
        "self.head(self.blocks[1](self.blocks[0](x)))", "torch.randn(batch, features)", ""),
    # DenseNet's growing concatenation along channels, Inception's branches
    "dense_concat": (
        "        self.conv1 = nn.Conv2d(features, 4, 3, padding=1)\n"
        "        self.conv2 = nn.Conv2d(features + 4, 4, 1)\n",
        "(lambda a: torch.cat([a, self.conv2(a)], 1))(torch.cat([x, torch.relu(self.conv1(x))], 1))",
        "torch.randn(batch, features, height, width)", "height = 5\nwidth = 8\n"),
    # a fused qkv projection split three ways, chunks of an input, a concatenation
    # along the last dim of views read through strides
    "qkv_split_cat": (
        "        self.qkv = nn.Linear(features, 3 * features)\n",
        "(lambda q, k, v: torch.cat([q * k, torch.sigmoid(v), *x.chunk(2, dim=-1), "
        "x.transpose(0, 1).flip(0)[:4].transpose(0, 1)], dim=-1))"
        "(*self.qkv(x).split(features, dim=-1))",
        "torch.randn(batch, features)", ""),
    # a residual block given its downsample, built before the block that registers it
    # last (ResNet's _make_layer): modules are created in the Model's order
    "residual_downsample": (
        "        downsample = nn.Sequential(nn.Conv2d(features, 6, 1, stride=2), "
        "nn.BatchNorm2d(6))\n"
        "        self.block = Residual(features, downsample)\n",
        "self.block(x)", "torch.randn(batch, features, height, width)",
        "height = 5\nwidth = 8\n"),
    # GPT's causal mask: a buffer declared again as tril(ones(n, n)) of the init size
    "causal_mask": (
        "        self.register_buffer('mask', torch.tril(torch.ones(features, features))"
        ".view(1, features, features))\n",
        "torch.softmax((x @ x.transpose(1, 2)).masked_fill(self.mask[:, :x.shape[1], "
        ":x.shape[1]] == 0, float('-inf')), dim=-1)",
        "torch.randn(batch, seq, features)", "seq = 5\n"),
}
# Two size sets beside the task's own: odd extents, then powers of two.
OVERRIDES = ({"batch": 3, "features": 9, "height": 7, "width": 3, "layer_sizes": [5, 11]},
             {"batch": 4, "features": 16, "height": 8, "width": 4, "layer_sizes": [8, 16]})


def network_task(name: str) -> str:
    init, body, inputs, extents = NETWORKS[name]
    return NETWORK_TASK.format(init=init, body=body, inputs=inputs, extents=extents)


def _overrides(name: str, sizes: dict) -> dict:
    extents = NETWORKS[name][3]
    return {k: v for k, v in sizes.items() if k not in ("height", "width") or k in extents}


# Representatives, checked at every size; the MLP alone runs in the fast lane.
FAST = ("sequential_mlp", "qkv_split_cat")


@pytest.mark.parametrize("name", representatives(sorted(NETWORKS), FAST,
                                                    lane=("sequential_mlp",)))
def test_network_passes_the_worker(name, shared_verifier):
    task_src = network_task(name)
    candidate = lowered(task_src)
    _assert_forward_only_launches(candidate, kernels=len(_launches(candidate)))
    _assert_matches(task_src, candidate, rtol=1e-4, atol=1e-4)
    verify_at_sizes(shared_verifier, f"net-{name}", task_src, candidate,
                    [_overrides(name, sizes) for sizes in checked_sizes(name, FAST, OVERRIDES)])


def test_container_parameters_keep_their_qualified_names():
    candidate = lowered(network_task("sequential_mlp"))
    assert "self.network = nn.Module()" in candidate
    # widths follow the list init argument, numbered children keep their numbers
    assert "setattr(self.network, '0', nn.Linear(args[0], args[1][0], bias=True))" in candidate
    assert "setattr(self.network, '4', nn.Linear(args[1][1], 3, bias=True))" in candidate
    # sizes derived from the init arguments follow them
    dense = lowered(network_task("dense_concat"))
    assert "self.conv2 = nn.Conv2d((args[0] + 4), 4, (1, 1)" in dense
    assert "self.qkv = nn.Linear(args[0], 3 * args[0]" in lowered(network_task("qkv_split_cat"))
    assert "getattr(self.network, '2').weight" in candidate


def test_custom_submodule_parameters_are_declared_before_its_children():
    candidate = lowered(network_task("module_list_blocks"))
    block = "getattr(self.blocks, '0')"
    scale = candidate.index(f"{block}.scale = nn.Parameter(torch.randn((args[0], )))")
    assert scale < candidate.index(f"{block}.fc = nn.Linear(args[0], args[0], bias=True)")
    assert "setattr(getattr(self.head, '1'), '0', nn.Linear(args[0], args[1][0]" in candidate


def test_modules_are_created_in_the_models_order_under_their_names():
    candidate = lowered(network_task("residual_downsample"))
    init = candidate[candidate.index("def __init__"):candidate.index("def forward")]
    # placeholders first (the block's conv keeps its place before downsample), then the
    # downsample's convolution and norm, then the block's convolution
    assert init.index("self.block.conv = nn.Module()") < init.index(
        "self.block.downsample = nn.Module()")
    assert init.index("setattr(self.block.downsample, '1', nn.BatchNorm2d") < init.index(
        "self.block.conv = nn.Conv2d")


def test_concatenation_is_one_copy_kernel_launched_per_input():
    candidate = lowered(network_task("qkv_split_cat"))
    launches = _launches(candidate)
    cats = [k for k in launches if k.startswith("cat_kernel_")]
    assert len(set(cats)) == 1 and len(cats) == 5, launches
    # the equal qkv parts follow the projection's width; chunks are views
    assert ".chunk(3, 1)  # aten.split_with_sizes" in candidate
    assert ".narrow(1, offset" in candidate


def test_causal_mask_buffer_follows_the_init_size():
    candidate = lowered(network_task("causal_mask"))
    assert ("self.register_buffer('mask', torch.tril(torch.ones(args[0], args[0]))"
            ".view((1, args[0], args[0], )), persistent=True)") in candidate


def test_a_submodule_with_buffers_of_its_own_is_refused_fast():
    task_src = NETWORK_TASK.format(
        init="        self.inner = nn.Module()\n"
             "        self.inner.register_buffer('shift', torch.randn(features))\n",
        body="x + self.inner.shift", inputs="torch.randn(batch, features)", extents="")
    with pytest.raises(LoweringError) as info:
        lowered(task_src)
    assert info.value.op == "parameters"
    assert "buffer `shift` of shape [12]" in str(info.value)


def test_a_size_equal_to_an_init_argument_by_chance_stays_a_number():
    """features = 12 and a head of 12 outputs: only the input width follows features
    (the fit builds the Model at other init arguments and sees which sizes move)."""
    task_src = NETWORK_TASK.format(
        init="        self.head = nn.Linear(features, 12)\n"
             "        self.narrow_fc = nn.Linear(12, features // 2)\n",
        body="self.narrow_fc(self.head(x))", inputs="torch.randn(batch, features)", extents="")
    candidate = lowered(task_src)
    assert "self.head = nn.Linear(args[0], 12, bias=True)" in candidate
    assert "self.narrow_fc = nn.Linear(12, args[0] // 2, bias=True)" in candidate
    _assert_matches(task_src, candidate, rtol=1e-4, atol=1e-4)
