"""Per-node sharding strategies on an N-D mesh.

A strategy fixes the placements of a node's outputs and the placements it expects for each tensor
input. Sources, in order: autoplan's own rules (ops DTensor lacks, e.g. CPU flash attention),
DTensor's single-mesh-dim rules expanded to N-D as a product over mesh dims, DTensor's full N-D
rules, and finally a replicate-only fallback that warns (or raises in strict mode).
"""

from __future__ import annotations

import itertools
import operator
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.utils._pytree import tree_flatten, tree_map

from autoplan.adapters import dtensor as dt
from autoplan.tracing import PATH_KEY

Placements = dt.Placements
aten = torch.ops.aten


class UnsupportedOpError(RuntimeError):
    """An op has no sharding rule and strict mode forbids the replicate-only fallback."""


@dataclass(frozen=True)
class Strategy:
    """Placements of a node's outputs (``None`` for non-tensor outputs) and of its tensor inputs."""

    outputs: tuple[Placements | None, ...]
    inputs: tuple[Placements, ...]

    @property
    def output(self) -> Placements:
        return self.outputs[0]


@dataclass(frozen=True)
class NodeStrategies:
    strategies: tuple[Strategy, ...]
    source: str  # "autoplan" | "dtensor-1d" | "dtensor" | "placeholder" | "fallback"


def tensor_inputs(node: fx.Node) -> list[fx.Node]:
    """A node's fx-node arguments in flattened (args, kwargs) order; duplicates kept (``x + x``)."""
    flat, _ = tree_flatten((node.args, node.kwargs))
    return [a for a in flat if isinstance(a, fx.Node)]


def value_of(node: fx.Node) -> tuple[fx.Node, int]:
    """The (producer, output index) a node's value comes from: getitems read a multi-output producer."""
    if node.op == "call_function" and node.target is operator.getitem:
        return node.args[0], node.args[1]
    return node, 0


def output_vals(node: fx.Node) -> tuple:
    val = node.meta.get("val")
    return tuple(val) if isinstance(val, (tuple, list)) else (val,)


def is_valid(placements: Placements | None, val, mesh_shape: Sequence[int]) -> bool:
    """Reject shards the mesh cannot split evenly, partial integer tensors and exotic placement types."""
    if placements is None:
        return True
    if not isinstance(val, torch.Tensor):
        return all(isinstance(p, Replicate) for p in placements)
    factor: dict[int, int] = {}
    for size, p in zip(mesh_shape, placements):
        if type(p) not in (Replicate, Shard, Partial):  # e.g. DTensor's strided shards: never planned
            return False
        if isinstance(p, Shard):
            d = p.dim + val.ndim if p.dim < 0 else p.dim
            if not 0 <= d < val.ndim:
                return False
            factor[d] = factor.get(d, 1) * size
        elif isinstance(p, Partial) and not (val.dtype.is_floating_point or val.dtype.is_complex):
            return False
    return all(val.shape[d] % f == 0 for d, f in factor.items())


def all_placements(val, mesh_shape: Sequence[int], partial: bool = False) -> list[Placements]:
    """Every valid Replicate/Shard (and optionally Partial) assignment over the mesh dims."""
    ndim = val.ndim if isinstance(val, torch.Tensor) else 0
    base = [Replicate(), *[Shard(d) for d in range(ndim)]] + ([Partial()] if partial else [])
    return [p for p in itertools.product(base, repeat=len(mesh_shape)) if is_valid(p, val, mesh_shape)]


def _product_rows(rows: Sequence[tuple], n_out: int, mesh_ndim: int) -> list[Strategy]:
    """Combine single-mesh-dim rows into N-D strategies: one row per mesh dim."""
    out = []
    for combo in itertools.product(rows, repeat=mesh_ndim):
        cols = list(zip(*combo))
        outs = tuple(None if any(p is None for p in c) else tuple(c) for c in cols[:n_out])
        ins = tuple(tuple(c) for c in cols[n_out:])
        out.append(Strategy(outs, ins))
    return out


def _sdpa_rows(n_out: int, n_in: int) -> list[tuple]:
    """Batch- and head-parallel attention: every 4-D tensor (and the 3-D logsumexp) sharded alike."""
    rows = [tuple([Replicate()] * (n_out + n_in))]
    for d in (0, 1):
        rows.append(tuple([Shard(d)] * (n_out + n_in)))
    return rows


# Ops DTensor has no rule for, keyed by op, giving single-mesh-dim rows (out..., in...).
_OWN_RULES: dict[torch._ops.OpOverload, Callable[[int, int], list[tuple]]] = {
    aten._scaled_dot_product_flash_attention_for_cpu.default: _sdpa_rows,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: _sdpa_rows,
}


def _meta_args(node: fx.Node):
    to_meta = lambda a: dt.tensor_meta(a.meta["val"]) if isinstance(a, fx.Node) else a  # noqa: E731
    return tree_map(to_meta, node.args), tree_map(to_meta, node.kwargs)


def _full_rule(node: fx.Node, mesh: DeviceMesh, choices: dict[fx.Node, list[Placements]]) -> list[Strategy]:
    """DTensor's N-D rule over all input choices at once, plus one call per aligned choice.

    Rules that follow their inputs (stack, cat, views) answer a many-choice query with the single
    strategy they prefer, and some raise when *one* choice is unusable; asking again with every
    input at the same placement recovers the alternatives.
    """
    out: list[Strategy] = []
    error: Exception | None = None
    try:
        out += _full_rule_once(node, mesh, choices)
    except Exception as e:  # noqa: BLE001 - DTensor rules raise many kinds of errors for bad choices
        error = e
    nodes = list(dict.fromkeys(tensor_inputs(node)))
    if len(nodes) == 1 and error is None:
        return out
    aligned = [
        p for p in dict.fromkeys(itertools.chain(*(choices[a] for a in nodes))) if all(p in choices[a] for a in nodes)
    ]
    for p in aligned:
        try:
            out += _full_rule_once(node, mesh, {a: [p] for a in nodes})
        except Exception:  # noqa: BLE001
            continue
    if not out and error is not None:
        raise error
    return out


def _full_rule_once(node: fx.Node, mesh: DeviceMesh, choices: dict[fx.Node, list[Placements]]) -> list[Strategy]:
    def wrap(a):
        if isinstance(a, fx.Node):
            return dt.input_choices(mesh, choices[a], dt.tensor_meta(a.meta["val"]))
        if isinstance(a, (list, tuple)) and a and all(isinstance(x, fx.Node) for x in a):
            return dt.tuple_choices([wrap(x) for x in a])
        return a

    args = tuple(wrap(a) for a in node.args)
    kwargs = {k: wrap(v) for k, v in node.kwargs.items()}
    out = []
    for outs, ins in dt.full_rule_strategies(node.target, args, kwargs):
        n_in = len(tensor_inputs(node))
        out.append(Strategy(outs, ins if ins is not None else (outs[0],) * n_in))
    return out


def _producible(
    node: fx.Node, cands: list[Strategy], choices: dict[fx.Node, list[Placements]], mesh_shape: Sequence[int]
) -> list[Strategy]:
    """Keep strategies whose inputs are placements the producers offer, or fully replicated.

    Expanding single-dim rules is a full product (every Partial flavour, every shard pairing); the
    inputs no producer can offer would only ever be reached by a redistribution, which the
    replicated (gathered) variant already covers.
    """
    inputs = tensor_inputs(node)
    offered = [set(choices[a]) | {(Replicate(),) * len(mesh_shape)} for a in inputs]
    return [s for s in cands if all(p in ok for p, ok in zip(s.inputs, offered))]


def _replicate_only(node: fx.Node, mesh_ndim: int) -> list[Strategy]:
    rep = (Replicate(),) * mesh_ndim
    outs = tuple(rep if isinstance(v, torch.Tensor) else None for v in output_vals(node))
    return [Strategy(outs, (rep,) * len(tensor_inputs(node)))]


def _filter(node: fx.Node, cands: Iterable[Strategy], mesh_shape: Sequence[int]) -> tuple[Strategy, ...]:
    ins = [a.meta["val"] for a in tensor_inputs(node)]
    outs = output_vals(node)
    seen: dict[Strategy, None] = {}
    for s in cands:
        if len(s.inputs) != len(ins) or len(s.outputs) != len(outs):
            continue
        if all(is_valid(p, v, mesh_shape) for p, v in zip(s.outputs, outs)) and all(
            is_valid(p, v, mesh_shape) for p, v in zip(s.inputs, ins)
        ):
            seen.setdefault(s)
    return tuple(seen)


@dataclass
class StrategyBuilder:
    """Enumerates strategies node by node; ``choices`` are the producers' candidate output placements."""

    mesh: DeviceMesh
    strict: bool = False

    def __post_init__(self):
        self.mesh_shape = tuple(self.mesh.shape)
        self._warned: set = set()

    def for_placeholder(self, node: fx.Node) -> NodeStrategies:
        val = node.meta["val"]
        return NodeStrategies(tuple(Strategy((p,), ()) for p in all_placements(val, self.mesh_shape)), "placeholder")

    def for_op(self, node: fx.Node, choices: dict[fx.Node, list[Placements]]) -> NodeStrategies:
        op = node.target
        n_in = len(tensor_inputs(node))
        n_out = len(output_vals(node))
        rep = (Replicate(),) * n_out + (Replicate(),) * n_in
        if op in _OWN_RULES:
            rows, source = _OWN_RULES[op](n_out, n_in), "autoplan"
            return self._finish(node, _product_rows(rows, n_out, len(self.mesh_shape)), source)
        if isinstance(op, torch._ops.OpOverload):
            args_meta, kwargs_meta = _meta_args(node)
            rows = dt.single_dim_rules(op, args_meta, kwargs_meta)
            if rows is not None:
                rows = [r for r in rows if len(r) == n_out + n_in] + [rep]
                cands = _product_rows(rows, n_out, len(self.mesh_shape))
                return self._finish(node, _producible(node, cands, choices, self.mesh_shape), "dtensor-1d")
            if dt.has_full_rule(op):
                return self._finish(node, _full_rule(node, self.mesh, choices), "dtensor")
        return self._fallback(node)

    def _finish(self, node: fx.Node, cands: list[Strategy], source: str) -> NodeStrategies:
        strategies = _filter(node, cands, self.mesh_shape)
        if not strategies:
            return self._fallback(node)
        return NodeStrategies(strategies, source)

    def _fallback(self, node: fx.Node) -> NodeStrategies:
        path = node.meta.get(PATH_KEY) or "<top level>"
        msg = f"no sharding rule for {node.target} (node {node.name}, module {path})"
        if self.strict:
            raise UnsupportedOpError(msg + "; strict mode forbids running it replicated")
        if node.target not in self._warned:
            self._warned.add(node.target)
            warnings.warn(msg + "; it will run replicated", stacklevel=2)
        return NodeStrategies(tuple(_replicate_only(node, len(self.mesh_shape))), "fallback")


def enumerate_strategies(
    graph: fx.Graph, rep: dict[fx.Node, fx.Node], builder: StrategyBuilder
) -> dict[fx.Node, NodeStrategies]:
    """Strategies for every representative node, in graph order.

    An input's choices are the placements its producer can output. When the producer has not been
    enumerated yet (a tied layer reading a later copy's value), every placement is a choice.
    """
    out: dict[fx.Node, NodeStrategies] = {}
    for n in graph.nodes:
        if rep[n] is not n:
            continue
        if n.op == "placeholder":
            out[n] = builder.for_placeholder(n)
        elif n.op == "call_function" and n.target is not operator.getitem:
            choices = {}
            for a in tensor_inputs(n):
                u, k = value_of(a)
                if rep[u] in out:
                    choices[a] = list(dict.fromkeys(s.outputs[k] for s in out[rep[u]].strategies))
                else:
                    choices[a] = all_placements(a.meta["val"], builder.mesh_shape, partial=True)
            out[n] = builder.for_op(n, choices)
    return out
