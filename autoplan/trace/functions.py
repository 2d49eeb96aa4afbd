"""The torch functions tracing runs as the kernels a GPU runs: ``F.scaled_dot_product_attention``
as one aten attention kernel of the chosen backend, ``F.batch_norm`` with reductions the planner
can split, ``torch._grouped_mm`` in any floating dtype, recurrent layers unrolled over time,
``nn.MultiheadAttention`` batch first and ``F.dropout`` as the fused kernel; and the module path of
the op being traced, which errors name."""

from __future__ import annotations

import torch
import torch.fx.traceback as fx_traceback
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from autoplan.trace import attention as attn
from autoplan.trace import grouped_mm, multihead, recurrent
from autoplan.trace.batch_norm import batch_norm

aten = torch.ops.aten


def current_module_path() -> str:
    """The innermost module whose forward is running (kept by ``_record_module_paths``)."""
    stack = fx_traceback.current_meta.get("nn_module_stack") or {}
    return next(reversed(stack.values()))[0] if stack else ""


def additive_bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An ``attn_mask`` as the kernels' additive bias: boolean masks keep True, drop False (-inf)."""
    if mask.dtype != torch.bool:
        return mask.to(dtype)
    return torch.zeros_like(mask, dtype=dtype).masked_fill(mask.logical_not(), float("-inf"))


def sdpa_kernel_call(
    option: str,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` as one aten kernel, so the graph holds what a GPU runs.

    Flash takes grouped-query keys/values as they are; efficient and cuDNN get them repeated to the
    query's head count, as torch does. Masks become the kernels' additive bias, expanded to the
    scores' 4-D shape.
    """
    where = current_module_path()
    at = f"(module {where or '<top level>'})"
    if query.ndim != 4 or key.ndim != 4 or value.ndim != 4:
        if option == "auto":
            option = "math"  # torch's fused kernels all need 4-D inputs; a GPU runs these on the math path
        elif option != "math":
            raise ValueError(f"attention={option!r} needs 4-D (batch, heads, seq, head_dim) inputs {at}")
    if attn_mask is not None and is_causal:
        raise ValueError(f"scaled_dot_product_attention got both an attn_mask and is_causal=True {at}")
    if key.shape[-3] != query.shape[-3] and not enable_gqa:
        if key.shape[-3] != 1 or value.shape[-3] != 1:
            raise ValueError(f"query has {query.shape[-3]} heads, key/value {key.shape[-3]}: pass enable_gqa=True {at}")
        # one key/value head broadcast over the query heads (multi-query attention written without
        # enable_gqa): torch's fused kernels refuse it, so a GPU runs it on the math path too
        if option not in ("auto", "math"):
            raise ValueError(f"attention={option!r} cannot broadcast one key/value head: pass enable_gqa=True {at}")
        option = "math"
    backend = attn.choose_backend(
        option, query.dtype, query.shape[-1], attn_mask is not None, where, value_head_dim=value.shape[-1]
    )
    if backend == "math":
        # the aten kernel reads a mask as an additive bias: F.scaled_dot_product_attention converts
        # boolean masks before calling it, and so must we
        bias = None if attn_mask is None else additive_bias(attn_mask, query.dtype)
        math = aten._scaled_dot_product_attention_math
        return math(query, key, value, bias, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)[0]
    if backend == "flash":
        return aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal, scale=scale)[0]
    if key.shape[-3] != query.shape[-3]:
        repeats = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(repeats, dim=-3), value.repeat_interleave(repeats, dim=-3)
    bias = None
    if attn_mask is not None:
        scores = (query.shape[0], query.shape[1], query.shape[2], key.shape[2])
        bias = additive_bias(attn_mask, query.dtype).expand(scores)
    lse = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    kernel = attn.FORWARD_KERNELS[backend].op
    return kernel(query, key, value, bias, lse, dropout_p, is_causal, scale=scale)[0]


class TracedFunctions(TorchFunctionMode):
    """While tracing, ``F.scaled_dot_product_attention`` calls the aten kernel ``option`` picks (the
    host's own dispatch for ``"cpu"``), ``F.batch_norm`` computes its statistics with reductions
    the planner can split (``autoplan.trace.batch_norm``), ``torch._grouped_mm`` runs in any
    floating dtype (``autoplan.trace.grouped_mm``), recurrent layers are unrolled over time
    (``autoplan.trace.recurrent``), ``nn.MultiheadAttention`` runs batch first through that
    attention kernel (``autoplan.trace.multihead``) and ``F.dropout`` is the one fused kernel a GPU
    runs (``aten.native_dropout``): the CPU's way, a fresh mask filled in place, would send every
    model training with dropout through the slower functionalizing trace, where Hugging Face's
    checks for tracing no longer see fake tensors and read mask values."""

    def __init__(self, option: str):
        super().__init__()
        self.option = option

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and self.option != "cpu":
            return sdpa_kernel_call(self.option, *args, **kwargs)
        if func is F.batch_norm:
            return batch_norm(*args, **kwargs)
        if func is grouped_mm.aten_grouped_mm:
            return grouped_mm.in_any_dtype(*args, **kwargs)
        if func is F.dropout:
            return fused_dropout(*args, **kwargs)
        if func in recurrent.FUNCTIONS:
            return recurrent.FUNCTIONS[func](*args, **kwargs)
        if func is F.multi_head_attention_forward:
            out = multihead.multi_head_attention_forward(self._attention, *args, **kwargs)
            if out is not None:
                return out
        return func(*args, **kwargs)

    def _attention(self, *args, **kwargs) -> torch.Tensor:
        """``F.scaled_dot_product_attention`` as this mode traces it, for the functions it writes out
        (its own calls are not seen by the mode)."""
        if self.option == "cpu":
            return F.scaled_dot_product_attention(*args, **kwargs)
        return sdpa_kernel_call(self.option, *args, **kwargs)


def fused_dropout(input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> torch.Tensor:
    if not training or p == 0 or inplace:
        return F.dropout(input, p, training, inplace)
    return torch.native_dropout(input, p, True)[0]
