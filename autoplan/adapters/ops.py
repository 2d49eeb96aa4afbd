"""Adapter over torch's private operator classes: ``torch._ops.OpOverload`` (the type of every ATen
op in a traced graph), its ``_schema`` and ``_opname``, ``torch.utils._python_dispatch``'s
dispatch mode (and a way to run real code outside every active mode), the grouped matmul's Python
entry point ``torch._grouped_mm`` and the shape check ``torch._check`` fake kernels make, so a torch
upgrade touches one module.

Graph passes tell ATen calls from other nodes by the overload type, read argument names, defaults
and mutability off the schema, and match ops by their bare name across overloads.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch._ops import OpOverload
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

__all__ = ["OpOverload", "TorchDispatchMode", "base_name", "check", "grouped_mm", "outside_modes", "schema"]

grouped_mm = torch._grouped_mm  # what models call; ATen's kernel takes bfloat16 only
check = torch._check  # a condition on (possibly symbolic) sizes, failing with the message given


def schema(op: OpOverload):
    """The op's ``FunctionSchema``: its name (``aten::mm``), arguments (names, defaults) and returns."""
    return op._schema


def base_name(op: OpOverload) -> str:
    """The op's name without namespace or overload: ``mm`` for ``aten.mm.default``."""
    return op._opname


@contextlib.contextmanager
def outside_modes() -> Iterator[None]:
    """Run real tensor code outside every active dispatch mode (a trace's fake, proxy and
    functionalization modes, and modes of our own) and torch function mode; they are back after."""
    with _disable_current_modes(), torch._C.DisableTorchFunction():
        yield
