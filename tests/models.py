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


class TiedLM(nn.Module):
    """Embedding and output head share one weight."""

    def __init__(self, vocab: int = 64, dim: int = 32):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.mid = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(self.emb(tokens))))


class WeightNormLinear(nn.Module):
    """The classic weight_norm pattern: a forward pre-hook recomputes ``weight = g * v / ||v||`` every call."""

    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        self.g = nn.Parameter(torch.ones(d_out, 1))
        self.v = nn.Parameter(torch.randn(d_out, d_in) / d_in**0.5)
        self.register_forward_pre_hook(WeightNormLinear._recompute)

    @staticmethod
    def _recompute(module, args):
        module.weight = module.g * module.v / module.v.norm(dim=1, keepdim=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.weight)


class WeightNormMLP(nn.Module):
    def __init__(self, d: int = 32, hidden: int = 64):
        super().__init__()
        self.fc1 = WeightNormLinear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))
