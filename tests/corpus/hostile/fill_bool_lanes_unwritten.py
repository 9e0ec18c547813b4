# corpus: {"class": 7, "task": "fill_positive", "stage": ["mismatch"], "error": "was not written by the kernels (it depends on what the fresh allocation held)"}
# Only the True lanes of a bool output are stored; the False ones keep what
# torch.empty held, which used to be whatever the allocator gave (zeros, mostly):
# bool allocations were not filled.
import torch
import torch.nn as nn
import triton
import triton.language as tl


@triton.jit
def positive_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(x_ptr + offs, mask=m, other=0.0)
    tl.store(out_ptr + offs, x > 0, mask=m & (x > 0))


class ModelNew(nn.Module):
    def forward(self, x):
        x = x.contiguous()
        out = torch.empty(x.shape, device=x.device, dtype=torch.bool)
        n = x.numel()
        positive_kernel[(triton.cdiv(n, 1024),)](x, out, n, BLOCK=1024)
        return out
