import torch
import torch.nn as nn


class Model(nn.Module):
    """Simple model that performs a Mish activation: x * tanh(softplus(x))."""

    def __init__(self):
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Applies the activation element-wise; output has the input's shape."""
        return torch.nn.functional.mish(x)


batch_size = 16
dim = 4096


def get_inputs():
    x = torch.randn(batch_size, dim)
    return [x]


def get_init_inputs():
    return []  # No special initialization inputs needed
