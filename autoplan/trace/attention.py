"""What autoplan knows about the scaled-dot-product-attention op family.

Strategies, costs, tracing and lowering all need to know, for each aten SDPA kernel, which argument
is the query, key, value, bias, ... and which output is which; they read it here rather than from
each other. The table also names each GPU kernel's host twin (the CPU flash op computing the same
values), which lets a plan made with GPU kernels run on a CPU mesh.

Argument roles are schema argument names mapped to a common vocabulary, so a new overload only
needs a row here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch

from autoplan.adapters.ops import OpOverload, schema
from autoplan.adapters.pytree import tree_flatten

aten = torch.ops.aten

BACKENDS = ("flash", "efficient", "cudnn", "math", "cpu")
OPTIONS = ("auto", *BACKENDS)
FLASH_MAX_HEAD_DIM = 256
FLASH_HEAD_DIM_MULTIPLE = 8
_LOW_PRECISION = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class SdpaOp:
    """One aten SDPA kernel: the role of its arguments and of its outputs."""

    op: OpOverload
    backend: str  # "flash" | "efficient" | "cudnn" | "cpu"
    backward: bool
    arg_names: Mapping[str, str]  # role -> schema argument name
    output_roles: tuple[str, ...]  # role of each output, in order

    def position(self, role: str) -> int | None:
        """Index of ``role``'s argument in the schema; ``None`` when this op has no such argument."""
        name = self.arg_names.get(role)
        if name is None:
            return None
        return next(i for i, a in enumerate(schema(self.op).arguments) if a.name == name)

    def role_of(self, name: str) -> str:
        """The role of the schema argument ``name`` ("" for arguments autoplan does not interpret)."""
        return next((r for r, n in self.arg_names.items() if n == name), "")

    def arg(self, args: Sequence[Any], kwargs: Mapping[str, Any], role: str, default: Any = None) -> Any:
        """The value passed for ``role``, positionally or by keyword, else the schema default (or ``default``)."""
        i = self.position(role)
        if i is None:
            return default
        if i < len(args):
            return args[i]
        name = self.arg_names[role]
        if name in kwargs:
            return kwargs[name]
        schema_default = schema(self.op).arguments[i].default_value
        return default if schema_default is None else schema_default

    def call(self, values: Mapping[str, Any]) -> Any:
        """Call the kernel with arguments given by role (all by keyword; unset ones take their defaults)."""
        return self.op(**{self.arg_names[role]: v for role, v in values.items()})

    def output(self, role: str) -> int | None:
        return self.output_roles.index(role) if role in self.output_roles else None


_FWD_COMMON = {"query": "query", "key": "key", "value": "value", "dropout_p": "dropout_p", "is_causal": "is_causal"}
_FWD_COMMON |= {"scale": "scale"}
_BWD_COMMON = {**_FWD_COMMON, "grad_out": "grad_out", "out": "out", "lse": "logsumexp"}
_GRADS = ("grad_query", "grad_key", "grad_value")

_OPS = (
    SdpaOp(
        aten._scaled_dot_product_flash_attention.default,
        "flash",
        False,
        MappingProxyType(dict(_FWD_COMMON)),
        ("out", "lse", "cum_seq_q", "cum_seq_k", "max_q", "max_k", "rng_state", "unused", "debug_mask"),
    ),
    SdpaOp(
        aten._scaled_dot_product_flash_attention_backward.default,
        "flash",
        True,
        MappingProxyType({**_BWD_COMMON, "max_q": "max_q", "max_k": "max_k"}),
        _GRADS,
    ),
    SdpaOp(
        aten._scaled_dot_product_efficient_attention.default,
        "efficient",
        False,
        MappingProxyType({**_FWD_COMMON, "bias": "attn_bias"}),
        ("out", "lse", "philox_seed", "philox_offset"),
    ),
    SdpaOp(
        aten._scaled_dot_product_efficient_attention_backward.default,
        "efficient",
        True,
        MappingProxyType(
            {**_BWD_COMMON, "grad_out": "grad_out_", "bias": "attn_bias", "grad_input_mask": "grad_input_mask"}
        ),
        (*_GRADS, "grad_bias"),
    ),
    SdpaOp(
        aten._scaled_dot_product_cudnn_attention.default,
        "cudnn",
        False,
        MappingProxyType({**_FWD_COMMON, "bias": "attn_bias"}),
        ("out", "lse", "cum_seq_q", "cum_seq_k", "max_q", "max_k", "philox_seed", "philox_offset", "debug_mask"),
    ),
    SdpaOp(
        aten._scaled_dot_product_cudnn_attention_backward.default,
        "cudnn",
        True,
        MappingProxyType({**_BWD_COMMON, "bias": "attn_bias", "max_q": "max_q", "max_k": "max_k"}),
        _GRADS,
    ),
    SdpaOp(
        aten._scaled_dot_product_flash_attention_for_cpu.default,
        "cpu",
        False,
        MappingProxyType({**_FWD_COMMON, "bias": "attn_mask"}),
        ("out", "lse"),
    ),
    SdpaOp(
        aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
        "cpu",
        True,
        MappingProxyType({**_BWD_COMMON, "bias": "attn_mask"}),
        _GRADS,
    ),
)

SDPA_OPS: Mapping[OpOverload, SdpaOp] = MappingProxyType({s.op: s for s in _OPS})

# GPU kernel -> the CPU op computing the same values (outputs 0 and 1 of a forward, the three grads of a backward)
HOST_TWIN: Mapping[OpOverload, SdpaOp] = MappingProxyType(
    {
        s.op: SDPA_OPS[
            aten._scaled_dot_product_flash_attention_for_cpu_backward.default
            if s.backward
            else aten._scaled_dot_product_flash_attention_for_cpu.default
        ]
        for s in _OPS
        if s.backend != "cpu"
    }
)

FORWARD_KERNELS: Mapping[str, SdpaOp] = MappingProxyType({s.backend: s for s in _OPS if not s.backward})


def spec_of(op: Any) -> SdpaOp | None:
    """The table row of ``op`` (an OpOverload), ``None`` if it is not an SDPA kernel."""
    return SDPA_OPS.get(op)


def argument_roles(spec: SdpaOp, args: Sequence[Any], kwargs: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """(role, value) of every leaf of a call's arguments, in flattened (args, kwargs) order."""
    names = [a.name for a in schema(spec.op).arguments]
    pairs = [*zip(names, args), *kwargs.items()]
    return [(spec.role_of(name), x) for name, a in pairs for x in tree_flatten(a)[0]]


def is_causal(spec: SdpaOp, args: Sequence[Any], kwargs: Mapping[str, Any]) -> bool:
    return bool(spec.arg(args, kwargs, "is_causal", False))


def check_option(option: Any) -> str:
    """``option`` if it names an attention choice, else a ValueError listing the valid ones."""
    if option not in OPTIONS:
        raise ValueError(f"attention={option!r} is not one of {', '.join(map(repr, OPTIONS))}")
    return option


def choose_backend(
    option: str, dtype: torch.dtype, head_dim: int, has_mask: bool, where: str = "", value_head_dim: int | None = None
) -> str:
    """The kernel an ``F.scaled_dot_product_attention`` call traces to under ``option``.

    ``"auto"`` picks what a CUDA GPU (the cost model's target) runs, in torch's priority order
    (flash, efficient, math, cudnn): flash for fp16/bf16 without a mask and a head dim it supports,
    else memory-efficient attention. So fp32 models (and masked attention) get ``"efficient"``.
    An explicit choice is taken as given, except flash with a mask or an unsupported head dim,
    which no flash kernel can compute. An explicit ``"flash"`` (or ``"cudnn"``) on fp32 is allowed:
    the host twin runs it on a CPU mesh (tests do), but a GPU kernel refuses fp32 at run time.
    Flash takes one head dim for query, key and value: a narrower value (``value_head_dim``, as
    MLA's) goes to memory-efficient attention.
    """
    check_option(option)
    flash_head_dim = (
        head_dim <= FLASH_MAX_HEAD_DIM
        and head_dim % FLASH_HEAD_DIM_MULTIPLE == 0
        and value_head_dim in (None, head_dim)
    )
    if option == "auto":
        return "flash" if dtype in _LOW_PRECISION and not has_mask and flash_head_dim else "efficient"
    if option == "flash":
        at = f" (module {where or '<top level>'})"
        if has_mask:
            raise ValueError(f"attention='flash' cannot take an attn_mask{at}; use 'efficient', 'cudnn' or 'auto'")
        if not flash_head_dim:
            raise ValueError(
                f"attention='flash' needs a head dim <= {FLASH_MAX_HEAD_DIM} and a multiple of"
                f" {FLASH_HEAD_DIM_MULTIPLE}, got {head_dim}"
                + (
                    f", and the value's the same, got {value_head_dim}"
                    if value_head_dim not in (None, head_dim)
                    else ""
                )
                + at
            )
    return option
