import torch
import torch.nn as nn


class Model(nn.Module):
    """A small convolutional encoder-decoder: a strided, padded 3x3 convolution with a
    ReLU, then a transposed convolution back to the input's resolution with a tanh."""

    def __init__(self, in_channels: int, hidden_channels: int):
        super().__init__()
        self.down = nn.Conv2d(in_channels, hidden_channels, 3, stride=2, padding=1)
        self.up = nn.ConvTranspose2d(hidden_channels, in_channels, 4, stride=2, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(batch_size, in_channels, height, width) -> the same shape."""
        return torch.tanh(self.up(torch.relu(self.down(x))))


batch_size = 2
in_channels = 3
hidden_channels = 16
height = 16
width = 20


def get_inputs():
    x = torch.randn(batch_size, in_channels, height, width)
    return [x]


def get_init_inputs():
    return [in_channels, hidden_channels]
