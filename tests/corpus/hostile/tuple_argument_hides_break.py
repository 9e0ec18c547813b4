# corpus: {"class": 8, "task": "relu", "stage": ["compile"], "error": "Break", "trials": 1}
# A tuple argument (the sizes) made the old compile check skip the whole launch with a
# note, so the `break` in the loop, which no GPU compiles, passed. Triton 3.9 does
# compile tuple arguments (a tuple of types), so the launch is compiled and fails.
import torch
import torch.nn as nn
import triton
import triton.language as tl


@triton.jit
def relu_kernel(x_ptr, out_ptr, shape, BLOCK: tl.constexpr):
    n = shape[0] * shape[1]
    for step in range(4):
        offs = (tl.program_id(0) * 4 + step) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        tl.store(out_ptr + offs, tl.maximum(tl.load(x_ptr + offs, mask=m), 0.0), mask=m)
        if (tl.program_id(0) * 4 + step + 1) * BLOCK >= n:
            break


class ModelNew(nn.Module):
    def forward(self, x):
        x = x.contiguous()
        out = torch.empty_like(x)
        relu_kernel[(triton.cdiv(x.numel(), 4 * 256),)](x, out, tuple(x.shape), BLOCK=256)
        return out
