# corpus: {"task": "numerics_fp16", "shape_generic": true}
# Native float16 arithmetic: the loads are float16, x * y + x stays float16 (Triton's type
# promotion keeps two fp16 operands in fp16), each operation rounded to nearest even.
import torch
import torch.nn as nn
import triton
import triton.language as tl


@triton.jit
def fma_relu_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(x_ptr + offs, mask=m)
    y = tl.load(y_ptr + offs, mask=m)
    z = x * y + x
    tl.store(out_ptr + offs, tl.maximum(z, 0.0), mask=m)


class ModelNew(nn.Module):
    def forward(self, x, y):
        x, y = x.contiguous(), y.contiguous()
        out = torch.empty_like(x)
        fma_relu_kernel[(triton.cdiv(x.numel(), 1024),)](x, y, out, x.numel(), BLOCK=1024)
        return out
