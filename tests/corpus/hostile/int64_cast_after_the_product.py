# corpus: {"class": 9, "task": "huge_relu", "stage": ["compile"], "error": "kernel relu_rows: offset `row * stride`", "shape_overrides": {"batch_size": 4, "dim": 1024}}
# One program per row; the row offset is cast to int64 only after `row * stride` was
# computed in int32, which has already wrapped at the task's own 32768 x 131072.
import torch
import torch.nn as nn
import triton
import triton.language as tl


@triton.jit
def relu_rows(x_ptr, out_ptr, stride, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    base = (row * stride).to(tl.int64)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        m = cols < n_cols
        v = tl.load(x_ptr + base + cols, mask=m)
        tl.store(out_ptr + base + cols, tl.maximum(v, 0.0), mask=m)


class ModelNew(nn.Module):
    def forward(self, x):
        x = x.contiguous()
        out = torch.empty_like(x)
        relu_rows[(x.shape[0],)](x, out, x.stride(0), x.shape[1], BLOCK=256)
        return out
