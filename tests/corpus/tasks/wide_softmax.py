import torch
import torch.nn as nn


# A softmax over wide rows: every probability is below float32's atol (KernelBench
# issue #165) for any draw (at scale 0.1 one of 65,536 rose above it in ~1% of draws),
# and the float32 reference is accurate.
class Model(nn.Module):
    def forward(self, x):
        return torch.softmax(x, dim=1)


batch_size = 4
dim = 16384


def get_inputs():
    return [0.05 * torch.randn(batch_size, dim)]


def get_init_inputs():
    return []
