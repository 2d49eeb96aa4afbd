"""Activation recompute options: which forward values a layer recomputes in backward, and when.

A layer (a repeated module instance, ``layers.3``) may drop forward values the backward reads and
compute them again from what it does keep, when the backward first needs them:

- ``selective``: the layer's cheap ops (pointwise, norms' reductions, views): their outputs are as
  big as a matmul's but cost almost nothing to recompute;
- ``full``: every forward op of the layer (activation checkpointing): only the layer's outputs
  (what later layers read) and the values it reads from outside stay saved;
- ``checkpoint``: what the model's own ``torch.utils.checkpoint`` calls recompute, offered on the
  layers that make them (``fold_checkpoints``).

A layer's outputs are never recomputed: that would chain each layer's recompute into the one
before it. Layers with random ops (dropout) are not offered: recomputing them would draw new
numbers. The memory model prices the options (``autoplan.cost.memory``), the ILP chooses, and the
lowering tags the chosen ops so the partition runs them again (the FSDP re-gather mechanism).
"""

from __future__ import annotations

import operator
from collections.abc import Iterable

import torch
import torch.fx as fx

from autoplan.adapters.ops import schema as op_schema
from autoplan.trace.clustering import instance_of
from autoplan.trace.tracing import CHECKPOINT_KEY, PATH_KEY, PHASE_KEY, RERUN_KEY

OPTIONS = ("selective", "full", "checkpoint")
aten = torch.ops.aten
# reductions a norm is made of: cheap, and their inputs are saved anyway
_NORM_REDUCTIONS = {aten.mean.dim, aten.sum.dim_IntList, aten.amax.default, aten.var_mean.correction}


def layer_of(node: fx.Node) -> str:
    """The repeated-layer instance a traced node belongs to ("" outside any)."""
    layer = instance_of(node.meta.get(PATH_KEY, ""))
    return layer[0] if layer else ""


def _forward_ops(graph: fx.Graph) -> Iterable[fx.Node]:
    return (n for n in graph.nodes if n.op == "call_function" and n.meta.get(PHASE_KEY) == "forward")


def _is_random(node: fx.Node) -> bool:
    """Does the op draw random numbers? Attention kernels are tagged so for their dropout, which
    draws nothing at ``dropout_p=0``."""
    if torch.Tag.nondeterministic_seeded not in getattr(node.target, "tags", ()):
        return False
    schema = op_schema(node.target)
    for i, arg in enumerate(schema.arguments):
        if arg.name == "dropout_p":
            p = node.args[i] if i < len(node.args) else node.kwargs.get("dropout_p", arg.default_value)
            return p != 0
    return True


def _is_cheap(node: fx.Node) -> bool:
    op = node.target
    if op is operator.getitem or getattr(op, "is_view", False) or op in _NORM_REDUCTIONS:
        return True
    return torch.Tag.pointwise in getattr(op, "tags", ())


def layers(graph: fx.Graph) -> dict[str, list[fx.Node]]:
    """Forward ops per layer that may recompute (no random op), in graph order."""
    found: dict[str, list[fx.Node]] = {}
    for n in _forward_ops(graph):
        if layer := layer_of(n) or n.meta.get(CHECKPOINT_KEY, ""):
            found.setdefault(layer, []).append(n)
    return {k: ops for k, ops in found.items() if not any(_is_random(n) for n in ops)}


def tagged(ops: list[fx.Node], option: str) -> frozenset[fx.Node]:
    """The ops of one layer that ``option`` recomputes: never the layer's outputs."""
    if option not in OPTIONS:
        raise ValueError(f"unknown recompute option {option!r}; choose from {', '.join(OPTIONS)}")
    inside = set(ops)
    outputs = {
        n
        for n in ops
        if any(u not in inside and u.meta.get(PHASE_KEY) == "forward" or u.op == "output" for u in n.users)
    }
    # a tuple's elements are outputs when the tuple is: the tuple itself is kept with them
    outputs |= {n for n in ops if any(u in outputs and u.target is operator.getitem for u in n.users)}
    wanted = {
        "full": lambda n: True,
        "selective": _is_cheap,
        "checkpoint": lambda n: bool(n.meta.get(CHECKPOINT_KEY)),
    }[option]
    chosen = {n for n in ops if n not in outputs and wanted(n)}
    # an element is recomputed from its tuple, which is never saved whole: only with its producer
    return frozenset(n for n in chosen if n.target is not operator.getitem or n.args[0] in chosen)


def chosen_nodes(graph: fx.Graph, choice: dict[str, str]) -> frozenset[fx.Node]:
    """Every forward op a plan's recompute choice (layer -> option) recomputes."""
    per_layer = layers(graph)
    missing = sorted(set(choice) - set(per_layer))
    if missing:
        raise ValueError(f"no layer {missing[0]!r} that can recompute in this graph")
    return frozenset().union(*(tagged(per_layer[k], o) for k, o in choice.items()))


def closure(forward: list[fx.Node], read: Iterable[fx.Node], is_tagged) -> list[fx.Node]:
    """Tagged forward nodes among the values the backward reads (``read``), with the tagged nodes
    they depend on, in forward order."""
    need: set[fx.Node] = set()
    stack = [a for a in read if is_tagged(a)]
    while stack:
        n = stack.pop()
        if n not in need:
            need.add(n)
            stack.extend(a for a in n.all_input_nodes if is_tagged(a))
    return [n for n in forward if n in need]


def just_in_time(recompute: list[fx.Node], backward: list[fx.Node]) -> list[fx.Node]:
    """Backward nodes in order, each recomputed chain placed right before its first reader.

    A recomputed value then lives only while its own layer's backward runs (FSDP's memory contract
    for re-gathered weights, checkpointing's for activations), instead of every layer's being
    recomputed at the start of the backward.
    """
    position = {n: i for i, n in enumerate(recompute)}
    placed: set[fx.Node] = set()
    order: list[fx.Node] = []
    for n in backward:
        stack, due = [a for a in n.all_input_nodes if a in position and a not in placed], set()
        while stack:
            a = stack.pop()
            if a not in due:
                due.add(a)
                stack.extend(b for b in a.all_input_nodes if b in position and b not in placed)
        order += sorted(due, key=position.__getitem__)
        placed |= due
        order.append(n)
    return [*order, *(n for n in recompute if n not in placed)]


def _key(value, canon: dict[fx.Node, fx.Node]):
    """A hashable form of an op's arguments, nodes by identity (a copy's as the forward op it copies);
    ``None`` for one that has none."""
    if isinstance(value, fx.Node):
        return canon.get(value, value)
    if isinstance(value, (list, tuple)):
        parts = tuple(_key(v, canon) for v in value)
        return None if None in parts else (type(value).__name__, parts)
    if isinstance(value, dict):
        return _key(sorted(value.items()), canon)
    try:
        hash(value)
    except TypeError:
        return None
    return (type(value).__name__, value)


def _copies(graph: fx.Graph) -> list[dict[fx.Node, fx.Node]]:
    """The runs of backward ops that copy forward ops (copy -> its forward op), in graph order: ops
    with a forward op's target and arguments, and detaches of what they copy. A run stops at the
    first backward op that is not such a copy."""
    first: dict[tuple, fx.Node] = {}
    canon: dict[fx.Node, fx.Node] = {}
    runs: list[dict[fx.Node, fx.Node]] = [{}]
    for n in graph.nodes:
        if n.op != "call_function":
            continue
        key = None if _is_random(n) else _key((n.target, n.args, n.kwargs), canon)
        if n.meta.get(PHASE_KEY) == "forward":
            if key is not None:
                first.setdefault(key, n)
            continue
        twin = first.get(key) if key is not None else None
        if n.target is aten.detach.default and isinstance(n.args[0], fx.Node):
            value = canon.get(n.args[0], n.args[0])
            if value.meta.get(PHASE_KEY) == "forward" and (n.args[0] in canon or n.meta.get(RERUN_KEY)):
                twin = value
        if twin is None:
            if runs[-1]:
                runs.append({})
            continue
        canon[n] = runs[-1][n] = twin
    return [run for run in runs if run]


def fold_checkpoints(graph: fx.Graph) -> int:
    """Turn the model's own checkpointing into a recompute option the planner may keep or drop.

    Traced, a ``torch.utils.checkpoint`` region runs its forward ops a second time in the backward:
    a run of copies of forward ops (and detaches of them), some made by modules called while the
    backward is traced (``RERUN_KEY``). Each such run is folded into the forward ops it copies, which
    are marked ``CHECKPOINT_KEY`` with the layer they belong to (the layer of most of them: code in
    the checkpointed function outside any module joins it). The ``checkpoint`` option then
    recomputes exactly what the model's checkpointing did, just in time as it did, and ``none``
    keeps the values saved instead. A run outside any layer that may recompute stays as traced:
    the model's recomputation there is kept as it is. Returns how many copies were folded."""
    offered = layers(graph)
    folded = 0
    for run in _copies(graph):
        if not any(n.meta.get(RERUN_KEY) for n in run):
            continue  # an op the backward computes again for its own reasons, not a checkpoint
        found = [layer_of(twin) for twin in run.values() if layer_of(twin)]
        layer = max(found, key=found.count) if found else ""
        if layer not in offered:
            continue
        for n, twin in run.items():
            n.replace_all_uses_with(twin)
            graph.erase_node(n)
            if n.target is not aten.detach.default:
                twin.meta[CHECKPOINT_KEY] = layer
            folded += 1
    return folded


def checkpointed_layers(graph: fx.Graph) -> list[str]:
    """Layers where the model checkpoints some of its own forward ops (``fold_checkpoints``)."""
    return [layer for layer, ops in layers(graph).items() if tagged(ops, "checkpoint")]
