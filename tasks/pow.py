import torch
import torch.nn as nn


class Model(nn.Module):
    """Raises the input to a constant power."""

    def __init__(self, exponent: float = 2.0):
        super().__init__()
        self.exponent = exponent

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Returns x ** exponent."""
        return torch.pow(x, self.exponent)


batch_size = 16
dim = 4096


def get_inputs():
    x = torch.randn(batch_size, dim)
    return [x]


def get_init_inputs():
    return [3.0]  # exponent
