# corpus: {"class": 10, "task": "trunc_scaled", "stage": ["audit"], "error": "casts float32 to int64"}
# The same truncation spelled as copies: the scaled values copied into an int64 buffer,
# then back into the float output, after which a kernel only copies.
import torch
import torch.nn as nn
import triton
import triton.language as tl


@triton.jit
def scale_kernel(x_ptr, out_ptr, n, SCALE: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=m) * SCALE, mask=m)


class ModelNew(nn.Module):
    def forward(self, x):
        n = x.numel()
        y = torch.empty_like(x)
        scale_kernel[(triton.cdiv(n, 1024),)](x, y, n, SCALE=4.0, BLOCK=1024)
        whole = torch.empty(x.shape, dtype=torch.int64, device=x.device)
        whole.copy_(y)
        y.copy_(whole)
        out = torch.empty_like(x)
        scale_kernel[(triton.cdiv(n, 1024),)](y, out, n, SCALE=1.0, BLOCK=1024)
        return out
