"""``find_repeats``: layers tie only where their ops, shapes and constants all agree."""

import torch
import torch.nn.functional as F
from torch import nn

from autoplan.trace.clustering import find_repeats
from autoplan.trace.tracing import trace_joint


class _Layer(nn.Module):
    def __init__(self, slope: float, dims: tuple[int, ...]) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.slope, self.dims = slope, dims

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.leaky_relu(self.lin(x), self.slope).sum(self.dims, keepdim=True) + x


class _Stack(nn.Module):
    def __init__(self, layers: list[tuple[float, tuple[int, ...]]]) -> None:
        super().__init__()
        self.first = nn.Linear(8, 8)  # the first layer's input takes a gradient too, as the others'
        self.layers = nn.ModuleList(_Layer(*a) for a in layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.first(x)
        for layer in self.layers:
            x = layer(x)
        return x


def _classes(layers) -> tuple:
    with torch.device("meta"):
        model = _Stack(layers)
    return find_repeats(trace_joint(model, lambda: torch.randn(4, 8))).classes


def test_layers_differing_only_in_a_constant_or_an_argument_list_are_not_tied():
    same = [(0.1, (1,))] * 5
    assert _classes(same) == (tuple(f"layers.{i}" for i in range(5)),)
    slope = [*same[:2], (0.2, (1,)), *same[3:]]
    assert _classes(slope) == (("layers.0", "layers.1", "layers.3", "layers.4"),)
    dims = [*same[:2], (0.1, (-1,)), *same[3:]]
    assert _classes(dims) == (("layers.0", "layers.1", "layers.3", "layers.4"),)
