"""Small models shared by the tests."""

import torch
from torch import nn

from autoplan.models.llama3 import LlamaConfig, TransformerBlock, rope_tables


class MLP(nn.Module):
    def __init__(self, d_in: int = 64, hidden: int = 128, d_out: int = 64):
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


class Block(nn.Module):
    """One LLaMA block with its RoPE table as a buffer, taking (batch, seq, dim) activations."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.block = TransformerBlock(cfg, 0)
        self.register_buffer("freqs", rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x, self.freqs)
