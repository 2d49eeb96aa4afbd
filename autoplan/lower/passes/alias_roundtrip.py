"""Alias round trips: one redistribution may serve many consumers, but none should go A -> B -> A.

Before strategies are enumerated, every value read more than once gets an ``aten.alias`` node that
all its readers read instead (``insert_aliases``). The ILP places the alias like any other node, so
a value can be redistributed once for all the consumers that want the same placement. What the
ILP cannot express is "this consumer reads the producer itself": a consumer that wants the
producer's own placement A while the alias is placed B pays A -> B -> A, and the redistributed
copy stays alive until its last reader. ``remove_round_trips`` runs on the planned graph before
lowering: it rewires those reads straight to the producer and erases aliases nobody reads any more.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.fx as fx

from autoplan.adapters.pytree import tree_flatten, tree_unflatten
from autoplan.cost.costs import CostModel
from autoplan.plan import Plan
from autoplan.shard.strategies import Placements, tensor_inputs
from autoplan.solve.evaluate import reprice
from autoplan.trace import regions
from autoplan.trace.clustering import instance_of
from autoplan.trace.regions import REGION_KEY
from autoplan.trace.tracing import CHECKPOINT_KEY, PATH_KEY, PHASE_KEY, TracedGraph

ALIAS = torch.ops.aten.alias.default
ALIAS_KEY = "autoplan_alias"  # set on the aliases ``insert_aliases`` adds


@dataclass(frozen=True)
class AliasStats:
    inserted: int  # values read more than once, each now read through one alias


@dataclass(frozen=True)
class RoundTripStats:
    removed: int  # reads that went producer A -> alias B -> A, now reading the producer directly
    aliases_dropped: int  # aliases erased because nothing reads them any more (no-op aliases included)


def _reads(node: fx.Node) -> int:
    """How many tensor inputs of ops read ``node`` (``x + x`` reads it twice)."""
    return sum(tensor_inputs(u).count(node) for u in node.users if u.op == "call_function")


def _wants_alias(node: fx.Node) -> bool:
    """Tensor values read more than once: activations and parameters (read by the next ops and
    again by the backward) and gradients (a layer's output gradient feeds the residual path and the
    matmul backwards)."""
    return (
        node.op in ("placeholder", "call_function")
        and isinstance(node.meta.get("val"), torch.Tensor)
        and not (node.op == "call_function" and node.target is ALIAS)
        and _reads(node) >= 2
    )


def _alias_path(node: fx.Node, readers: list[fx.Node]) -> str:
    """The alias serves its readers: when they all sit in one repeated layer (``layers.3``), or all
    outside any, it goes with them, otherwise with the producer. So every copy of a layer gets the
    same aliases, whether its neighbour is another copy or not (the value entering layer 0 comes
    from the embedding, the last layer's output goes to the final norm), and clustering still
    matches the copies.
    """
    own = node.meta.get(PATH_KEY, "")
    paths = [u.meta.get(PATH_KEY, "") for u in readers]
    layers = {instance_of(p) for p in paths}
    return paths[0] if len(layers) == 1 and instance_of(own) not in layers else own


def insert_aliases(tg: TracedGraph) -> AliasStats:
    """Put an alias after every tensor value that ops read more than once; the ops read the alias.

    Graph outputs keep reading the value itself. The alias carries the producer's value; its phase
    is forward when any reader is.
    """
    graph = tg.gm.graph
    inserted = 0
    after_placeholders = tg.placeholders[-1]  # ops never sit between placeholders
    for node in list(graph.nodes):
        if not _wants_alias(node):
            continue
        readers = [u for u in node.users if u.op == "call_function"]
        with graph.inserting_after(after_placeholders if node.op == "placeholder" else node):
            alias = graph.call_function(ALIAS, (node,))
        if node.op == "placeholder":
            after_placeholders = alias
        alias.meta["val"] = node.meta["val"]
        alias.meta[PATH_KEY] = _alias_path(node, readers)
        forward = any(u.meta.get(PHASE_KEY) == "forward" for u in readers)
        alias.meta[PHASE_KEY] = "forward" if forward else "backward"
        alias.meta[ALIAS_KEY] = True
        if CHECKPOINT_KEY in node.meta:  # a view of what the model checkpoints is recomputed with it
            alias.meta[CHECKPOINT_KEY] = node.meta[CHECKPOINT_KEY]
        if REGION_KEY in node.meta and node.target is not regions.EXIT:  # a local value stays local
            alias.meta[REGION_KEY] = node.meta[REGION_KEY]
        for u in readers:
            u.replace_input_with(node, alias)
        inserted += 1
    tg.gm.recompile()
    return AliasStats(inserted)


def _copy(tg: TracedGraph) -> TracedGraph:
    """A copy with its own graph (same node names, shared meta values), so the traced graph stays as
    planned for other plans."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in tg.gm.graph.nodes:
        env[n] = graph.node_copy(n, lambda a: env[a])
    return dataclasses.replace(tg, gm=fx.GraphModule(tg.gm, graph))


def _rewire(consumer: fx.Node, alias: fx.Node, source: Placements, every: bool, plan: Plan) -> int:
    """Point reads of ``alias`` at its producer: those expecting ``source``, or all of them with ``every``."""
    flat, spec = tree_flatten((consumer.args, consumer.kwargs))
    positions = [i for i, a in enumerate(flat) if isinstance(a, fx.Node)]
    moved = 0
    for i, wanted in zip(positions, plan.nodes[consumer.name].inputs, strict=True):
        if flat[i] is alias and (every or wanted == source):
            flat[i] = alias.args[0]
            moved += 1
    if moved:
        consumer.args, consumer.kwargs = tree_unflatten(flat, spec)
    return moved


def rewire_aliases(graph: fx.Graph, plan: Plan) -> RoundTripStats:
    """In place: reads of an alias that want its producer's placement read the producer instead.

    A no-op alias (placed like its producer) loses all its reads: a consumer wanting a third
    placement redistributes from the producer exactly as it would from the alias. Otherwise reads
    wanting a third placement stay on the alias, which still serves them. Aliases left without
    readers are erased.
    """
    removed = dropped = 0
    for alias in [n for n in graph.nodes if n.op == "call_function" and n.target is ALIAS]:
        source = plan.nodes[alias.args[0].name].outputs[0]
        noop = plan.nodes[alias.name].outputs[0] == source
        for consumer in [u for u in alias.users if u.op == "call_function"]:
            moved = _rewire(consumer, alias, source, noop, plan)
            removed += 0 if noop else moved
        if not alias.users:
            graph.erase_node(alias)
            dropped += 1
    return RoundTripStats(removed, dropped)


def remove_round_trips(
    tg: TracedGraph, plan: Plan, cost_model: CostModel, fixed_outputs: dict[int, Placements]
) -> tuple[TracedGraph, Plan, RoundTripStats]:
    """The planned graph without alias round trips, and the plan priced again on it from scratch.

    Works on a copy: ``tg`` and ``plan`` are left as they are, so other plans can still be applied.
    """
    out = _copy(tg)
    stats = rewire_aliases(out.gm.graph, plan)
    out.gm.recompile()
    return out, reprice(out, plan, cost_model, fixed_outputs), stats
