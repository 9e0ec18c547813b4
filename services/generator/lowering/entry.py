"""The lowering's public entry points: :func:`lower_task` (a task's source in, a
candidate module's source out) and :func:`warm_up` (for the sandbox's fork server).
"""

from __future__ import annotations

from typing import Any

from services.generator.launch_configs import ROW_BLOCK
from services.generator.lowering.errors import LoweringError
from services.generator.lowering.lowerer import Lowerer
from services.generator.lowering.task import export_program, load_task, scalar_tensors

__all__ = ["lower_task", "warm_up"]


def lower_task(
    task_desc: str,
    shape_overrides: dict[str, Any] | None = None,
    *,
    block_size: int = 1024,
    num_warps: int = 4,
    num_stages: int = 1,
    block_m: int = 32,
    block_n: int = 32,
    block_k: int = 32,
    row_fusion: int = 1,
    online: int = 1,
    rows: int = 8,
    arch: str = "",
    tune: int = 1,
    progress: Any = None,
) -> str:
    """Return candidate source (a Python module defining ``class ModelNew``) for a task.

    The task is run (with ``shape_overrides`` rebound as module-level names before
    ``get_init_inputs()`` / ``get_inputs()`` are called), exported to core ATen with
    dynamic input extents, and every node lowered by one of the schedules:
    ``pointwise`` (element-wise chains with broadcasting, one kernel per tensor that
    must exist in memory), ``row reduction`` (sum, mean, amax/amin, max/min, argmax/
    argmin, prod, var, any/all over any dims, with the element-wise chain producing its
    input fused in; softmax, log_softmax, layer/group/batch/instance and RMS norms and
    losses decompose into these), ``matmul`` (mm, bmm, addmm, baddbmm; ``tl.dot`` tiles,
    bias and element-wise epilogues), ``scan`` (cumsum, cumprod), ``flip``, ``pooling`` (max_pool1d/2d/3d with
    or without indices, avg_pool1d/2d/3d) and ``convolution`` (aten.convolution forward,
    1-D to 3-D, strided, padded, dilated, grouped, transposed; an implicit GEMM on
    ``tl.dot`` with the bias and element-wise epilogues), ``concat`` (``torch.cat``) and
    ``recurrent`` (nn.LSTM / GRU / RNN: an input-projection GEMM per layer and
    direction, then a step kernel per time step launched from a loop in forward). Views (permute, expand, slice, ...)
    stay views in forward, and kernels read every operand through its strides;
    pointwise kernels read operands that are contiguous in the output's shape at the
    output's flat offsets instead (``FLAT``, chosen by forward per call).
    Tensors may be float32, float16, bfloat16 or bool; kernels compute in float32.
    ``ModelNew(*init_inputs)`` declares the Model's parameters in the same order (the
    same seed gives the same values) and its ``forward`` only allocates, views and
    launches. It runs under ``TRITON_INTERPRET=1`` on CPU and on CUDA.

    Args:
        task_desc: Task source in KernelBench format.
        shape_overrides: Module-level names to rebind, e.g. ``{"batch_size": 16}``.
        block_size: Elements per program of pointwise and pooling kernels, and BLOCK_R * BLOCK_I of
            reduction and scan tiles; a power of two.
        num_warps: ``num_warps`` of every launch; a power of two from 1 to 32.
        num_stages: ``num_stages`` of every launch; at least 1.
        block_m, block_n, block_k: matmul and convolution tile sizes (output rows,
            output columns, reduction slice); powers of two, at least 16 (``tl.dot``'s
            smallest tile on NVIDIA GPUs).
        row_fusion: 1: a row reduction is fused with the reductions and element-wise
            nodes on the same rows into one kernel (softmax, layer norm: one read of
            the input when a row fits ``block_size``), and a reduction over a matmul's
            columns with the matmul (the product never stored); 0: one kernel per
            reduction.
        online: 1: in a fused kernel whose rows do not fit one tile, softmax's max and
            sum share one loop (online softmax) and variance is Welford's (one loop);
            0: one loop per reduction (variance: two).
        rows: rows a fused-rows program reduces at once where the rows are the
            trailing dims and fit a one-pass tile together (at most ``block_size //
            next_pow2(row length)``): an operand the same for every row (layer norm's
            weight and bias) is loaded once per program; a power of two from 1 to 64.
        arch: "" (the cpu backend, Triton's interpreter): every launch takes the
            parameters above. A GPU arch (``h100``, ``sm_90``, ``mi300x``, ``gfx942``
            ...): every kernel carries ``@triton.autotune`` over its schedule's list
            for the arch's family (:mod:`services.generator.launch_configs`), keyed
            on the extents that matter; reduction tiles stay a size-dependent choice
            of forward.
        tune: with ``arch``: 1, the table's lists (a row reduction's tile is then
            :data:`services.generator.launch_configs.ROW_BLOCK` elements); 0, a
            one-config list of the launch parameters given (an evolve point).
        progress: called with a phase (``the task's get_inputs()``, ``the task's
            Model.forward ...``) as each call into the task's code starts, for a caller
            that must name what hangs.

    Returns:
        The candidate module's source.

    Raises:
        LoweringError: The task does not run or export, or its graph holds an operator
            or shape the coder cannot lower (``.op`` names it).
        ValueError: a launch parameter is out of range.
    """
    if block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, not {block_size}")
    if num_warps not in (1, 2, 4, 8, 16, 32):
        raise ValueError(f"num_warps must be a power of two from 1 to 32, not {num_warps}")
    if num_stages < 1:
        raise ValueError(f"num_stages must be at least 1, not {num_stages}")
    for name, value in (("block_m", block_m), ("block_n", block_n), ("block_k", block_k)):
        if value < 16 or value & (value - 1):
            raise ValueError(f"{name} must be a power of two of at least 16, not {value}")
    if rows not in (1, 2, 4, 8, 16, 32, 64):
        raise ValueError(f"rows must be a power of two from 1 to 64, not {rows}")
    for name, value in (("row_fusion", row_fusion), ("online", online), ("tune", tune)):
        if value not in (0, 1):
            raise ValueError(f"{name} must be 0 or 1, not {value}")
    task = load_task(task_desc, shape_overrides, progress)
    if progress is not None:
        progress("the task's Model.forward (traced by torch.export)")
    params = {"block_size": block_size, "num_warps": num_warps, "num_stages": num_stages,
              "block_m": block_m, "block_n": block_n, "block_k": block_k,
              "row_fusion": row_fusion, "online": online, "rows": rows, "precision": "ieee"}
    if arch:
        params.update(arch=arch, tune=tune)
        if tune:
            params["block_size"] = ROW_BLOCK
    scalars = scalar_tensors(task)
    if scalars is not None:
        try:
            return Lowerer(export_program(task, scalars), task, params).run()
        except LoweringError:
            # A number used as a size, a dim or in Python control flow does not trace
            # as a tensor: lower with it baked in, as torch.export specializes it.
            pass
    return Lowerer(export_program(task), task, params).run()


# A task of ours (trusted): lowered once by :func:`warm_up`.
_WARM_UP_TASK = """\
import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, x, y):
        return torch.sigmoid(x) * y + torch.sum(x, dim=1, keepdim=True)


def get_inputs():
    return [torch.randn(4, 8), torch.randn(4, 8)]


def get_init_inputs():
    return []
"""


def warm_up() -> None:
    """Lower a small task of ours once, so torch.export's lazy state (imports, caches)
    exists before the lowering sandbox's fork server forks its children.

    Trusted code only (never a user's task). Creates no thread: tensors of 32 elements
    stay below every intra-op parallel threshold, so the single-threaded fork server
    forks cleanly.
    """
    lower_task(_WARM_UP_TASK)
