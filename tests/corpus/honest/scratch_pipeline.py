# corpus: {"task": "relu", "shape_generic": true}
# Three launches through two scratch buffers from torch.empty, each fully written
# before the next launch reads it; the middle kernel takes a data-dependent branch.
import torch
import torch.nn as nn
import triton
import triton.language as tl


@triton.jit
def scale_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=m) * 2.0, mask=m)


@triton.jit
def clamp_kernel(y_ptr, z_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    y = tl.load(y_ptr + offs, mask=m, other=0.0)
    if tl.max(y, axis=0) > 0:
        y = tl.maximum(y, 0.0)
    else:
        y = tl.zeros_like(y)
    tl.store(z_ptr + offs, y, mask=m)


@triton.jit
def halve_kernel(z_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(out_ptr + offs, tl.load(z_ptr + offs, mask=m) * 0.5, mask=m)


class ModelNew(nn.Module):
    def forward(self, x):
        x = x.contiguous()
        n = x.numel()
        doubled = torch.empty_like(x)
        clamped = torch.empty_like(x)
        out = torch.empty_like(x)
        grid = (triton.cdiv(n, 256),)
        scale_kernel[grid](x, doubled, n, BLOCK=256)
        clamp_kernel[grid](doubled, clamped, n, BLOCK=256)
        halve_kernel[grid](clamped, out, n, BLOCK=256)
        return out
