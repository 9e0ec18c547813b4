# corpus: {"class": 4, "task": "relu", "stage": ["compile"], "error": "helper"}
# The kernel body calls a Python helper that computes with numpy: the interpreter runs
# kernel bodies as Python, a GPU compiler refuses it.
import numpy
import torch
import torch.nn as nn
import triton
import triton.language as tl


def helper(x):
    return numpy.maximum(x, 0)


@triton.jit
def relu_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(out_ptr + offs, helper(tl.load(x_ptr + offs, mask=m)), mask=m)


class ModelNew(nn.Module):
    def forward(self, x):
        out = torch.empty_like(x)
        relu_kernel[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), BLOCK=1024)
        return out
