# corpus: {"class": 4, "task": "rowsum", "stage": ["mismatch"], "error": "differ"}
# Split sums added atomically into an output that is zeroed once by torch.zeros: with
# several configs the GPU autotuner runs the kernel again on the same output, so the
# sums double (reset_to_zero would have declared it).
import torch
import torch.nn as nn
import triton
import triton.language as tl


@triton.autotune(configs=[triton.Config({"BLOCK": 128}), triton.Config({"BLOCK": 256})],
                 key=["n_cols"])
@triton.jit
def rowsum_kernel(x_ptr, out_ptr, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    part = tl.program_id(1)
    offs = part * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * n_cols + offs, mask=offs < n_cols, other=0.0)
    tl.atomic_add(out_ptr + row, tl.sum(x, axis=0))


class ModelNew(nn.Module):
    def forward(self, x):
        x = x.contiguous()
        rows, cols = x.shape
        out = torch.zeros(rows, device=x.device, dtype=x.dtype)
        rowsum_kernel[lambda meta: (rows, triton.cdiv(cols, meta["BLOCK"]))](x, out, cols)
        return out
