"""``nn.MultiheadAttention`` as the planner traces it: batch first, through the attention kernel.

torch's ``F.multi_head_attention_forward`` works sequence first (``[seq, batch, embed]``, its
``batch_first`` module transposes in and out), so its projections flatten (sequence, batch) with the
sequence outermost. A batch split cannot cross that flatten: DTensor has no placement for every
sequence position's block of rows, so a plan of ``nn.Transformer`` gathered the batch at each
projection and ran attention replicated. Computed batch first, the same projections flatten with the
batch outermost and split like any linear layer's. The attention itself goes to the kernel the
tracing chose for ``F.scaled_dot_product_attention`` (a GPU's, where torch's function would have
called it from inside itself, out of the tracer's sight).

What this form does not cover (attention weights asked for, ``bias_k``/``bias_v``, zero attention,
static keys, per-head 3-D masks, unbatched inputs) is traced by torch's own function.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def _additive(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A mask in ``nn.MultiheadAttention``'s convention (boolean True: not attended) as an additive bias."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.zeros_like(mask, dtype=dtype).masked_fill(mask, float("-inf"))


def _covered(query, need_weights, bias_k, bias_v, add_zero_attn, attn_mask, static_k, static_v) -> bool:
    plain = not need_weights and bias_k is None and bias_v is None and not add_zero_attn
    two_d = attn_mask is None or attn_mask.ndim == 2
    return plain and static_k is None and static_v is None and query.ndim == 3 and two_d


def _projections(query, key, value, in_proj_weight, in_proj_bias, separate, q_w, k_w, v_w):
    if not separate and query is key and key is value:
        return F.linear(query, in_proj_weight, in_proj_bias).chunk(3, dim=-1)
    weights = (q_w, k_w, v_w) if separate else in_proj_weight.chunk(3)
    biases = (None,) * 3 if in_proj_bias is None else in_proj_bias.chunk(3)
    return tuple(F.linear(x, w, b) for x, w, b in zip((query, key, value), weights, biases))


def multi_head_attention_forward(
    attention: Callable,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    embed_dim_to_check: int,
    num_heads: int,
    in_proj_weight: torch.Tensor | None,
    in_proj_bias: torch.Tensor | None,
    bias_k: torch.Tensor | None,
    bias_v: torch.Tensor | None,
    add_zero_attn: bool,
    dropout_p: float,
    out_proj_weight: torch.Tensor,
    out_proj_bias: torch.Tensor | None,
    training: bool = True,
    key_padding_mask: torch.Tensor | None = None,
    need_weights: bool = True,
    attn_mask: torch.Tensor | None = None,
    use_separate_proj_weight: bool = False,
    q_proj_weight: torch.Tensor | None = None,
    k_proj_weight: torch.Tensor | None = None,
    v_proj_weight: torch.Tensor | None = None,
    static_k: torch.Tensor | None = None,
    static_v: torch.Tensor | None = None,
    average_attn_weights: bool = True,
    is_causal: bool = False,
):
    """``F.multi_head_attention_forward`` computed batch first, its attention through ``attention``
    (``F.scaled_dot_product_attention``'s signature); ``None`` where torch's own function must run."""
    if not _covered(query, need_weights, bias_k, bias_v, add_zero_attn, attn_mask, static_k, static_v):
        return None
    if query.shape[-1] != embed_dim_to_check:
        raise ValueError(f"was expecting embedding dimension of {embed_dim_to_check}, but got {query.shape[-1]}")
    if is_causal and attn_mask is None:
        raise RuntimeError("nn.MultiheadAttention's is_causal hint needs an attn_mask, as torch's own function does")
    # batch first: [seq, batch, embed] -> [batch, seq, embed], a view
    q, k, v = _projections(
        *(x.transpose(0, 1) for x in (query, key, value)),
        in_proj_weight,
        in_proj_bias,
        use_separate_proj_weight,
        q_proj_weight,
        k_proj_weight,
        v_proj_weight,
    )
    batch, tgt_len, embed = q.shape
    q, k, v = (x.unflatten(-1, (num_heads, embed // num_heads)).transpose(1, 2) for x in (q, k, v))
    padding = _additive(key_padding_mask, query.dtype)
    mask = None
    if is_causal and padding is None:  # as torch does: the hint alone, the mask left unread
        causal = True
    else:
        causal = False
        mask = _additive(attn_mask, query.dtype)
        if padding is not None:
            padding = padding.view(batch, 1, 1, padding.shape[-1])
            mask = padding if mask is None else mask + padding
    out = attention(q, k, v, attn_mask=mask, dropout_p=dropout_p if training else 0.0, is_causal=causal)
    out = F.linear(out.transpose(1, 2).reshape(batch, tgt_len, embed), out_proj_weight, out_proj_bias)
    return out.transpose(0, 1), None
