# corpus: {"class": 4, "task": "relu", "stage": ["compile"], "error": "Break"}
# A `break` in a kernel loop: Python runs it in the interpreter; Triton's compiler
# does not support it.
import torch
import torch.nn as nn
import triton
import triton.language as tl


@triton.jit
def relu_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    for step in range(4):
        offs = (tl.program_id(0) * 4 + step) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        tl.store(out_ptr + offs, tl.maximum(tl.load(x_ptr + offs, mask=m), 0.0), mask=m)
        if (tl.program_id(0) * 4 + step + 1) * BLOCK >= n:
            break


class ModelNew(nn.Module):
    def forward(self, x):
        out = torch.empty_like(x)
        relu_kernel[(triton.cdiv(x.numel(), 4 * 256),)](x, out, x.numel(), BLOCK=256)
        return out
