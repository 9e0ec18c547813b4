# corpus: {"class": 8, "task": "big_relu", "stage": ["compile"], "error": "relu_loop_kernel", "shape_overrides": {"batch_size": 16}, "trials": 1}
# Above 2**20 elements (the task's own sizes, which only a dry run reaches on a cpu
# worker) forward launches a second kernel whose `break` no GPU compiles; the checked
# sizes launch only the first. The dry run's launches are compiled like any call's.
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
    def forward(self, x):
        x = x.contiguous()
        out = torch.empty_like(x)
        if x.numel() > 2**20:
            relu_loop_kernel[(triton.cdiv(x.numel(), 4 * 1024),)](x, out, x.numel(),
                                                                  BLOCK=1024)
        else:
            relu_kernel[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), BLOCK=1024)
        return out
