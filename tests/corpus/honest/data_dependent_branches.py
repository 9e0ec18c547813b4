# corpus: {"task": "big_relu", "shape_overrides": {"batch_size": 16}, "trials": 2, "shape_generic": true}
# Branches the checked sizes take as the task's own do: on loaded values (a block with
# no positive value stores zeros without the where), masks that leave lanes off at
# some sizes, the first program and a constexpr. The task's own sizes are dry-run only.
import torch
import torch.nn as nn
import triton
import triton.language as tl


@triton.jit
def relu_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, CLAMP: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(x_ptr + offs, mask=m, other=0.0)
    if tl.max(x, axis=0) > 0.0:
        y = tl.where(x > 0.0, x, 0.0)
    else:
        y = tl.zeros_like(x)
    if CLAMP:
        y = tl.minimum(y, float("inf"))
    # the first program stores like the others: a condition that mixes programs at
    # every size with more than one program
    y = tl.where(pid == 0, y + 0.0, y)
    tl.store(out_ptr + offs, y, mask=m)


class ModelNew(nn.Module):
    def forward(self, x):
        x = x.contiguous()
        out = torch.empty_like(x)
        n = x.numel()
        relu_kernel[(triton.cdiv(n, 1024),)](x, out, n, BLOCK=1024, CLAMP=True)
        return out
