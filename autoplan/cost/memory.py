"""Per-device memory of a plan: what a training step keeps alive, step by step, and its peak.

A stage beside ``costs``: it reads the joint graph and a strategy per node and prices bytes instead
of seconds. The schedule is the joint graph's order (forward, then backward), which is the order the
lowered per-rank program runs in. At each step the live bytes are:

- resident: parameters, buffers and the input batch (local shards), and the optimizer's states;
- values: every op output from the step that makes it to the last step that reads it. Views share
  their base's storage. Gradients stay until the optimizer step; model outputs stay until the end of
  the forward (the loss is computed from them) unless the backward reads them. Forward values the
  backward reads are the activations saved for backward. The outputs' gradients (the backward's
  tangents) stay to the end of the backward: the autograd engine holds the arguments of the
  backward it calls (``runtime._PlanFunction``) until that returns, so the lowered graph's dropping
  them after their last reader frees nothing;
- transient: an op's inputs moved to another placement, alive while the op runs (the lowering
  redistributes each input inside the op's own segment, so the moved copy is not kept); likewise
  a gradient's move into its parameter's placement where it is produced, and the model outputs'
  moves at the forward's end. A view of a moved input owns the moved copy until the last reader
  of it or its views. Where the lowering prefetches (``Schedule.issued``), a parameter an op reads
  gathered is alive from the first step of the stretch (a layer instance in one phase) before the
  op's, where its gather is issued.

A step has two moments. While its inputs move, before the op makes anything, each move holds the
buffers its collectives make around themselves (a gather on a non-leading dim holds the gathered
chunks and their re-laid copy at once), which are freed before the op runs. While the op runs,
its moved inputs are their results alone, beside its outputs and the moves of the gradients it
makes; where such a move is the made copy's last reader, the made copy is freed once the move's
first collective or copy has read it, and the later buffers do not hold it. The step's bytes are
the higher moment's.

The ILP bounds the same sums at a few steps (``PeakRows``), each at the moment the walk found
higher there; every term is the bytes of one node's output under its chosen placement, or a
move's bytes over the placements at its two ends, which is linear in the placement choice
(exactly the walk's sum, but for a few rare shapes the rows over-count).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

import numpy as np
import torch
import torch.fx as fx

from autoplan.adapters.dtensor import Placements, tensor_meta
from autoplan.cost import moves
from autoplan.cost.costs import Price, local_bytes
from autoplan.cost.moves import Move
from autoplan.cost.timeline import Key, Recomputed, Schedule, chain_peak, live_storages, node_of, schedule, stored_at
from autoplan.plan import MemoryReport
from autoplan.shard.strategies import Strategy, aliases_input, output_vals, value_of
from autoplan.trace.recompute import layer_of
from autoplan.trace.tracing import PHASE_KEY, TracedGraph


@dataclass(frozen=True)
class OptimizerSpec:
    """What the optimizer keeps per parameter: AdamW's two fp32 states by default, and an fp32 master
    copy of parameters stored in a lower precision. ``state_dtype=None``: the states take each
    parameter's own dtype, as torch's optimizers keep them (``TORCH_ADAMW``)."""

    states: int = 2
    state_dtype: torch.dtype | None = torch.float32
    master_weights: bool = True

    def bytes_per_param_byte(self, dtype: torch.dtype) -> float:
        """Optimizer bytes per byte of a (local) parameter of ``dtype``."""
        per_element = self.states * (self.state_dtype or dtype).itemsize
        if self.master_weights and dtype.itemsize < torch.float32.itemsize:
            per_element += torch.float32.itemsize
        return per_element / dtype.itemsize


ADAMW = OptimizerSpec()
# ``torch.optim.AdamW`` run on the parameters as they are
TORCH_ADAMW = OptimizerSpec(state_dtype=None, master_weights=False)


class MovePrice(Protocol):
    """The bytes a move from the placement a value is made in to the one it is read in holds while
    it runs, its result included; with ``consumed``, where the move is the value's last reader, the
    bytes beyond the value's own (``CostModel.redistribute_peak_bytes``)."""

    def __call__(self, made: Placements, read: Placements, meta: Any, consumed: bool = False) -> float: ...


@dataclass(frozen=True)
class GradientMove:
    """A parameter's gradient where the schedule makes it. Made in another placement than its
    parameter's, it is moved there at once (the lowering reduces it where it is made): the made
    copy lives on only while its readers run, the moved one to the optimizer step."""

    move: Move  # the gradient into its parameter's placement
    owner: Key  # its storage (it may be a view, e.g. the transpose of a matmul's output)
    made: int
    kept: int  # the last step the made copy is alive when moved
    sole: bool  # its storage holds it alone (one gradient, of the storage's size)

    @property
    def value(self) -> fx.Node:
        """The graph's gradient output."""
        return self.move.value

    @property
    def param(self) -> fx.Node:
        return self.move.dst

    @property
    def consumed(self) -> bool:
        """Its move is its storage's last reader: the made copy is freed once the move's first
        primitive has read it, so the move's later buffers are held without it."""
        return self.sole and self.kept == self.made


def scheduled_gradients(grads: list[Move], sched: Schedule) -> list[GradientMove]:
    """Each of the gradients' moves (``moves.gradient_moves``) on ``sched``; placement-independent.
    A layer's gradients are moved together once its last is made (one bucket,
    ``lower.passes.bucketing``): each made copy lives until then."""
    values = {m.value for m in grads}
    count = Counter(sched.owner[o] for o in values)
    kept: dict[Key, int] = {}
    for n, owner in sched.owner.items():
        if owner in count:
            last = sched.reads[n] if n in values else sched.last_use[n]
            kept[owner] = max(kept.get(owner, sched.born[owner]), last)
    reduced: dict[str, int] = {}  # layer -> the step its last gradient is made
    for m in grads:
        if layer := layer_of(m.value):
            reduced[layer] = max(reduced.get(layer, 0), sched.step[m.value])
    out = []
    for m in grads:
        w, at = sched.owner[m.value], reduced.get(layer_of(m.value), sched.step[m.value])
        kept[w] = max(kept[w], at)
        out.append(GradientMove(m, w, at, kept[w], count[w] == 1 and _numel(node_of(w)) == _numel(m.value)))
    return out


def _numel(n: fx.Node) -> int:
    return sum(v.numel() for v in output_vals(n) if isinstance(v, torch.Tensor))


def _made(value: fx.Node, chosen: dict[fx.Node, Strategy]) -> Placements | None:
    """The placement ``chosen`` makes ``value`` in (None where it has no strategy)."""
    u, k = value_of(value)
    return chosen[u].outputs[k] if u in chosen else None


def gradient_prices(
    grads: list[GradientMove], step: int, move: MovePrice, mesh_shape, before: bool = False
) -> list[tuple[GradientMove, Price]]:
    """What each gradient adds at ``step`` (``before``: right before it) to its storage's bytes, as
    a price of its move (made placement, parameter's placement): the move's buffers where it is
    made (beyond the made copy's bytes, which it frees, where ``GradientMove.consumed``); the moved
    copy while the made one lives; afterwards the moved copy in the made one's place (exact for a
    storage holding one gradient of its own size, else the moved copy on top)."""
    copy = moved_copy_bytes(mesh_shape)

    def replaced(made: Placements, read: Placements, meta) -> float:
        return 0.0 if made == read else float(local_bytes(meta, read, mesh_shape) - local_bytes(meta, made, mesh_shape))

    out = []
    for g in grads:
        if step < g.made or before and step == g.made:
            continue
        made = partial(move, consumed=True) if g.consumed else move
        out.append((g, made if step == g.made else copy if step <= g.kept or not g.sole else replaced))
    return out


def value_bytes(node: fx.Node, outputs: tuple[Placements | None, ...], mesh_shape) -> int:
    """Local bytes of a node's tensor outputs under ``outputs``."""
    return sum(
        local_bytes(tensor_meta(v), pl, mesh_shape)
        for v, pl in zip(output_vals(node), outputs)
        if isinstance(v, torch.Tensor) and pl is not None
    )


def _moved_inputs(n: fx.Node, chosen: dict[fx.Node, Strategy], move: Price) -> float:
    """Bytes the moves of ``n``'s inputs to the placements ``n`` reads them in hold while it runs."""
    total = 0.0
    for m in moves.op_inputs(n):
        if m.src in chosen and isinstance(m.value.meta.get("val"), torch.Tensor):
            made, read = m.ends(chosen.__getitem__)
            if made != read:
                total += move(made, read, m.meta)
    return total


def _gathered_params(n: fx.Node, chosen: dict[fx.Node, Strategy], values: frozenset[fx.Node], mesh_shape) -> int:
    """Bytes of the copies ``n`` reads of parameter values (``values``) in a larger local shard than
    they are made in: the gathers the lowering's prefetch issues ahead of ``n``."""
    total = 0
    for m in moves.op_inputs(n):
        if m.value in values and m.src in chosen and isinstance(m.value.meta.get("val"), torch.Tensor):
            made, read = m.ends(chosen.__getitem__)
            copy = local_bytes(m.meta, read, mesh_shape)
            if copy > local_bytes(m.meta, made, mesh_shape):
                total += copy
    return total


def output_move_bytes(
    tg: TracedGraph,
    chosen: dict[fx.Node, Strategy],
    fixed_outputs: dict[int, Placements],
    move: MovePrice,
    sched: Schedule,
) -> float:
    """Bytes the model outputs' moves to their constrained placements (or their tangents') hold at
    the end of the forward, where the lowering makes them. An output the backward does not read is
    freed once the move's first step has read it (``consumed``)."""
    total = 0.0
    for m in moves.output_moves(tg, fixed_outputs):
        if m.value not in chosen or (m.dst is not None and m.dst not in chosen):
            continue
        target, made = m.fixed if m.dst is None else chosen[m.dst].outputs[0], chosen[m.value].outputs[0]
        if made != target:
            consumed = sched.dies.get(sched.owner.get(m.value), sched.n_steps) <= sched.forward_end
            total += move(made, target, m.meta, consumed=consumed)
    return total


@dataclass(frozen=True)
class Walk:
    """The bytes alive at each step of a schedule under a plan, and the report of its peak."""

    live: np.ndarray
    report: MemoryReport


def _moved_gradients(
    gms: list[GradientMove], chosen: dict[fx.Node, Strategy], sched: Schedule
) -> tuple[list[GradientMove], dict[Key, int]]:
    """The gradients made in another placement than their parameter's, and each storage's last step.

    Such a gradient is moved at once (the lowering reduces it where it is made): the made copy dies
    after its readers, the moved one stays. A storage holding only such gradients dies with them."""
    is_moved = [_made(g.value, chosen) not in (None, chosen[g.param].outputs[0]) for g in gms]
    moved = [g for g, m in zip(gms, is_moved) if m]
    dies = dict(sched.dies)
    kept = {g.owner for g in moved} - {g.owner for g, m in zip(gms, is_moved) if not m}
    for g in moved:
        if g.owner in kept:
            dies[g.owner] = g.kept
    return moved, dies


def _storages(
    sched: Schedule, chosen: dict[fx.Node, Strategy], mesh_shape, move: MovePrice, dies: dict[Key, int]
) -> dict[Key, tuple[int, int, int]]:
    """Storage -> (bytes, first step, last step) under ``chosen``. A view of a moved value owns the
    moved copy (its views too), from the view's step to its views' last reader; the value it was
    moved from no longer lives for those readers (an activation gathered for a matmul dies at its
    gather when the backward reads only the gathered copy)."""
    owned: dict[Key, tuple[int, int, int]] = {}
    copies = {
        k
        for k, o in sched.owner.items()
        if o is not k and node_of(k) in chosen and _moved_inputs(node_of(k), chosen, move)
    }
    for k, owner in sched.owner.items():
        n = node_of(k)
        if n not in chosen:
            continue
        if owner is k:
            owned[k] = (value_bytes(n, chosen[n].outputs, mesh_shape), sched.born[k], dies[k])
        elif k in copies:
            early = k in sched.issued and _gathered_params(n, chosen, sched.param_values, mesh_shape)
            born = sched.issued[k] if early else sched.step[k]
            owned[k] = (value_bytes(n, chosen[n].outputs, mesh_shape), born, sched.view_last[k])
    for o, last in _outlived(sched, copies, dies).items():
        if o in owned:
            owned[o] = (*owned[o][:2], last)
    return owned


def _outlived(sched: Schedule, copies: set[Key], dies: dict[Key, int]) -> dict[Key, int]:
    """The last step of each storage some of whose views own a moved copy (``copies``), counting
    only the readers of the storage itself and of the views that still share it. Parameters,
    inputs and outputs keep their lifetimes, and so does a storage the gradient walk ended."""
    last = {}
    for o in {sched.owner[k] for k in copies}:
        if not _may_outlive(sched, o, dies):
            continue
        last[o] = sched.last_use[o]
        stack = [v for v in sched.views.get(o, ()) if v not in copies]
        while stack:
            v = stack.pop()
            last[o] = max(last[o], sched.last_use[v])
            stack += [w for w in sched.views.get(v, ()) if w not in copies]
    return last


def _may_outlive(sched: Schedule, owner: Key, dies: dict[Key, int]) -> bool:
    """Whether ``owner``'s storage may die before its views' last reader (``_outlived``)."""
    return owner not in sched.resident and dies[owner] == sched.dies[owner] != sched.n_steps - 1


def held_by_views(sched: Schedule, storages: list[Key], step: int) -> list[tuple[Key, Key]]:
    """(storage, view) for each of ``storages`` alive at ``step`` only because one view read from
    it is still read (itself or through its own views): where that view reads it moved, the
    storage is dead by then (``_outlived``). An ILP row counts such a storage less its bytes where
    the view's input move is made; one kept by several views it counts whole (never less than the
    walk)."""
    out = []
    for o in storages:
        if _may_outlive(sched, o, sched.dies) and sched.last_use[o] < step:
            alive = [v for v in sched.views.get(o, ()) if sched.view_last[v] >= step]
            if len(alive) == 1:
                out.append((o, alive[0]))
    return out


def _prefetched(sched: Schedule, chosen: dict[fx.Node, Strategy], mesh_shape) -> list[tuple[int, int, int]]:
    """(bytes, first step, last step) of the parameters an op (not a view) reads gathered, from
    where the prefetch issues their gathers to the step before the op's (the op's own step counts
    them as its moved inputs; a view's gathered copy is its storage, see ``_storages``)."""
    spans = []
    for k, issued in sched.issued.items():
        n = node_of(k)
        if issued < sched.step[k] and n in chosen and not aliases_input(n):
            if b := _gathered_params(n, chosen, sched.param_values, mesh_shape):
                spans.append((b, issued, sched.step[k] - 1))
    return spans


def _bucket_buffers(sched: Schedule, chosen: dict[fx.Node, Strategy], mesh_shape) -> list[tuple[int, int, int]]:
    """(bytes, step, step) of each layer's flat buffer of gathered parameters where it is copied out
    (``Schedule.copied_out``): for that step, every gathered copy of the bucket is held twice."""
    spans = []
    for k, at in sched.copied_out.items():
        n = node_of(k)
        if n in chosen and (b := _gathered_params(n, chosen, sched.param_values, mesh_shape)):
            spans.append((b, at, at))
    return spans


def _stored_bytes(n_steps: int, spans: list[tuple[int, int, int]]) -> np.ndarray:
    """The bytes stored at each of ``n_steps`` steps, of ``spans`` (bytes, first step, last step)."""
    delta = np.zeros(n_steps + 1)
    for b, born, dies in spans:
        delta[born] += b
        delta[dies + 1] -= b
    return np.cumsum(delta)[:-1]


def _transients(
    sched: Schedule,
    chosen: dict[fx.Node, Strategy],
    mesh_shape,
    move: MovePrice,
    owned: dict[Key, tuple[int, int, int]],
    moved: list[GradientMove],
) -> tuple[np.ndarray, np.ndarray]:
    """The bytes beside the stored ones at each step's two moments: while its op runs (the moved
    copies it reads, then the moves of the gradients it makes), and while its inputs move, before
    it makes anything (the moves' buffers)."""
    running = np.zeros(sched.n_steps)
    moving = np.full(sched.n_steps, -np.inf)
    copy = moved_copy_bytes(mesh_shape)
    for k, step in sched.step.items():
        n = node_of(k)
        if n in chosen and n.op == "call_function":
            moving[step] = _moved_inputs(n, chosen, move) - (owned[k][0] if k in owned else 0)
            if not aliases_input(n):  # a view owns its moved copy (``_storages``)
                running[step] = _moved_inputs(n, chosen, copy)
    for g in moved:  # what the gradient's move holds besides its result (stored from its step)
        meta = tensor_meta(g.value.meta["val"])
        want = chosen[g.param].outputs[0]
        moved_copy = local_bytes(meta, want, mesh_shape)
        running[g.made] += move(_made(g.value, chosen), want, meta, consumed=g.consumed) - moved_copy
        moving[g.made] -= moved_copy  # not made yet
    return running, moving


def _peak_parts(
    sched: Schedule,
    owned: dict[Key, tuple[int, int, int]],
    extra: list[tuple[int, int, int]],
    early: list[tuple[int, int, int]],
    grads: set[Key],
    t: int,
    inputs_moving: bool,
) -> tuple[dict[str, int], int]:
    """The stored bytes alive at step ``t`` by kind, and the activations saved for the backward.
    ``inputs_moving``: the peak is while the op's inputs move, so what it makes there is not made yet."""
    peak = sched.order[t]
    parts = {"gradients": sum(b for b, born, dies in extra if born <= t <= dies and not (inputs_moving and born == t))}
    if early:  # prefetched for an op that runs later
        parts["gathered parameters"] = sum(b for b, born, dies in early if born <= t <= dies)
    saved = 0
    for n, (b, born, dies) in owned.items():
        kind = _kind(n, born, sched, grads)
        if born <= t <= dies and not (inputs_moving and n is peak):
            parts[kind] = parts.get(kind, 0) + b
        if kind == "activations" and dies > sched.forward_end:
            saved += b
    return parts, saved


def walk(
    tg: TracedGraph,
    chosen: dict[fx.Node, Strategy],
    mesh_shape,
    optimizer: OptimizerSpec = ADAMW,
    sched: Schedule | None = None,
    move: MovePrice | None = None,
    fixed_outputs: dict[int, Placements] | None = None,
    grads: list[Move] | None = None,
) -> Walk:
    """Walk the schedule under ``chosen`` and find the step with the most bytes alive.

    ``move`` prices what a redistribution holds while it runs (by default its result only; the
    cost model's ``redistribute_peak_bytes`` adds the buffers collectives make around themselves);
    ``fixed_outputs``: the placements constrained model outputs are moved to; ``grads``:
    ``moves.gradient_moves(tg)``, where it was made already."""
    sched = sched or schedule(tg)
    move = move or moved_copy_bytes(mesh_shape)
    params = tg.placeholder_for("param")
    per_param = {f: value_bytes(n, chosen[n].outputs, mesh_shape) for f, n in params.items()}
    optimizer_bytes = int(
        sum(per_param[f] * optimizer.bytes_per_param_byte(n.meta["val"].dtype) for f, n in params.items())
    )
    gms = scheduled_gradients(moves.gradient_moves(tg) if grads is None else grads, sched)
    moved, dies = _moved_gradients(gms, chosen, sched)
    owned = _storages(sched, chosen, mesh_shape, move, dies)
    last = sched.n_steps - 1
    extra = [(value_bytes(g.param, chosen[g.param].outputs, mesh_shape), g.made, last) for g in moved]
    early = _prefetched(sched, chosen, mesh_shape) + _bucket_buffers(sched, chosen, mesh_shape)
    stored = _stored_bytes(sched.n_steps, [*owned.values(), *extra, *early])
    running, moving = _transients(sched, chosen, mesh_shape, move, owned, moved)
    # and while the forward's last op runs, the model outputs' moves
    running[sched.forward_end] += output_move_bytes(tg, chosen, fixed_outputs or {}, move, sched)
    live = stored + np.maximum(running, moving) + optimizer_bytes
    t = int(np.argmax(live))
    peak = sched.order[t]
    # at the peak while the op's inputs move, what it makes there is not made yet
    inputs_moving = bool(moving[t] > running[t])
    held = _moved_inputs(node_of(peak), chosen, move) if inputs_moving else running[t]
    parts, saved = _peak_parts(sched, owned, extra, early, {g.owner for g in gms}, t, inputs_moving)
    report = MemoryReport(
        param_bytes=sum(per_param.values()),
        grad_bytes=sum(per_param.values()),  # once reduced into the parameters' placements
        optimizer_bytes=optimizer_bytes,
        activation_bytes=saved,
        peak_bytes=int(live[t]),
        peak_at=peak.name,
        peak_phase="backward" if isinstance(peak, Recomputed) else node_of(peak).meta.get(PHASE_KEY, "forward"),
        peak_parts=dict(sorted({"optimizer": optimizer_bytes, "transient": int(held), **parts}.items())),
        per_param=per_param,
    )
    return Walk(live, report)


def _kind(n: Key, born: int, sched: Schedule, grads: set[fx.Node]) -> str:
    if n in sched.resident:
        return "parameters and inputs"
    if node_of(n) in sched.param_values:  # a parameter's view owning its gathered copy
        return "gathered parameters"
    if isinstance(n, Recomputed):
        return "recomputed activations"
    if n in grads:
        return "gradients"
    return "activations" if born <= sched.forward_end else "backward temporaries"


def row_bytes(
    n: fx.Node, outputs: tuple[Placements | None, ...], params: set[fx.Node], mesh_shape, optimizer: OptimizerSpec
) -> float:
    """What a live storage adds to an ILP peak row: its bytes, and a parameter's optimizer states."""
    b = value_bytes(n, outputs, mesh_shape)
    return b * (1 + optimizer.bytes_per_param_byte(n.meta["val"].dtype)) if n in params else b


def moves_at(sched: Schedule, step: int) -> tuple[list[fx.Node], list[fx.Node]]:
    """The ops whose moved inputs' copies are alive at ``step``, as an ILP row there counts them:
    the op run at ``step`` (a recomputed copy's moves count on its option), whose moves hold all
    their buffers while they run (a view's too: a gather through the whole tensor to take a chunk
    of it holds the whole tensor) and their results while it runs; and the views alive then, run
    before, whose input is read in another placement, which hold only the moved result (the view
    owns it until the last reader of it or its views, see ``walk``)."""
    n = node_of(sched.order[step])
    ops = [n] if n.op == "call_function" else []
    views = {
        node_of(v)
        for v, owner in sched.owner.items()
        if owner is not v and sched.step[v] < step <= sched.view_last[v] and node_of(v).op == "call_function"
    }
    return ops, sorted(views, key=sched.step.__getitem__)


def copied_out_at(sched: Schedule, step: int) -> list[fx.Node]:
    """The ops and views whose layer's bucket of parameter gathers is copied out of its flat buffer
    at ``step`` (``Schedule.copied_out``): the buffer holds their gathered copies once more then."""
    return [node_of(k) for k, at in sched.copied_out.items() if at == step]


def issued_early(sched: Schedule, step: int) -> list[fx.Node]:
    """The ops and views whose parameters' gathers the lowering issued before ``step`` and that read
    them after it (``Schedule.issued``): their gathered copies are alive at ``step``."""
    return [node_of(k) for k, at in sched.issued.items() if at <= step < sched.step[k]]


def gathered_copy_bytes(mesh_shape) -> MovePrice:
    """Bytes of the copy a parameter value's move makes where it reads a larger local shard than is
    made: a gather, issued early (``issued_early``; ``_gathered_params`` per op)."""

    def price(made: Placements, read: Placements, meta, consumed: bool = False) -> float:
        copy = local_bytes(meta, read, mesh_shape)
        return float(copy) if copy > local_bytes(meta, made, mesh_shape) else 0.0

    return price


def moved_copy_bytes(mesh_shape) -> MovePrice:
    """Bytes of the copy a move from one placement to another makes (none when they are equal). The
    copy is made while its source is alive, so a consumed source changes nothing."""

    def price(made: Placements, read: Placements, meta, consumed: bool = False) -> float:
        return 0.0 if made == read else float(local_bytes(meta, read, mesh_shape))

    return price


def linear_peak_bytes(
    sched: Schedule,
    step: int,
    chosen: dict[fx.Node, Strategy],
    params: set[fx.Node],
    mesh_shape,
    optimizer,
    move: MovePrice,
    grads: list[GradientMove],
    moving: bool = False,
) -> int:
    """The part of the bytes alive at ``step`` the ILP row for ``step`` counts (moves priced by
    ``move``; ``grads``: ``scheduled_gradients``): while its op runs, or with ``moving`` while the op's
    inputs move, before it makes anything (see ``walk``)."""
    keys = stored_at(sched, step, moving)
    alive = [node_of(k) for k in keys]
    stored = sum(row_bytes(n, chosen[n].outputs, params, mesh_shape, optimizer) for n in alive if n in chosen)
    for k, v in held_by_views(sched, keys, step):  # read gathered: dead at the gather
        n, view = node_of(k), node_of(v)
        if n in chosen and view in chosen and _moved_inputs(view, chosen, move):
            stored -= value_bytes(n, chosen[n].outputs, mesh_shape)
    ops, views = moves_at(sched, step)
    copy = moved_copy_bytes(mesh_shape)
    moved = sum(_moved_inputs(op, chosen, move if moving else copy) for op in ops if op in chosen)
    moved += sum(_moved_inputs(v, chosen, copy) for v in views if v in chosen)
    for g, price in gradient_prices(grads, step, move, mesh_shape, moving):
        made = _made(g.value, chosen)
        if made is not None:
            moved += price(made, chosen[g.param].outputs[0], tensor_meta(g.value.meta["val"]))
    early = issued_early(sched, step) + copied_out_at(sched, step)
    moved += sum(_gathered_params(n, chosen, sched.param_values, mesh_shape) for n in early if n in chosen)
    return int(stored + moved)


def recompute_changes(
    base: Schedule, rc: Schedule, rc_live: np.ndarray, step: int, copy: Recomputed | None = None
) -> tuple[set[fx.Node], set[fx.Node]]:
    """At the base schedule's ``step``: the storages recomputing frees (saved values no longer
    alive) and those it keeps alive in addition (inputs of recomputed ops saved in their place,
    and the recomputed copies alive at ``copy``'s run where ``rc`` recomputes it, else at the peak
    of the chain the step triggers). ``rc_live`` is ``live_profile(rc)``."""
    before = set(live_storages(base, step))
    at = rc.step[copy] if copy in rc.step else chain_peak(rc, rc.step[base.order[step]], rc_live)
    after = {node_of(k) for k in live_storages(rc, at)}
    return before - after, after - before
