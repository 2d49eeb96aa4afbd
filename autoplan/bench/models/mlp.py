"""A stack of residual SwiGLU blocks, named as LLaMA's feed-forwards are (``layers.N.feed_forward.
w1/w2/w3``), so that every hand plan applies: the MLP ``bench validate`` checks the cost model on
(``--model autoplan.bench.models.mlp:factory``).

Each block is ``x + w2(silu(w1 x) * w3 x)``: with dim 512 and hidden 2048 on a batch of 2048 rows,
its matmuls and its weights are large enough for DDP, FSDP and tensor parallelism to differ by more
than a CPU's timing noise.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

DIM, HIDDEN, LAYERS, BATCH = 512, 2048, 4, 2048


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.feed_forward = FeedForward(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.feed_forward(x)


class SwiGLUStack(nn.Module):
    def __init__(self, dim: int = DIM, hidden: int = HIDDEN, layers: int = LAYERS):
        super().__init__()
        self.layers = nn.ModuleList(Block(dim, hidden) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def factory(batch: int = BATCH) -> tuple[nn.Module, Callable[[], torch.Tensor]]:
    """The stack on the meta device and a fixed batch of ``batch`` rows (the same on every rank)."""
    with torch.device("meta"):
        model = SwiGLUStack()
    x = torch.randn(batch, DIM, generator=torch.Generator().manual_seed(0))
    return model, lambda: x
