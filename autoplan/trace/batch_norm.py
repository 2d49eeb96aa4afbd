"""Batch normalisation as the planner traces it: statistics from plain reductions.

``F.batch_norm`` in training mode traces to one fused aten kernel that DTensor cannot split over the
batch: the statistics need every sample. Written as per-channel means over the batch and spatial
dims, the same computation splits like any reduction: each rank reduces its shard and an all-reduce
of one value per channel over the ranks that split the batch completes it (what ``SyncBatchNorm``
does by hand), priced by the planner like any other collective. The step then equals one device's:
statistics over the global batch, and the running statistics updated from them (the variance
unbiased by the global count).

The backward is written out too (``_BatchNorm``): differentiating the means would broadcast each
channel's partial sum back over the whole activation, which no batch split can then use; the
closed form reduces to per-channel values first, so the activations' gradients stay split.
"""

from __future__ import annotations

import torch


def _channel(x: torch.Tensor) -> list[int]:
    return [1, -1] + [1] * (x.ndim - 2)


class _BatchNorm(torch.autograd.Function):
    """Training-mode normalisation with batch statistics: returns (y, mean, biased variance)."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        dims = [0, *range(2, x.ndim)]
        mean = x.mean(dims, keepdim=True)
        centered = x - mean
        var = centered.square().mean(dims, keepdim=True)
        invstd = torch.rsqrt(var + eps)
        y = centered * invstd
        if weight is not None:
            y = y * weight.view(_channel(x))
        if bias is not None:
            y = y + bias.view(_channel(x))
        ctx.save_for_backward(x, mean, invstd, weight)
        ctx.has_bias = bias is not None
        ctx.mark_non_differentiable(mean, var)
        return y, mean.flatten(), var.flatten()

    @staticmethod
    def backward(ctx, grad_y, _grad_mean, _grad_var):
        x, mean, invstd, weight = ctx.saved_tensors
        dims = [0, *range(2, x.ndim)]
        xhat = (x - mean) * invstd
        grad_xhat = grad_y if weight is None else grad_y * weight.view(_channel(x))
        grad_x = None
        if ctx.needs_input_grad[0]:
            mean_grad = grad_xhat.mean(dims, keepdim=True)
            mean_grad_xhat = (grad_xhat * xhat).mean(dims, keepdim=True)
            grad_x = (grad_xhat - mean_grad - xhat * mean_grad_xhat) * invstd
        grad_w = (grad_y * xhat).sum(dims) if weight is not None and ctx.needs_input_grad[1] else None
        grad_b = grad_y.sum(dims) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b, None


def batch_norm(
    x: torch.Tensor,
    running_mean: torch.Tensor | None,
    running_var: torch.Tensor | None,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    training: bool = False,
    momentum: float | None = 0.1,
    eps: float = 1e-5,
) -> torch.Tensor:
    """``F.batch_norm`` from reductions and pointwise ops, updating the running statistics in place as
    it does (the module passes its cumulative factor as ``momentum`` when its own is ``None``)."""
    channel = _channel(x)
    if training or running_mean is None:
        y, mean, var = _BatchNorm.apply(x, weight, bias, eps)
        if training and running_mean is not None:
            count = x.numel() // x.shape[1]
            factor = 0.0 if momentum is None else momentum
            with torch.no_grad():
                running_mean.mul_(1 - factor).add_(mean, alpha=factor)
                running_var.mul_(1 - factor).add_(var * (count / max(count - 1, 1)), alpha=factor)
        return y
    y = (x - running_mean.view(channel)) * torch.rsqrt(running_var + eps).view(channel)
    if weight is not None:
        y = y * weight.view(channel)
    if bias is not None:
        y = y + bias.view(channel)
    return y
