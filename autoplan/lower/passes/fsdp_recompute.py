"""FSDP recompute tagging: backward re-gathers a sharded parameter instead of keeping the gathered copy.

Without tags, partitioning saves every forward value the backward reads, including all-gathered
(unsharded) weights: that breaks FSDP's memory contract (reshard after forward). This pass tags a
parameter's first collective (an all-gather, or an all-to-all re-sharding it), its wait and the
whole cheap chain downstream of it (views, dtype casts, chunk/cat reassembly, a nested shard's
chunk picked by index, further collectives of the same value) as must-recompute; the partition
then copies the chain into the backward graph and saves only the shard.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from autoplan.lower.collectives import collective_kind, communicates

RECOMPUTE_KEY = "autoplan_recompute"

aten = torch.ops.aten
# Ops a gathered weight flows through before it is used: no compute worth keeping.
CHEAP = {
    aten.view.default,
    aten._unsafe_view.default,
    aten.reshape.default,
    aten.t.default,
    aten.transpose.int,
    aten.permute.default,
    aten.expand.default,
    aten.slice.Tensor,
    aten.select.int,
    aten.index_select.default,
    aten.split.Tensor,
    aten.chunk.default,
    aten.cat.default,
    aten.clone.default,
    aten.contiguous.default,
    aten._to_copy.default,
    aten.alias.default,
    aten.unsqueeze.default,
    aten.squeeze.dim,
    operator.getitem,
}


@dataclass(frozen=True)
class RecomputeStats:
    chains: int  # parameter collectives whose results are re-gathered in backward
    nodes: int  # nodes tagged must-recompute


def _is_forward(n: fx.Node) -> bool:
    return n.meta.get("partitioner_tag") == "is_forward"


def from_parameter(n: fx.Node, params: set[fx.Node]) -> bool:
    """Does ``n`` read a parameter through cheap single-input ops only?"""
    while n not in params:
        if n.op != "call_function" or n.target not in CHEAP or len(n.all_input_nodes) != 1:
            return False
        n = n.all_input_nodes[0]
    return True


def _upstream(n: fx.Node, params: set[fx.Node]) -> list[fx.Node]:
    """The cheap ops between a parameter and ``n`` (``from_parameter`` holds), ``n`` included."""
    chain = []
    while n not in params:
        chain.append(n)
        n = n.all_input_nodes[0]
    return chain


def tag_parameter_gathers(graph: fx.Graph, params: set[fx.Node]) -> RecomputeStats:
    """Tag every forward collective of a parameter, its cheap downstream chain and the cheap ops
    that read the shard it gathers (a mixed-precision cast of the shard: the backward casts again
    rather than keep the low-precision shard). The cost model prices each such chain's
    collectives twice (``CostModel.reruns``), so the two must agree."""
    tagged: set[fx.Node] = set()
    chains = 0
    for n in graph.nodes:
        if not (_is_forward(n) and collective_kind(n) in ("all_gather", "all_to_all")):
            continue
        if n in tagged or not from_parameter(n.args[0], params):
            continue
        chains += 1
        tagged.update(_upstream(n.args[0], params))
        frontier = [n]
        while frontier:
            node = frontier.pop()
            if node in tagged:
                continue
            tagged.add(node)
            for user in node.users:
                cheap = communicates(user) or user.target in CHEAP
                # multi-input cheap ops (a ``cat`` of gathered chunks) join once all their inputs
                # have; a chunk picked by index (a nested shard's own chunk of the gathered weight,
                # a copy) once its data has: the small index is saved instead
                data = user.args[:1] if user.target is aten.index_select.default else user.all_input_nodes
                if _is_forward(user) and cheap and all(a in tagged for a in data):
                    frontier.append(user)
    for n in graph.nodes:  # a parameter's cast with no gather (replicated): cast again, not kept either
        if _is_forward(n) and n.target is aten._to_copy.default and from_parameter(n, params):
            tagged.update(_upstream(n, params))
    for node in tagged:
        node.meta[RECOMPUTE_KEY] = True
    return RecomputeStats(chains=chains, nodes=len(tagged))
