"""Find repeated layers before any per-node work, so strategies and ILP variables exist once per layer.

Nodes are grouped by layer instance (the module path up to its first numeric component, e.g.
``layers.7``). Instances of the same pattern (``layers.*``) whose node sequences are structurally
identical (same ops, shapes, dtypes, constant args, and the same wiring inside the instance) form a
class; every node of a clone is tied to the node at the same position in the class representative.
An instance that differs from all others simply stays unclustered: correctness never depends on it.

Identical layers are not always interchangeable: the first reads the embedding and its input
gradient ends in the embedding backward, the last feeds the final norm. A class ties them to the
middle layers anyway, so the ILP stays one layer's size, and lists them in ``boundary``: the
planner then re-solves each such group on its own against the rest (``api.AutoParallel``). A class
needs two layers in the same position (a middle); shorter stacks are not tied at all.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.fx as fx

from autoplan.trace.tracing import PATH_KEY, TracedGraph


@dataclass(frozen=True)
class Clustering:
    rep: dict[fx.Node, fx.Node]  # every node -> the node whose decisions it shares (itself if unclustered)
    multiplicity: dict[fx.Node, int]  # representative -> how many nodes it stands for
    classes: tuple[tuple[str, ...], ...]  # instance ids per class of identical layers (representative first)
    instance: dict[fx.Node, str]  # node -> layer instance id ("" outside any repeated module)
    # instances tied to a class although they sit elsewhere (first/last layer): refined on their own
    boundary: tuple[tuple[str, ...], ...] = ()

    @property
    def n_clustered(self) -> int:
        return sum(1 for n, r in self.rep.items() if n is not r)


def module_paths(tg: TracedGraph) -> dict[fx.Node, str]:
    """Module path per node; parameters use their owner module, untagged ops inherit from an input."""
    owner = {
        n: lab[1].rpartition(".")[0]
        for n, lab in zip(tg.placeholders, tg.input_labels)
        if lab[0] in ("param", "buffer")
    }
    paths: dict[fx.Node, str] = {}
    for n in tg.gm.graph.nodes:
        path = owner.get(n) or n.meta.get(PATH_KEY, "")
        if not path and n.op == "call_function":
            path = next((paths[a] for a in n.all_input_nodes if paths.get(a)), "")
        paths[n] = path
    return paths


def instance_of(path: str) -> tuple[str, str] | None:
    """``layers.3.attention.wq`` -> (``layers.3``, ``layers.*``); ``None`` without a numeric component."""
    parts = path.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1]), ".".join([*parts[:i], "*"])
    return None


def _meta_sig(n: fx.Node) -> tuple:
    val = n.meta.get("val")
    vals = val if isinstance(val, (tuple, list)) else (val,)
    return tuple((tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else repr(v) for v in vals)


def _signature(nodes: list[fx.Node], rel_name: dict[fx.Node, str]) -> tuple:
    pos = {n: i for i, n in enumerate(nodes)}

    def arg_sig(a):
        """``a`` with its nodes by position, its containers kept (pytree's flattening cost a second
        on LLaMA-3 70B's 25 K nodes)."""
        if isinstance(a, fx.Node):
            if a in pos:
                return ("in", pos[a])
            # Only the shape matters outside the instance: layer 0 reads the embedding, layer 1 a residual add.
            return ("ext", _meta_sig(a))
        if isinstance(a, (tuple, list)):
            return (type(a).__name__, *map(arg_sig, a))
        if isinstance(a, dict):
            return ("dict", *((k, arg_sig(v)) for k, v in a.items()))
        return repr(a)

    sig = []
    for n in nodes:
        target = rel_name.get(n, n.name) if n.op == "placeholder" else str(n.target)
        sig.append((n.op, target, _meta_sig(n), arg_sig(n.args), arg_sig(n.kwargs)))
    return tuple(sig)


def _context(nodes: list[fx.Node], instance: dict[fx.Node, str], pattern_of: dict[str, str]) -> tuple:
    """A layer's position: where each node's outside edges lead, to another layer or out of the stack."""
    own = instance[nodes[0]]

    def where(other: fx.Node) -> str:
        inst = instance.get(other, "")
        return "peer" if inst and pattern_of.get(inst) == pattern_of[own] else "out"

    ctx = []
    for n in nodes:
        ins = sorted(where(a) for a in n.all_input_nodes if instance.get(a) != own)
        outs = sorted(where(u) for u in n.users if u.op == "call_function" and instance.get(u) != own)
        ctx.append((tuple(ins), tuple(outs)))
    return tuple(ctx)


def layer_instances(tg: TracedGraph) -> dict[fx.Node, tuple[str, str]]:
    """Node -> (layer instance, pattern), ``("", "")`` outside repeated modules (the output node has none)."""
    paths = module_paths(tg)
    return {n: instance_of(paths[n]) or ("", "") for n in tg.gm.graph.nodes if n.op != "output"}


def unclustered(tg: TracedGraph) -> Clustering:
    """Every node deciding on its own, each still in its layer instance: overlap segments and
    recompute options are per layer whether or not identical layers share decisions."""
    nodes = list(tg.gm.graph.nodes)
    layers = layer_instances(tg)
    return Clustering(
        {n: n for n in nodes}, dict.fromkeys(nodes, 1), (), {n: layers.get(n, ("", ""))[0] for n in nodes}
    )


def find_repeats(tg: TracedGraph) -> Clustering:
    by_instance: dict[str, list[fx.Node]] = defaultdict(list)
    pattern_of: dict[str, str] = {}
    instance: dict[fx.Node, str] = {}
    for n, (inst, pattern) in layer_instances(tg).items():
        instance[n] = inst
        if inst:
            by_instance[inst].append(n)
            pattern_of[inst] = pattern

    rel_name = {}
    for n, lab in zip(tg.placeholders, tg.input_labels):
        found = instance_of(lab[1]) if isinstance(lab[1], str) else None
        rel_name[n] = f"{lab[0]}:{lab[1][len(found[0]) :] if found else lab[1]}"

    groups: dict[tuple, dict[tuple, list[str]]] = defaultdict(lambda: defaultdict(list))
    for inst, nodes in by_instance.items():
        groups[(pattern_of[inst], _signature(nodes, rel_name))][_context(nodes, instance, pattern_of)].append(inst)

    order = {inst: i for i, inst in enumerate(by_instance)}
    classes, boundary = [], []
    for by_context in groups.values():
        bulk = max(by_context.values(), key=len)
        if len(bulk) < 2:  # no two layers in the same position (a stack of 2 or 3): nothing to share
            continue
        classes.append(tuple(sorted((i for g in by_context.values() for i in g), key=order.__getitem__)))
        boundary += [tuple(g) for g in by_context.values() if g is not bulk]
    return _tie(tg.gm.graph.nodes, instance, tuple(classes), tuple(boundary))


def _tie(nodes, instance: dict[fx.Node, str], classes, boundary) -> Clustering:
    """Every node of a class member shares the decisions of the node at its position in the first
    member (in graph order, so strategies of the representative see their producers enumerated)."""
    by_instance: dict[str, list[fx.Node]] = defaultdict(list)
    for n, inst in instance.items():
        by_instance[inst].append(n)
    rep = {n: n for n in nodes}
    for members in classes:
        for inst in members[1:]:
            for r, n in zip(by_instance[members[0]], by_instance[inst]):
                rep[n] = r
    mult = {n: 0 for n in rep}
    for r in rep.values():
        mult[r] += 1
    return Clustering(rep, mult, classes, instance, boundary)


def untie(clustering: Clustering, group: tuple[str, ...]) -> Clustering:
    """``clustering`` with the instances of ``group`` sharing decisions only among themselves."""
    rest = [tuple(i for i in c if i not in group) for c in clustering.classes]
    classes = tuple(c for c in [*rest, group] if len(c) > 1)
    boundary = tuple(b for b in clustering.boundary if b != group)
    return _tie(clustering.rep, clustering.instance, classes, boundary)
