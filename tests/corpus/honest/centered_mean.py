# corpus: {"task": "centered_mean", "shape_generic": true, "note": "float64 recheck, trial 0: output 0: the float32 reference is noise"}
# The task's float32 output is rounding noise around 0; this kernel sums in another
# order, so its noise differs: it passes against the task's Model in float64.
import torch
import torch.nn as nn
import triton
import triton.language as tl


@triton.jit
def centered_mean_kernel(x_ptr, out_ptr, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + row * n_cols + offs, mask=offs < n_cols, other=0.0)
    mean = tl.sum(acc, axis=0) / n_cols
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row * n_cols + offs, mask=offs < n_cols, other=0.0)
        acc += tl.where(offs < n_cols, x - mean, 0.0)
    tl.store(out_ptr + row, tl.sum(acc, axis=0) / n_cols)


class ModelNew(nn.Module):
    def forward(self, x):
        x = x.contiguous()
        rows, cols = x.shape
        out = torch.empty(rows, device=x.device, dtype=x.dtype)
        centered_mean_kernel[(rows,)](x, out, cols, BLOCK=256)
        return out
