import torch
import torch.nn as nn


class Model(nn.Module):
    """A view that ties two extents together: ``features == 2 * width`` at the task's own
    sizes, and not at most others (the Model itself fails there)."""

    def __init__(self, features):
        super().__init__()
        self.features = features

    def forward(self, x):
        return torch.relu(x.reshape(x.shape[0], self.features))


batch_size = 16
width = 32
features = 64


def get_inputs():
    return [torch.randn(batch_size, width, 2)]


def get_init_inputs():
    return [features]
