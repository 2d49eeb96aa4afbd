"""A torchtitan-style mixture-of-experts decoder: LLaMA-3's attention and norms, and in each layer
past the first dense ones a token-choice top-k MoE: a router with a load-balancing loss, a shared
expert and SwiGLU routed experts, in one of two forms (``MoEConfig.experts``):

- ``"capacity"``: routing written as expert-parallel code writes it, in ``autoplan.local_map``
  regions: each rank sends its own tokens into its own slots of static per-expert capacity buffers
  ``[E, C, D]`` (``C = ceil(tokens x top_k / E x capacity_factor)`` of the tokens it holds; those
  past an expert's capacity are dropped, as capacity-based MoEs drop them) and reads them back.
  Between the two regions the experts are plain batched matmuls over the buffers, which the planner
  may split over the experts (expert parallel, the buffers moving by all-to-all), inside each
  expert, or not at all.
- ``"grouped"``: written as for one device, as torchtitan's experts are: the routed tokens sorted
  by expert, per-expert offsets, grouped matmuls (``torch._grouped_mm``) and an ``index_add``
  combine. No regions, no capacity, nothing dropped: the planner splits the grouped matmuls over
  the experts (``autoplan.shard.expert_rows``), inside each, or not at all.

The configs' shapes follow the published models; attention is LLaMA's grouped-query attention, not
DeepSeek's MLA.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard

from autoplan.adapters.ops import grouped_mm
from autoplan.bench.models.llama3 import FeedForward, LlamaConfig, RMSNorm, TransformerBlock, rope_tables
from autoplan.trace.regions import local_map


@dataclass(frozen=True)
class MoEConfig(LlamaConfig):
    n_experts: int = 8
    top_k: int = 2
    expert_dim: int = 256  # each routed expert's hidden size
    n_shared: int = 1  # shared experts, as one FFN of ``n_shared * expert_dim``
    n_dense_layers: int = 1  # the first layers keep a dense FFN of ``ffn_dim``
    capacity_factor: float = 1.25
    # count the routed tokens past capacity in each MoE's ``tokens_dropped`` buffer; a model that
    # writes buffers is traced whole (functionalized), not two layers stamped, so planning is slower
    count_dropped: bool = False
    aux_loss_weight: float = 1e-2
    mesh_ndim: int = 2  # the routing regions split tokens over the first mesh dim
    experts: str = "capacity"  # or "grouped" (see the module's docstring)


MOE_CONFIGS: dict[str, MoEConfig] = {
    "debug": MoEConfig(
        dim=64, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=256, ffn_dim=128, max_seq_len=64,
        n_experts=4, top_k=2, expert_dim=32, n_shared=1, n_dense_layers=1,
    ),
    "16b": MoEConfig(  # DeepSeek-V3 16B (DeepSeek-MoE 16B shapes)
        dim=2048, n_layers=27, n_heads=16, n_kv_heads=16, vocab_size=102400, ffn_dim=10944, max_seq_len=4096,
        n_experts=64, top_k=6, expert_dim=1408, n_shared=2, n_dense_layers=1,
    ),
    "30b-a3b": MoEConfig(  # Qwen3-30B-A3B
        dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, vocab_size=151936, ffn_dim=6144, max_seq_len=4096,
        n_experts=128, top_k=8, expert_dim=768, n_shared=0, n_dense_layers=0,
    ),
    "671b": MoEConfig(  # DeepSeek-V3 671B
        dim=7168, n_layers=61, n_heads=128, n_kv_heads=128, vocab_size=129280, ffn_dim=18432, max_seq_len=4096,
        n_experts=256, top_k=8, expert_dim=2048, n_shared=1, n_dense_layers=3,
    ),
}  # fmt: skip
MODEL_NAMES = {"debug": "moe-debug", "16b": "deepseek-v3-16b", "30b-a3b": "qwen3-30b-a3b", "671b": "deepseek-v3-671b"}


class _AddAuxLoss(torch.autograd.Function):
    """``x`` unchanged, and the auxiliary loss's gradient (one) into ``aux``: the load-balancing loss
    joins the training loss without changing the model's output."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        ctx.aux_dtype = aux.dtype
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.ones((), dtype=ctx.aux_dtype, device=grad.device)


def _capacity(tokens: int, cfg: MoEConfig) -> int:
    return max(1, math.ceil(tokens * cfg.top_k / cfg.n_experts * cfg.capacity_factor))


def _dispatch(cfg: MoEConfig):
    rows = (Shard(0),) + (Replicate(),) * (cfg.mesh_ndim - 1)
    slots = (Shard(1),) + (Replicate(),) * (cfg.mesh_ndim - 1)

    @local_map(out_placements=(slots, rows, rows), in_placements=(rows, rows))
    def dispatch(tokens: torch.Tensor, chosen: torch.Tensor):
        """This rank's tokens into its slots of each expert's buffer; a slot past the capacity goes
        to a spare row, dropped. Also returns how many routed tokens this rank dropped (shape [1])."""
        e, k, cap = cfg.n_experts, cfg.top_k, _capacity(tokens.shape[0], cfg)
        flat = chosen.reshape(-1)
        onehot = F.one_hot(flat, e)
        slot = ((onehot.cumsum(0) * onehot).sum(-1) - 1).clamp(max=cap)
        buffer = tokens.new_zeros(e, cap + 1, tokens.shape[1])
        buffer = buffer.index_put((flat, slot), tokens.repeat_interleave(k, 0))
        return buffer[:, :cap], slot, (slot == cap).sum().reshape(1)

    return dispatch


def _combine(cfg: MoEConfig):
    rows = (Shard(0),) + (Replicate(),) * (cfg.mesh_ndim - 1)
    slots = (Shard(1),) + (Replicate(),) * (cfg.mesh_ndim - 1)

    @local_map(out_placements=rows, in_placements=(slots, rows, rows, rows))
    def combine(buffer: torch.Tensor, chosen: torch.Tensor, slot: torch.Tensor, scores: torch.Tensor):
        """Each token's experts' outputs read back from this rank's slots, weighted by its scores
        (a dropped one contributes nothing)."""
        e, cap, d = buffer.shape
        padded = torch.cat([buffer, buffer.new_zeros(e, 1, d)], dim=1)
        routed = padded[chosen.reshape(-1), slot] * scores.reshape(-1, 1)
        return routed.reshape(-1, cfg.top_k, d).sum(1)

    return combine


class MoE(nn.Module):
    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.cfg = cfg
        self.router = nn.Linear(cfg.dim, cfg.n_experts, bias=False)
        self.w1 = nn.Parameter(torch.empty(cfg.n_experts, cfg.dim, cfg.expert_dim))
        self.w3 = nn.Parameter(torch.empty(cfg.n_experts, cfg.dim, cfg.expert_dim))
        self.w2 = nn.Parameter(torch.empty(cfg.n_experts, cfg.expert_dim, cfg.dim))
        shared = LlamaConfig(cfg.dim, 1, 1, 1, 1, cfg.n_shared * cfg.expert_dim) if cfg.n_shared else None
        self.shared = FeedForward(shared) if shared else None
        if cfg.experts == "capacity":
            self.dispatch, self.combine = _dispatch(cfg), _combine(cfg)
        elif cfg.experts != "grouped":
            raise ValueError(f"MoEConfig.experts is 'capacity' or 'grouped', not {cfg.experts!r}")
        # routed tokens (token x choice) past their expert's capacity, summed over steps and ranks
        if cfg.count_dropped:
            self.register_buffer("tokens_dropped", torch.zeros((), dtype=torch.int64), persistent=False)
        with torch.no_grad():
            self.init_weights(0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        tokens = x.reshape(-1, d)
        probs = self.router(tokens).softmax(-1)
        scores, chosen = torch.topk(probs, self.cfg.top_k, dim=-1)
        # load balance: the experts' share of the routed tokens times their mean probability
        share = F.one_hot(chosen, self.cfg.n_experts).sum(1).float().mean(0) / self.cfg.top_k
        aux = self.cfg.aux_loss_weight * self.cfg.n_experts * (share * probs.mean(0)).sum()
        if self.cfg.experts == "grouped":
            y = self._grouped(tokens, chosen, scores).reshape(b, s, d)
        else:
            buffer, slot, dropped = self.dispatch(tokens, chosen)
            if self.cfg.count_dropped:
                self.tokens_dropped.add_(dropped.sum())
            out = torch.bmm(F.silu(torch.bmm(buffer, self.w1)) * torch.bmm(buffer, self.w3), self.w2)
            y = self.combine(out, chosen, slot, scores.to(out.dtype)).reshape(b, s, d)
        if self.shared is not None:
            y = y + self.shared(x)
        return _AddAuxLoss.apply(y, aux)

    def _grouped(self, tokens: torch.Tensor, chosen: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """Every routed (token, choice) row sorted by expert, the experts' SwiGLU as grouped matmuls
        over their runs of rows, each output weighted by its score and added into its token."""
        e, k = self.cfg.n_experts, self.cfg.top_k
        flat = chosen.reshape(-1)
        order = flat.argsort(stable=True)
        offsets = torch.histc(flat.float(), bins=e, min=0, max=e - 1).cumsum(0).to(torch.int32)
        token = order // k
        routed = tokens[token]
        hidden = F.silu(grouped_mm(routed, self.w1, offsets)) * grouped_mm(routed, self.w3, offsets)
        out = grouped_mm(hidden, self.w2, offsets) * scores.reshape(-1)[order, None].to(tokens.dtype)
        return torch.zeros_like(tokens).index_add(0, token, out)

    def init_weights(self, std: float) -> None:
        nn.init.trunc_normal_(self.router.weight, std=0.02)
        if self.cfg.count_dropped:
            self.tokens_dropped.zero_()
        for w, s in ((self.w1, 0.02), (self.w3, std), (self.w2, std)):
            nn.init.trunc_normal_(w, std=s)
        if self.shared is not None:
            self.shared.init_weights(std)


class MoEBlock(TransformerBlock):
    """LLaMA-3's block whose feed-forward, past the first ``n_dense_layers``, is a mixture of experts."""

    def __init__(self, cfg: MoEConfig, layer_id: int):
        super().__init__(cfg, layer_id)
        if layer_id >= cfg.n_dense_layers:
            self.feed_forward = MoE(cfg)


class MoETransformer(nn.Module):
    """Token ids (batch, seq) -> logits (batch, seq, vocab); the load-balancing loss joins the
    training loss through the backward (``_AddAuxLoss``). The dense first layers sit in their own
    list, so the MoE layers are one stack of identical layers (traced as two, then stamped)."""

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.register_buffer("freqs", rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta), persistent=False)
        dense = min(cfg.n_dense_layers, cfg.n_layers)
        self.dense_layers = nn.ModuleList(MoEBlock(cfg, i) for i in range(dense))
        self.layers = nn.ModuleList(MoEBlock(cfg, i) for i in range(dense, cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in (*self.dense_layers, *self.layers):
            h = layer(h, self.freqs)
        return self.output(self.norm(h))

    @torch.no_grad()
    def init_weights(self) -> None:
        """Initialise every parameter and buffer in place; works after ``to_empty`` from meta."""
        self.freqs.copy_(rope_tables(self.cfg.head_dim, self.cfg.max_seq_len, self.cfg.rope_theta, self.freqs.device))
        nn.init.normal_(self.tok_embeddings.weight)
        for layer in (*self.dense_layers, *self.layers):
            layer.init_weights()
        self.norm.init_weights()
        final_std = self.cfg.dim**-0.5
        nn.init.trunc_normal_(self.output.weight, std=final_std, a=-3 * final_std, b=3 * final_std)
