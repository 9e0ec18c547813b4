# corpus: {"task": "relu", "shape_generic": true, "note": "compiled for sm_"}
# Sizes passed to the kernel as one tuple argument: Triton 3.9 specialises a tuple
# argument as the tuple of its items' types and compiles it on a GPU, so the compile
# check compiles it too (an item equal to 1 is a constexpr there, as on the GPU).
import torch
import torch.nn as nn
import triton
import triton.language as tl


@triton.jit
def relu_kernel(x_ptr, out_ptr, shape, BLOCK: tl.constexpr):
    n = shape[0] * shape[1]
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(out_ptr + offs, tl.maximum(tl.load(x_ptr + offs, mask=m), 0.0), mask=m)


class ModelNew(nn.Module):
    def forward(self, x):
        x = x.contiguous()
        out = torch.empty_like(x)
        relu_kernel[(triton.cdiv(x.numel(), 1024),)](x, out, (x.shape[0], x.shape[1], 1),
                                                     BLOCK=1024)
        return out
