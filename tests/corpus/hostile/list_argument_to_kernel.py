# corpus: {"class": 8, "task": "relu", "stage": ["compile"], "error": "argument 'sizes' is a list", "trials": 1}
# A kernel argument that is a list: the interpreter passes any Python object to a
# kernel, but a GPU launch of Triton 3.9 specialises only numbers, tensors and tuples
# and raises TypeError here. The old compile check skipped the launch with a note.
import torch
import torch.nn as nn
import triton
import triton.language as tl


@triton.jit
def relu_kernel(x_ptr, out_ptr, sizes, BLOCK: tl.constexpr):
    n = sizes[0] * sizes[1]
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(out_ptr + offs, tl.maximum(tl.load(x_ptr + offs, mask=m), 0.0), mask=m)


class ModelNew(nn.Module):
    def forward(self, x):
        x = x.contiguous()
        out = torch.empty_like(x)
        relu_kernel[(triton.cdiv(x.numel(), 1024),)](x, out, [x.shape[0], x.shape[1]],
                                                     BLOCK=1024)
        return out
