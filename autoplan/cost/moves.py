"""Every edge of a traced graph that carries a placement: the one list of the moves a plan may make.

A move takes a value from the placement its producer makes it in to the one its reader wants: an
op's tensor input, a parameter's gradient (into its parameter's placement, where the optimizer step
reads it), a model output (into its constrained placement, else its tangent's). The list depends on
the graph and the output constraints alone, not on the placements chosen, so it is built once and
every pricing of a plan reads it: the ILP's edges, the expanded plan's redistributions, ``explain``'s
alternatives.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch.fx as fx

from autoplan.adapters.dtensor import TensorMeta, tensor_meta
from autoplan.cost import overlap
from autoplan.shard.strategies import Placements, Strategy, tensor_inputs, value_of
from autoplan.trace.tracing import TracedGraph


@dataclass(frozen=True)
class Move:
    """``value``, output ``k`` of ``src``, into input ``slot`` of ``dst``, or into a sink placed like
    the placeholder ``dst`` (``slot`` None: a parameter taking its gradient, a tangent taking a model
    output) or like ``fixed`` (``dst`` None: a constrained model output). ``consumer`` names the
    reader in reports (a node, ``grad:<fqn>`` or ``output:<i>``); ``kind``: which of the three it is;
    ``segment``: the overlap segment whose compute the move can hide under
    (``overlap.Hiding.segment_of``), None if it cannot; ``again``: the backward's second run of a
    move into a parameter's gathered view (``overlap.read_again``); ``bucket``: where the lowering
    runs its collectives inside one of a layer's buckets, where it pays ``share`` of their launch
    and latency (``CostModel.sharing``)."""

    src: fx.Node
    k: int
    value: fx.Node
    dst: fx.Node | None
    slot: int | None
    consumer: str
    kind: Literal["input", "gradient", "output"]
    phase: str
    segment: str | None
    fixed: Placements | None = None
    again: bool = False
    bucket: str | None = None  # the bucket its collectives run in (``overlap.Hiding.bucket_of``), if any
    share: float = 1.0  # of its collectives' latency it pays: one over its bucket's moves (``moves``)

    @functools.cached_property
    def meta(self) -> TensorMeta:
        """The moved tensor's metadata (made on first use: reading a stride is a call)."""
        return tensor_meta(self.value.meta["val"])

    def ends(self, strategy_of: Callable[[fx.Node], Strategy]) -> tuple[Placements, Placements]:
        """The placements the move takes the value between, each node's strategy from ``strategy_of``."""
        src = strategy_of(self.src).outputs[self.k]
        if self.dst is None:
            return src, self.fixed
        d = strategy_of(self.dst)
        return src, d.output if self.slot is None else d.inputs[self.slot]


def moves(tg: TracedGraph, fixed_outputs: dict[int, Placements], hiding: overlap.Hiding | None = None) -> list[Move]:
    """Every move of ``tg``'s plans: op inputs in graph order, then the parameters' gradients, then
    the model outputs with a placement to meet. ``hiding``: where moves hide
    (``overlap.Hiding.of(tg)`` unless given)."""
    hiding = hiding or overlap.Hiding.of(tg)
    found = input_moves(tg, hiding) + gradient_moves(tg, hiding) + output_moves(tg, fixed_outputs)
    sharing = Counter(m.bucket for m in found if m.bucket)
    return [dataclasses.replace(m, share=1.0 / sharing[m.bucket]) if m.bucket else m for m in found]


def input_moves(tg: TracedGraph, hiding: overlap.Hiding) -> list[Move]:
    """The ops' tensor inputs, in graph order."""
    out = []
    for n in tg.gm.graph.nodes:
        if n.op == "call_function" and n.target is not operator.getitem:
            out += op_inputs(n, hiding)
    return out


def op_inputs(n: fx.Node, hiding: overlap.Hiding | None = None) -> list[Move]:
    """The moves of one op's tensor inputs, the op in the traced graph or a recomputed copy of it in
    a schedule's; with ``hiding``, each move's segment, and the backward's second run of a move
    into a gathered view it reads (without, the memory model, which prices bytes at each step of
    its own schedule, where the backward's copy of the view is an op of its own)."""
    ph = overlap.phase(n)
    out = []
    for j, a in enumerate(tensor_inputs(n)):
        u, k = value_of(a)
        seg, bucket = (hiding.segment_of(u, n, False), hiding.bucket_of(u, n, False)) if hiding else (None, None)
        out.append(Move(u, k, a, n, j, n.name, "input", ph, seg, bucket=bucket))
        if hiding and n in hiding.again:
            seg, bucket = hiding.segment_of(u, n, False, again=True), hiding.bucket_of(u, n, False, again=True)
            out.append(Move(u, k, a, n, j, n.name, "input", "backward", seg, again=True, bucket=bucket))
    return out


def gradient_moves(tg: TracedGraph, hiding: overlap.Hiding | None = None) -> list[Move]:
    """Each parameter's gradient into its parameter's placement, in the graph's output order."""
    hiding = hiding or overlap.Hiding.of(tg)
    params = tg.placeholder_for("param")
    out = []
    for fqn, g in tg.outputs_of("grad_param").items():
        if g is not None:
            u, k = value_of(g)
            p = params[fqn]
            seg, bucket = hiding.segment_of(u, p, True), hiding.bucket_of(u, p, True)
            out.append(Move(u, k, g, p, None, f"grad:{fqn}", "gradient", "backward", seg, bucket=bucket))
    return out


def output_moves(tg: TracedGraph, fixed_outputs: dict[int, Placements]) -> list[Move]:
    """The model outputs' moves (``TracedGraph.output_sinks``): none hides, they end the forward."""
    out = []
    for s in tg.output_sinks(fixed_outputs):
        u, k = value_of(s.node)
        out.append(Move(u, k, s.node, s.tangent, None, f"output:{s.index}", "output", "forward", None, s.fixed))
    return out
