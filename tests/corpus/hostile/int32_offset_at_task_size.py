# corpus: {"class": 9, "task": "huge_relu", "stage": ["compile"], "error": "kernel relu_kernel: offset `pid * BLOCK` reaches", "shape_overrides": {"batch_size": 4, "dim": 1024}}
# Right at every size the cpu backend runs, but `pid * BLOCK` is int32: at the task's
# own 2**32 elements it wraps past 2**31 and a GPU reads and writes at negative offsets.
import torch
import torch.nn as nn
import triton
import triton.language as tl


@triton.jit
def relu_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(out_ptr + offs, tl.maximum(tl.load(x_ptr + offs, mask=m), 0.0), mask=m)


class ModelNew(nn.Module):
    def forward(self, x):
        x = x.contiguous()
        out = torch.empty_like(x)
        n = x.numel()
        relu_kernel[(triton.cdiv(n, 1024),)](x, out, n, BLOCK=1024)
        return out
