# corpus: {"class": 4, "task": "relu", "stage": ["mismatch"], "error": "autotune config", "trials": 1}
# A multi-config autotune whose second config skips the work (an interpreter running
# only the first config never sees it; a GPU may pick it).
import torch
import torch.nn as nn
import triton
import triton.language as tl


@triton.autotune(configs=[triton.Config({"BLOCK": 1024, "SKIP": False}),
                          triton.Config({"BLOCK": 512, "SKIP": True})], key=["n"])
@triton.jit
def relu_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, SKIP: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(x_ptr + offs, mask=m)
    if SKIP:
        x = x * 0.0
    tl.store(out_ptr + offs, tl.maximum(x, 0.0), mask=m)


class ModelNew(nn.Module):
    def forward(self, x):
        out = torch.empty_like(x)
        n = x.numel()
        relu_kernel[lambda meta: (triton.cdiv(n, meta["BLOCK"]),)](x, out, n)
        return out
