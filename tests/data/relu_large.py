"""ReLU over a large activation, in KernelBench's task format (written for AIKG's tests).

Sized for a large GPU (about 6 GiB of float32 input); tests and the README shrink it
with shape overrides (``--shape batch_size=16 --shape dim=4096``).
"""

import torch
import torch.nn as nn


class Model(nn.Module):
    """max(x, 0), element-wise; the output has the input's shape and dtype."""

    def __init__(self):
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x)


batch_size = 4096
dim = 393216


def get_inputs():
    return [torch.randn(batch_size, dim)]


def get_init_inputs():
    return []
