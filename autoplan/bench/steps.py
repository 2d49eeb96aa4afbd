"""What every benchmark that runs a training step shares: the loss it backpropagates through, and
how it counts the bytes a rank keeps between steps."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch.distributed.tensor import DTensor


class DenseSum(torch.autograd.Function):
    """A loss shaped like cross-entropy's memory, with none of its own: the forward frees the
    logits (nothing saved) and the backward hands them a dense gradient of their size. ``mean``
    would upcast bf16 logits to an fp32 copy on CPU, a cost of the bench and not of the plan."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor) -> torch.Tensor:
        ctx.shape = logits.shape
        return logits.sum()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.expand(ctx.shape).contiguous()


def backward_step(model: Callable[[torch.Tensor], torch.Tensor], inputs: torch.Tensor) -> None:
    """One forward and backward of ``model`` (a module, or what compiled it) on ``inputs`` through ``DenseSum``."""
    DenseSum.apply(model(inputs)).backward()


def kept_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the storages behind ``tensors`` (a DTensor counts its local shard), each storage once."""
    local = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
    return sum({id(s): s.nbytes() for s in (t.untyped_storage() for t in local)}.values())
