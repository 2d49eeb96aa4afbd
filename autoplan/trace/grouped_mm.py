"""``torch._grouped_mm`` in every floating dtype: the product MoE experts run, one matmul per group.

ATen's grouped matmul takes bfloat16 only (its meta kernel checks), so an fp32 MoE, the dtype its
numerics are checked in, cannot be traced with it, nor run on CPU. While tracing, a call in
another dtype becomes ``autoplan::grouped_mm``: the same product with the same layouts, computed
group by group, with its backward in terms of itself. The planner splits and prices it as the
ATen op (``shard.strategies._grouped_mm_rows``, ``flops.grouped_mm_flops``), and the lowered
program runs it on each rank's shards, or, split over the experts, on the rank's block of experts
(``expert_block``). bfloat16 calls stay ATen's.

Layouts (``offs``: the groups' cumulative ends along the grouped dim):
- 2-D x 3-D: ``[M, K] x [E, K, N] -> [M, N]``, rows grouped (tokens sorted by expert);
- 3-D x 3-D: ``[E, M, K] x [E, K, N] -> [E, M, N]``, no offsets;
- 2-D x 2-D: ``[K, M] x [M, N] -> [E, K, N]``, the inner dim grouped (the experts' weight gradient);
- 3-D x 2-D: ``[E, M, K] x [K, N] -> [M, N]``, the columns grouped.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from torch.distributed.tensor import Shard
from torch.overrides import TorchFunctionMode

from autoplan.adapters.dtensor import share_rule
from autoplan.adapters.ops import check
from autoplan.adapters.ops import grouped_mm as aten_grouped_mm

aten = torch.ops.aten


def _out_shape(a: Tensor, b: Tensor, offs: Tensor | None) -> tuple[int, ...]:
    if a.dim() == 2 and b.dim() == 3:
        return (a.shape[0], b.shape[2])
    if a.dim() == 3 and b.dim() == 3:
        return (a.shape[0], a.shape[1], b.shape[2])
    if a.dim() == 2 and b.dim() == 2:
        return (offs.shape[0], a.shape[0], b.shape[1])
    return (a.shape[1], b.shape[1])


@torch.library.custom_op("autoplan::grouped_mm", mutates_args=())
def grouped_mm(a: Tensor, b: Tensor, offs: Tensor | None = None) -> Tensor:
    """``torch._grouped_mm(a, b, offs)`` in ``a``'s dtype, one matmul per group; rows or columns
    past the last offset are zero."""
    if offs is None:
        return torch.bmm(a, b)
    out = a.new_zeros(_out_shape(a, b, offs))
    start = 0
    for g, end in enumerate(offs.tolist()):
        if a.dim() == 2 and b.dim() == 3:
            out[start:end] = a[start:end] @ b[g]
        elif a.dim() == 2:
            out[g] = a[:, start:end] @ b[start:end]
        else:
            out[:, start:end] = a[g] @ b[:, start:end]
        start = end
    return out


@grouped_mm.register_fake
def _(a: Tensor, b: Tensor, offs: Tensor | None = None) -> Tensor:
    check(a.dim() in (2, 3) and b.dim() in (2, 3), lambda: "grouped_mm multiplies 2-D or 3-D tensors")
    check(offs is not None or (a.dim() == 3 and b.dim() == 3), lambda: "grouped_mm needs offsets here")
    return a.new_empty(_out_shape(a, b, offs))


def _backward(ctx, grad: Tensor):
    a, b, offs = ctx.saved_tensors if ctx.has_offs else (*ctx.saved_tensors, None)
    t = lambda x: x.transpose(-2, -1)  # noqa: E731
    if a.dim() == 2 and b.dim() == 3:  # rows grouped: each row's gradient through its own expert
        grad_a, grad_b = grouped_mm(grad, t(b), offs), grouped_mm(t(a), grad, offs)
    elif a.dim() == 3 and b.dim() == 3:
        grad_a, grad_b = grouped_mm(grad, t(b)), grouped_mm(t(a), grad)
    elif a.dim() == 2:  # inner dim grouped
        grad_a, grad_b = grouped_mm(grad, t(b), offs), grouped_mm(t(a), grad, offs)
    else:  # columns grouped
        grad_a, grad_b = grouped_mm(grad, t(b), offs), grouped_mm(t(a), grad, offs)
    return grad_a, grad_b, None


def _setup_context(ctx, inputs, output) -> None:
    a, b, offs = inputs
    ctx.has_offs = offs is not None
    ctx.save_for_backward(a, b, *([offs] if offs is not None else []))


grouped_mm.register_autograd(_backward, setup_context=_setup_context)
share_rule(torch.ops.autoplan.grouped_mm.default, aten._grouped_mm.default)


GROUPED_MM = (aten._grouped_mm.default, torch.ops.autoplan.grouped_mm.default)


def expert_mesh_dims(node, inputs: Sequence, outputs: Sequence) -> list[int]:
    """The mesh dims that the placements ``inputs`` and ``outputs`` of the traced op ``node`` split
    its experts over (the expert-parallel row of a grouped matmul's rule): the experts' weights
    (2-D x 3-D) or the weight gradient (2-D x 2-D) split on dim 0; none for any other op."""
    if node.target not in GROUPED_MM:
        return []
    a, b = (x.meta["val"] for x in node.args[:2])
    if a.dim() != 2:
        return []
    split = inputs[1] if b.dim() == 3 else outputs[0]
    return [d for d, p in enumerate(split) if p == Shard(0)]


def expert_block(op, a: Tensor, b: Tensor, offs: Tensor, block: Tensor, n_local: int) -> Tensor:
    """One rank's part of a grouped matmul whose experts are split: the groups ``block * n_local``
    to ``(block + 1) * n_local`` of ``op(a, b, offs)`` (``block``, a 0-d tensor, is the rank's
    expert block), where ``a`` (and ``b`` for 2-D x 2-D) hold every group.

    - 2-D x 3-D (``b``: this rank's experts): the rows of those groups, every other row zero; the
      ranks' results sum to the whole product.
    - 2-D x 2-D (the experts' weight gradient): those groups' products, the rank's shard of the
      ``[E, K, N]`` output.

    Tokens are sorted by expert, so the block's rows are one contiguous run that starts at a
    data-dependent row. It is rotated to row 0 by an index (no host sync, static shapes), multiplied
    by the local groups, and rotated back. Only the block's rows are multiplied: expert parallelism
    divides the work as it divides the weights.
    """
    rows = a.shape[0] if b.dim() == 3 else a.shape[1]
    bounds = torch.cat([offs.new_zeros(1), offs])
    ends = bounds.index_select(0, block * n_local + 1 + torch.arange(n_local, device=offs.device))
    start = bounds.index_select(0, (block * n_local).reshape(1))
    row = torch.arange(rows, device=a.device)
    shift = (row + start) % rows
    if b.dim() == 2:  # the grouped dim is a's columns and b's rows
        return op(a.index_select(1, shift), b.index_select(0, shift), ends - start)
    out = op(a.index_select(0, shift), b, ends - start).index_select(0, (row - start) % rows)
    mine = (row >= start) & (row < ends[-1])
    return torch.where(mine.unsqueeze(1), out, out.new_zeros(()))


def in_any_dtype(a: Tensor, b: Tensor, offs: Tensor | None = None, bias=None, out_dtype=None) -> Tensor:
    """``torch._grouped_mm``'s call: ATen's kernel for bfloat16, ``autoplan::grouped_mm`` otherwise."""
    if a.dtype == torch.bfloat16 or bias is not None or (out_dtype is not None and out_dtype != a.dtype):
        return aten_grouped_mm(a, b, offs, bias=bias, out_dtype=out_dtype)
    return grouped_mm(a, b, offs)


class any_dtype(TorchFunctionMode):  # noqa: N801 (used as a context manager, like torch's modes)
    """Within it, ``torch._grouped_mm`` runs in every floating dtype (``in_any_dtype``): an fp32 MoE
    runs eagerly on CPU, e.g. as the single-device reference of a plan's numerics."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is aten_grouped_mm:
            return in_any_dtype(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))
