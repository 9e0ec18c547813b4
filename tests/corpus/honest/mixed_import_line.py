# corpus: {"task": "relu", "shape_generic": true}
# ruff: noqa: E401, I001
# torch, triton and triton.language on one import line, as LLMs often write it: the kernel
# module keeps triton and tl from it.
import torch, triton, triton.language as tl
import torch.nn as nn


@triton.jit
def relu_kernel(x_ptr, o_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(x_ptr + offs, mask=m, other=0.0)
    tl.store(o_ptr + offs, tl.maximum(x, 0.0), mask=m)


class ModelNew(nn.Module):
    def forward(self, x):
        x = x.contiguous()
        out = torch.empty_like(x)
        relu_kernel[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), BLOCK=1024)
        return out
