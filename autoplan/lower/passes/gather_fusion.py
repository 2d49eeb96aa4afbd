"""Chained collective fusion: one all-gather (or reduce-scatter) over the flattened mesh instead of
one per mesh dim.

``S(0)S(0) -> RR`` lowers to a gather on one mesh dim, then on the other (possibly with identity
views between). One gather over the flattened group is a single launch with a better algorithm.
The gather order decides how chunks are laid out: gathering the inner (last) mesh dim first yields
row-major rank order, which is the flattened group's own order; the opposite order yields
column-major order, which the pass restores with a local chunk transpose after the fused gather.

``PP -> S(0)S(0)`` (an FSDP gradient over both mesh dims) mirrors it: a reduce-scatter on one dim,
then on the other. Scattering the outer (first) dim first leaves rank ``(i, j)`` the chunk
``i * n1 + j``, the flattened group's own; the opposite order leaves it chunk ``j * n0 + i``, which
the pass arranges by transposing the chunks of the input before the fused reduce-scatter. Each
rank's sum then has all the group's terms in one collective instead of two partial sums. ``PP ->
RR`` (a replicated norm weight's gradient) is an all-reduce on each dim: one over the whole mesh
computes the same sum.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.distributed.device_mesh import DeviceMesh

from autoplan.adapters.dtensor import flattened_group_name
from autoplan.lower.collectives import c10d

aten = torch.ops.aten


@dataclass(frozen=True)
class FusionStats:  # of one collective kind
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


def _chain_pairs(graph: fx.Graph, op, mesh: DeviceMesh, same: Callable[[fx.Node, fx.Node], bool]):
    """``(first, its wait, the views between, second, its wait, first's mesh dim)`` for each
    ``op(dim i) -> wait -> identity views -> op(dim j) -> wait`` chain over a 2-D mesh whose two
    collectives ``same`` accepts; the int counts the candidate chains left alone."""
    dim_of = {mesh.get_group(d).group_name: d for d in range(2)}
    found, rejected = [], 0
    for first in list(graph.nodes):
        if not _is(first, op) or first.args[-1] not in dim_of:
            continue
        waits = list(first.users)
        if len(waits) != 1 or not _is(waits[0], c10d.wait_tensor.default):
            continue
        chain = _identity_chain(waits[0])
        second = next(iter(chain[0].users), None) if chain and len(chain[0].users) == 1 else None
        if second is None or not _is(second, op):
            continue
        inner, outer = dim_of.get(first.args[-1]), dim_of.get(second.args[-1])
        if outer is None or outer == inner or not same(first, second) or len(second.users) != 1:
            rejected += 1
            continue
        (second_wait,) = second.users
        found.append((first, waits[0], chain[1], second, second_wait, inner))
    return found, rejected


def fuse_gather_chains(graph: fx.Graph, mesh: DeviceMesh) -> FusionStats:
    """Fuse ``gather(dim i) -> wait -> identity views -> gather(dim j) -> wait`` over a 2-D mesh.

    Rewrites ``graph`` in place; a GraphModule owning it must be recompiled afterwards.
    """
    if mesh.ndim != 2:
        return FusionStats(0, 0)

    def same(a: fx.Node, b: fx.Node) -> bool:
        return a.meta["val"].dtype == b.meta["val"].dtype

    pairs, rejected = _chain_pairs(graph, c10d.all_gather_into_tensor.default, mesh, same)
    for first, wait, views, second, second_wait, inner in pairs:
        _replace(graph, first, second_wait, inner, mesh, flattened_group_name(mesh))
        # collectives count as side effects for dead-code elimination: erase the old chain explicitly
        for node in (second_wait, second, *reversed(views), wait, first):
            graph.erase_node(node)
    return FusionStats(len(pairs), rejected)


def _same_reduction(a: fx.Node, b: fx.Node) -> bool:
    """Two reductions of a chain that one reduction over the whole mesh can stand for: one reduce
    op, one dtype."""
    return a.args[1] == b.args[1] and a.meta["val"].dtype == b.meta["val"].dtype


def fuse_all_reduce_chains(graph: fx.Graph, mesh: DeviceMesh) -> FusionStats:
    """Fuse ``all_reduce(dim i) -> wait -> identity views -> all_reduce(dim j) -> wait`` (one
    reduce op) over a 2-D mesh into one all-reduce over the flattened mesh."""
    if mesh.ndim != 2:
        return FusionStats(0, 0)

    pairs, rejected = _chain_pairs(graph, c10d.all_reduce.default, mesh, _same_reduction)
    for first, wait, views, second, second_wait, _ in pairs:
        with graph.inserting_before(second_wait):
            reduced = graph.call_function(
                c10d.all_reduce.default, (first.args[0], first.args[1], flattened_group_name(mesh))
            )
            reduced.meta = {**first.meta, "val": second_wait.meta["val"]}
            result = graph.call_function(c10d.wait_tensor.default, (reduced,))
            result.meta = dict(second_wait.meta)
        second_wait.replace_all_uses_with(result)
        for node in (second_wait, second, *reversed(views), wait, first):
            graph.erase_node(node)
    return FusionStats(len(pairs), rejected)


def fuse_reduce_scatter_chains(graph: fx.Graph, mesh: DeviceMesh) -> FusionStats:
    """Fuse ``reduce_scatter(dim i) -> wait -> identity views -> reduce_scatter(dim j) -> wait``
    (one reduce op) over a 2-D mesh into one reduce-scatter over the flattened mesh."""
    if mesh.ndim != 2:
        return FusionStats(0, 0)

    pairs, rejected = _chain_pairs(graph, c10d.reduce_scatter_tensor.default, mesh, _same_reduction)
    for first, wait, views, second, second_wait, inner in pairs:
        src, (n0, n1) = first.args[0], mesh.shape
        val = src.meta["val"]
        with graph.inserting_before(second_wait):
            if inner == 1:  # scattered tp first: chunk (j, i) must reach rank (i, j)
                chunk = [val.shape[0] // (n0 * n1), *val.shape[1:]]
                blocks = graph.call_function(aten.view.default, (src, [n1, n0, *chunk]))
                swapped = graph.call_function(aten.transpose.int, (blocks, 0, 1))
                ordered = graph.call_function(
                    aten.clone.default, (swapped,), {"memory_format": torch.contiguous_format}
                )
                src_flat = graph.call_function(aten.view.default, (ordered, list(val.shape)))
                blocks.meta["val"] = val.new_empty([n1, n0, *chunk])
                swapped.meta["val"] = blocks.meta["val"].transpose(0, 1)
                ordered.meta["val"] = val.new_empty([n0, n1, *chunk])
                src_flat.meta["val"] = val
                for n in (blocks, swapped, ordered, src_flat):
                    n.meta.update({k: v for k, v in first.meta.items() if k != "val"})
                src = src_flat
            scatter = graph.call_function(
                c10d.reduce_scatter_tensor.default, (src, first.args[1], n0 * n1, flattened_group_name(mesh))
            )
            scatter.meta = {**first.meta, "val": second_wait.meta["val"]}
            result = graph.call_function(c10d.wait_tensor.default, (scatter,))
            result.meta = dict(second_wait.meta)
        second_wait.replace_all_uses_with(result)
        for node in (second_wait, second, *reversed(views), wait, first):
            graph.erase_node(node)
    return FusionStats(len(pairs), rejected)


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
