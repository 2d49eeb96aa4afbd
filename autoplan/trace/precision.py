"""Mixed precision as FSDP2's ``MixedPrecisionPolicy`` means it, traced into the joint graph.

Parameters stay in their own dtype (fp32, and so do the optimizer's states); each module casts its
own parameters to ``param_dtype`` when its forward starts, so every cast sits in the module that
uses it (a layer's casts are part of the layer, for clustering and stamping) and the backward casts
each gradient back to the parameter's dtype. The casts are ordinary pointwise ops to the planner: a
cast may run on a parameter's shard before its gather (half the bytes) or after it, whichever the
costs pick. ``reduce_dtype`` is kept by ``mark_reduced_gradients``: a parameter's gradient is
reduced only where it is in that dtype (before or after its cast back), so its reduction moves
``reduce_dtype``'s bytes and sums in it, as FSDP2's reduce-scatter does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.fx as fx
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from autoplan.adapters.modules import swap_parameter
from autoplan.adapters.pytree import tree_map_only

__all__ = ["KEEP_PARTIAL", "REDUCE_BEFORE", "MixedPrecisionPolicy", "casting", "check_policy", "mark_reduced_gradients"]

KEEP_PARTIAL = "autoplan_keep_partial"  # node meta: a gradient's value whose partial sums are not reduced
REDUCE_BEFORE = "autoplan_reduce_before"  # node meta: a gradient's cast the reduction may come before
aten = torch.ops.aten
_FLOATS = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
# ops a parameter's gradient flows through unchanged in its partial sums, up to the cast back
_LINEAR = {
    aten._to_copy.default,
    aten.add.Tensor,
    aten.alias.default,
    aten.view.default,
    aten._unsafe_view.default,
    aten.reshape.default,
    aten.t.default,
    aten.transpose.int,
    aten.permute.default,
    aten.clone.default,
}


def check_policy(policy) -> MixedPrecisionPolicy | None:
    """``policy`` if it is a ``MixedPrecisionPolicy`` with floating-point dtypes (or ``None``), else
    ``TypeError``/``ValueError`` saying what is wrong."""
    if policy is None:
        return None
    if not isinstance(policy, MixedPrecisionPolicy):
        raise TypeError(
            f"mp_policy must be a torch.distributed.fsdp.MixedPrecisionPolicy, got {type(policy).__name__}: e.g."
            " MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)"
        )
    for field in ("param_dtype", "reduce_dtype", "output_dtype"):
        dtype = getattr(policy, field)
        if dtype is not None and dtype not in _FLOATS:
            floats = ", ".join(map(str, _FLOATS))
            raise ValueError(f"mp_policy.{field}={dtype} is not a floating-point dtype ({floats})")
    return policy


def describe(policy: MixedPrecisionPolicy | None) -> dict[str, str]:
    """The policy's dtypes by field (``"param_dtype": "bfloat16"``), the fields it sets only; the
    reduce dtype FSDP2 falls back to (the compute dtype) is spelled out."""
    if policy is None or policy.param_dtype is None:
        return {}
    fields = {"param_dtype": policy.param_dtype, "reduce_dtype": policy.reduce_dtype or policy.param_dtype}
    fields["output_dtype"] = policy.output_dtype
    return {k: str(v).removeprefix("torch.") for k, v in fields.items() if v is not None}


def _own_parameters(module: nn.Module) -> list[tuple[nn.Module, str]]:
    """The parameter slots whose casts ``module``'s forward makes: its own, and those of children
    that have no forward of their own to cast them (``nn.ParameterList``, ``nn.ParameterDict``,
    ``nn.ModuleList`` and ``nn.ModuleDict``, and the like, down to modules that do)."""
    slots = [(module, name) for name, p in module.named_parameters(recurse=False) if p is not None]
    for child in module.children():
        if type(child).forward is nn.Module.forward:
            slots += _own_parameters(child)
    return slots


@contextlib.contextmanager
def casting(root: nn.Module, policy: MixedPrecisionPolicy | None, prefix: str = "") -> Iterator[None]:
    """While active, every module under ``root`` whose name starts with ``prefix`` runs its forward
    on its parameters cast to ``policy.param_dtype`` (floating-point ones of another dtype), and
    gets its own tensors back after it. Hooks run in registration order: enter this after the
    hooks that record module paths, so the casts carry their module's path."""
    dtype = None if policy is None else policy.param_dtype
    if dtype is None:
        yield
        return
    handles = []
    saved: dict[int, list[list[tuple[nn.Module, str, object]]]] = {}

    def pre(mod, args):
        swapped = []
        for owner, name in _own_parameters(mod):
            p = getattr(owner, name)
            if isinstance(p, torch.Tensor) and p.dtype.is_floating_point and p.dtype != dtype:
                swapped.append((owner, name, swap_parameter(owner, name, p.to(dtype))))
        saved.setdefault(id(mod), []).append(swapped)

    def post(mod, args, out):
        for owner, name, original in reversed(saved[id(mod)].pop()):
            swap_parameter(owner, name, original)

    for name, mod in root.named_modules():
        if name.startswith(prefix) and _own_parameters(mod):
            handles.append(mod.register_forward_pre_hook(pre))
            handles.append(mod.register_forward_hook(post, always_call=True))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _floats_to(value, dtype: torch.dtype | None):
    """``value`` with its floating-point tensors cast to ``dtype`` (unchanged where it is ``None``)."""
    if dtype is None:
        return value
    return tree_map_only(torch.Tensor, lambda t: t.to(dtype) if t.dtype.is_floating_point else t, value)


def cast_inputs(value, policy: MixedPrecisionPolicy | None):
    """The forward's arguments with their floating-point tensors in ``param_dtype``
    (``cast_forward_inputs``), as FSDP2 casts a root module's inputs."""
    return _floats_to(value, policy.param_dtype if policy is not None and policy.cast_forward_inputs else None)


def cast_outputs(value, policy: MixedPrecisionPolicy | None):
    """The forward's outputs with their floating-point tensors in ``output_dtype``, when it is set."""
    return _floats_to(value, None if policy is None else policy.output_dtype)


def _gradient_chain(gradient: fx.Node) -> list[fx.Node]:
    """The values a parameter's gradient is made of, up through the ops its partial sums pass
    unchanged (casts, views, sums of contributions), the gradient first."""
    chain, stack, seen = [], [gradient], set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        chain.append(n)
        if n.op == "call_function" and n.target in _LINEAR:
            stack.extend(a for a in n.args if isinstance(a, fx.Node))
    return chain


def _dtype(n: fx.Node) -> torch.dtype | None:
    val = n.meta.get("val")
    return val.dtype if isinstance(val, torch.Tensor) and val.dtype.is_floating_point else None


def mark_reduced_gradients(gradients: list[fx.Node], policy: MixedPrecisionPolicy | None) -> int:
    """Hold each parameter's gradient reduction to the policy's reduce dtype (``reduce_dtype``, else
    ``param_dtype``, as FSDP2 reduces): the values of its chain (``_gradient_chain``) in another
    dtype are marked ``KEEP_PARTIAL`` (their partial sums are not reduced), and a cast whose input
    is in the reduce dtype is marked ``REDUCE_BEFORE`` (the planner keeps the choice of reducing
    before it). A chain with no value in the reduce dtype is left alone. Returns how many values
    were marked ``KEEP_PARTIAL``."""
    reduce = None if policy is None else policy.reduce_dtype or policy.param_dtype
    if reduce is None:
        return 0
    marked = 0
    for g in gradients:
        if not isinstance(g, fx.Node):
            continue
        chain = _gradient_chain(g)
        if reduce not in {_dtype(n) for n in chain}:
            continue
        for n in chain:
            if _dtype(n) not in (None, reduce):
                marked += not n.meta.get(KEEP_PARTIAL)
                n.meta[KEEP_PARTIAL] = True
            if n.target is aten._to_copy.default and _dtype(n.args[0]) == reduce and _dtype(n) != reduce:
                n.meta[REDUCE_BEFORE] = True
    return marked
