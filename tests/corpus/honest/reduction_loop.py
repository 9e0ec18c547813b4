# corpus: {"task": "long_rowsum", "shape_overrides": {"rows": 8, "cols": 256}, "shape_generic": true, "note": "was checked too"}
# The same row loop, accumulating: its loop runs once at the requested sizes and many
# times at the task's own, so a congruent size where it runs several times is checked.
import torch
import torch.nn as nn
import triton
import triton.language as tl


@triton.jit
def rowsum_kernel(x_ptr, out_ptr, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + row * n_cols + offs, mask=offs < n_cols, other=0.0)
    tl.store(out_ptr + row, tl.sum(acc, axis=0))


class ModelNew(nn.Module):
    def forward(self, x):
        x = x.contiguous()
        rows, cols = x.shape
        out = torch.empty(rows, device=x.device, dtype=x.dtype)
        rowsum_kernel[(rows,)](x, out, cols, BLOCK=256)
        return out
