import torch
import torch.nn as nn


class Model(nn.Module):
    """Each row's smallest value, of positive int32 inputs."""

    def forward(self, x):
        return x.amin(dim=1)


rows = 8
cols = 1000


def get_inputs():
    return [torch.randint(1, 1000, (rows, cols), dtype=torch.int32)]


def get_init_inputs():
    return []
