import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, num_embeddings, embedding_dim):
        super().__init__()
        self.emb = nn.Embedding(num_embeddings, embedding_dim)

    def forward(self, ids):
        return self.emb(ids)


batch_size = 2
num_embeddings = 10
embedding_dim = 8


def get_inputs():
    return [torch.randint(0, num_embeddings, (batch_size, 5))]


def get_init_inputs():
    return [num_embeddings, embedding_dim]
