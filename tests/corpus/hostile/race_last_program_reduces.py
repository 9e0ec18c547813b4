# corpus: {"class": 6, "task": "rowsum", "stage": ["mismatch"], "error": "outputs depend on the order its programs ran: a race"}
# One launch writes each block's partial sum, and the row's last program (by index)
# adds the partials up: right when that program runs last, as in the interpreter; a
# GPU promises no order between blocks (and nothing makes the partials visible to it).
import torch
import torch.nn as nn
import triton
import triton.language as tl


@triton.jit
def rowsum_kernel(x_ptr, part_ptr, out_ptr, n_cols, BLOCK: tl.constexpr,
                  PARTS: tl.constexpr):
    row = tl.program_id(0)
    part = tl.program_id(1)
    offs = part * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * n_cols + offs, mask=offs < n_cols, other=0.0)
    tl.store(part_ptr + row * PARTS + part, tl.sum(x, axis=0))
    if part == PARTS - 1:
        idx = tl.arange(0, PARTS)
        partials = tl.load(part_ptr + row * PARTS + idx)
        tl.store(out_ptr + row, tl.sum(partials, axis=0))


class ModelNew(nn.Module):
    def forward(self, x):
        x = x.contiguous()
        rows, cols = x.shape
        parts = triton.next_power_of_2(triton.cdiv(cols, 128))
        partials = torch.zeros(rows * parts, device=x.device, dtype=x.dtype)
        out = torch.empty(rows, device=x.device, dtype=x.dtype)
        rowsum_kernel[(rows, parts)](x, partials, out, cols, BLOCK=128, PARTS=parts)
        return out
