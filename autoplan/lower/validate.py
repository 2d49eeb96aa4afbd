"""Checks a lowered per-rank graph must pass before it runs on the mesh's devices.

A graph lowered on a CPU host for a GPU mesh can go wrong in ways the host never sees at run time:
a value left on the host, a collective reading a non-contiguous view (c10d's functional collectives
reject one on CUDA; gloo accepts it), or a kernel that exists only on the host. ``lower`` runs these
checks on every graph it makes, so such a graph is rejected before any GPU is involved.

Host-only ops are found by name, because a CPU-only torch build cannot ask the dispatcher whether an
op has a CUDA kernel (it has none registered for any op). The rule: the ``mkldnn`` and ``onednn``
namespaces; ATen ops whose name says they are for the CPU (``_for_cpu``), or wrap a CPU-only library
(``mkldnn``, ``onednn``, ``fbgemm``); and ops that read a device value on the host
(``_local_scalar_dense`` and the composites that lower to it), which stall the GPU stream every step.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from autoplan.adapters.ops import OpOverload, schema
from autoplan.adapters.pytree import tree_flatten
from autoplan.errors import AutoplanError
from autoplan.lower.collectives import is_c10d_collective
from autoplan.lower.passes.contiguity import contiguous_by_construction

aten = torch.ops.aten

_HOST_NAMESPACES = {"mkldnn", "onednn"}
_HOST_NAME_PARTS = ("_for_cpu", "mkldnn", "onednn", "fbgemm")
_HOST_SYNCS = {
    aten._local_scalar_dense.default,
    aten.item.default,
    aten.equal.default,
    aten.is_nonzero.default,
}


class LoweringError(AutoplanError, RuntimeError):
    """The plan and DTensor disagree about a node (a planner bug, reported with the node), or a node
    the mesh's devices cannot run as planned."""


class GraphCheckError(AutoplanError, RuntimeError):
    """A lowered graph that would fail (or stall) on the mesh's devices, with the node at fault."""


def _describe(node: fx.Node) -> str:
    return f"{node.name} ({node.target})"


def host_only(target) -> bool:
    """Does ``target`` run only on the host (see the module docstring for the rule)?"""
    if target in _HOST_SYNCS:
        return True
    if not isinstance(target, OpOverload):
        return False
    namespace, _, name = schema(target).name.partition("::")
    return namespace in _HOST_NAMESPACES or any(part in name for part in _HOST_NAME_PARTS)


def _tensors(node: fx.Node, root: nn.Module | None) -> list[torch.Tensor]:
    if node.op == "get_attr" and root is not None:
        value = getattr(root, node.target)
    else:
        value = node.meta.get("val")
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


def check_lowered(graph: fx.Graph, mesh: DeviceMesh, root: nn.Module | None = None) -> None:
    """Raise ``GraphCheckError`` naming the first node that breaks a rule: every tensor value (and
    constant of ``root``) on the mesh's device type; every collective input contiguous by
    construction; on a non-CPU mesh, no host-only op."""
    device = mesh.device_type
    on_host = device == "cpu"
    for node in graph.nodes:
        if node.op == "output":
            continue
        for t in _tensors(node, root):
            if t.device.type != device:
                raise GraphCheckError(
                    f"{_describe(node)} makes a tensor on {t.device.type}, but the mesh is on {device}"
                )
        if node.op != "call_function":
            continue
        if not on_host and host_only(node.target):
            raise GraphCheckError(f"{_describe(node)} runs only on the host; the mesh is on {device}")
        if is_c10d_collective(node) and not contiguous_by_construction(node.args[0]):
            source = node.args[0]
            raise GraphCheckError(
                f"{_describe(node)} reads {_describe(source)}, which is not contiguous by construction "
                "(c10d collectives on CUDA reject non-contiguous inputs)"
            )
