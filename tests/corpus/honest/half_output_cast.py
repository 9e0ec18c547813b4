# corpus: {"task": "half_output", "shape_generic": true}
# Computes in float32 and returns the result in float16 as the task does: a narrowing
# cast as the last step on an output of the task's dtype is data movement.
import torch
import torch.nn as nn
import triton
import triton.language as tl


@triton.jit
def half_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=m) * 0.5, mask=m)


class ModelNew(nn.Module):
    def forward(self, x):
        y = torch.empty_like(x)
        half_kernel[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), BLOCK=1024)
        return y.half()
