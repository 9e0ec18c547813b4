# corpus: {"class": 6, "task": "rowsum", "stage": ["mismatch"], "error": "outputs depend on the order its programs ran: a race"}
# A chained sum: each program adds its block to the running total the program before
# it stored, and the row's last block writes the result. Programs that run one after
# another in index order (the interpreter) chain correctly; a GPU runs them at once,
# in any order, and a program reads a total not yet written.
import torch
import torch.nn as nn
import triton
import triton.language as tl


@triton.jit
def chained_rowsum_kernel(x_ptr, run_ptr, out_ptr, n_cols, PARTS, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    row = pid // PARTS
    part = pid % PARTS
    offs = part * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * n_cols + offs, mask=offs < n_cols, other=0.0)
    before = tl.load(run_ptr + pid - 1, mask=part > 0, other=0.0)
    total = before + tl.sum(x, axis=0)
    tl.store(run_ptr + pid, total)
    tl.store(out_ptr + row, total, mask=part == PARTS - 1)


class ModelNew(nn.Module):
    def forward(self, x):
        x = x.contiguous()
        rows, cols = x.shape
        parts = triton.cdiv(cols, 128)
        running = torch.empty(rows * parts, device=x.device, dtype=x.dtype)
        out = torch.empty(rows, device=x.device, dtype=x.dtype)
        chained_rowsum_kernel[(rows * parts,)](x, running, out, cols, parts, BLOCK=128)
        return out
