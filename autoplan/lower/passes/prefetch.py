"""Prefetch: issue each parameter's all-gather a layer ahead of its use, wait for it where it is read.

The lowering emits a collective right before the op that reads its result, so a rank that gathers
a sharded weight (FSDP) computes nothing while the gather runs. A parameter's gather depends on
nothing the step computes, so it can be issued as early as the program likes; FSDP issues the next
layer's gathers while the current layer computes, and the overlap model (``cost.overlap``) prices
parameter moves as hidden under their layer's compute on that assumption. This pass makes the
program do what is priced: in a partitioned forward or backward graph, every all-gather of a
parameter (its shard read through views and casts, or a bucket of such shards packed into one
buffer; in the backward, the saved shards of re-gathered weights) moves, with the cheap chain that
feeds it, to the start of the stretch of nodes before its own (the previous layer instance, in the
order the graph runs them). Its ``wait_tensor`` stays where it was, right before the first reader.

Stretches are runs of one ``REGION_KEY`` value along the graph. A moved gather keeps its own
layer's tag, so regional compilation puts the gathers a layer issues early in a small region of
their own (run eagerly: no compute) before the previous layer's region, whose structure, like
every layer's, no longer holds any gather: identical layers still share one compiled region.

A prefetched gathered weight is alive one stretch longer. The memory model counts that when the
planner is told (``AutoParallel(prefetch=True)``, whose ``apply_placement`` then prefetches): its
estimate and the peak it reports follow the prefetched program, while the ILP's peak rows leave the
earlier gathers to the bytes a row misses (``solve.peak``). The pass is opt-in, and refused on
gloo, which does not survive gathers in flight beside other collectives
(``LoweringOptions.check``); NCCL orders them on its stream.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx

from autoplan.lower.collectives import c10d
from autoplan.lower.passes.fsdp_recompute import CHEAP


@dataclass(frozen=True)
class PrefetchStats:
    gathers: int  # parameter all-gathers issued a stretch ahead of their use
    nodes: int  # nodes moved with them (the gathers and the chains feeding them)


def stretches(graph: fx.Graph, region_key: str) -> dict[fx.Node, int]:
    """The stretch index of every call node: a new stretch starts where the region tag changes.
    A node without a tag stays in the stretch it appears in."""
    index: dict[fx.Node, int] = {}
    current, tag = 0, None
    for n in graph.nodes:
        if n.op != "call_function":
            continue
        t = n.meta.get(region_key)
        if t is not None and t != tag:
            current += tag is not None
            tag = t
        index[n] = current
    return index


def _chain(gather: fx.Node, sources: set[fx.Node], position: dict[fx.Node, float]) -> list[fx.Node] | None:
    """The gather and the cheap call nodes it is made by from parameters (several, for a bucket's
    packed shards), in graph order; None if it reads anything else."""
    chain, todo = {gather}, list(gather.all_input_nodes)
    while todo:
        n = todo.pop()
        if n in chain or n in sources:
            continue
        if n.op != "call_function" or n.target not in CHEAP:
            return None
        chain.add(n)
        todo.extend(n.all_input_nodes)
    return sorted(chain, key=position.__getitem__)


def prefetch_parameter_gathers(graph: fx.Graph, region_key: str, params: set[str]) -> PrefetchStats:
    """Move every all-gather of a parameter (one of the placeholders named ``params``, read through
    cheap ops only), with its chain, to the start of the stretch before its own; rewrites ``graph``
    in place."""
    sources = {n for n in graph.find_nodes(op="placeholder") if n.name in params}
    stretch = stretches(graph, region_key)
    position = {n: float(i) for i, n in enumerate(graph.nodes)}
    found = (_chain(g, sources, position) for g in graph.nodes if g.target is c10d.all_gather_into_tensor.default)
    chains = [c for c in found if c is not None]
    moving = {n for chain in chains for n in chain}
    starts: dict[int, fx.Node] = {}  # each stretch's first node that stays
    for n, s in stretch.items():
        if n not in moving:
            starts.setdefault(s, n)
    gathers = nodes = 0
    for chain in chains:
        anchor = starts.get(stretch[chain[-1]] - 1)
        if anchor is None:
            continue
        late = [n for n in chain if position[n] > position[anchor]]  # a shared view may be early already
        for n in late:
            anchor.prepend(n)
            position[n] = position[anchor] - 0.5
        gathers += 1
        nodes += len(late)
    return PrefetchStats(gathers, nodes)
