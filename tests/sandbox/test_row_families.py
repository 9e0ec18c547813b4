"""Row-wise reduction families at near-minimal counted traffic, verified end to end on
cpu (services/generator/lowering/schedules/fused_rows.py, row_layout.py, reduction.py):
max/min over a dim with and without their indices, instance norm's rows over a view
with a leading extent of 1, batch norm's statistics over the dims around the channels,
layer norm's affine shared by the rows of a program, group norm's affine after its
view back to (N, C, H, W). Each is verified at two sizes of
different divisibility (a power of two; odd extents no block divides)."""

from __future__ import annotations

import uuid

import pytest

from schemas import VerifyResult
from services.common.verify_client import build_request
from services.generator.lowering.schedules.fused_rows import GATHER_TILE
from tests.helpers import representatives
from tests.lowering_cache import lowered

TASK = """
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, {init_args}):
        super().__init__()
{init}
    def forward(self, x):
        return {body}


batch = 4
features = 4
height = 8
width = 8


def get_inputs():
    return [torch.randn({shape})]


def get_init_inputs():
    return [{init_inputs}]
"""

NCHW = "batch, features, height, width"
FAMILIES = {
    # name: (Model.__init__ args, its lines, forward's body, input shape, init inputs)
    "max_values": ("", "", "torch.max(x, dim=1)[0]", "batch, features, width", ""),
    "min_values": ("", "", "torch.min(x, dim=2)[0]", "batch, features, width", ""),
    "max_values_indices": ("", "", "tuple(torch.max(x, dim=1))", "batch, features, width", ""),
    "instance_norm": ("c", "        self.norm = nn.InstanceNorm2d(c)\n", "self.norm(x)", NCHW,
                      "features"),
    "batch_norm": ("c", "        self.norm = nn.BatchNorm2d(c)\n", "self.norm(x)", NCHW,
                   "features"),
    "layer_norm": ("c, h, w", "        self.norm = nn.LayerNorm((c, h, w))\n", "self.norm(x)",
                   NCHW, "features, height, width"),
    "group_norm": ("c", "        self.norm = nn.GroupNorm(2, c)\n", "self.norm(x)", NCHW,
                   "features"),
    "group_norm_residual": ("c", "        self.norm = nn.GroupNorm(2, c)\n",
                            "self.norm(x) + 2.0 * x", NCHW, "features"),
}
ONE_KERNEL_ONE_PASS = sorted(set(FAMILIES) - {"group_norm", "group_norm_residual"})
SIZES = [{"batch": 4, "features": 4, "height": 8, "width": 8},
         {"batch": 3, "features": 5, "height": 7, "width": 3}]


def task(name: str) -> str:
    init_args, init, body, shape, init_inputs = FAMILIES[name]
    return TASK.format(init_args=init_args or "*args", init=init or "        pass\n",
                       body=body, shape=shape, init_inputs=init_inputs)


async def verify(verifier, source: str, overrides: dict, **params) -> VerifyResult:
    code = lowered(source, overrides, **params)
    request = build_request(
        request_id=f"families-{uuid.uuid4().hex[:8]}", job_id="job-families",
        candidate_id="c", op_name="rows", task_desc=source, code=code, backend="cpu",
        arch="h100", shape_overrides=overrides, trials=1, timeout_s=120.0)
    result = await verifier.verify(request, device="0")
    assert result.passed, (result.stage, result.error)
    assert result.shape_generic is not False, result.notes
    return result


@pytest.mark.parametrize("name", representatives(ONE_KERNEL_ONE_PASS, (
    "max_values_indices", "batch_norm", "layer_norm")))
@pytest.mark.parametrize("sizes", SIZES, ids=["pow2", "odd"])
async def test_a_family_reads_and_writes_once_in_one_kernel(shared_verifier, name,
                                                            sizes) -> None:
    t = (await verify(shared_verifier, task(name), sizes)).traffic
    assert t.launches == 1, t
    # Layer norm's weight and bias are read once per program of several rows
    # (rows=8; 4 rows of 256 elements fit a 1024-element tile): a few percent more.
    assert t.traffic_ratio <= (1.15 if name == "layer_norm" else 1.01), t


def test_max_without_its_indices_computes_none_and_with_them_one_loop() -> None:
    values = lowered(task("max_values"), SIZES[1])
    assert values.count("for r0 in range(") == 1 and "best_r" not in values
    both = lowered(task("max_values_indices"), SIZES[1])
    assert both.count("for r0 in range(") == 1 and "best_r" in both


async def test_layer_norm_affine_is_shared_by_the_rows_of_a_program(shared_verifier) -> None:
    sizes = SIZES[0]
    shared = (await verify(shared_verifier, task("layer_norm"), sizes)).traffic
    alone = (await verify(shared_verifier, task("layer_norm"), sizes, rows=1)).traffic
    # rows=1: weight and bias read by every row, 4 x 256 x 2 more elements than once.
    assert alone.traffic_ratio >= 1.6 and shared.traffic_ratio < alone.traffic_ratio - 0.4
    assert shared.modeled_time_us < alone.modeled_time_us
    with pytest.raises(ValueError, match="rows must be a power of two"):
        lowered(task("layer_norm"), rows=3)


# The odd sizes (~15 s interpreted) run in `make test` only; each verification checks
# the task's own sizes and an awkward shape-generality size besides the requested ones.
@pytest.mark.parametrize("sizes", [
    pytest.param(SIZES[0], id="pow2"),
    pytest.param({**SIZES[1], "features": 6}, id="odd", marks=pytest.mark.slow)])
async def test_group_norm_and_its_affine_after_the_view_are_one_kernel(shared_verifier,
                                                                       sizes) -> None:
    # The statistics over the view (N, G, 1, C / G * H * W), the affine over the view
    # back to (N, C, H, W): the weight and bias of a row's channels loaded once per
    # row and spread over its elements (tl.gather), not once per element.
    source = task("group_norm")
    candidate = lowered(source, sizes)
    assert "tl.gather(" in candidate
    # its tile held to GATHER_TILE elements whatever block_size says (ptxas time)
    assert f"<= {GATHER_TILE}" in candidate and "<= 4096" not in candidate
    t = (await verify(shared_verifier, source, sizes)).traffic
    assert t.launches == 1 and t.traffic_ratio <= 1.05, t
    # Rows longer than a tile: Welford's loop, then the normalizing loop (input twice).
    t = (await verify(shared_verifier, source, sizes, block_size=32)).traffic
    assert t.launches == 1 and 1.4 <= t.traffic_ratio <= 1.55, t
    # x read again after the view (the residual), at the view's indices: same kernel.
    t = (await verify(shared_verifier, task("group_norm_residual"), sizes)).traffic
    assert t.launches == 1 and t.traffic_ratio <= 1.55, t


async def test_batch_norm_rows_longer_than_a_tile_take_two_passes(shared_verifier) -> None:
    # 4 x 8 x 8 = 256 elements per channel in 64-element tiles: Welford's loop, then
    # the normalizing loop; the input read twice, the output written once.
    t = (await verify(shared_verifier, task("batch_norm"), SIZES[0], block_size=64)).traffic
    assert t.launches == 1 and 1.4 <= t.traffic_ratio <= 1.52, t
