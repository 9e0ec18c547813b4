# corpus: {"class": 9, "task": "big_relu", "stage": ["unchecked"], "error": "relu_kernel's condition `n > 8000000`", "shape_overrides": {"batch_size": 16}}
# One kernel, one launch, the same grid: the kernel itself branches on its scalar size
# argument and skips the relu above 8e6 elements. Every size within a cpu budget takes
# the right branch; the task's own 2**24 elements take the wrong one.
import torch
import torch.nn as nn
import triton
import triton.language as tl


@triton.jit
def relu_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(x_ptr + offs, mask=m)
    if n > 8000000:
        y = x
    else:
        y = tl.maximum(x, 0.0)
    tl.store(out_ptr + offs, y, mask=m)


class ModelNew(nn.Module):
    def forward(self, x):
        x = x.contiguous()
        out = torch.empty_like(x)
        n = x.numel()
        relu_kernel[(triton.cdiv(n, 1024),)](x, out, n, BLOCK=1024)
        return out
