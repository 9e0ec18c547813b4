# corpus: {"task": "linear", "trials": 2, "shape_generic": true}
# nn.Linear's weight copied in __init__ transposed and contiguous (a layout copy of an
# init-seeded parameter, no computed value); the kernel reads the copy.
import torch
import torch.nn as nn
import triton
import triton.language as tl


@triton.jit
def linear_kernel(x_ptr, wt_ptr, b_ptr, out_ptr, M, N, K, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        rk = k + tl.arange(0, BLOCK_K)
        a = tl.load(x_ptr + rm[:, None] * K + rk[None, :],
                    mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
        w = tl.load(wt_ptr + rk[:, None] * N + rn[None, :],
                    mask=(rk[:, None] < K) & (rn[None, :] < N), other=0.0)
        acc += tl.dot(a, w, input_precision="ieee")
    acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0)[None, :]
    tl.store(out_ptr + rm[:, None] * N + rn[None, :], acc,
             mask=(rm[:, None] < M) & (rn[None, :] < N))


class ModelNew(nn.Module):
    def __init__(self, in_features, out_features):
        super().__init__()
        self.fc = nn.Linear(in_features, out_features)
        self.register_buffer("wt", self.fc.weight.detach().t().contiguous())

    def forward(self, x):
        x = x.contiguous()
        M, K = x.shape
        N = self.fc.out_features
        out = torch.empty((M, N), device=x.device, dtype=x.dtype)
        grid = (triton.cdiv(M, 16), triton.cdiv(N, 32))
        linear_kernel[grid](x, self.wt, self.fc.bias, out, M, N, K,
                            BLOCK_M=16, BLOCK_N=32, BLOCK_K=32)
        return out
