"""Contiguous collective inputs by construction: c10d's functional collectives on CUDA (and on any
device under torch 2.11) reject a non-contiguous input.

The lowered graph's recorded layouts cannot be trusted for this: each segment is traced from fresh
(contiguous) local fakes, so a value whose producer returns a transposed view at run time (``t`` of a
weight shard, then an identity ``view``) is recorded as contiguous. Instead, a collective reads either
a value that is contiguous whatever its inputs were (a collective's own result, an explicit
contiguous copy, a matmul's result, or a contiguity-keeping view of one), or an inserted
``aten.contiguous``, which costs nothing at run time when its input already is contiguous and copies
when it is not.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from autoplan.lower.collectives import c10d, is_c10d_collective

aten = torch.ops.aten

# Views whose output is contiguous whenever their input is (a view of a contiguous tensor to a new
# shape has row-major strides; unit dims do not count for contiguity).
_KEEPS_CONTIGUITY = {
    aten.view.default,
    aten._unsafe_view.default,
    aten.reshape.default,
    aten.alias.default,
    aten.detach.default,
    aten.unsqueeze.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.squeeze.default,
}


# Ops whose result is always a new row-major tensor, whatever their inputs' layouts.
_FRESH_CONTIGUOUS = {aten.mm.default, aten.bmm.default, aten.addmm.default}


@dataclass(frozen=True)
class ContiguityStats:
    inserted: int  # collective inputs routed through an inserted ``aten.contiguous``
    collectives: int  # collectives in the graph


def _asks_contiguous(node: fx.Node) -> bool:
    return node.kwargs.get("memory_format", torch.contiguous_format) == torch.contiguous_format


def contiguous_by_construction(node: fx.Node) -> bool:
    """Is ``node``'s value contiguous at run time whatever the layouts of the graph's inputs?"""
    while node.op == "call_function" and node.target in _KEEPS_CONTIGUITY:
        node = node.args[0]
    if node.op != "call_function":
        return False
    if node.target is aten.contiguous.default:
        return _asks_contiguous(node)
    if node.target is aten.clone.default:
        return "memory_format" in node.kwargs and _asks_contiguous(node)
    if node.target in _FRESH_CONTIGUOUS:
        return True
    if node.target is c10d.wait_tensor.default:
        return isinstance(node.args[0], fx.Node) and is_c10d_collective(node.args[0])
    return False


def make_collective_inputs_contiguous(graph: fx.Graph) -> ContiguityStats:
    """Route every collective input that is not contiguous by construction through ``aten.contiguous``.

    The inserted node sits right before its collective and takes the collective's tags (phase,
    FSDP recompute, region), so the partition keeps it with the collective: recomputed with a
    re-gathered weight, never saved in its place.
    """
    inserted = collectives = 0
    for node in list(graph.nodes):
        if not is_c10d_collective(node):
            continue
        collectives += 1
        source = node.args[0]
        if contiguous_by_construction(source):
            continue
        with graph.inserting_before(node):
            made = graph.call_function(aten.contiguous.default, (source,))
        made.meta = {k: v for k, v in node.meta.items() if k not in ("val", "tensor_meta")}
        made.meta["val"] = source.meta["val"].new_empty(source.meta["val"].shape)
        node.replace_input_with(source, made)
        inserted += 1
    return ContiguityStats(inserted=inserted, collectives=collectives)
