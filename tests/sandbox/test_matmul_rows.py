"""A matmul with a row reduction as its epilogue
(services/generator/lowering/schedules/matmul_rows.py): Linear, an element-wise chain
and a reduction over the columns (logsumexp's online max and sum included) in one
kernel whose product never reaches memory, verified end to end on cpu at two sizes
with counted traffic equal to the tiled reads."""

from __future__ import annotations

import math
import uuid

import pytest

from schemas import VerifyResult
from services.common.verify_client import build_request
from tests.helpers import representatives
from tests.lowering_cache import lowered

TEMPLATE = """\
import torch
import torch.nn as nn

batch = 64
in_features = 48
out_features = 80


class Model(nn.Module):
    def __init__(self, in_features, out_features):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)

    def forward(self, x):
        return {op}


def get_inputs():
    return [torch.randn(batch, in_features)]


def get_init_inputs():
    return [in_features, out_features]
"""
# Linear, then a chain and a reduction over dim 1 (KernelBench level 2's Gemm + Sum,
# Max, Mean ... problems, written our way).
OPS = {
    "sum": "torch.sum(torch.sigmoid(self.linear(x)), dim=1, keepdim=True)",
    "mean": "(self.linear(x) / 2).mean(dim=1)",
    "max": "torch.max(self.linear(x), dim=1, keepdim=True).values",
    "amin": "torch.amin(torch.relu(self.linear(x)) * 2.0, dim=-1)",
    "logsumexp": "torch.logsumexp(torch.sigmoid(self.linear(x)) * 4.0, dim=1)",
}
# Two sizes of different divisibility: M and N multiples of the 32 x 32 tiles, then
# ragged M, N and K (the last tiles masked).
SIZES = [{"batch": 64, "in_features": 48, "out_features": 80},
         {"batch": 37, "in_features": 33, "out_features": 150}]
TILE = 32  # lower_task's default block_m / block_n


def task(name: str) -> str:
    return TEMPLATE.format(op=OPS[name])


def kernel_names(code: str) -> list[str]:
    return [line.split("(")[0][4:] for line in code.splitlines()
            if line.startswith("def ") and "_kernel_" in line]


async def verify(verifier, name: str, sizes: dict, **params) -> VerifyResult:
    code = lowered(task(name), sizes, **params)
    request = build_request(
        request_id=f"mmrows-{uuid.uuid4().hex[:8]}", job_id="job-mmrows", candidate_id="c",
        op_name=name, task_desc=task(name), code=code, backend="cpu", arch="h100",
        shape_overrides=sizes, trials=1, timeout_s=120.0)
    result = await verifier.verify(request, device="0")
    assert result.passed, (result.stage, result.error)
    return result


@pytest.mark.parametrize("name", sorted(OPS))
def test_linear_chain_and_reduction_lower_to_one_kernel(name) -> None:
    code = lowered(task(name), SIZES[1])
    names = [k.rsplit("_", 1)[0] for k in kernel_names(code)]
    # logsumexp's log(sum) + shift: a pointwise kernel over the M results
    assert names == ["matmul_rows_kernel"] + (["pointwise_kernel"] if name == "logsumexp"
                                              else []), code
    body = code.split("\nimport torch\n", 1)[1]  # after the header naming the sizes
    assert "150" not in body and "37" not in body  # shape-generic: no size baked in


@pytest.mark.parametrize("name", representatives(sorted(OPS), ("sum", "logsumexp")))
@pytest.mark.parametrize("sizes", SIZES, ids=["pow2", "ragged"])
async def test_the_product_never_reaches_memory(shared_verifier, name, sizes) -> None:
    """One launch; x is read once per column tile, the weight and the bias once per row
    tile, and only the M results are written (masked lanes not counted)."""
    result = await verify(shared_verifier, name, sizes)
    m, k, n = sizes["batch"], sizes["in_features"], sizes["out_features"]
    t = result.traffic
    launch = t.per_launch[0]
    assert launch.kernel.startswith("matmul_rows_kernel_"), launch
    assert launch.loaded == 4 * (m * k * math.ceil(n / TILE) + (n * k + n) * math.ceil(m / TILE))
    # logsumexp stores its shift too (the max, read by the pointwise log(sum) + shift)
    assert launch.stored == 4 * m * (2 if name == "logsumexp" else 1)
    assert t.launches == (2 if name == "logsumexp" else 1), t


@pytest.mark.slow  # two more verifications of a case the fast lane covers
async def test_without_row_fusion_the_product_is_stored_and_read_back(shared_verifier) -> None:
    """row_fusion=0 (a point of evolve's space): a matmul kernel stores the product and a
    reduction kernel reads it; it passes too and moves the product twice more."""
    sizes = SIZES[0]
    fused = await verify(shared_verifier, "sum", sizes)
    apart = await verify(shared_verifier, "sum", sizes, row_fusion=0)
    assert apart.traffic.launches == 2
    product = 4 * sizes["batch"] * sizes["out_features"]
    assert apart.traffic.bytes_moved - fused.traffic.bytes_moved == 2 * product


def test_a_product_read_elsewhere_is_not_fused() -> None:
    """The product is also an output: it must be stored, so the reduction reads it back."""
    source = task("sum").replace(
        "return torch.sum(torch.sigmoid(self.linear(x)), dim=1, keepdim=True)",
        "y = self.linear(x)\n        return y, y.sum(dim=1)")
    names = [k.rsplit("_", 1)[0] for k in kernel_names(lowered(source, SIZES[0]))]
    assert "matmul_rows_kernel" not in names and "matmul_kernel" in names, names
