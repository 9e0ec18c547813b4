import torch
import torch.nn as nn


class Model(nn.Module):
    """Scalar-tensor arithmetic in both operand orders."""

    def __init__(self):
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Returns (2.0 - x) * 0.5 + 1 / (|x| + 1); the scalar stands left of the tensor."""
        return (2.0 - x) * 0.5 + 1 / (torch.abs(x) + 1.0)


batch_size = 16
dim = 4096


def get_inputs():
    x = torch.randn(batch_size, dim)
    return [x]


def get_init_inputs():
    return []  # No special initialization inputs needed
