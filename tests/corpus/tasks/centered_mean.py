import torch
import torch.nn as nn


# Mathematically zero (the mean of values less their mean); in float32 it is rounding
# noise, largest with the offset of the task's inputs.
class Model(nn.Module):
    def forward(self, x):
        centered = x - x.mean(dim=-1, keepdim=True)
        return centered.mean(dim=-1)


rows = 16
cols = 1000


def get_inputs():
    return [torch.randn(rows, cols) + 1000.0]


def get_init_inputs():
    return []
