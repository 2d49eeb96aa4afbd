"""The reduced placement problem: strategies and costs for the ILP, after clustering and merging.

Two reductions keep the ILP small without changing what a plan costs:
- repeated layers share decisions (``Clustering``): costs of a representative count once per copy;
- followers (single-input ops that can follow every placement their producer offers: views,
  casts, unary pointwise, reductions) are merged into their producer, so their strategy is a
  function of the producer's and the edge between them disappears.
Every remaining edge is grouped by the *placements* on each side rather than by strategies.
"""

from __future__ import annotations

import dataclasses
import operator
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.fx as fx

from autoplan.adapters.dtensor import tensor_meta
from autoplan.cost import overlap
from autoplan.cost.compute import is_free
from autoplan.cost.costs import CostModel, Matrix, Price, pairwise
from autoplan.cost.moves import Move, moves
from autoplan.progress import progress
from autoplan.shard.strategies import (
    NodeStrategies,
    Placements,
    Strategy,
    output_vals,
    tensor_inputs,
    value_of,
)
from autoplan.trace.clustering import Clustering
from autoplan.trace.precision import KEEP_PARTIAL, REDUCE_BEFORE
from autoplan.trace.tracing import TracedGraph


@dataclass
class EdgeGroup:
    """Redistribution between two units, by placement: ``cost[o, q]`` seconds (already x multiplicity).

    ``src_label[r]`` is the producer-side placement index of the producer unit's strategy r;
    ``dst_label[s]`` the consumer-side placement index of the consumer unit's strategy s.
    """

    src: fx.Node
    dst: fx.Node
    src_label: np.ndarray
    dst_label: np.ndarray
    cost: np.ndarray
    changes: np.ndarray  # 1 where the placements differ (for the tie-break)


@dataclass
class PlacementProblem:
    units: list[fx.Node]  # nodes that own ILP variables
    strategies: dict[fx.Node, tuple[Strategy, ...]]  # every representative node
    unit_cost: dict[fx.Node, np.ndarray]  # per unit strategy, seconds (compute + folded edges)
    forbidden: dict[fx.Node, np.ndarray]  # per unit strategy, True where some folded edge is impossible
    edges: list[EdgeGroup]
    root: dict[fx.Node, tuple[fx.Node, np.ndarray]]  # representative node -> (unit, unit strategy -> own strategy)
    clustering: Clustering
    n_merged: int = 0
    group_index: dict[tuple, int] = field(default_factory=dict)  # edge key -> index in ``edges``
    overlap: list[OverlapSegment] = field(default_factory=list)
    least_compute: dict[fx.Node, float] = field(default_factory=dict)  # representative -> its fastest strategy's s


@dataclass(frozen=True)
class Linear:
    """A linear function of the ILP's choice: a value per unit strategy and per edge-group placement
    pair (seconds or bytes; what a recompute option costs or frees)."""

    units: dict[fx.Node, np.ndarray] = field(default_factory=dict)
    edges: dict[int, np.ndarray] = field(default_factory=dict)

    def add_unit(self, unit: fx.Node, values: np.ndarray) -> None:
        self.units[unit] = self.units.get(unit, 0) + values

    def add_edge(self, group: int, values: np.ndarray) -> None:
        self.edges[group] = self.edges.get(group, 0) + values

    def add(self, other: Linear) -> None:
        for unit, values in other.units.items():
            self.add_unit(unit, values)
        for group, values in other.edges.items():
            self.add_edge(group, values)

    def at(self, problem: PlacementProblem, choice: dict[fx.Node, int]) -> float:
        """Its value where each unit takes strategy ``choice[unit]`` (each edge group then takes the
        placement pair of its two units' strategies)."""
        total = sum(float(np.asarray(v)[choice[u]]) for u, v in self.units.items())
        for g, v in self.edges.items():
            e = problem.edges[g]
            total += float(np.asarray(v)[e.src_label[choice[e.src]], e.dst_label[choice[e.dst]]])
        return total


@dataclass(frozen=True)
class OverlapSegment:
    """One layer (its copies together) in one phase (``autoplan.cost.overlap``): it hides up to the
    lesser of its compute ``budget`` and its ``hideable`` seconds, linear in the choice."""

    name: str
    budget: float
    hideable: Linear


@dataclass(frozen=True)
class _Edge:
    """One (producer value, consumer slot) edge priced by placement, and where its cost lands."""

    src_unit: fx.Node
    dst_unit: fx.Node
    srcs: list
    dsts: list
    src_label: np.ndarray
    dst_label: np.ndarray
    cost: np.ndarray  # seconds per (producer placement, consumer placement), one edge
    unit: fx.Node | None  # the unit that absorbs the cost when no edge variables are needed
    index: np.ndarray | None  # per strategy of ``unit``: its entry of the flattened cost
    key: tuple | None  # the edge group, when both sides choose

    def per_strategy(self, cost: np.ndarray) -> np.ndarray:
        return cost.reshape(-1)[self.index]


def _edge(strats, root, price: Matrix, ur: fx.Node, k: int, cr: fx.Node, slot, own_labels=None) -> _Edge:
    """The edge from ``ur``'s output ``k`` to ``cr``'s input ``slot``, each placement pair priced
    by ``price`` (a redistribution's seconds, or the bytes of the moved copy). ``own_labels(node,
    side, values)``: ``_labels(values())``, possibly kept (a node's placements on one side, over
    all its strategies)."""
    own_labels = own_labels or (lambda node, side, values: _labels(values()))
    meta = tensor_meta(output_vals(ur)[k])
    src_unit, src_map = root[ur]
    dst_unit, dst_map = root[cr]
    out = own_labels(ur, ("out", k), lambda: [s.outputs[k] for s in strats[ur]])
    into = own_labels(cr, ("in", slot), lambda: [_slot_placement(s, slot) for s in strats[cr]])
    srcs, src_label = _mapped(out, src_map)
    dsts, dst_label = _mapped(into, dst_map)
    cost = price(srcs, dsts, meta)
    parts = (src_unit, dst_unit, srcs, dsts, src_label, dst_label, cost)
    if src_unit is dst_unit:
        return _Edge(*parts, src_unit, src_label * len(dsts) + dst_label, None)
    if len(srcs) == 1:
        return _Edge(*parts, dst_unit, dst_label, None)
    if len(dsts) == 1:
        return _Edge(*parts, src_unit, src_label, None)
    return _Edge(*parts, None, None, (src_unit, dst_unit, src_label.tobytes(), dst_label.tobytes()))


def _sums_partials(srcs: list, dsts: list) -> np.ndarray:
    """True where moving placements ``srcs[o]`` to ``dsts[q]`` sums partial values on some mesh dim.
    Every such sum of a gradient is held to the reduce dtype, over any mesh dim: mesh dims carry no
    role, and a planner free to sum over some of them in the compute dtype (as FSDP2 with tensor
    parallelism sums TP partials) sums the costly data-parallel partials there instead."""
    return np.array(
        [[any(a.is_partial() and not b.is_partial() for a, b in zip(s, d)) for d in dsts] for s in srcs], dtype=bool
    ).reshape(len(srcs), len(dsts))


def forward_costs(
    tg: TracedGraph, problem: PlacementProblem, cost_model: CostModel, node_sets: list[frozenset[fx.Node]]
) -> list[Linear]:
    """Seconds to run each set of forward ops once more: their compute and the moves of their
    inputs, except inputs read from parameters, buffers and the batch (re-gathered weights are
    already recomputed for FSDP). Identical layers share representatives, priced once."""
    resident = tg.resident()
    compute: dict[fx.Node, np.ndarray] = {}
    edges: dict[tuple, _Edge] = {}
    return [_forward_cost(problem, cost_model, nodes, resident, compute, edges) for nodes in node_sets]


def _forward_cost(problem, cost_model, nodes, resident, compute: dict, edges: dict) -> Linear:
    """``compute`` and ``edges``: what was priced already, per representative and per
    (producer rep, output, consumer rep, slot)."""
    rep, out = problem.clustering.rep, Linear()
    for n in sorted(nodes, key=lambda n: n.name):
        if rep[n] not in problem.root:  # a tuple's element: no decision, no kernel
            continue
        unit, m = problem.root[rep[n]]
        if rep[n] not in compute:
            compute[rep[n]] = cost_model.strategy_seconds(rep[n], problem.strategies[rep[n]])
        out.add_unit(unit, compute[rep[n]][m])
        for j, a in enumerate(tensor_inputs(n)):
            u, k = value_of(a)
            if u in resident:
                continue
            key = (rep[u], k, rep[n], j)
            if key not in edges:
                edges[key] = _edge(problem.strategies, problem.root, cost_model.redistribute_costs, *key)
            _add_edge(out, problem, edges[key])
    return out


def _add_edge(out: Linear, problem: PlacementProblem, edge: _Edge) -> None:
    """``edge``'s values as a term of ``out``: on a unit where one side has no choice, else on its group."""
    if edge.key is None:
        out.add_unit(edge.unit, edge.per_strategy(edge.cost))
    else:
        out.add_edge(problem.group_index[edge.key], edge.cost)


def priced_moves(problem: PlacementProblem, priced: Iterable[tuple[Move, Price]], edges: dict | None = None) -> Linear:
    """Each move's ``price`` over the placement its value is made in and the one it is read in (a
    constrained output's: its constraint), as a function of the choice (e.g. the bytes of the
    copy a move makes). Moves whose ends have no decision are left out. ``edges``: the pairs
    priced so far for ``problem``, by price and edge (a peak row prices the moves of every view
    alive at its step, mostly the same ones as the row before it)."""
    rep, root, out = problem.clustering.rep, problem.root, Linear()
    edges = {} if edges is None else edges
    for m, price in priced:
        ur = rep.get(m.src)
        if ur not in root or not isinstance(output_vals(m.src)[m.k], torch.Tensor):
            continue
        if m.dst is None:
            meta = tensor_meta(output_vals(ur)[m.k])
            unit, i = root[ur]
            out.add_unit(unit, np.array([price(problem.strategies[ur][j].outputs[m.k], m.fixed, meta) for j in i]))
        elif rep.get(m.dst) in root:
            key = (price, ur, m.k, rep[m.dst], "out" if m.slot is None else m.slot)
            if key not in edges:
                edges[key] = _edge(problem.strategies, root, pairwise(price), *key[1:])
            _add_edge(out, problem, edges[key])
    return out


class Shared:
    """What every ILP build of one planner, its re-solves and its plans' pricing read that the trace
    and the strategies alone decide, worked out once: the moves (``autoplan.cost.moves``) under each
    set of output constraints (a walk of LLaMA-3 70B's 25 K nodes), where each move can hide (a
    re-solve's split clustering keeps its instance map), and each strategy tuple's placements on
    one side (``_labels``)."""

    def __init__(self, tg: TracedGraph, clustering: Clustering, prefetch: bool = False) -> None:
        self.tg = tg
        self.hiding = overlap.Hiding.of(tg, clustering.instance, prefetch)
        self._moves: dict[tuple, list[Move]] = {}  # by the output constraints
        # by the strategy tuple's identity and the side, kept alive beside its labels so that its id
        # cannot be reused: hashing a tuple of strategies costs as much as labelling it
        self._labels: dict[tuple, tuple[tuple[Strategy, ...], tuple[list, np.ndarray]]] = {}

    def moves(self, fixed_outputs: dict[int, Placements]) -> list[Move]:
        key = tuple(sorted(fixed_outputs.items()))
        if key not in self._moves:
            self._moves[key] = moves(self.tg, fixed_outputs, self.hiding)
        return self._moves[key]

    def labels(self, strategies: tuple[Strategy, ...], side: tuple, values) -> tuple[list, np.ndarray]:
        """``_labels(values())``, the placements of ``strategies`` on ``side``."""
        found = self._labels.get((id(strategies), side))
        if found is None or found[0] is not strategies:
            found = self._labels[(id(strategies), side)] = (strategies, _labels(values()))
        return found[1]


def op_inputs(all_moves: list[Move]) -> list[tuple[fx.Node, int, fx.Node, int]]:
    """The ops' tensor inputs among ``all_moves`` as (op, slot, producer, output index), in graph order."""
    return [(m.dst, m.slot, m.src, m.k) for m in all_moves if m.slot is not None and not m.again]


def _producer_reps(inputs: list[tuple], clustering: Clustering) -> dict[fx.Node, set]:
    """For each representative, the representatives its (single) input comes from over all its copies."""
    found: dict[fx.Node, set] = defaultdict(set)
    rep = clustering.rep
    for n, _, u, k in inputs:
        found[rep[n]].add((rep[u], k))
    return found


def _single_use_view(v: fx.Node) -> bool:
    """A view read exactly once that keeps its input's layout: redistributing before it costs what
    redistributing after it would.

    A view with several readers is a place where one redistribution can serve them all, so it keeps
    its own decision. So does a transpose of a contiguous tensor (a weight's ``t``): a collective
    before it moves a contiguous tensor, after it a strided one, and the two differ by re-layout
    copies (gathering a weight split on dim 0 before its ``t`` copies nothing).
    """
    if not is_free(v) or v.op != "call_function" or v.target is operator.getitem:
        return False
    (user, *rest) = v.users or [None]
    return (
        not rest
        and user is not None
        and user.op == "call_function"
        and len(tensor_inputs(user)) >= 1
        and sum(a is v for a in tensor_inputs(user)) == 1
        and _keeps_layout(v)
    )


def _keeps_layout(v: fx.Node) -> bool:
    """Whether view ``v`` is contiguous exactly where its (first tensor) input is, as traced."""
    source = next(iter(tensor_inputs(v)), None)
    out, into = v.meta.get("val"), getattr(source, "meta", {}).get("val")
    if not isinstance(out, torch.Tensor) or not isinstance(into, torch.Tensor):
        return True
    return out.is_contiguous() == into.is_contiguous()


def merge_followers(
    inputs: list[tuple], clustering: Clustering, strategies: dict[fx.Node, NodeStrategies]
) -> dict[fx.Node, tuple[fx.Node, np.ndarray]]:
    """Decide which nodes follow their producer (``inputs``: ``op_inputs``); returns node ->
    (producer rep, producer idx -> own idx)."""
    producers = _producer_reps(inputs, clustering)
    follow: dict[fx.Node, tuple[fx.Node, np.ndarray]] = {}

    def root_of(n: fx.Node) -> fx.Node:
        while n in follow:
            n = follow[n][0]
        return n

    for v, ns in strategies.items():
        if not _single_use_view(v) or len(producers.get(v, ())) != 1 or v.meta.get(REDUCE_BEFORE):
            continue  # a gradient's cast that a reduction may come before keeps the edge that prices it
        ((u, k),) = producers[v]
        if u not in strategies or root_of(u) is v:
            continue
        by_input: dict[Placements, list[int]] = defaultdict(list)
        for i, s in enumerate(ns.strategies):
            if len(set(s.inputs)) == 1:
                by_input[s.inputs[0]].append(i)
        mapping = []
        for s in strategies[u].strategies:
            hits = by_input.get(s.outputs[k], [])
            if len(hits) != 1:
                break
            mapping.append(hits[0])
        else:
            follow[v] = (u, np.array(mapping, dtype=np.int64))
    return follow


def resolve_roots(
    strategies: dict[fx.Node, NodeStrategies], follow: dict[fx.Node, tuple[fx.Node, np.ndarray]]
) -> dict[fx.Node, tuple[fx.Node, np.ndarray]]:
    root: dict[fx.Node, tuple[fx.Node, np.ndarray]] = {}

    def resolve(n: fx.Node) -> tuple[fx.Node, np.ndarray]:
        if n not in root:
            if n in follow:
                parent, local = follow[n]
                r, m = resolve(parent)
                root[n] = (r, local[m])
            else:
                root[n] = (n, np.arange(len(strategies[n].strategies)))
        return root[n]

    for n in strategies:
        resolve(n)
    return root


def _slot_placement(s: Strategy, slot) -> Placements | None:
    """What a consumer strategy expects: input ``slot`` or, for ``"out"`` sinks, its own output."""
    return s.outputs[0] if slot == "out" else s.inputs[slot]


def _changes(srcs: list, dsts: list, cost_model: CostModel) -> np.ndarray:
    """1 where a producer placement differs from a consumer one, by the cost model's numbers for
    placement tuples (hashing the placements themselves runs in Python: a 3-D mesh's 63 per side
    made every build, and every re-solve's, pay for it)."""
    return (cost_model.numbers(srcs)[:, None] != cost_model.numbers(dsts)[None, :]).astype(float)


def _labels(values: list) -> tuple[list, np.ndarray]:
    """The distinct values in order of first appearance, and each value's index among them."""
    distinct = list(dict.fromkeys(values))
    index = {v: i for i, v in enumerate(distinct)}
    return distinct, np.array([index[v] for v in values], dtype=np.int64)


def _mapped(labels: tuple[list, np.ndarray], m: np.ndarray) -> tuple[list, np.ndarray]:
    """``_labels`` of the values at ``m``, from ``labels`` of them all (numpy, no hashing)."""
    distinct, label = labels
    picked = label[m]
    found, first = np.unique(picked, return_index=True)
    kept = found[np.argsort(first)]
    number = np.empty(len(distinct), dtype=np.int64)
    number[kept] = np.arange(len(kept))
    return [distinct[i] for i in kept], number[picked]


def move_counts(
    all_moves: list[Move], clustering: Clustering
) -> tuple[dict[tuple, int], list[tuple[fx.Node, int, Placements]]]:
    """``all_moves`` by representatives: (producer rep, output index, consumer rep, slot, again) ->
    how many moves it stands for, and the moves to fixed placements as (producer rep, output index,
    placements).

    Slots are tensor-input positions; ``"out"`` marks a value that must arrive in the consumer's
    *output* placement: a gradient in its parameter's placement, an output in its tangent's.
    ``again``: the backward's second run of a move into a gathered view (``Move.again``).
    """
    rep = clustering.rep
    edges: dict[tuple, int] = defaultdict(int)
    sinks = []
    for m in all_moves:
        if m.dst is None:
            sinks.append((rep[m.src], m.k, m.fixed))
        else:
            edges[(rep[m.src], m.k, rep[m.dst], "out" if m.slot is None else m.slot, m.again)] += 1
    return edges, sinks


def build_problem(
    tg: TracedGraph,
    clustering: Clustering,
    strategies: dict[fx.Node, NodeStrategies],
    cost_model: CostModel,
    fixed_outputs: dict[int, Placements],
    shared: Shared,
    merge: bool = True,
    least: dict[fx.Node, float] | None = None,
) -> PlacementProblem:
    """``least``: each node's compute at its fastest strategy (``OverlapSegment.budget``), where
    ``strategies`` were narrowed (a re-solve fixing some layers); else worked out from them."""
    all_moves = shared.moves(fixed_outputs)
    inputs = op_inputs(all_moves)
    follow = merge_followers(inputs, clustering, strategies) if merge else {}
    root = resolve_roots(strategies, follow)
    strats = {n: ns.strategies for n, ns in strategies.items()}
    units = [n for n in strategies if root[n][0] is n]
    unit_cost = {u: np.zeros(len(strats[u])) for u in units}
    where = clustering.instance
    budget: dict[str, float] = defaultdict(float)
    least = dict(least or {})
    for v, ss in strats.items():
        unit, m = root[v]
        seconds = cost_model.strategy_seconds(v, ss)  # a re-solve's untied copies reuse their rep's
        unit_cost[unit] += (seconds * clustering.multiplicity[v])[m]
        least.setdefault(v, overlap.least(seconds))
        budget[overlap.segment(where.get(v, ""), overlap.phase(v))] += least[v] * clustering.multiplicity[v]

    edge_mult, sinks = move_counts(all_moves, clustering)

    groups: dict[tuple, EdgeGroup] = {}
    hideable: list[tuple[str, _Edge]] = []

    def own_labels(node, side, values):  # a node's strategy tuple outlives a build (re-solves)
        return shared.labels(strats[node], side, values)

    rep = clustering.rep
    shares = {
        (rep[m.src], m.k, rep[m.dst], "out" if m.slot is None else m.slot, m.again): m.share
        for m in all_moves
        if m.bucket
    }
    for (ur, k, cr, slot, again), mult in progress(edge_mult.items(), "costs", len(edge_mult)):
        # a layer's parameter and gradient moves share its buckets' latency (``Move.share``)
        share = shares.get((ur, k, cr, slot, again))
        priced = cost_model if share is None else cost_model.sharing(share)
        edge = _edge(strats, root, priced.redistribute_costs, ur, k, cr, slot, own_labels)
        meta = tensor_meta(output_vals(ur)[k])
        runs = cost_model.reruns(edge.srcs, edge.dsts, meta) * mult if again else mult  # a regather, or none
        cost = edge.cost * runs
        if ur.meta.get(KEEP_PARTIAL):  # a gradient's sums are in the policy's reduce dtype
            cost = np.where(_sums_partials(edge.srcs, edge.dsts), np.inf, cost)
        name = shared.hiding.segment_of(ur, cr, slot == "out", again)
        if name is not None:  # only its collectives hide: its copies run in line with compute
            seconds = priced.hideable_costs(edge.srcs, edge.dsts, meta)
            hideable.append((name, dataclasses.replace(edge, cost=seconds * runs)))
        if edge.key is None:
            unit_cost[edge.unit] += edge.per_strategy(cost)
        elif edge.key in groups:
            groups[edge.key].cost = groups[edge.key].cost + cost
        else:
            changes = _changes(edge.srcs, edge.dsts, cost_model)
            groups[edge.key] = EdgeGroup(edge.src_unit, edge.dst_unit, edge.src_label, edge.dst_label, cost, changes)
    for ur, k, placements in sinks:
        meta = tensor_meta(output_vals(ur)[k])
        unit, m = root[ur]
        unit_cost[unit] += np.array(
            [cost_model.redistribute_cost(strats[ur][i].outputs[k], placements, meta) for i in m]
        )

    forbidden = {u: ~np.isfinite(c) for u, c in unit_cost.items()}
    for u, c in unit_cost.items():
        c[forbidden[u]] = 0.0
    problem = PlacementProblem(
        units=units,
        strategies=strats,
        unit_cost=unit_cost,
        forbidden=forbidden,
        edges=list(groups.values()),
        root=root,
        clustering=clustering,
        n_merged=len(follow),
        group_index={key: i for i, key in enumerate(groups)},
    )
    comm: dict[str, Linear] = defaultdict(Linear)
    for name, edge in hideable:
        _add_edge(comm[name], problem, edge)
    problem.overlap = [OverlapSegment(name, budget[name], comm[name]) for name in sorted(comm)]
    problem.least_compute = least
    return problem


def allowed_strategies(problem: PlacementProblem, node: fx.Node, placements: Placements) -> list[int]:
    """Unit strategy indices under which ``node`` outputs ``placements``."""
    rep = problem.clustering.rep[node]
    _, m = problem.root[rep]
    return [r for r, i in enumerate(m) if problem.strategies[rep][i].outputs[0] == tuple(placements)]
