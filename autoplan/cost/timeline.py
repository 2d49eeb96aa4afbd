"""The step order of a training step, whatever the placements: which entry of the joint graph runs
at each step (with the backward's recomputed copies where the lowering runs them), when each
stored value is born and last read, which values share a storage, and where the lowering issues
a parameter's gathers. The memory model (``memory``) prices bytes over it, and the ILP's peak rows
(``solve.peak``) bound the steps it finds highest.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.fx as fx

from autoplan.cost.overlap import regathered
from autoplan.shard.strategies import aliases_input, output_vals
from autoplan.trace.recompute import closure, just_in_time, layer_of
from autoplan.trace.tracing import PHASE_KEY, TracedGraph


@dataclass(frozen=True)
class Recomputed:
    """The backward's copy of a forward value the plan recomputes (``autoplan.trace.recompute``)."""

    node: fx.Node

    @property
    def name(self) -> str:
        return f"{self.node.name} (recomputed)"


Key = fx.Node | Recomputed  # a schedule entry: a graph node, or the recomputed copy of one


def node_of(key: Key) -> fx.Node:
    return key.node if isinstance(key, Recomputed) else key


@dataclass(frozen=True)
class Schedule:
    """The step order of the joint graph and how long each stored value lives; placement-independent.

    With recompute, the backward's order holds the recomputed copies where the lowering runs them
    (right before their first reader), and the originals die at their last forward read."""

    order: tuple[Key, ...]
    step: dict[Key, int]  # call_function and placeholder entries -> position in the schedule
    owner: dict[Key, Key]  # each value -> the entry whose storage it lives in (views -> base)
    born: dict[Key, int]  # storage owner -> first step it is alive
    last_use: dict[Key, int]  # each value -> the last step that reads it (itself, not its views)
    view_last: dict[Key, int]  # each view -> the last step that reads it or a view of it
    reads: dict[Key, int]  # each value -> the last op that reads it (graph outputs not counted)
    dies: dict[Key, int]  # storage owner -> last step it is alive
    resident: frozenset[fx.Node]  # parameters, buffers, inputs, constants: alive throughout
    forward_end: int  # the last forward step
    n_steps: int
    param_values: frozenset[fx.Node] = frozenset()  # parameters and their forward views
    issued: dict[Key, int] = field(default_factory=dict)  # op reading param_values -> its gathers' step
    # op reading param_values -> where its layer's bucket of gathers is copied out of the flat buffer
    # (which then holds them all once more): its layer's first reader in its phase
    copied_out: dict[Key, int] = field(default_factory=dict)
    views: dict[Key, tuple[Key, ...]] = field(default_factory=dict)  # each entry -> the views read from it


def _order(nodes: list[fx.Node], recomputed: frozenset[fx.Node]) -> tuple[list[Key], dict[Key, list[Key]]]:
    """Entries in run order and the entries each one reads: the backward (and recomputed copies)
    read the copies of recomputed values."""
    if not recomputed:
        return list(nodes), {n: n.all_input_nodes for n in nodes}
    backward = [n for n in nodes if n.op == "call_function" and n.meta.get(PHASE_KEY) == "backward"]
    in_backward = set(backward)
    forward = [n for n in nodes if n not in in_backward]
    rerun = closure(forward, [a for n in backward for a in n.all_input_nodes], recomputed.__contains__)
    copies = set(rerun)
    order: list[Key] = [*forward, *(Recomputed(n) if n in copies else n for n in just_in_time(rerun, backward))]

    def read_in_backward(a: fx.Node) -> Key:
        return Recomputed(a) if a in copies else a

    inputs: dict[Key, list[Key]] = {}
    for k in order:
        n = node_of(k)
        late = isinstance(k, Recomputed) or n in in_backward
        inputs[k] = [read_in_backward(a) if late else a for a in n.all_input_nodes]
    return order, inputs


def issue_steps(order: list[Key], step: dict[Key, int], reading: list[Key], ahead: int) -> dict[Key, int]:
    """For each of ``reading`` (ops reading a parameter), the step the lowering issues its
    parameters' gathers at. ``ahead`` 0: where its layer's first reader in its phase runs (the
    layer's gathers run in one bucket issued there, ``lower.passes.bucketing``); 1: the first step
    of the stretch before its own, where prefetch issues them (``lower.passes.prefetch``). A
    stretch is a run of one layer instance in one phase (the forward and the backward are graphs
    of their own: a backward op's gathers are never issued in the forward). Ops outside layers
    are gathered where they run."""
    first: list[int] = []  # each stretch's first step, -1 before the backward's first
    index: dict[Key, int] = {}
    previous = None
    for k in order:
        n = node_of(k)
        if n.op != "call_function":
            continue
        late = isinstance(k, Recomputed) or n.meta.get(PHASE_KEY) == "backward"
        tag = (layer_of(n), late)
        if tag != previous:
            if previous is not None and previous[1] != late:
                first.append(-1)
            first.append(step[k])
            previous = tag
        index[k] = len(first) - 1
    if ahead:
        return {k: first[index[k] - 1] if index[k] > 0 and first[index[k] - 1] >= 0 else step[k] for k in reading}
    own: dict[tuple, int] = {}  # (layer, phase) -> its first reader's step
    out = {}
    for k in reading:
        n = node_of(k)
        layer = layer_of(n)
        if layer:
            key = (layer, isinstance(k, Recomputed) or n.meta.get(PHASE_KEY) == "backward")
            out[k] = own.setdefault(key, step[k])
    return out


def schedule(tg: TracedGraph, recomputed: frozenset[fx.Node] = frozenset(), prefetch: bool = False) -> Schedule:
    """The schedule of the joint graph; ``recomputed``: forward ops the backward runs again (the
    parameters' gathered views always are, see ``regathered``); the lowering gathers each op's
    parameters where its layer's first are gathered (one bucket), or with ``prefetch`` a stretch
    ahead of it (``Schedule.issued``)."""
    nodes = [n for n in tg.gm.graph.nodes if n.op in ("placeholder", "call_function", "get_attr")]
    params = set(tg.placeholder_for("param").values())
    views = regathered(nodes, params)
    order, inputs = _order(nodes, recomputed | views)
    step = {k: i for i, k in enumerate(order)}
    last = len(order) - 1
    forward_end = max((step[n] for n in nodes if n.meta.get(PHASE_KEY) == "forward"), default=last)
    kinds = {n: lab[0] for n, lab in zip(tg.placeholders, tg.input_labels)}
    always = tg.resident()
    resident = frozenset(n for n in nodes if n.op == "get_attr" or n in always)
    owner: dict[Key, Key] = {}
    reads = dict(step)
    for k in order:
        ins = inputs[k]
        owner[k] = owner[ins[0]] if aliases_input(node_of(k)) and ins and ins[0] in owner else k
        for a in ins:
            if a in reads:
                reads[a] = max(reads[a], step[k])
    last_use = dict(reads)
    out_kinds = [lab[0] for lab in tg.output_labels]
    for o, kind in zip(tg.output_node.args[0], out_kinds):
        if isinstance(o, fx.Node):
            last_use[o] = max(last_use[o], last if kind.startswith("grad") else forward_end)
    dies = dict(last_use)
    view_last = {k: last_use[k] for k in order if owner[k] is not k}
    for k in order:
        dies[owner[k]] = max(dies[owner[k]], last_use[k])
        parent = inputs[k][0] if k in view_last else None
        while parent in view_last:  # a view of a view keeps what its parent owns alive
            view_last[parent] = max(view_last[parent], last_use[k])
            parent = inputs[parent][0]
    first_backward = forward_end + 1
    born = {k: (first_backward if kinds.get(k) == "tangent" else step[k]) for k in order}
    for k in order:  # the autograd engine holds the backward's arguments until it returns
        if kinds.get(k) == "tangent":
            dies[k] = last
    for n in resident:
        born[n], dies[n] = 0, last
    param_values = frozenset(params | views)
    calls = (k for k in order if node_of(k).op == "call_function")
    reading = [k for k in calls if any(node_of(a) in param_values for a in inputs[k])]
    copied_out = issue_steps(order, step, reading, 0)
    issued = issue_steps(order, step, reading, 1) if prefetch else copied_out
    return Schedule(
        tuple(order),
        step,
        owner,
        born,
        last_use,
        view_last,
        reads,
        dies,
        resident,
        forward_end,
        len(order),
        param_values,
        issued,
        copied_out,
        _views_of(view_last, inputs),
    )


def _views_of(view_last: dict[Key, int], inputs: dict[Key, list[Key]]) -> dict[Key, tuple[Key, ...]]:
    """Each entry read by a view -> those views (``Schedule.views``)."""
    out: dict[Key, list[Key]] = {}
    for k in view_last:
        out.setdefault(inputs[k][0], []).append(k)
    return {k: tuple(v) for k, v in out.items()}


def live_storages(sched: Schedule, step: int) -> list[Key]:
    """The stored values alive at ``step`` (views counted in their base), whatever the placements."""
    return [n for n, o in sched.owner.items() if o is n and sched.born[n] <= step <= sched.dies[n]]


def stored_at(sched: Schedule, step: int, moving: bool = False) -> list[Key]:
    """``live_storages`` at ``step``; ``moving``: while the op there has its inputs moved, before
    it makes its own storage."""
    made = sched.order[step] if moving else None
    return [k for k in live_storages(sched, step) if k is not made]


def live_profile(sched: Schedule) -> np.ndarray:
    """Bytes alive at each step with every value unsharded: where the peaks are, whatever the
    placements (they scale most values alike)."""
    delta = np.zeros(sched.n_steps + 1)
    for n, o in sched.owner.items():
        if o is n:
            vals = output_vals(node_of(n))
            b = sum(v.numel() * v.element_size() for v in vals if isinstance(v, torch.Tensor))
            delta[sched.born[n]] += b
            delta[sched.dies[n] + 1] -= b
    return np.cumsum(delta)[:-1]


def candidate_steps(sched: Schedule, count: int = 4) -> list[int]:
    """Where the peak is likely, for the ILP to bound: the end of the forward and the highest local
    maxima of the unsharded profile."""
    live = live_profile(sched)
    left, right = np.r_[-np.inf, live[:-1]], np.r_[live[1:], -np.inf]
    maxima = np.flatnonzero((live >= left) & (live > right))
    top = maxima[np.argsort(-live[maxima], kind="stable")][:count]
    return sorted({sched.forward_end, *(int(t) for t in top)})


def chain_peak(sched: Schedule, step: int, live: np.ndarray) -> int:
    """Of ``step`` and the recomputed copies run right before it (the chain it triggers), the step
    with the most bytes alive in the profile ``live``: a chain's intermediates can die before the
    op that needs its end, so the chain's own peak may be above that op's."""
    first = step
    while first > 0 and isinstance(sched.order[first - 1], Recomputed):
        first -= 1
    return first + int(np.argmax(live[first : step + 1]))
