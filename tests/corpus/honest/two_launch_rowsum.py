# corpus: {"task": "rowsum", "shape_generic": true}
# Partial sums into a scratch buffer from torch.empty (every element written), then a
# second launch adds each row's partials: the launch boundary orders the two.
import torch
import torch.nn as nn
import triton
import triton.language as tl


@triton.jit
def partial_kernel(x_ptr, part_ptr, n_cols, PARTS, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    part = tl.program_id(1)
    offs = part * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * n_cols + offs, mask=offs < n_cols, other=0.0)
    tl.store(part_ptr + row * PARTS + part, tl.sum(x, axis=0))


@triton.jit
def finish_kernel(part_ptr, out_ptr, PARTS, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    idx = tl.arange(0, BLOCK)
    partials = tl.load(part_ptr + row * PARTS + idx, mask=idx < PARTS, other=0.0)
    tl.store(out_ptr + row, tl.sum(partials, axis=0))


class ModelNew(nn.Module):
    def forward(self, x):
        x = x.contiguous()
        rows, cols = x.shape
        parts = triton.cdiv(cols, 128)
        partials = torch.empty(rows, parts, device=x.device, dtype=x.dtype)
        out = torch.empty(rows, device=x.device, dtype=x.dtype)
        partial_kernel[(rows, parts)](x, partials, cols, parts, BLOCK=128)
        finish_kernel[(rows,)](partials, out, parts, BLOCK=triton.next_power_of_2(parts))
        return out
