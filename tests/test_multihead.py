"""``nn.MultiheadAttention`` traced batch first (``autoplan.trace.multihead``): torch's own encoder
splits the batch where its sequence-first projections kept every op replicated, and steps as one
device does; the cases the batch-first form leaves to torch (attention weights asked for) still do."""

import torch
from gloo_training import batch_split_share
from test_models import run_both
from torch import nn


class Encoder(nn.Module):
    def __init__(self, dim: int = 64, need_weights: bool = False):
        super().__init__()
        layer = nn.TransformerEncoderLayer(dim, 4, 2 * dim, dropout=0.0, activation="gelu", batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.probe = nn.MultiheadAttention(dim, 4, batch_first=True) if need_weights else None
        self.head = nn.Linear(dim, 10)

    def forward(self, x):
        x = self.encoder(x, is_causal=True, mask=nn.Transformer.generate_square_subsequent_mask(x.shape[1]))
        if self.probe is not None:  # asks for the attention weights: torch's own function runs
            x = x + self.probe(x, x, x, need_weights=True)[0]
        return self.head(x)


def _steps(batch: int, seq: int = 16, dim: int = 64):
    g = torch.Generator().manual_seed(3)
    return [torch.randn(batch, seq, dim, generator=g) for _ in range(2)], [
        torch.randn(batch, seq, 10, generator=g) for _ in range(2)
    ]


def test_torch_encoder_splits_the_batch_and_matches_one_device():
    batches, targets = _steps(64)
    plan, collectives, differ = run_both(Encoder, batches, targets)
    assert not differ, differ
    assert batch_split_share(plan) == 1


def test_attention_weights_asked_for_trace_with_torchs_function():
    batches, targets = _steps(8)
    _, _, differ = run_both(lambda: Encoder(need_weights=True), batches, targets)
    assert not differ, differ
