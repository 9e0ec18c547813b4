"""Counted traffic and the GPU time model (services/worker/traffic.py), in this process:
the formulas, the eager graph's count, and the interpreter's counts of real kernels."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

from schemas.events import EagerCount, LaunchTraffic
from services.worker import traffic
from services.worker.targets import TARGETS, target_for
from tests.corpus import CORPUS, TASKS, load


def test_modeled_time_follows_from_the_counts_and_the_arch_table() -> None:
    h100 = TARGETS["h100"]
    # Memory-bound: 64 MiB at 3.35 TB/s, two launches of 3 us.
    nbytes = 64 << 20
    assert traffic.modeled_time_us(nbytes, {}, 2, h100) == pytest.approx(
        nbytes / 3.35e12 * 1e6 + 2 * 3.0)
    # Compute-bound: a 4096^3 tf32 product (2 * 4096^3 FLOPs at 494.7 TFLOP/s).
    flops = 2 * 4096 ** 3
    assert traffic.modeled_time_us(3 * 4096 * 4096 * 4, {"tf32": flops}, 1, h100) == \
        pytest.approx(flops / 494.7e12 * 1e6 + 3.0)
    # A dtype the table has no peak for is modeled at the fp32 peak.
    assert traffic.modeled_time_us(0, {"fp64": 67e6}, 0, h100) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="no bandwidth"):
        traffic.modeled_time_us(1, {}, 1, type(h100)("bare", 90, 1, 1))


def test_summary_ratio_flops_and_model_fields() -> None:
    launches = [LaunchTraffic(kernel="k", loaded=800, stored=400, flops=100,
                              dot_flops={"tf32": 1000}),
                LaunchTraffic(kernel="aten.copy_.default", loaded=400, stored=400)]
    eager = EagerCount(bytes=4000, dot_flops={"fp32": 1000}, launches=3)
    summary = traffic.summarize(launches, bytes_min=1200, eager=eager,
                                target=target_for("h200"))
    assert (summary.bytes_moved, summary.launches, summary.flops) == (2000, 2, 1100)
    assert summary.traffic_ratio == pytest.approx(2000 / 1200, rel=1e-3)
    assert summary.model_arch == "h200"
    assert summary.modeled_time_us == pytest.approx(
        traffic.modeled_time_us(2000, {"tf32": 1000}, 2, TARGETS["h200"]), rel=1e-3)
    assert summary.modeled_speedup == pytest.approx(
        summary.modeled_eager_time_us / summary.modeled_time_us, rel=1e-3)
    bare = traffic.summarize(launches, bytes_min=0, eager=None, target=None)
    assert bare.traffic_ratio is None and bare.modeled_time_us is None


def test_counts_that_cannot_describe_matched_outputs_are_named() -> None:
    summary = traffic.summarize([LaunchTraffic(kernel="k", loaded=10, stored=8)], 18, None,
                                None)
    assert traffic.check_counts(summary, output_bytes=8) is None
    assert "stored 8 bytes but its outputs hold 16" in traffic.check_counts(summary, 16)


def test_dot_dtypes_name_the_peak_they_run_at() -> None:
    assert traffic.dot_dtype(torch.float32, ieee=False) == "tf32"
    assert traffic.dot_dtype("fp32", ieee=True) == "fp32"
    assert traffic.dot_dtype(torch.bfloat16, ieee=False) == "bf16"
    assert traffic.dot_dtype("fp8e4nv", ieee=False) == "fp8"


def test_operator_traffic_of_copies_views_and_allocations() -> None:
    x = torch.ones(8, 4)
    aten = torch.ops.aten
    assert traffic.op_traffic(aten.view.default, (x, [32]), {}, x.view(32)) is None
    assert traffic.op_traffic(aten.empty.memory_format, ([8],), {}, torch.empty(8)) is None
    y = torch.empty(8, 4)
    assert traffic.op_traffic(aten.copy_.default, (y, x), {}, y) == (128, 128)
    assert traffic.op_traffic(aten.clone.default, (x,), {}, x.clone()) == (128, 128)
    assert traffic.op_traffic(aten.zeros.default, ([8, 4],), {}, y) == (0, 128)


def test_the_eager_graph_is_counted_on_fake_tensors_as_on_real_ones() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    weight = torch.randn(32, 16)

    def forward(x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x @ weight)

    x = torch.randn(8, 32)
    with traffic.EagerCounter() as real:
        out = forward(x)
    assert torch.equal(out, torch.relu(x @ weight))  # results unchanged
    with FakeTensorMode(allow_non_fake_inputs=True):
        fake_x = torch.randn(8, 32)
        with traffic.EagerCounter() as fake:
            forward(fake_x)
    # mm reads x and the weight and writes 8 x 16; relu reads and writes 8 x 16.
    expected = (8 * 32 + 32 * 16 + 8 * 16) * 4 + 2 * 8 * 16 * 4
    for counter in (real, fake):
        assert counter.count.bytes == expected
        assert counter.count.launches == 2
        assert counter.count.dot_flops == {"fp32": 2 * 8 * 16 * 32}


@pytest.fixture(scope="module")
def interpreter_counts():
    """The interpreter with the replayer's counters installed, for the module's tests;
    taken out again after them (the bounds check refuses every access of a launch it was
    given no tensors for, so later tests in this process would fail)."""
    from triton.runtime import interpreter

    from services.worker.replay import install_bounds_checks

    saved = os.environ.get("TRITON_INTERPRET")
    native = interpreter._interpreter
    os.environ["TRITON_INTERPRET"] = "1"
    bounds = install_bounds_checks()

    def count(name: str, launch, tensors: list[torch.Tensor]) -> LaunchTraffic:
        bounds.set_ranges([(t.untyped_storage().data_ptr(), t.untyped_storage().data_ptr()
                            + t.untyped_storage().nbytes(), str(i))
                           for i, t in enumerate(tensors)], name)
        bounds.count = LaunchTraffic(kernel=name)
        try:
            launch()
            return bounds.count
        finally:
            bounds.count = None
            bounds.set_ranges([], "")

    yield count
    interpreter._interpreter = native
    if saved is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = saved


def kernel_of(path: Path, name: str):
    """The ``@triton.jit`` function ``name`` of the candidate file at ``path``, imported."""
    spec = importlib.util.spec_from_file_location(f"candidate_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name)


def test_interpreted_loads_and_stores_are_counted_without_masked_lanes(
        interpreter_counts, tmp_path) -> None:
    relu = kernel_of(CORPUS / "honest" / "elementwise_relu.py", "relu_kernel")
    (tmp_path / "relu_twice.py").write_text(RELU_TWICE)
    relu_reading_twice = kernel_of(tmp_path / "relu_twice.py", "relu_twice_kernel")

    x, y = torch.randn(1000), torch.empty(1000)
    got = interpreter_counts("relu", lambda: relu[(4,)](x, y, 1000, BLOCK=256), [x, y])
    assert (got.loaded, got.stored) == (4000, 4000)  # 1000 lanes of 4 bytes, not 1024
    assert got.flops == 1024  # tl.maximum on every lane of the 4 blocks
    twice = interpreter_counts("twice", lambda: relu_reading_twice[(4,)](x, y, 1000, BLOCK=256),
                               [x, y])
    assert (twice.loaded, twice.stored) == (8000, 4000)


def test_interpreted_dot_flops_are_counted(interpreter_counts) -> None:
    import triton
    import triton.language as tl

    @triton.jit
    def matmul(a, b, c, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr):
        rows, cols, ks = tl.arange(0, M), tl.arange(0, N), tl.arange(0, K)
        tile_a = tl.load(a + rows[:, None] * K + ks[None, :])
        tile_b = tl.load(b + ks[:, None] * N + cols[None, :])
        tl.store(c + rows[:, None] * N + cols[None, :], tl.dot(tile_a, tile_b))

    a, b, c = torch.randn(16, 32), torch.randn(32, 16), torch.empty(16, 16)
    got = interpreter_counts("matmul", lambda: matmul[(1,)](a, b, c, 16, 16, 32), [a, b, c])
    assert got.dot_flops == {"tf32": 2 * 16 * 16 * 32}
    assert (got.loaded, got.stored) == ((16 * 32 + 32 * 16) * 4, 16 * 16 * 4)


# ---------------------------------------------------------------- through the verifier

FOUR = 4  # float32 bytes


def corpus_request(name: str, code: str | None = None, **fields):
    import uuid

    from services.common.verify_client import build_request

    source, meta = load(CORPUS / "honest" / f"{name}.py")
    return build_request(
        request_id=f"traffic-{uuid.uuid4().hex[:8]}", job_id="job-traffic",
        candidate_id="c", op_name=meta["task"], task_desc=TASKS[meta["task"]],
        code=code or source, backend="cpu", arch=fields.pop("arch", "h100"), timeout_s=120.0,
        trials=meta.get("trials", 2), **fields)


async def test_a_relu_moves_its_input_and_output_once(shared_verifier) -> None:
    result = await shared_verifier.verify(corpus_request("elementwise_relu"), device="0")
    assert result.passed, result
    n = 16 * 1024  # tests/corpus/tasks/relu.py
    t = result.traffic
    assert (t.per_launch[0].loaded, t.per_launch[0].stored) == (n * FOUR, n * FOUR)
    assert (t.bytes_moved, t.bytes_min, t.traffic_ratio, t.launches) == (
        2 * n * FOUR, 2 * n * FOUR, 1.0, 1)
    assert t.flops == n  # tl.maximum on every lane (16 blocks of 1024, none masked)
    assert t.model_arch == "h100" and t.modeled_speedup == pytest.approx(1.0)
    assert t.modeled_time_us == pytest.approx(
        traffic.modeled_time_us(2 * n * FOUR, {}, 1, TARGETS["h100"]), rel=1e-3)


async def test_a_two_pass_softmax_reads_its_input_twice(shared_verifier) -> None:
    result = await shared_verifier.verify(corpus_request("softmax_two_pass"), device="0")
    assert result.passed, result
    rows, cols = 4, 1024  # tests/corpus/tasks/softmax.py
    maxima, scale = result.traffic.per_launch
    assert (maxima.loaded, maxima.stored) == (rows * cols * FOUR, rows * FOUR)
    assert (scale.loaded, scale.stored) == (rows * cols * FOUR + rows * FOUR,
                                            rows * cols * FOUR)
    assert result.traffic.bytes_min == 2 * rows * cols * FOUR
    assert result.traffic.traffic_ratio == pytest.approx(
        (3 * rows * cols + 2 * rows) / (2 * rows * cols), rel=1e-4)


async def test_a_tiled_matmul_counts_its_tile_loads_and_dot_flops(shared_verifier) -> None:
    import math

    result = await shared_verifier.verify(corpus_request("tiled_matmul"), device="0")
    assert result.passed, result
    m = k = n = 96  # tests/corpus/tasks/matmul.py: N x N by N x N
    tiles = math.ceil
    (launch,) = result.traffic.per_launch
    # Each of the cdiv(N, 32) column blocks reads all of A, each row block all of B.
    assert launch.loaded == (m * k * tiles(n / 32) + k * n * tiles(m / 32)) * FOUR
    assert launch.stored == m * n * FOUR
    padded = [32 * tiles(v / 32) for v in (m, n, k)]
    assert launch.dot_flops == {"fp32": 2 * padded[0] * padded[1] * padded[2]}
    assert result.traffic.modeled_eager_time_us is not None


# The corpus's relu, its kernel loading each element twice.
RELU_TWICE = load(CORPUS / "honest" / "elementwise_relu.py")[0].replace(
    "relu_kernel", "relu_twice_kernel").replace(
    "    tl.store(out_ptr + offs, tl.maximum(tl.load(x_ptr + offs, mask=m), 0.0), mask=m)\n",
    "    a = tl.load(x_ptr + offs, mask=m)\n    b = tl.load(x_ptr + offs, mask=m)\n"
    "    tl.store(out_ptr + offs, tl.maximum(a, b * 0.0), mask=m)\n")

# Host code that goes for the counter: the interpreter's memory entry points put back
# and the running count zeroed, when the model is built and around its launch.
BLIND = '''
import triton.runtime.interpreter as interpreter


def _blind():
    native = getattr(interpreter._interpreter, "_native", interpreter._interpreter)
    interpreter._interpreter = native
    counted = getattr(interpreter._interpreter, "count", None)
    if counted is not None:
        counted.loaded = counted.stored = 0
'''
RELU_FAKING_COUNTS = (RELU_TWICE.replace("\n\n@triton.jit", BLIND + "\n\n@triton.jit", 1)
                      .replace("class ModelNew(nn.Module):\n", "class ModelNew(nn.Module):\n"
                               "    def __init__(self):\n        super().__init__()\n"
                               "        _blind()\n\n", 1)
                      .replace("        x = x.contiguous()\n", "        _blind()\n"
                               "        x = x.contiguous()\n", 1)
                      .replace("        return out\n", "        _blind()\n        return out\n", 1))


# The same kernel re-reading its input twice more: three loads of each element.
RELU_THRICE = RELU_TWICE.replace(
    "    b = tl.load(x_ptr + offs, mask=m)\n",
    "    b = tl.load(x_ptr + offs, mask=m)\n    c = tl.load(x_ptr + offs, mask=m)\n").replace(
    "tl.maximum(a, b * 0.0)", "tl.maximum(a, b * 0.0 + c * 0.0)")


@pytest.mark.parametrize(("source", "reads", "ratio"), [
    (RELU_TWICE, 2, 1.5),  # 2 reads + 1 write over 1 read + 1 write
    (RELU_THRICE, 3, 2.0),  # re-read twice: 3 reads + 1 write over 2
], ids=["read_twice", "re_read_twice"])
async def test_a_kernel_re_reading_its_input_shows_it_in_the_ratio(shared_verifier, source,
                                                                   reads, ratio) -> None:
    assert RELU_THRICE.count("tl.load(x_ptr") == 3
    result = await shared_verifier.verify(corpus_request("elementwise_relu", source),
                                          device="0")
    assert result.passed, result
    assert result.traffic.traffic_ratio == pytest.approx(ratio)
    assert result.traffic.per_launch[0].loaded == reads * result.traffic.per_launch[0].stored


async def test_a_candidate_cannot_reset_or_fake_the_counter(shared_verifier,
                                                            dynamic_only) -> None:
    """Its host code runs in the planner, never in the replayer that counts: the counts
    are those of the same kernel without the tampering."""
    honest = await shared_verifier.verify(corpus_request("elementwise_relu", RELU_TWICE),
                                          device="0")
    tampering = await shared_verifier.verify(
        corpus_request("elementwise_relu", RELU_FAKING_COUNTS), device="0")
    if tampering.passed:
        assert tampering.traffic.bytes_moved == honest.traffic.bytes_moved
        assert tampering.traffic.per_launch[0].loaded == honest.traffic.per_launch[0].loaded
    else:  # refused outright is as good: no verdict carries its counts
        assert tampering.traffic is None, tampering
