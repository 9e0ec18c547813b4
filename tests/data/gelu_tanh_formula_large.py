"""GELU's tanh approximation spelled out with tensor arithmetic, in KernelBench's task
format (written for AIKG's tests): the built-in coder must fuse the whole chain.
Sized for a large GPU, shrunk with shape overrides.

0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x^3))) (Hendrycks and Gimpel,
"Gaussian Error Linear Units", arXiv:1606.08415, section 2).
"""

import math

import torch
import torch.nn as nn


class Model(nn.Module):
    """The tanh-approximated GELU, element-wise."""

    def __init__(self):
        super().__init__()
        self.scale = math.sqrt(2.0 / math.pi)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inner = self.scale * (x + 0.044715 * torch.pow(x, 3.0))
        return 0.5 * x * (1.0 + torch.tanh(inner))


batch_size = 2048
dim = 262144


def get_inputs():
    return [torch.randn(batch_size, dim)]


def get_init_inputs():
    return []
