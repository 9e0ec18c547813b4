# corpus: {"class": 7, "task": "relu", "stage": ["mismatch"], "error": "normal x10000"}
# A relu that saturates at 1000 (a clamp meant for another activation): no draw of the
# task's own, x100 or x0.001 inputs reaches 1000, so three trials used to pass it.
import torch
import torch.nn as nn
import triton
import triton.language as tl


@triton.jit
def relu_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(x_ptr + offs, mask=m)
    tl.store(out_ptr + offs, tl.minimum(tl.maximum(x, 0.0), 1000.0), mask=m)


class ModelNew(nn.Module):
    def forward(self, x):
        out = torch.empty_like(x)
        relu_kernel[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), BLOCK=1024)
        return out
