"""Expand the ILP's per-unit choices to every node and price the result from scratch.

Pricing walks the full traced graph (all layers, all edges), independently of clustering and
follower merging, so the reported cost is the true cost of the expanded plan.
"""

from __future__ import annotations

import dataclasses
import operator
from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import torch
import torch.fx as fx

from autoplan.adapters.dtensor import TensorMeta
from autoplan.cost import overlap
from autoplan.cost.costs import CostModel, local_bytes
from autoplan.cost.moves import Move, moves
from autoplan.plan import Alternative, CostBreakdown, NodePlan, Plan, Redistribution
from autoplan.shard.strategies import Placements, Strategy, op_signature, value_of
from autoplan.solve.problem import PlacementProblem
from autoplan.trace.tracing import PATH_KEY, TracedGraph


def expand_choice(tg: TracedGraph, problem: PlacementProblem, choice: dict[fx.Node, int]) -> dict[fx.Node, Strategy]:
    """The strategy of every placeholder and op node (getitems read their producer's output)."""
    out: dict[fx.Node, Strategy] = {}
    rep = problem.clustering.rep
    for n in tg.gm.graph.nodes:
        if n.op in ("placeholder", "get_attr") or (n.op == "call_function" and n.target is not operator.getitem):
            r = rep[n]
            unit, m = problem.root[r]
            out[n] = problem.strategies[r][m[choice[unit]]]
    for n in tg.gm.graph.nodes:
        if n.op == "call_function" and n.target is operator.getitem:
            u, k = value_of(n)
            out[n] = Strategy((out[u].outputs[k],), ())
    return out


@dataclass(frozen=True)
class Evaluation:
    nodes: dict[str, NodePlan]
    redistributions: list[Redistribution]
    cost: CostBreakdown


def op_name(n: fx.Node) -> str:
    return n.name if n.op == "placeholder" else str(n.target)


def _op_key(n: fx.Node) -> tuple | fx.Node:
    """Everything an op's compute cost depends on besides its strategy (``op_signature``), so
    identical layers are priced once; the node itself where its arguments cannot be hashed."""
    key = op_signature(n)
    try:
        hash(key)
    except TypeError:
        return n
    return key


def evaluate(
    chosen: dict[fx.Node, Strategy],
    cost_model: CostModel,
    all_moves: list[Move],
    rules: dict[fx.Node, str],
    budget: dict[str, float],
) -> Evaluation:
    """Price ``chosen``, its moves ``all_moves`` (``autoplan.cost.moves.moves`` of its graph);
    ``budget``: per overlap segment, the compute communication hides under."""
    compute_cache: dict[tuple, float] = {}
    ideal_cache: dict[tuple, float] = {}
    nodes: dict[str, NodePlan] = {}
    redistributions: list[Redistribution] = []
    totals = {"compute_forward": 0.0, "compute_backward": 0.0, "comm_forward": 0.0, "comm_backward": 0.0}
    seg_comm: dict[str, float] = defaultdict(float)
    ideal = 0.0

    for n, s in chosen.items():
        compute = 0.0
        if n.op == "call_function" and n.target is not operator.getitem:
            op_key = _op_key(n)
            # the strategy by identity (copies of a layer hold their representative's, alive while
            # this runs): hashing its placements runs in Python
            key = (op_key, id(s))
            if key not in compute_cache:
                compute_cache[key] = cost_model.op_seconds(n, s)
            if op_key not in ideal_cache:
                ideal_cache[op_key] = cost_model.ideal_op_seconds(n)
            compute = compute_cache[key]
            ideal += ideal_cache[op_key]
            totals[f"compute_{overlap.phase(n)}"] += compute
        nodes[n.name] = NodePlan(
            name=n.name,
            op=op_name(n),
            module=n.meta.get(PATH_KEY, ""),
            phase=overlap.phase(n) if n.op != "placeholder" else "",
            outputs=s.outputs,
            inputs=s.inputs,
            compute_s=compute,
            rule=rules.get(n, ""),
        )

    paid: dict[tuple, float] = defaultdict(float)  # per bucket's collective: latency shares paid
    phases: dict[tuple, str] = {}  # ... and the phase it runs in
    for e in all_moves:
        src, dst = e.ends(chosen.__getitem__)
        if src == dst or (e.again and not cost_model.reruns([src], [dst], e.meta)[0, 0]):
            continue  # no move, or one the backward keeps from the forward
        priced = cost_model.sharing(e.share) if e.bucket else cost_model
        seconds = priced.redistribute_cost(src, dst, e.meta)
        collectives = cost_model.redistribute_collectives(src, dst, e.meta)
        nbytes = local_bytes(e.meta, src, cost_model.mesh.shape)
        redistributions.append(
            Redistribution(e.consumer, e.src.name, src, dst, collectives, seconds, e.phase, nbytes, e.again)
        )
        phase = "forward" if e.phase == "forward" else "backward"
        totals[f"comm_{phase}"] += seconds
        if e.segment is not None:
            seg_comm[e.segment] += priced.hideable_cost(src, dst, e.meta)
        for kind, dim in collectives if e.bucket else ():
            if kind != "local":
                key = (e.bucket, kind, dim, e.meta.dtype)
                paid[key] += e.share
                phases[key] = phase
    # each bucket pays its latency once: what its moves' shares left unpaid (or paid twice), which
    # is counted exposed
    unpaid = 0.0
    for key, shares in paid.items():
        seconds = cost_model.bucket_latency(key[1], key[2]) * (1.0 - shares)
        totals[f"comm_{phases[key]}"] += seconds
        unpaid += seconds
    hidden = overlap.hidden_seconds(budget, seg_comm)
    cost = CostBreakdown(**totals, hidden_comm=hidden, ideal_compute=ideal, bucket_latency=unpaid)
    return Evaluation(nodes, redistributions, cost)


def _node_key(n: fx.Node) -> tuple:
    if n.op == "placeholder":
        val = n.meta.get("val")
        return ("placeholder", tuple(val.shape), val.dtype) if isinstance(val, torch.Tensor) else ("placeholder",)
    return _op_key(n)


def alternatives(
    chosen: dict[fx.Node, Strategy],
    options: dict[fx.Node, tuple[Strategy, ...]],
    cost_model: CostModel,
    all_moves: list[Move],
    budget: dict[str, float],
    keep: int = 3,
) -> dict[str, tuple[float, tuple[Alternative, ...]]]:
    """Per node: the chosen strategy's redistribution seconds (into and out of it) and the ``keep``
    cheapest other strategies, each priced with every other node's choice kept: ``delta_s`` is what
    the step would change by, overlap included (a move that hides under its layer's ``budget``
    costs only what spills over). This is the local view ``explain`` needs (why this node, given its
    neighbours); pins and the memory budget are not applied to the alternatives. Identical layers
    are priced once, and a node's strategies all at once: each edge's moves as one cost row (a
    node has hundreds of strategies on a 3-D mesh)."""
    view = _local_view(chosen, cost_model, all_moves, budget)
    memo: dict[tuple, tuple[float, tuple[Alternative, ...]]] = {}
    out = {}
    for n, s0 in chosen.items():
        if n.op == "call_function" and n.target is operator.getitem:
            continue
        opts = options.get(n, ())
        context = _context(view, n)
        key = (_node_key(n), id(s0), id(opts), context)
        if key not in memo:
            memo[key] = _priced(view, n, s0, opts, keep)
        out[n.name] = memo[key]
    return out


@dataclass(frozen=True)
class _LocalView:
    """What pricing one node's strategies against its neighbours' choices needs: the plan, each
    node's moves with their segment and the tensor they move, and per segment the seconds of the
    plan's moves that hide under it and its budget."""

    chosen: dict[fx.Node, Strategy]
    cost_model: CostModel
    touching: dict[fx.Node, list[tuple[Move, str | None, TensorMeta]]]
    hideable: dict[str, float]
    budget: dict[str, float]


def _local_view(
    chosen: dict[fx.Node, Strategy], cost_model: CostModel, all_moves: list[Move], budget: dict[str, float]
) -> _LocalView:
    """Each node's moves, with their segment and the tensor they move (its meta made once per
    value: a stride is a call), and per segment the seconds of ``chosen``'s moves under it."""
    touching: dict[fx.Node, list[tuple[Move, str | None, TensorMeta]]] = defaultdict(list)
    metas: dict[fx.Node, TensorMeta] = {}
    hideable: dict[str, float] = defaultdict(float)
    for e in all_moves:
        seg = e.segment
        if e.value not in metas:
            metas[e.value] = e.meta
        touching[e.src].append((e, seg, metas[e.value]))
        if e.dst is not None:
            touching[e.dst].append((e, seg, metas[e.value]))
        src, dst = e.ends(chosen.__getitem__)
        if seg is not None and src != dst:
            runs = cost_model.reruns([src], [dst], metas[e.value])[0, 0] if e.again else 1.0
            priced = cost_model.sharing(e.share) if e.bucket else cost_model
            hideable[seg] += priced.hideable_cost(src, dst, metas[e.value]) * runs
    return _LocalView(chosen, cost_model, touching, hideable, budget)


def _context(view: _LocalView, n: fx.Node) -> tuple:
    """The state of ``n``'s moves that its alternatives' prices depend on, for the memo's key: which
    end ``n`` is, its neighbours' placements, each tensor and each segment's load and budget."""
    chosen, hideable, budget = view.chosen, view.hideable, view.budget
    # placements and strategies by identity (every copy of a layer holds its representative's
    # objects, alive while this runs): hashing placements ran in Python, 340 K times on a 3-D
    # mesh; each move's segment by its place among the node's (which moves share one), and its state
    place = {seg: i for i, seg in enumerate(dict.fromkeys(seg for _, seg, _ in view.touching[n]))}
    return tuple(
        (e.src is n, e.k, e.slot, *map(id, e.ends(chosen.__getitem__)), meta)
        + ((place[seg], hideable[seg], budget.get(seg, 0.0)) if seg else ())
        for e, seg, meta in view.touching[n]
    )


def _priced(
    view: _LocalView, n: fx.Node, s0: Strategy, opts: tuple[Strategy, ...], keep: int
) -> tuple[float, tuple[Alternative, ...]]:
    """The chosen ``s0``'s redistribution seconds and the ``keep`` cheapest of ``opts`` other than
    it, each with what the step from ``s0`` would change the cost by (a node's strategies priced
    at once: one cost row per move), as the ILP prices it: bucketed moves at their latency share,
    without the buckets' unshared latency (``CostBreakdown.bucket_latency``)."""
    cost_model = view.cost_model
    candidates = (s0, *opts)
    seconds = _seconds_of(view, n, candidates, "redistribute_costs")
    compute = np.r_[cost_model.op_seconds(n, s0), cost_model.strategy_seconds(n, opts)]
    comm = seconds.sum(axis=0)
    step = compute + comm - _hidden(view, n, _seconds_of(view, n, candidates, "hideable_costs"))
    priced = []
    for i in np.argsort(step[1:], kind="stable") + 1:
        if len(priced) == keep or not np.isfinite(step[i]):
            break
        s = candidates[i]
        if s is not s0 and s != s0:
            delta = float(step[i] - step[0])
            priced.append(Alternative(s.outputs, s.inputs, float(compute[i]), float(comm[i]), delta))
    return float(comm[0]), tuple(priced)


def _seconds_of(view: _LocalView, n: fx.Node, candidates: tuple[Strategy, ...], part: str) -> np.ndarray:
    """Seconds of each of ``n``'s moves (rows) under each candidate (columns), the other end as
    chosen, by the ``CostModel`` method ``part`` (``redistribute_costs`` or its hideable part; a
    bucketed move's at its latency share, ``CostModel.sharing``)."""
    chosen, cost_model = view.chosen, view.cost_model
    rows = []
    for e, _, meta in view.touching[n]:
        price = getattr(cost_model.sharing(e.share) if e.bucket else cost_model, part)
        src, dst = e.ends(chosen.__getitem__)
        if e.src is n:
            ends, other = [s.outputs[e.k] for s in candidates], dst
            row = price(ends, [dst], meta)[:, 0]
            if e.again:
                row = row * cost_model.reruns(ends, [dst], meta)[:, 0]
        else:
            ends, other = [s.output if e.slot is None else s.inputs[e.slot] for s in candidates], src
            row = price([src], ends, meta)[0]
            if e.again:
                row = row * cost_model.reruns([src], ends, meta)[0]
        # no move where the ends agree (as ``evaluate`` prices it), even one DTensor would refuse
        rows.append(np.where(cost_model.numbers(ends) == cost_model.numbers([other])[0], 0.0, row))
    return np.array(rows).reshape(len(rows), len(candidates))


def _hidden(view: _LocalView, n: fx.Node, hideable: np.ndarray) -> np.ndarray:
    """Per candidate, the seconds of its moves' ``hideable`` parts (rows, as ``_seconds_of``) that
    run under their segments' compute, the other nodes' hideable moves kept (column 0: the chosen
    strategy)."""
    segments = [seg for _, seg, _ in view.touching[n]]
    out = np.zeros(hideable.shape[1])
    for seg in dict.fromkeys(s for s in segments if s is not None):
        mine = hideable[[s == seg for s in segments]].sum(axis=0)
        load = view.hideable[seg] - mine[0] + mine
        out += np.minimum(load, view.budget.get(seg, 0.0))
    return out


def reprice(tg: TracedGraph, plan: Plan, cost_model: CostModel, fixed_outputs: dict[int, Placements]) -> Plan:
    """``plan`` on a graph a pass has rewired: every remaining node keeps its strategy, and the
    redistributions and costs are computed again from scratch rather than patched."""
    nodes = [n for n in tg.gm.graph.nodes if n.op != "output"]
    chosen = {n: Strategy(plan.nodes[n.name].outputs, plan.nodes[n.name].inputs) for n in nodes}
    rules = {n: plan.nodes[n.name].rule for n in chosen}
    hiding = overlap.Hiding.of(tg, prefetch=plan.prefetch)
    ev = evaluate(chosen, cost_model, moves(tg, fixed_outputs, hiding), rules, plan.overlap_budget)
    return dataclasses.replace(
        plan,
        nodes=ev.nodes,
        cost=dataclasses.replace(ev.cost, recompute=plan.cost.recompute),  # the recompute choice is kept
        redistributions=ev.redistributions,
        passes=dict(plan.passes),
    )
