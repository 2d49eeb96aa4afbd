"""FLOPs of one aten call, from shapes alone (fake and meta tensors do): torch's flop counter, with
autoplan's own formulas for attention kernels and grouped matmuls."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.utils.flop_counter import flop_registry

from autoplan.adapters.ops import OpOverload
from autoplan.trace import attention, grouped_mm, regions

aten = torch.ops.aten


def sdpa_flops(q_shape: Sequence[int], k_shape: Sequence[int], v_shape: Sequence[int], is_causal: bool) -> float:
    """QK^T plus PV (2*b*h*s_q*s_kv*(d_qk + d_v)); a causal mask skips about half the blocks.

    ``h`` is the query heads: with grouped-query attention every query head still multiplies
    against a full key/value sequence, whatever the number of key/value heads.
    """
    b, h, s_q, d_qk = q_shape
    s_kv, d_v = k_shape[-2], v_shape[-1]
    flops = 2 * b * h * s_q * s_kv * (d_qk + d_v)
    return flops / 2 if is_causal else flops


def _sdpa_kernel_flops(op: OpOverload, args: Sequence[Any], kwargs: Mapping[str, Any]) -> float:
    """Forward: 2 GEMMs. Backward (flash-style) recomputes the scores and runs four more: 2.5x the forward."""
    spec = attention.SDPA_OPS[op]
    q, k, v = (spec.arg(args, kwargs, role) for role in ("query", "key", "value"))
    flops = sdpa_flops(q.shape, k.shape, v.shape, attention.is_causal(spec, args, kwargs))
    return 2.5 * flops if spec.backward else flops


def grouped_mm_flops(a_shape: Sequence[int], b_shape: Sequence[int]) -> float:
    """``aten._grouped_mm``: each row of a group multiplies only its own expert's matrix, so the
    work counts the rows routed (tokens x top-k), not every expert on every token. Whatever the
    offsets, the groups tile the dim they split, so the total is fixed by the shapes:

    - 2-D x 3-D (tokens grouped by expert, ``[M, K] x [E, K, N]``) and 3-D x 3-D (a batch of
      experts, ``[E, M, K] x [E, K, N]``): each of ``a``'s rows against one ``K x N`` matrix;
    - 2-D x 2-D (the weight gradient, ``[K, M] x [M, N]`` grouped along ``M``): the groups split
      the inner dim, one ``K x N`` product per row of ``b`` in all;
    - 3-D x 2-D (``[E, M, K] x [K, N]`` grouped along ``N``): each group's ``M x K`` against its
      own columns, every column once.
    """
    if len(a_shape) == 3 and len(b_shape) == 2:
        return 2.0 * a_shape[1] * a_shape[2] * b_shape[1]
    if len(a_shape) == 2 and len(b_shape) == 2:
        return 2.0 * a_shape[0] * a_shape[1] * b_shape[1]
    return 2.0 * math.prod(a_shape) * b_shape[-1]


def node_flops(op: OpOverload, args: Sequence[Any], kwargs: Mapping[str, Any], out: Any) -> float:
    """Global FLOPs of one aten call; works on fake/meta tensors since only shapes are read; 0 without a formula.

    Attention kernels use autoplan's formula even where torch's flop counter has one: that one
    ignores the causal mask, which halves the work.
    """
    if op in attention.SDPA_OPS:
        return float(_sdpa_kernel_flops(op, args, kwargs))
    if op in grouped_mm.GROUPED_MM:
        return grouped_mm_flops(args[0].shape, args[1].shape)
    if op in regions.UNTRACED:  # as declared; the backward runs the body again, then twice its work
        return regions.flops_of_body(args[-1]) * (1 if op is regions.UNTRACED[0] else 3)
    packet = op.overloadpacket
    if packet in flop_registry:
        return float(flop_registry[packet](*args, **kwargs, out_val=out))
    return 0.0
