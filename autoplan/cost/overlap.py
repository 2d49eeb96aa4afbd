"""Which communication can run under compute, and where: what the lowered program overlaps.

A training step's collectives are not all on its critical path, but only those the per-rank
program issues ahead of their reader, or waits for after other work, run beside compute:

- A value computed from parameters alone (a weight's all-gather, its transposed view gathered
  again in backward) waits for no activation. It hides when the program prefetches parameter
  gathers a layer ahead (``AutoParallel(prefetch=True)``, ``lower.passes.prefetch``, as FSDP does on
  a second stream). Without prefetch the lowering issues it right before its reader, which waits.
- A parameter's gradient, once produced, moves into its parameter's placement while the backward
  goes on. An all-reduce's wait is where the result is read, or at the end of the next layer's
  stretch (``lower.passes.wait_sinking``): it hides under the rest of its producer's segment and
  the next, which its producer's whole segment stands for. A
  reduce-scatter's wait still follows it at once, and is priced hidden all the same until it is
  sunk too: priced exposed, it steers plans to layouts whose memory the walk over-counts.
- A parameter's gathered view is not kept for the backward: the lowering gathers it again there
  (``regathered``; FSDP's reshard after forward). The move into it, where it runs a collective,
  runs twice, the second time in the backward segment of its layer, where it hides only under the
  same rule.
- Everything else (an activation's all-reduce in tensor parallelism, a sequence-parallel gather)
  blocks the op reading it.

So each *segment*, a layer instance in one phase, hides up to min(its compute budget, its
hideable communication), the latter being the ``DeviceProfile.comm_overlap`` fraction of those
moves' collective seconds (``transfers.plan_seconds``): the step pays ``compute + comm - hidden``.
The budget is the compute the segment needs at least (each op at its fastest strategy), a
constant of the graph: with the compute of the chosen strategies instead, the ILP's LP relaxation
mixes strategies to balance the two and the solve takes minutes instead of seconds, while
sensible plans run each op near its fastest anyway (a plan that replicates compute is only denied
hiding under the extra time). Layers are alike, so a layer's own compute stands for the previous
layer's, under which its prefetch really runs. The ILP and the plan's evaluation both price
through this module, so the objective equals the expanded plan's cost.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.fx as fx

from autoplan.shard.strategies import aliases_input
from autoplan.trace.clustering import layer_instances
from autoplan.trace.precision import REDUCE_BEFORE
from autoplan.trace.tracing import PHASE_KEY, TracedGraph


def phase(n: fx.Node) -> str:
    """``forward`` or ``backward`` (placeholders and the output count as backward)."""
    return n.meta.get(PHASE_KEY, "backward")


def parameter_only(tg: TracedGraph) -> frozenset[fx.Node]:
    """Nodes whose value depends on parameters alone (and constants): a move of them can be
    issued ahead of the op that reads it."""
    params = set(tg.placeholder_for("param").values())
    found: set[fx.Node] = set()
    for n in tg.gm.graph.nodes:
        if n.op == "placeholder":
            if n in params:
                found.add(n)
        elif n.op == "call_function" and all(a in found for a in n.all_input_nodes):
            found.add(n)
    return frozenset(found)


def regathered(nodes: list[fx.Node], params: set[fx.Node]) -> frozenset[fx.Node]:
    """Forward views and casts of parameters (through views and casts only: a mixed-precision
    policy's cast to the compute dtype). Where a plan reads a parameter in another placement, such
    a value owns the gathered copy, and the lowering casts and gathers it again for the backward
    instead of keeping it (FSDP's reshard after forward, ``passes.fsdp_recompute``)."""
    found: set[fx.Node] = set()
    for n in nodes:
        if n.op != "call_function" or n.meta.get(PHASE_KEY) != "forward":
            continue
        if aliases_input(n) or n.target is torch.ops.aten._to_copy.default:
            ins = n.all_input_nodes
            if len(ins) == 1 and (ins[0] in params or ins[0] in found):
                found.add(n)
    return frozenset(found)


def read_again(tg: TracedGraph) -> frozenset[fx.Node]:
    """The ``regathered`` views the backward reads, itself or through another: the backward runs
    the move into each of them again."""
    views = regathered(list(tg.gm.graph.nodes), set(tg.placeholder_for("param").values()))
    found: set[fx.Node] = set()
    for n in reversed(tg.gm.graph.nodes):
        if n in views and any(phase(u) == "backward" or u in found for u in n.users):
            found.add(n)
    return frozenset(found)


def segment(instance: str, phase_name: str) -> str:
    return f"{instance or '(outside layers)'} {phase_name}"


@dataclass(frozen=True)
class Hiding:
    """Which moves of one traced graph can hide, and under which segment's compute, in the program
    lowered with or without ``prefetch``."""

    instance: dict[fx.Node, str]  # node -> layer instance, "" outside repeated layers
    params: frozenset[fx.Node]
    early: frozenset[fx.Node]  # parameter-only values where the program prefetches them, else none
    again: frozenset[fx.Node]  # views whose incoming move the backward runs again (``read_again``)
    from_params: frozenset[fx.Node] = frozenset()  # parameter-only values (``parameter_only``)

    @classmethod
    def of(cls, tg: TracedGraph, instance: dict[fx.Node, str] | None = None, prefetch: bool = False) -> Hiding:
        if instance is None:
            instance = {n: i for n, (i, _) in layer_instances(tg).items()}
        from_params = parameter_only(tg)
        early = from_params if prefetch else frozenset()
        return cls(instance, frozenset(tg.placeholder_for("param").values()), early, read_again(tg), from_params)

    def bucket_of(self, src: fx.Node, reader: fx.Node | None, into_output: bool, again: bool = False) -> str | None:
        """The bucket (a segment, layer instance and phase, and what it carries) whose collectives
        carry moving ``src``'s value, None if the lowering runs them on their own
        (``passes.bucketing``): a parameter-only value's move into an op (a weight's gather, and
        its re-gather in the backward, ``again``) joins its reader's layer's parameter bucket, a
        gradient's move into its parameter's placement (reduced before or after a cast back) its
        producer's gradient bucket."""
        if into_output and reader in self.params or reader is not None and reader.meta.get(REDUCE_BEFORE):
            at, what = src, "gradients"
        elif not into_output and reader is not None and src in self.from_params:
            at, what = reader, "parameters"
        else:
            return None
        return f"{segment(self.instance.get(at, ''), 'backward' if again else phase(at))} {what}"

    def segment_of(self, src: fx.Node, reader: fx.Node | None, into_output: bool, again: bool = False) -> str | None:
        """The segment whose compute moving ``src``'s value can hide under, ``None`` if it cannot.

        ``reader`` reads the moved value in its input (an op) or, with ``into_output``, in its
        output placement (a parameter taking its gradient, a tangent taking a model output). A
        prefetched parameter-only value read by an op counts in the op's segment (``again``: the
        backward's run of the move, in the backward segment of the op's layer); a gradient moved
        into its parameter's placement counts in its producer's (the move runs while the backward
        goes on; so does one reduced before its cast to the parameter's dtype).
        """
        if into_output:
            if reader not in self.params:
                return None
            at = src
        elif reader is not None and reader.meta.get(REDUCE_BEFORE):  # a gradient reduced before its cast back
            at = src
        elif reader is None or src not in self.early:
            return None
        else:
            at = reader
        return segment(self.instance.get(at, ""), "backward" if again else phase(at))


def least(seconds: np.ndarray) -> float:
    """An op's compute at its fastest strategy (strategies DTensor cannot run are ``inf``)."""
    finite = seconds[np.isfinite(seconds)]
    return float(finite.min()) if finite.size else 0.0


def budgets(tg: TracedGraph, least_of: Callable[[fx.Node], float]) -> dict[str, float]:
    """Per segment (layer instance and phase, as ``evaluate`` sees them): the compute it needs at
    least, from each node's ``least_of``, which its hideable communication can run under."""
    out: dict[str, float] = defaultdict(float)
    for n, (inst, _) in layer_instances(tg).items():
        if n.op == "call_function":
            out[segment(inst, phase(n))] += least_of(n)
    return dict(out)


def hidden_seconds(budget: dict[str, float], comm: dict[str, float]) -> float:
    """Seconds of communication that run under compute: per segment, the lesser of the two."""
    return sum(min(budget.get(s, 0.0), c) for s, c in comm.items())
