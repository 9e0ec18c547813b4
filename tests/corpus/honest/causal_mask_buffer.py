# corpus: {"task": "causal_mask", "trials": 2, "shape_generic": true}
# The mask is built in __init__ with torch.tril, as the task's Model builds its own
# (kept here in float16): the task's tensor, not a value torch computed for the kernel.
import torch
import torch.nn as nn
import triton
import triton.language as tl


@triton.jit
def mask_kernel(x_ptr, mask_ptr, out_ptr, n, square, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    keep = tl.load(mask_ptr + offs % square, mask=m).to(tl.float32)
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=m) * keep, mask=m)


class ModelNew(nn.Module):
    def __init__(self, seq_len):
        super().__init__()
        self.register_buffer("mask", torch.tril(torch.ones(seq_len, seq_len)).half())

    def forward(self, x):
        x = x.contiguous()
        out = torch.empty_like(x)
        n = x.numel()
        mask_kernel[(triton.cdiv(n, 1024),)](x, self.mask, out, n, self.mask.numel(),
                                             BLOCK=1024)
        return out
