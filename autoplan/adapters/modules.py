"""Adapter over ``nn.Module``'s private state: its hook and buffer dictionaries and its private
load-state-dict hook, so a torch upgrade touches one module.

The public accessors skip what these read: ``named_buffers`` and ``named_children`` leave out slots
set to ``None`` and repeated objects, and there is no public way to drop hooks registered by others.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn


def child_names(module: nn.Module) -> list[str]:
    """The names of every child slot, in registration order, empty (``None``) slots included."""
    return list(module._modules)


def buffer_slots(module: nn.Module) -> int:
    """How many buffer slots ``module`` itself has, empty (``None``) ones included."""
    return len(module._buffers)


def non_persistent_buffers(module: nn.Module) -> list[str]:
    """Names of ``module``'s own buffers that ``state_dict`` leaves out (``persistent=False``) and
    that hold a tensor, sorted."""
    return [b for b in sorted(module._non_persistent_buffers_set) if module._buffers.get(b) is not None]


def clear_forward_hooks(module: nn.Module) -> None:
    """Drop every forward pre-hook and forward hook registered on ``module`` itself."""
    module._forward_pre_hooks.clear()
    module._forward_hooks.clear()


def add_load_state_dict_pre_hook(module: nn.Module, hook: Callable) -> None:
    """Run ``hook(module, state_dict, prefix, *rest)`` before ``module`` loads its own entries of a
    state dict (the hook may rewrite them)."""
    module._register_load_state_dict_pre_hook(hook, with_module=True)


def swap_parameter(module: nn.Module, name: str, tensor) -> object:
    """Put ``tensor`` (any tensor, not only an ``nn.Parameter``) in ``module``'s own parameter slot
    ``name`` and return what was there: what ``torch.func.functional_call`` does to run a module on
    other tensors, which ``setattr`` refuses for a plain tensor."""
    previous = module._parameters[name]
    module._parameters[name] = tensor
    return previous
