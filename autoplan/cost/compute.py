"""What one traced op costs to run: its FLOPs, the dtype its math runs in, and whether it launches a
kernel at all. ``CostModel`` prices these on the target device (``roofline_seconds``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.fx as fx

from autoplan.adapters.dtensor import TensorMeta
from autoplan.adapters.pytree import tree_map
from autoplan.cost.flops import node_flops
from autoplan.shard.strategies import aliases_input
from autoplan.trace import attention, regions


def is_free(node: fx.Node) -> bool:
    """Ops that launch no kernel: placeholders, getitems, views, aliases and the boundaries of
    ``local_map`` regions (a shard passed on as it is)."""
    return node.op != "call_function" or aliases_input(node) or node.target in (regions.ENTER, regions.EXIT)


def flops_of(node: fx.Node) -> float:
    """The FLOPs of ``node``'s call on its traced values."""
    to_val = lambda a: a.meta["val"] if isinstance(a, fx.Node) else a  # noqa: E731
    args = tree_map(to_val, node.args)
    kwargs = tree_map(to_val, node.kwargs)
    return node_flops(node.target, args, kwargs, node.meta.get("val"))


def kernel_kind(node: fx.Node) -> str:
    """Which of a device profile's efficiency curves prices ``node``: "attention" for fused SDPA
    kernels (forward and backward), "matmul" for every other op with FLOPs."""
    return "attention" if node.target in attention.SDPA_OPS else "matmul"


def compute_dtype(tensors: Sequence[TensorMeta]) -> torch.dtype:
    """The dtype the math runs in: the first floating one (indices and masks do not pick the tensor-core rate)."""
    fallback = tensors[0].dtype if tensors else torch.float32
    return next((m.dtype for m in tensors if m.dtype.is_floating_point), fallback)
