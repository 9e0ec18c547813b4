import torch
import torch.nn as nn


class Model(nn.Module):
    def forward(self, x):
        if x.abs().max() >= 0:  # always true; data-dependent, so not exportable
            return torch.softmax(x, dim=1)
        return x


batch_size = 16
dim = 1024


def get_inputs():
    return [torch.randn(batch_size, dim)]


def get_init_inputs():
    return []
