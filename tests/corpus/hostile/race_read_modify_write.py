# corpus: {"class": 6, "task": "rowsum", "stage": ["mismatch"], "error": "outputs depend on the order its programs ran: a race"}
# Each block of a row adds its partial sum to the row's total with a plain load and
# store (no atomic): run one program after another, as the interpreter does, the sum
# is right; on a GPU the blocks run at once and all but one update is lost.
import torch
import torch.nn as nn
import triton
import triton.language as tl


@triton.jit
def rowsum_kernel(x_ptr, out_ptr, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    part = tl.program_id(1)
    offs = part * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * n_cols + offs, mask=offs < n_cols, other=0.0)
    total = tl.load(out_ptr + row)
    tl.store(out_ptr + row, total + tl.sum(x, axis=0))


class ModelNew(nn.Module):
    def forward(self, x):
        x = x.contiguous()
        rows, cols = x.shape
        out = torch.zeros(rows, device=x.device, dtype=x.dtype)
        rowsum_kernel[(rows, triton.cdiv(cols, 128))](x, out, cols, BLOCK=128)
        return out
