# corpus: {"class": 7, "task": "fill_sqrt", "stage": ["mismatch"], "error": "was not written by the kernels (it depends on what the fresh allocation held)"}
# The square root is stored only where the input is not negative; the other lanes keep
# what torch.empty held: NaN, where the reference has NaN too, as long as fresh memory
# is NaN-filled. A GPU's fresh memory holds anything.
import torch
import torch.nn as nn
import triton
import triton.language as tl


@triton.jit
def sqrt_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(x_ptr + offs, mask=m, other=0.0)
    tl.store(out_ptr + offs, tl.sqrt(x), mask=m & (x >= 0))


class ModelNew(nn.Module):
    def forward(self, x):
        x = x.contiguous()
        out = torch.empty_like(x)
        n = x.numel()
        sqrt_kernel[(triton.cdiv(n, 1024),)](x, out, n, BLOCK=1024)
        return out
