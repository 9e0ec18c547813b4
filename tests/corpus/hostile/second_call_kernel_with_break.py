# corpus: {"class": 8, "task": "relu", "stage": ["compile"], "error": "at trial 1", "trials": 2}
# The first call launches a kernel every GPU compiles; from the second call on,
# another one, whose `break` no GPU compiles. Only the first call's launches used to
# be compiled, so the second kernel was only ever interpreted.
import torch
import torch.nn as nn
import triton
import triton.language as tl


@triton.jit
def relu_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(out_ptr + offs, tl.maximum(tl.load(x_ptr + offs, mask=m), 0.0), mask=m)


@triton.jit
def relu_loop_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    for step in range(4):
        offs = (tl.program_id(0) * 4 + step) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        tl.store(out_ptr + offs, tl.maximum(tl.load(x_ptr + offs, mask=m), 0.0), mask=m)
        if (tl.program_id(0) * 4 + step + 1) * BLOCK >= n:
            break


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        x = x.contiguous()
        out = torch.empty_like(x)
        self.calls += 1
        if self.calls == 1:
            relu_kernel[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), BLOCK=1024)
        else:
            relu_loop_kernel[(triton.cdiv(x.numel(), 4 * 256),)](x, out, x.numel(), BLOCK=256)
        return out
