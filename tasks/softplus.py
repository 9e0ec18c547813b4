import torch
import torch.nn as nn


class Model(nn.Module):
    """Simple model that performs a Softplus activation."""

    def __init__(self, beta: float = 1.0, threshold: float = 20.0):
        super().__init__()
        self.softplus = nn.Softplus(beta=beta, threshold=threshold)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Applies Softplus; linear where beta * x exceeds the threshold."""
        return self.softplus(x)


batch_size = 16
dim = 4096


def get_inputs():
    x = torch.randn(batch_size, dim) * 4.0
    return [x]


def get_init_inputs():
    return [2.0, 5.0]  # beta, threshold
