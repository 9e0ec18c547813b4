"""Leaky ReLU with its slope as a constructor argument, in KernelBench's task format
(written for AIKG's tests); sized for a large GPU, shrunk with shape overrides."""

import torch
import torch.nn as nn
import torch.nn.functional as F


class Model(nn.Module):
    """x where x >= 0, else slope * x; the slope comes from ``get_init_inputs()``."""

    def __init__(self, slope: float = 0.01):
        super().__init__()
        self.slope = slope

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.leaky_relu(x, negative_slope=self.slope)


batch_size = 4096
dim = 393216


def get_inputs():
    return [torch.randn(batch_size, dim)]


def get_init_inputs():
    return [0.05]
