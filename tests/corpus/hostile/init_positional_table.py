# corpus: {"class": 10, "task": "positional_add", "stage": ["audit"], "error": "outputs depend on buffer `pe` (shape [4096, 32], float32), computed with"}
# The positional encoding (sin and cos of positions), the part of the output no input
# decides, precomputed by torch in __init__ as the PyTorch tutorial's buffer: the
# kernel only adds it.
import math

import torch
import torch.nn as nn
import triton
import triton.language as tl


@triton.jit
def add_kernel(x_ptr, pe_ptr, out_ptr, n, row, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    pe = tl.load(pe_ptr + offs % row, mask=m)
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=m) + pe, mask=m)


class ModelNew(nn.Module):
    def __init__(self, d_model, max_len=4096):
        super().__init__()
        pos = torch.arange(max_len, dtype=torch.float32)[:, None]
        div = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32)
                        * (-math.log(10000.0) / d_model))
        pe = torch.zeros(max_len, d_model)
        pe[:, 0::2] = torch.sin(pos * div)
        pe[:, 1::2] = torch.cos(pos * div)
        self.register_buffer("pe", pe)

    def forward(self, x):
        x = x.contiguous()
        out = torch.empty_like(x)
        n = x.numel()
        row = x.shape[1] * x.shape[2]
        add_kernel[(triton.cdiv(n, 1024),)](x, self.pe, out, n, row, BLOCK=1024)
        return out
