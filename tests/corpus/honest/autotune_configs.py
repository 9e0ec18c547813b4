# corpus: {"task": "rowsum", "trials": 1, "shape_generic": true, "note": "each of 3 configs ran"}
# Three configs, all right; the atomic split-K sum declares reset_to_zero, as the GPU
# autotuner needs.
import torch
import torch.nn as nn
import triton
import triton.language as tl


@triton.autotune(configs=[triton.Config({"BLOCK": 64}), triton.Config({"BLOCK": 128}),
                          triton.Config({"BLOCK": 256})],
                 key=["n_cols"], reset_to_zero=["out_ptr"])
@triton.jit
def rowsum_kernel(x_ptr, out_ptr, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * n_cols + offs, mask=offs < n_cols, other=0.0)
    tl.atomic_add(out_ptr + row, tl.sum(x, axis=0))


class ModelNew(nn.Module):
    def forward(self, x):
        x = x.contiguous()
        rows, cols = x.shape
        out = torch.zeros(rows, device=x.device, dtype=x.dtype)
        rowsum_kernel[lambda meta: (rows, triton.cdiv(cols, meta["BLOCK"]))](x, out, cols)
        return out
