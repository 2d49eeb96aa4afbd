"""Chained all-gather fusion: one all-gather over the flattened mesh instead of one per mesh dim.

``S(0)S(0) -> RR`` lowers to a gather on one mesh dim, then on the other (possibly with identity
views between). One gather over the flattened group is a single launch with a better algorithm.
The gather order decides how chunks are laid out: gathering the inner (last) mesh dim first yields
row-major rank order, which is the flattened group's own order; the opposite order yields
column-major order, which the pass restores with a local chunk transpose after the fused gather.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.distributed.device_mesh import DeviceMesh

from autoplan.adapters.dtensor import flattened_group_name
from autoplan.lower.collectives import c10d

aten = torch.ops.aten


@dataclass(frozen=True)
class FusionStats:
    fused: int  # chains of two all-gathers replaced by one
    rejected: int  # candidate chains left alone (other users, non-identity views, dtype changes...)


def _is(node: fx.Node, op) -> bool:
    return node.op == "call_function" and node.target is op


def _identity_chain(start: fx.Node) -> tuple[fx.Node, list[fx.Node]] | None:
    """Follow single-user views from ``start``; the end must have ``start``'s shape and strides."""
    chain, node = [], start
    while len(node.users) == 1:
        (user,) = node.users
        if not (_is(user, aten.view.default) or _is(user, aten._unsafe_view.default) or _is(user, aten.alias.default)):
            break
        chain.append(user)
        node = user
    a, b = start.meta.get("val"), node.meta.get("val")
    if chain and not (a.shape == b.shape and a.stride() == b.stride()):
        return None
    return node, chain


def fuse_gather_chains(graph: fx.Graph, mesh: DeviceMesh) -> FusionStats:
    """Fuse ``gather(dim i) -> wait -> identity views -> gather(dim j) -> wait`` over a 2-D mesh.

    Rewrites ``graph`` in place; a GraphModule owning it must be recompiled afterwards.
    """
    if mesh.ndim != 2:
        return FusionStats(0, 0)
    dim_of = {mesh.get_group(d).group_name: d for d in range(2)}
    flat_group = None
    fused = rejected = 0
    for first in list(graph.nodes):
        if not _is(first, c10d.all_gather_into_tensor.default) or first.args[2] not in dim_of:
            continue
        waits = list(first.users)
        if len(waits) != 1 or not _is(waits[0], c10d.wait_tensor.default):
            continue
        found = _identity_chain(waits[0])
        second = next(iter(found[0].users), None) if found and len(found[0].users) == 1 else None
        if second is None or not _is(second, c10d.all_gather_into_tensor.default):
            continue
        inner, outer = dim_of.get(first.args[2]), dim_of.get(second.args[2])
        same_dtype = first.meta["val"].dtype == second.meta["val"].dtype
        if outer is None or outer == inner or not same_dtype or len(second.users) != 1:
            rejected += 1
            continue
        (second_wait,) = second.users
        if flat_group is None:
            flat_group = flattened_group_name(mesh)
        _replace(graph, first, second_wait, inner, mesh, flat_group)
        # collectives count as side effects for dead-code elimination: erase the old chain explicitly
        for node in (second_wait, second, *reversed(found[1]), waits[0], first):
            graph.erase_node(node)
        fused += 1
    return FusionStats(fused, rejected)


def _replace(graph: fx.Graph, first: fx.Node, last_wait: fx.Node, inner: int, mesh: DeviceMesh, group: str):
    src = first.args[0]
    n0, n1 = mesh.shape
    world = n0 * n1
    out_val = last_wait.meta["val"]
    with graph.inserting_before(last_wait):
        gather = graph.call_function(c10d.all_gather_into_tensor.default, (src, world, group))
        gather.meta = dict(first.meta)
        gather.meta["val"] = out_val
        result = graph.call_function(c10d.wait_tensor.default, (gather,))
        result.meta = dict(last_wait.meta)
        if inner == 0:  # gathered dp first: chunks must come out column-major (tp-major)
            chunk = list(src.meta["val"].shape)
            blocks = graph.call_function(aten.view.default, (result, [n0, n1, *chunk]))
            swapped = graph.call_function(aten.transpose.int, (blocks, 0, 1))
            ordered = graph.call_function(aten.clone.default, (swapped,), {"memory_format": torch.contiguous_format})
            result = graph.call_function(aten.view.default, (ordered, list(out_val.shape)))
            blocks.meta["val"] = out_val.new_empty([n0, n1, *chunk])
            swapped.meta["val"] = blocks.meta["val"].transpose(0, 1)
            ordered.meta["val"] = out_val.new_empty([n1, n0, *chunk])
            result.meta = dict(last_wait.meta)
    last_wait.replace_all_uses_with(result)
