"""FLOPs of one aten call, from shapes alone (fake and meta tensors do): torch's flop counter, with
autoplan's own formula for attention kernels."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch.utils.flop_counter import flop_registry

from autoplan.adapters.ops import OpOverload
from autoplan.trace import attention


def _sdpa_flops(q_shape: Sequence[int], k_shape: Sequence[int], v_shape: Sequence[int], is_causal: bool) -> float:
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
    flops = _sdpa_flops(q.shape, k.shape, v.shape, attention.is_causal(spec, args, kwargs))
    return 2.5 * flops if spec.backward else flops


def node_flops(op: OpOverload, args: Sequence[Any], kwargs: Mapping[str, Any], out: Any) -> float:
    """Global FLOPs of one aten call; works on fake/meta tensors since only shapes are read; 0 without a formula.

    Attention kernels use autoplan's formula even where torch's flop counter has one: that one
    ignores the causal mask, which halves the work.
    """
    if op in attention.SDPA_OPS:
        return float(_sdpa_kernel_flops(op, args, kwargs))
    packet = op.overloadpacket
    if packet in flop_registry:
        return float(flop_registry[packet](*args, **kwargs, out_val=out))
    return 0.0
