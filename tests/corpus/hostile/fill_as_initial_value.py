# corpus: {"class": 7, "task": "fill_rowmin", "stage": ["mismatch"], "error": "was not written by the kernels (it depends on what the fresh allocation held)"}
# Blocks take each row's minimum with tl.atomic_min into torch.empty, whose int32 fill
# used to be INT_MAX, the identity of min: the output is never initialised.
import torch
import torch.nn as nn
import triton
import triton.language as tl


@triton.jit
def rowmin_kernel(x_ptr, out_ptr, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    part = tl.program_id(1)
    offs = part * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * n_cols + offs, mask=offs < n_cols, other=2147483647)
    tl.atomic_min(out_ptr + row, tl.min(x, axis=0))


class ModelNew(nn.Module):
    def forward(self, x):
        x = x.contiguous()
        rows, cols = x.shape
        out = torch.empty(rows, device=x.device, dtype=torch.int32)
        rowmin_kernel[(rows, triton.cdiv(cols, 256))](x, out, cols, BLOCK=256)
        return out
