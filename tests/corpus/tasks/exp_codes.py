import torch
import torch.nn as nn


class Model(nn.Module):
    """exp of integer codes scaled to [-4, 4): a function of 4096 possible inputs, which
    a table computed once could answer."""

    def forward(self, codes):
        return torch.exp(codes.to(torch.float32) / 512.0 - 4.0)


batch_size = 16
n = 256


def get_inputs():
    return [torch.randint(0, 4096, (batch_size, n))]


def get_init_inputs():
    return []
