"""Find repeated layers before any per-node work, so strategies and ILP variables exist once per layer.

Nodes are grouped by layer instance (the module path up to its first numeric component, e.g.
``layers.7``). Instances of the same pattern (``layers.*``) whose node sequences are structurally
identical (same ops, shapes, dtypes, constant args, and the same wiring inside the instance) form a
class; every node of a clone is tied to the node at the same position in the class representative.
An instance that differs from all others simply stays unclustered: correctness never depends on it.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten

from autoplan.tracing import PATH_KEY, TracedGraph


@dataclass(frozen=True)
class Clustering:
    rep: dict[fx.Node, fx.Node]  # every node -> the node whose decisions it shares (itself if unclustered)
    multiplicity: dict[fx.Node, int]  # representative -> how many nodes it stands for
    classes: tuple[tuple[str, ...], ...]  # instance ids per class of identical layers (representative first)
    instance: dict[fx.Node, str]  # node -> layer instance id ("" outside any repeated module)

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
        if isinstance(a, fx.Node):
            if a in pos:
                return ("in", pos[a])
            # Only the shape matters outside the instance: layer 0 reads the embedding, layer 1 a residual add.
            return ("ext", _meta_sig(a))
        return repr(a)

    sig = []
    for n in nodes:
        flat, spec = tree_flatten((n.args, n.kwargs))
        target = rel_name.get(n, n.name) if n.op == "placeholder" else str(n.target)
        sig.append((n.op, target, _meta_sig(n), str(spec), tuple(arg_sig(a) for a in flat)))
    return tuple(sig)


def find_repeats(tg: TracedGraph) -> Clustering:
    paths = module_paths(tg)
    by_instance: dict[str, list[fx.Node]] = defaultdict(list)
    pattern_of: dict[str, str] = {}
    instance: dict[fx.Node, str] = {}
    for n in tg.gm.graph.nodes:
        if n.op == "output":
            continue
        found = instance_of(paths[n])
        if found is None:
            instance[n] = ""
            continue
        inst, pattern = found
        instance[n] = inst
        by_instance[inst].append(n)
        pattern_of[inst] = pattern

    rel_name = {}
    for n, lab in zip(tg.placeholders, tg.input_labels):
        found = instance_of(lab[1]) if isinstance(lab[1], str) else None
        rel_name[n] = f"{lab[0]}:{lab[1][len(found[0]) :] if found else lab[1]}"

    groups: dict[tuple, list[str]] = defaultdict(list)
    for inst, nodes in by_instance.items():
        groups[(pattern_of[inst], _signature(nodes, rel_name))].append(inst)

    rep = {n: n for n in tg.gm.graph.nodes}
    mult = {n: 1 for n in tg.gm.graph.nodes}
    classes = []
    for members in groups.values():
        if len(members) < 2:
            continue
        classes.append(tuple(members))
        head = by_instance[members[0]]
        for inst in members[1:]:
            for r, n in zip(head, by_instance[inst]):
                rep[n] = r
                mult[r] += 1
                mult[n] = 0
    return Clustering(rep=rep, multiplicity=mult, classes=tuple(classes), instance=instance)
