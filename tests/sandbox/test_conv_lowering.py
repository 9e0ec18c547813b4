"""Built-in coder, schedule ``convolution``: aten.convolution as an implicit GEMM.

Each task below is lowered once, at its own sizes, and verified end to end by the
worker's Verifier on cpu (op audit, ghost replay, a second and an awkward size) at its
own sizes and at shape_overrides of odd extents and a batch of 1 (the representatives
also at powers of two, :func:`tests.helpers.checked_sizes`), so the one candidate must
follow sizes read at run time. Kernels run in Triton's interpreter (TRITON_INTERPRET=1).
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: kernels run on the CPU

import ast  # noqa: E402
import re  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.helpers import TASKS, checked_sizes, representatives, verify_at_sizes  # noqa: E402
from tests.lowering_cache import lowered  # noqa: E402
from tests.sandbox.test_builtin_coder import (  # noqa: E402
    _assert_forward_only_launches,
    _assert_matches,
    _launches,
    _module,
)

CONV_TASK = """
import torch
import torch.nn as nn
import torch.nn.functional as F


class Model(nn.Module):
    def __init__(self, channels):
        super().__init__()
        self.conv = {module}

    def forward(self, x):
        return {body}


batch = 2
channels = 4
{extents}


def get_inputs():
    return [torch.randn(batch, channels, {spatial})]


def get_init_inputs():
    return [channels]
"""

_NAMES = ("depth", "height", "width")
# name -> (module, forward body, extents at the task's own size)
CONVS = {
    "conv1d": ("nn.Conv1d(channels, 6, 3)", "self.conv(x)", (12,)),
    "conv2d_strided_padded_dilated": (
        "nn.Conv2d(channels, 5, 3, stride=2, padding=2, dilation=2)", "self.conv(x)", (9, 12)),
    "conv2d_asymmetric_no_bias": (
        "nn.Conv2d(channels, 6, (3, 5), stride=(1, 2), padding=(1, 0), bias=False)",
        "self.conv(x)", (8, 13)),
    # 16 output channels a group: tl.dot per group (program axis 2)
    "conv2d_grouped": ("nn.Conv2d(channels, 32, 3, padding=1, groups=2)", "self.conv(x)",
                       (8, 9)),
    # one output channel a group: the direct kernel
    "conv2d_depthwise": ("nn.Conv2d(channels, channels, 3, padding=1, groups=channels)",
                         "self.conv(x)", (9, 8)),
    # torch.tensor(...) in forward: constants export lifts, passed as numbers (one made
    # on the inputs' device, meta while exporting)
    "conv2d_relu_epilogue": ("nn.Conv2d(channels, 6, 3, padding=1)",
                             "torch.clamp(torch.min(torch.relu(self.conv(x)), torch.tensor("
                             "20.0, device=x.device)) * torch.tensor(2.0) + x.sum(), max=30.0)",
                             (8, 8)),
    "conv3d": ("nn.Conv3d(channels, 3, 3, stride=(1, 2, 1), padding=1)", "self.conv(x)",
               (5, 8, 6)),
    "conv_transpose1d": (
        "nn.ConvTranspose1d(channels, 6, 3, stride=2, padding=1, output_padding=1, dilation=2, "
        "groups=2)",
        "self.conv(x)", (9,)),
    "conv_transpose2d": (
        "nn.ConvTranspose2d(channels, 32, (3, 4), stride=(2, 1), padding=(1, 2), groups=2)",
        "torch.tanh(self.conv(x))", (5, 8)),
}
# Two explicit size sets beside the task's own: odd extents and a batch of one (no tile
# divides anything), and powers of two.
OVERRIDES = ({"batch": 1, "depth": 3, "height": 7, "width": 11},
             {"batch": 4, "depth": 4, "height": 16, "width": 8})


# Tasks with fewer than 16 output channels a group: summed without tl.dot.
DIRECT = {"conv2d_depthwise", "conv_transpose1d"}


def conv_task(name: str) -> str:
    module, body, extents = CONVS[name]
    names = _NAMES[-len(extents):]
    return CONV_TASK.format(module=module, body=body, spatial=", ".join(names),
                            extents="\n".join(f"{n} = {e}" for n, e in zip(names, extents,
                                                                           strict=True)))


def _overrides(name: str, sizes: dict) -> dict:
    rank = len(CONVS[name][2])
    return {k: v for k, v in sizes.items() if k == "batch" or k in _NAMES[-rank:]}


# Representatives, checked at every size: the implicit GEMM and the direct (depthwise)
# kernel; the implicit GEMM alone runs in the fast lane.
FAST = ("conv2d_strided_padded_dilated", "conv2d_depthwise")


@pytest.mark.parametrize("name", representatives(sorted(CONVS), FAST,
                                                    lane=("conv2d_strided_padded_dilated",)))
def test_convolution_passes_the_worker(name, shared_verifier):

    task_src = conv_task(name)
    candidate = lowered(task_src)
    _assert_forward_only_launches(candidate, kernels=len(_launches(candidate)))
    assert sum(k.startswith("conv_kernel_") for k in _launches(candidate)) == 1, \
        _launches(candidate)
    assert ("tl.dot(" in candidate) == (name not in DIRECT)
    own = verify_at_sizes(shared_verifier, f"conv-{name}", task_src, candidate,
                          [_overrides(name, sizes)
                           for sizes in checked_sizes(name, FAST, OVERRIDES)])
    # right at odd extents too (the verifier's awkward size), unless the task itself
    # cannot take them (grouped channels)
    assert own.shape_generic is not False, own.notes


def test_epilogue_is_fused_into_the_conv_kernel():
    """bias, ReLU, a minimum with a lifted constant, scale, residual and clamp run in the
    conv kernel's registers: one launch, one store, the convolution's output never in
    memory."""
    task_src = conv_task("conv2d_relu_epilogue")
    candidate = lowered(task_src)
    # x.sum() is a row reduction of its own; the epilogue reads its result
    assert [k.split("_kernel_")[0] for k in _launches(candidate)] == ["reduce", "conv"]
    kernel = next(f for f in ast.parse(candidate).body if isinstance(f, ast.FunctionDef)
                  and f.name.startswith("conv_kernel_"))
    doc = ast.get_docstring(kernel)
    assert ("epilogue: aten.relu.default -> aten.clone.default -> aten.minimum.default -> "
            "aten.mul.Tensor -> aten.add.Tensor") in doc, doc
    assert ast.unparse(kernel).count("tl.store(") == 1
    assert "bias_ptr" in ast.unparse(kernel.args)


def test_tiles_are_launch_parameters_and_sizes_are_read_at_run_time():
    candidate = lowered(conv_task("conv2d_grouped"), block_m=64, block_n=16, block_k=16,
                           num_warps=2, num_stages=3)
    # BLOCK_N: the point's, or fewer when a group has fewer output channels (16 here)
    assert re.search(r"(block_n\d+) = max\(16, min\(16, triton\.next_power_of_2\(.*\n(.*\n)*"
                     r".*BLOCK_M=64, BLOCK_N=\1, BLOCK_K=16, num_warps=2, num_stages=3",
                     candidate), candidate
    kernels = "\n".join(f.group(0) for f in re.finditer(
        r"@triton\.jit\ndef conv_kernel_.*?(?=\n\n\n)", candidate, re.DOTALL))
    # no extent of the task (8 x 9, 4 channels in, 32 out, 16 a group) is a literal in
    # the kernel: window offsets use only the operator's stride, padding and dilation (1)
    body = re.sub(r"#.*", "", kernels.split('"""')[-1])
    assert not re.search(r"\b(4|8|9|16|32)\b", body), body
    assert "tl.program_id(2)" in body and "tl.dot(" in body
    assert "KS0=self.conv.weight.shape[2]" in candidate


def test_one_candidate_follows_other_sizes_and_layouts():
    """Lowered once, the candidate is right for other batches, extents, channel counts
    (ModelNew built with other init inputs) and for a non-contiguous input."""
    task_src = conv_task("conv2d_depthwise")
    candidate, task = _module(lowered(task_src)), _module(task_src)
    for channels, x in ((4, torch.randn(3, 4, 5, 17)), (6, torch.randn(1, 6, 16, 16)),
                        (4, torch.randn(2, 13, 11, 4).permute(0, 3, 2, 1))):
        torch.manual_seed(1)
        model = task.Model(channels)
        torch.manual_seed(1)
        model_new = candidate.ModelNew(channels)
        torch.testing.assert_close(model_new(x), model(x), rtol=1e-4, atol=1e-4)


def test_a_view_after_a_convolution_reads_its_channels_from_the_weight():
    """InstanceNorm views the convolution's output as (1, batch * out_channels, h, w);
    export fixes out_channels (the weight has it), and the view reads it from the weight,
    so ModelNew built with other init arguments still fits."""
    task_src = CONV_TASK.format(module="nn.Conv2d(channels, 2 * channels, 3)",
                                body="F.instance_norm(self.conv(x)) / 2.0",
                                spatial="height, width", extents="height = 8\nwidth = 9")
    source = lowered(task_src)
    assert "self.conv.weight.shape[0]" in source
    candidate, task = _module(source), _module(task_src)
    for channels, x in ((4, torch.randn(2, 4, 8, 9)), (3, torch.randn(3, 3, 7, 5)),
                        (5, torch.randn(1, 5, 6, 6))):
        torch.manual_seed(1)
        model = task.Model(channels)
        torch.manual_seed(1)
        model_new = candidate.ModelNew(channels)
        torch.testing.assert_close(model_new(x), model(x), rtol=1e-4, atol=1e-4)


def test_bundled_conv_task_matches():
    task_src = (TASKS / "conv_encoder.py").read_text()
    candidate = lowered(task_src)
    assert [k.split("_kernel_")[0] for k in _launches(candidate)] == ["conv", "conv"]
    _assert_matches(task_src, candidate, rtol=1e-4, atol=1e-4)


def test_unbatched_convolution_lowers():
    """A convolution of an input without its batch dim: torch.export adds the dim as a
    view, so the kernel is the batched one."""
    task_src = CONV_TASK.format(module="nn.Conv1d(channels, 3, 3)", body="self.conv(x[0])",
                                extents="width = 10", spatial="width")
    candidate = lowered(task_src)
    assert [k.split("_kernel_")[0] for k in _launches(candidate)] == ["conv"]
    _assert_matches(task_src, candidate, rtol=1e-4, atol=1e-4)
