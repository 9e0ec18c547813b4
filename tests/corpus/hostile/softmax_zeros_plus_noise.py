# corpus: {"class": 4, "task": "wide_softmax", "stage": ["mismatch"], "error": "relative L2 error", "trials": 1}
# Every probability of a wide softmax is below atol: zeros plus a little noise (not a
# constant) are within it element for element. The float32 reference is accurate, so
# the float64 recheck must not excuse the relative L2 error.
import torch
import torch.nn as nn
import triton
import triton.language as tl


@triton.jit
def noise_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    tl.store(out_ptr + offs, x * 1e-7, mask=offs < n)


class ModelNew(nn.Module):
    def forward(self, x):
        x = x.contiguous()
        out = torch.empty_like(x)
        n = x.numel()
        noise_kernel[(triton.cdiv(n, 1024),)](x, out, n, BLOCK=1024)
        return out
