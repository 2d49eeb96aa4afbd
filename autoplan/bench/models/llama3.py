"""A compact LLaMA-3 (RMSNorm, RoPE, GQA attention via SDPA, SwiGLU FFN, untied head).

Written to be traced: no data-dependent control flow, buffers built in ``init_weights`` so the
model can be created on ``meta`` and materialised later with ``to_empty`` + ``init_weights``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class LlamaConfig:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    ffn_dim: int
    max_seq_len: int = 8192
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


LLAMA3_CONFIGS: dict[str, LlamaConfig] = {
    "debug": LlamaConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, ffn_dim=128, max_seq_len=64),
    # the LLaMA-style model the CPU measurements use (validate, overhead): big enough that compute, not
    # dispatch, takes most of a step on two cores
    "small": LlamaConfig(dim=512, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=8192, ffn_dim=1536, max_seq_len=256),
    "8b": LlamaConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256, ffn_dim=14336),
    "70b": LlamaConfig(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=128256, ffn_dim=28672),
}


def rope_tables(head_dim: int, seq_len: int, theta: float, device=None) -> torch.Tensor:
    """Real-valued (seq, head_dim // 2, 2) cos/sin table; complex buffers do not shard or trace well."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    ang = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv)
    return torch.stack([ang.cos(), ang.sin()], dim=-1)


def apply_rope(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Rotate pairs of channels of ``x`` (batch, seq, heads, head_dim) by the table ``freqs``, in
    fp32 (the table's dtype) and back to ``x``'s dtype, as a mixed-precision step computes it."""
    b, s, h, d = x.shape
    xr = x.float().reshape(b, s, h, d // 2, 2)
    cos = freqs[:s, None, :, 0]
    sin = freqs[:s, None, :, 1]
    x0, x1 = xr[..., 0], xr[..., 1]
    out = torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1)
    return out.reshape(b, s, h, d).type_as(x)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalized in fp32 and cast back before the scale, as mixed-precision training runs it."""
        y = x.float()
        return (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight

    def init_weights(self) -> None:
        nn.init.ones_(self.weight)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.n_heads, self.head_dim)
        k = self.wk(x).view(b, s, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(b, s, self.n_kv_heads, self.head_dim)
        q, k = apply_rope(q, freqs), apply_rope(k, freqs)
        rep = self.n_heads // self.n_kv_heads
        if rep > 1:
            k = k.repeat_interleave(rep, dim=2)
            v = v.repeat_interleave(rep, dim=2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))

    def init_weights(self, std: float) -> None:
        for lin in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(lin.weight, std=0.02)
        nn.init.trunc_normal_(self.wo.weight, std=std)


class FeedForward(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def init_weights(self, std: float) -> None:
        nn.init.trunc_normal_(self.w1.weight, std=0.02)
        nn.init.trunc_normal_(self.w2.weight, std=std)
        nn.init.trunc_normal_(self.w3.weight, std=std)


class TransformerBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer_id: int):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)
        self.init_std = 0.02 / math.sqrt(2 * (layer_id + 1))

    def forward(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs)
        return h + self.feed_forward(self.ffn_norm(h))

    def init_weights(self) -> None:
        self.attention_norm.init_weights()
        self.ffn_norm.init_weights()
        self.attention.init_weights(self.init_std)
        self.feed_forward.init_weights(self.init_std)


class Transformer(nn.Module):
    """Token ids (batch, seq) -> logits (batch, seq, vocab)."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.register_buffer("freqs", rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta), persistent=False)
        self.layers = nn.ModuleList(TransformerBlock(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, self.freqs)
        return self.output(self.norm(h))

    @torch.no_grad()
    def init_weights(self) -> None:
        """Initialise every parameter and buffer in place; works after ``to_empty`` from meta."""
        self.freqs.copy_(rope_tables(self.cfg.head_dim, self.cfg.max_seq_len, self.cfg.rope_theta, self.freqs.device))
        nn.init.normal_(self.tok_embeddings.weight)
        for layer in self.layers:
            layer.init_weights()
        self.norm.init_weights()
        final_std = self.cfg.dim**-0.5
        nn.init.trunc_normal_(self.output.weight, std=final_std, a=-3 * final_std, b=3 * final_std)
