"""Small models shared by the tests."""

import torch
import torch.nn.functional as F
from torch import nn

from autoplan.bench.models.llama3 import LlamaConfig, TransformerBlock, rope_tables


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
    not, optionally under a sliding-window boolean mask (a buffer) when ``window`` is given, or with
    a learned additive bias per head and position pair (T5's position bias) when ``learned_bias``."""

    def __init__(
        self,
        dim: int = 64,
        heads: int = 8,
        kv_heads: int = 4,
        seq: int = 32,
        causal: bool = True,
        window=None,
        learned_bias: bool = False,
    ):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.causal = heads, kv_heads, dim // heads, causal
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        pos = torch.arange(seq)
        self.register_buffer("mask", None if window is None else (pos[:, None] - pos[None, :]).abs() < window)
        self.bias = nn.Parameter(torch.randn(heads, seq, seq) * 0.5) if learned_bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        mask = self.mask if self.bias is None else self.bias
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=self.causal, enable_gqa=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class BasicBlock(nn.Module):
    """A ResNet basic block: two 3x3 convolutions with BatchNorm, a projected shortcut when the width
    or stride changes; ``act`` is the activation (ReLU, or a smooth one for fp32 comparisons)."""

    def __init__(self, c_in: int, c_out: int, stride: int = 1, act=F.relu):
        super().__init__()
        self.act = act
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut = nn.Sequential()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.act(self.bn1(self.conv1(x)))
        return self.act(self.bn2(self.conv2(y)) + self.shortcut(x))


class ResNet(nn.Module):
    """A small ResNet as users write it: a stem, BasicBlocks of growing widths in one ``nn.Sequential``
    (same class, different shapes), global pooling and a classifier with a class count no mesh splits.
    ``smooth`` puts SiLU where ReLU was: fp32 runs that sum in different orders then differ by rounding
    only, where ReLU's derivative jumps for a value within rounding of 0."""

    def __init__(self, widths=(8, 16, 32), blocks_per_width: int = 2, classes: int = 10, smooth: bool = False):
        super().__init__()
        act = F.silu if smooth else F.relu
        stem_act = nn.SiLU() if smooth else nn.ReLU()
        self.stem = nn.Sequential(nn.Conv2d(3, widths[0], 3, 1, 1, bias=False), nn.BatchNorm2d(widths[0]), stem_act)
        blocks, c_in = [], widths[0]
        for i, c in enumerate(widths):
            for j in range(blocks_per_width):
                blocks.append(BasicBlock(c_in, c, stride=2 if i > 0 and j == 0 else 1, act=act))
                c_in = c
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(c_in, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.blocks(self.stem(x)).mean(dim=(2, 3)))


class ViT(nn.Module):
    """A small vision transformer: patch embedding, a class token, 197 learned positions (14x14 patches
    and the class token: no mesh of 2 or 4 splits them), pre-norm encoder layers, a head on the token."""

    def __init__(self, image: int = 56, patch: int = 4, dim: int = 32, heads: int = 4, layers: int = 2, classes=10):
        super().__init__()
        self.patch = nn.Conv2d(3, dim, patch, patch)
        self.cls = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.pos = nn.Parameter(torch.randn(1, (image // patch) ** 2 + 1, dim) * 0.02)
        layer = lambda: nn.TransformerEncoderLayer(  # noqa: E731
            dim, heads, 2 * dim, dropout=0.0, activation="gelu", batch_first=True, norm_first=True
        )
        self.encoder = nn.ModuleList([layer() for _ in range(layers)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.patch(x).flatten(2).transpose(1, 2)
        tokens = torch.cat([self.cls.expand(x.shape[0], -1, -1), tokens], dim=1) + self.pos
        for layer in self.encoder:
            tokens = layer(tokens)
        return self.head(self.norm(tokens[:, 0]))


class EncDec(nn.Module):
    """A T5-like encoder-decoder called with keywords: ``forward(input_ids, decoder_input_ids,
    attention_mask=None, scale=1.0)``; the mask is optional and a Python float scales the logits."""

    def __init__(self, vocab: int = 64, dim: int = 32, heads: int = 4):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.encoder = nn.TransformerEncoderLayer(dim, heads, 2 * dim, dropout=0.0, batch_first=True)
        self.decoder = nn.TransformerDecoderLayer(dim, heads, 2 * dim, dropout=0.0, batch_first=True)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, input_ids, decoder_input_ids, attention_mask=None, scale: float = 1.0):
        memory = self.embed(input_ids)
        if attention_mask is not None:
            memory = memory * attention_mask.unsqueeze(-1)
        memory = self.encoder(memory)
        out = self.decoder(self.embed(decoder_input_ids), memory)
        return self.lm_head(out) * scale


class _Square(torch.autograd.Function):
    """x**2 with a hand-written backward (2x * grad)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return 2 * x * grad


class CheckpointedMLP(nn.Module):
    """Layers run under ``torch.utils.checkpoint`` through closures over the layer, with a custom
    ``autograd.Function`` inside."""

    def __init__(self, dim: int = 32, hidden: int = 64, layers: int = 3):
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, hidden), nn.Linear(hidden, dim)) for _ in range(layers)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        for layer in self.layers:

            def block(h, layer=layer):
                return h + layer[1](_Square.apply(torch.tanh(layer[0](h))))

            x = checkpoint(block, x, use_reentrant=False)
        return x


class GroupedMoE(nn.Module):
    """A token-choice top-k mixture of experts as torchtitan writes one: a router, tokens sorted by
    expert, per-expert counts and offsets, SwiGLU experts as grouped matmuls, the outputs scattered
    back weighted by the router's scores, and a shared expert beside them."""

    def __init__(self, dim: int = 32, hidden: int = 32, experts: int = 4, top_k: int = 2):
        super().__init__()
        self.experts, self.top_k = experts, top_k
        self.router = nn.Linear(dim, experts, bias=False)
        self.w1 = nn.Parameter(torch.randn(experts, dim, hidden) / dim**0.5)
        self.w3 = nn.Parameter(torch.randn(experts, dim, hidden) / dim**0.5)
        self.w2 = nn.Parameter(torch.randn(experts, hidden, dim) / hidden**0.5)
        self.shared = MLP(dim, hidden, dim)

    def forward(self, x):
        b, s, d = x.shape
        tokens = x.reshape(-1, d)
        scores, chosen = torch.topk(self.router(tokens).softmax(-1), self.top_k, dim=-1)
        order = chosen.reshape(-1).argsort(stable=True)
        counts = torch.histc(chosen.reshape(-1).float(), bins=self.experts, min=0, max=self.experts - 1)
        offs = counts.cumsum(0).to(torch.int32)
        routed = tokens[order // self.top_k]
        h = F.silu(torch._grouped_mm(routed, self.w1, offs)) * torch._grouped_mm(routed, self.w3, offs)
        out = torch._grouped_mm(h, self.w2, offs) * scores.reshape(-1)[order, None]
        combined = torch.zeros_like(tokens).index_add(0, order // self.top_k, out)
        return (x + combined.reshape(b, s, d) + self.shared(x)).sum(-1)


class LocalRegionMLP(nn.Module):
    """An MLP whose middle runs in an ``autoplan.local_map`` region: row by row (so as on one device),
    on rows split over the mesh's first dim, with a weight it reads whole."""

    def __init__(self, dim: int = 32):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.scale = nn.Parameter(torch.randn(dim))

    def forward(self, x):
        from torch.distributed.tensor import Partial, Replicate, Shard

        from autoplan import local_map

        rows, whole = (Shard(0), Replicate()), (Replicate(), Replicate())

        # each rank's rows read the whole weight: its gradient there is a partial sum over the
        # ranks that split the rows, and the same on those that do not
        grads = (rows, (Partial(), Replicate()))

        @local_map(out_placements=rows, in_placements=(rows, whole), in_grad_placements=grads)
        def middle(h, scale):
            return F.gelu(h) * scale + h.pow(2).mean(-1, keepdim=True)

        return self.fc2(middle(self.fc1(x), self.scale))


class DataDependentMLP(nn.Module):
    """An MLP whose middle, an untraced ``autoplan.local_map`` region, transforms only the rows
    with a positive sum (nonzero and boolean indexing: shapes that depend on the data) and passes
    the others through, on rows split over the mesh's first dim."""

    def __init__(self, dim: int = 32):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.mix = nn.Parameter(torch.randn(dim, dim) / dim**0.5)

    def forward(self, x):
        from torch.distributed.tensor import Partial, Replicate, Shard

        from autoplan import local_map

        rows, whole = (Shard(0), Replicate()), (Replicate(), Replicate())
        grads = (rows, (Partial(), Replicate()))

        @local_map(out_placements=rows, in_placements=(rows, whole), in_grad_placements=grads, traced=False)
        def middle(h, mix):
            chosen = (h.sum(-1) > 0).nonzero().squeeze(-1)
            picked = h[h.sum(-1) > 0]
            return h.index_put((chosen,), torch.tanh(picked @ mix))

        return self.fc2(middle(self.fc1(x), self.mix))


class CapacityMoE(nn.Module):
    """A top-k mixture of experts whose routing runs in ``autoplan.local_map`` regions, as expert
    parallel code routes: each rank sends its own tokens into per-expert capacity buffers
    ``[E, C, D]`` (dispatch) and reads them back (combine); between them the experts' batched
    matmuls, which the planner may split over the experts (expert parallel: the buffers move from
    split by capacity, each rank's own slots, to split by expert, by all-to-all), inside each
    expert, or not at all. The capacity holds every token routed (nothing is dropped), so a plan
    computes what one device does."""

    def __init__(self, dim: int = 32, hidden: int = 64, experts: int = 4, top_k: int = 2):
        super().__init__()
        self.experts, self.top_k = experts, top_k
        self.router = nn.Linear(dim, experts, bias=False)
        self.w1 = nn.Parameter(torch.randn(experts, dim, hidden) / dim**0.5)
        self.w2 = nn.Parameter(torch.randn(experts, hidden, dim) / hidden**0.5)

    def forward(self, x):
        from torch.distributed.tensor import Replicate, Shard

        from autoplan import local_map

        b, s, d = x.shape
        e, k = self.experts, self.top_k
        rows, slots = (Shard(0), Replicate()), (Shard(1), Replicate())
        tokens = x.reshape(-1, d)

        @local_map(out_placements=(slots, rows, rows, rows), in_placements=(rows, rows))
        def dispatch(tokens, logits):
            scores, chosen = torch.topk(logits.softmax(-1), k, dim=-1)
            chosen = chosen.reshape(-1)
            onehot = F.one_hot(chosen, e)
            slot = (onehot.cumsum(0) * onehot).sum(-1) - 1  # each routed token's place in its expert
            buffer = tokens.new_zeros(e, tokens.shape[0] * k, d)
            buffer = buffer.index_put((chosen, slot), tokens.repeat_interleave(k, 0))
            return buffer, chosen, slot, scores.reshape(-1)

        @local_map(out_placements=rows, in_placements=(slots, rows, rows, rows))
        def combine(buffer, chosen, slot, scores):
            routed = buffer[chosen, slot] * scores[:, None]
            return routed.reshape(-1, k, d).sum(1)

        buffer, chosen, slot, scores = dispatch(tokens, self.router(tokens))
        out = torch.bmm(F.gelu(torch.bmm(buffer, self.w1)), self.w2)
        return (x + combine(out, chosen, slot, scores).reshape(b, s, d)).sum(-1)


class ResNet18(nn.Module):
    """ResNet-18 as torchvision lays it out: a 7x7 stride-2 stem, max pooling, four stages of two
    BasicBlocks (64 to 512 channels), global average pooling and a classifier."""

    def __init__(self, classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        stages, c_in = [], 64
        for i, c in enumerate((64, 128, 256, 512)):
            stages.append(nn.Sequential(BasicBlock(c_in, c, 1 if i == 0 else 2), BasicBlock(c, c)))
            c_in = c
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.fc = nn.Linear(512, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(F.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class LSTMLanguageModel(nn.Module):
    """Token embeddings, a two-layer ``nn.LSTM`` (batch first, dropout between the layers off) and a
    head over the vocabulary."""

    def __init__(self, vocab: int = 96, dim: int = 32, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.lstm = nn.LSTM(dim, dim, num_layers=layers, batch_first=True)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(self.embed(ids))[0])


class TorchTransformerSeq2Seq(nn.Module):
    """A sequence-to-sequence model around torch's own ``nn.Transformer``: embeddings, one encoder
    and one decoder layer, an output head. ``forward`` builds the float causal ``tgt_mask`` from
    factory ops (``torch.triu(torch.full(...))``, or ``nn.Transformer.generate_square_subsequent_mask``
    with ``square_mask=True``), which ``nn.Transformer`` reads to detect that it is causal, and takes
    a boolean ``src_key_padding_mask`` (True where a source position is padding) as an input. With
    ``window``, each target position also sees only the ``window`` positions up to it: the mask is
    not causal, so ``nn.Transformer`` attends with it rather than with the causal kernel. ``activation``
    is the feed-forward's (``nn.Transformer``'s default ReLU, or GELU for fp32 comparisons free of its
    kink)."""

    def __init__(
        self, vocab: int = 64, dim: int = 32, square_mask: bool = False, window: int | None = None, activation="relu"
    ):
        super().__init__()
        self.square_mask, self.window = square_mask, window
        self.src_embed = nn.Embedding(vocab, dim)
        self.tgt_embed = nn.Embedding(vocab, dim)
        self.transformer = nn.Transformer(
            d_model=dim,
            nhead=4,
            num_encoder_layers=1,
            num_decoder_layers=1,
            dim_feedforward=64,
            dropout=0.0,
            activation=activation,
            batch_first=True,
        )
        self.head = nn.Linear(dim, vocab)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor, src_key_padding_mask: torch.Tensor) -> torch.Tensor:
        s = tgt.shape[1]
        if self.square_mask:
            tgt_mask = nn.Transformer.generate_square_subsequent_mask(s)
        else:
            tgt_mask = torch.triu(torch.full((s, s), float("-inf")), 1)
        if self.window is not None:
            tgt_mask = tgt_mask + torch.tril(torch.full((s, s), float("-inf")), -self.window)
        hidden = self.transformer(
            self.src_embed(src), self.tgt_embed(tgt), tgt_mask=tgt_mask, src_key_padding_mask=src_key_padding_mask
        )
        return self.head(hidden)


class StochasticDepthNet(nn.Module):
    """Convolutional residual blocks whose branch each sample keeps with probability ``keep``, as
    torchvision's ``StochasticDepth(mode="row")`` does it: a [B, 1, 1, 1] mask drawn with
    ``bernoulli_`` and scaled by 1/keep in training, nothing dropped in eval. GELU keeps fp32
    comparisons free of ReLU's kink."""

    def __init__(self, channels: int = 16, blocks: int = 2, keep: float = 0.7, classes: int = 10):
        super().__init__()
        self.keep = keep
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.branches = nn.ModuleList(
            nn.Sequential(
                nn.Conv2d(channels, channels, 3, padding=1), nn.GELU(), nn.Conv2d(channels, channels, 1, bias=False)
            )
            for _ in range(blocks)
        )
        self.head = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for branch in self.branches:
            y = branch(x)
            if self.training:
                mask = torch.empty([x.shape[0], 1, 1, 1], dtype=x.dtype, device=x.device).bernoulli_(self.keep)
                y = y * mask.div_(self.keep)
            x = x + y
        return self.head(x.mean((2, 3)))


class BagRecommender(nn.Module):
    """A DLRM-style recommender: two sparse features pooled by ``nn.EmbeddingBag`` (a sum over a
    user's items, a mean over an item's tags), a dense feature projected to the same width, their
    pairwise dot products beside the dense projection, and an MLP scoring the sample."""

    def __init__(self, items: int = 200, tags: int = 50, dense: int = 8, dim: int = 16):
        super().__init__()
        self.items = nn.EmbeddingBag(items, dim, mode="sum")
        self.tags = nn.EmbeddingBag(tags, dim, mode="mean")
        self.dense = nn.Linear(dense, dim)
        self.mlp = nn.Sequential(nn.Linear(dim + 3, 32), nn.GELU(), nn.Linear(32, 1))

    def forward(self, item_ids: torch.Tensor, tag_ids: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        a, b, d = self.items(item_ids), self.tags(tag_ids), self.dense(dense)
        dots = torch.stack([(a * b).sum(-1), (a * d).sum(-1), (b * d).sum(-1)], dim=-1)
        return self.mlp(torch.cat([d, dots], dim=-1))
