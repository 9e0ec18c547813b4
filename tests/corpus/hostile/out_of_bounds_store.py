# corpus: {"class": 4, "task": "relu", "stage": ["runtime"], "error": "out of bounds"}
# An unmasked store past the end of the output (the interpreter writes host memory
# without complaint; a GPU faults or corrupts other buffers).
import torch
import torch.nn as nn
import triton
import triton.language as tl


@triton.jit
def relu_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(x_ptr + offs, mask=m, other=0.0)
    tl.store(out_ptr + offs, tl.maximum(x, 0.0))


class ModelNew(nn.Module):
    def forward(self, x):
        out = torch.empty_like(x)
        relu_kernel[(triton.cdiv(x.numel(), 1000),)](x, out, x.numel(), BLOCK=1024)
        return out
