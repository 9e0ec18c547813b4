# corpus: {"class": 8, "task": "relu", "stage": ["compile"], "error": "unused_helper", "trials": 1}
# An unused `@triton.jit` function with a **kwargs parameter: the interpreter's
# decorator accepts it, a GPU's refuses it when the module is imported (TypeError),
# so the candidate cannot even load on a GPU. The old compile child failed while
# loading the module and its failure was dropped: no verdict, a pass.
import torch
import torch.nn as nn
import triton
import triton.language as tl


@triton.jit
def unused_helper(x, **options):
    return x


@triton.jit
def relu_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(out_ptr + offs, tl.maximum(tl.load(x_ptr + offs, mask=m), 0.0), mask=m)


class ModelNew(nn.Module):
    def forward(self, x):
        x = x.contiguous()
        out = torch.empty_like(x)
        relu_kernel[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), BLOCK=1024)
        return out
