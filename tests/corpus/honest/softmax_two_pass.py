# corpus: {"task": "softmax", "shape_generic": true}
# Two launches per call: the row maxima, then the normalised exponentials.
import torch
import torch.nn as nn
import triton
import triton.language as tl


@triton.jit
def row_max_kernel(x_ptr, max_ptr, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * n_cols + offs, mask=offs < n_cols, other=-float("inf"))
    tl.store(max_ptr + row, tl.max(x, axis=0))


@triton.jit
def softmax_kernel(x_ptr, max_ptr, out_ptr, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    x = tl.load(x_ptr + row * n_cols + offs, mask=mask, other=-float("inf"))
    e = tl.where(mask, tl.exp(x - tl.load(max_ptr + row)), 0.0)
    tl.store(out_ptr + row * n_cols + offs, e / tl.sum(e, axis=0), mask=mask)


class ModelNew(nn.Module):
    def forward(self, x):
        x = x.contiguous()
        rows, cols = x.shape
        maxes = torch.empty(rows, device=x.device, dtype=x.dtype)
        out = torch.empty_like(x)
        block = triton.next_power_of_2(cols)
        row_max_kernel[(rows,)](x, maxes, cols, BLOCK=block)
        softmax_kernel[(rows,)](x, maxes, out, cols, BLOCK=block)
        return out
