# corpus: {"task": "relu", "shape_generic": true, "note": "CUDA was emulated"}
# Written for a GPU: asserts is_cuda, moves inputs with .cuda(), allocates on "cuda",
# times itself with CUDA events and keeps a torch fallback for tensors off the GPU.
import torch
import torch.nn as nn
import triton
import triton.language as tl


@triton.jit
def relu_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(out_ptr + offs, tl.maximum(tl.load(x_ptr + offs, mask=m), 0.0), mask=m)


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()
        self.elapsed_ms = 0.0

    def forward(self, x):
        if not x.is_cuda:
            return torch.relu(x)
        assert x.is_cuda and torch.cuda.is_available()
        x = x.cuda().contiguous()
        out = torch.empty(x.shape, device="cuda", dtype=x.dtype)
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        relu_kernel[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), BLOCK=1024)
        end.record()
        torch.cuda.synchronize()
        self.elapsed_ms += start.elapsed_time(end)
        return out
