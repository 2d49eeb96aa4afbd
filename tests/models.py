"""Small models shared by the tests."""

import torch
import torch.nn.functional as F
from torch import nn

from autoplan.models.llama3 import LlamaConfig, TransformerBlock, rope_tables


class MLP(nn.Module):
    def __init__(self, d_in: int = 64, hidden: int = 128, d_out: int = 64):
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


class Corners(nn.Module):
    """Parameters a plan must carry as they are: one stored transposed (non-contiguous), one the
    forward never reads (no gradient at all), and a buffer the forward reads."""

    def __init__(self, dim: int = 32, hidden: int = 64):
        super().__init__()
        self.w_in = nn.Parameter(torch.randn(dim, hidden).t())  # (hidden, dim), column-major storage
        self.unused = nn.Linear(dim, dim)
        self.out = nn.Linear(hidden, dim)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(x @ self.w_in.t()) * self.scale)


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


class SelfAttention(nn.Module):
    """Self-attention on (batch, seq, dim) with grouped-query keys/values (``enable_gqa``), causal or
    not, optionally under a sliding-window boolean mask (a buffer) when ``window`` is given."""

    def __init__(
        self, dim: int = 64, heads: int = 8, kv_heads: int = 4, seq: int = 32, causal: bool = True, window=None
    ):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.causal = heads, kv_heads, dim // heads, causal
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        pos = torch.arange(seq)
        self.register_buffer("mask", None if window is None else (pos[:, None] - pos[None, :]).abs() < window)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask, is_causal=self.causal, enable_gqa=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))
