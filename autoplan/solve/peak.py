"""The ILP's rows for memory: the estimated peak per device at chosen schedule steps, and the
parameter budget.

The bytes alive at a step are linear in the placements (each live storage's local shard, the
moves running then) and in the recompute options (what each layer's option frees there, and what
it keeps alive for its recomputed copies). The planner bounds the peak lazily, at a few ``Point``s
first and then where a plan's estimated peak still exceeds the cap; this module builds those rows,
finds the analogue points of tied layers, and says how much of a plan's peak a row does not count.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import torch
import torch.fx as fx
from torch.distributed.device_mesh import DeviceMesh

from autoplan.adapters.dtensor import tensor_meta
from autoplan.cost import memory, timeline
from autoplan.cost.costs import CostModel, local_bytes
from autoplan.cost.devices import DeviceProfile
from autoplan.cost.moves import Move, output_moves
from autoplan.shard.strategies import Placements, Strategy
from autoplan.solve.ilp import BudgetRow, FixedRows, RecomputeVar
from autoplan.solve.problem import Linear, PlacementProblem, Shared, priced_moves
from autoplan.trace import recompute
from autoplan.trace.clustering import Clustering
from autoplan.trace.tracing import TracedGraph

# where a peak row bounds the live bytes: a base schedule step, or the recomputed copy (run right
# before that step, which triggers its chain) at whose run the row measures what recomputing keeps;
# and whether at the step's op's run or, before it makes anything, while its inputs move (``memory.walk``)
Point = tuple[int, "timeline.Recomputed | None", bool]
PEAK_GROUP = "memory constraint: estimated peak"
MAX_POINTS = 8  # steps one round bounds at most


def option_name(layer: str, option: str) -> str:
    return f"{layer}: {option}"


def peak_group(peak_budget: float) -> str:
    return f"{PEAK_GROUP} bytes per device <= {peak_budget:.6g}"


def param_group(param_budget: float) -> str:
    return f"memory constraint: parameter bytes per device <= {param_budget:.6g}"


@dataclass
class PeakRows:
    """What the rows depend on that the trace alone decides: the schedule, each layer's recompute
    options and the storages they change at each step (worked out once, for every solve, round
    and re-solve)."""

    tg: TracedGraph
    clustering: Clustering
    mesh: DeviceMesh
    device_profile: DeviceProfile
    optimizer: memory.OptimizerSpec
    shared: Shared
    prefetch: bool = False  # the lowering gathers parameters a layer ahead (``timeline.schedule``)

    def __post_init__(self) -> None:
        self.mesh_shape = tuple(self.mesh.shape)
        self.params = set(self.tg.placeholder_for("param").values())
        self.schedule = timeline.schedule(self.tg, prefetch=self.prefetch)
        self.into: dict[fx.Node, list[Move]] = defaultdict(list)  # each op's input moves
        self.gradient_moves: list[Move] = []
        for m in self.shared.moves({}):  # the model outputs' moves are read per request
            if m.kind == "input" and not m.again:  # the walk has the backward's regathers of its own
                self.into[m.dst].append(m)
            elif m.kind == "gradient":
                self.gradient_moves.append(m)
        self.grads = memory.scheduled_gradients(self.gradient_moves, self.schedule)
        # what a move holds while it runs depends on the mesh alone, not on the device profile
        self.move_bytes = CostModel(self.mesh, self.device_profile).redistribute_peak_bytes
        self.copied = memory.moved_copy_bytes(self.mesh_shape)
        self.gathered = memory.gathered_copy_bytes(self.mesh_shape)
        self._priced: tuple[PlacementProblem | None, dict] = (None, {})  # ``priced_moves``'s edges, per problem
        self.layers = recompute.layers(self.tg.gm.graph)
        self.tagged = {
            (layer, o): recompute.tagged(ops, o) for layer, ops in self.layers.items() for o in recompute.OPTIONS
        }
        self._option_schedules: dict[str, tuple[timeline.Schedule, np.ndarray]] = {}
        self._changes: dict[tuple, dict[str, tuple[list, list]]] = {}
        where = self.clustering.instance
        self._twin = {(r, where[n]): n for n, r in self.clustering.rep.items() if where.get(n)}  # (rep, layer) -> node

    def storage_bytes(self, problem: PlacementProblem, nodes) -> Linear:
        """Bytes of ``nodes``' storages (a parameter's with its optimizer states), per unit strategy."""
        out = Linear()
        for n in nodes:
            rep = problem.clustering.rep.get(n)
            if rep not in problem.root:
                continue
            unit, m = problem.root[rep]
            outputs = [problem.strategies[rep][i].outputs for i in m]
            per = [memory.row_bytes(n, o, self.params, self.mesh_shape, self.optimizer) for o in outputs]
            out.add_unit(unit, np.array(per))
        return out

    def _option_schedule(self, option: str) -> tuple[timeline.Schedule, np.ndarray]:
        """The schedule with every layer recomputing under ``option`` (what each layer frees is its
        own), and its unsharded live profile."""
        if option not in self._option_schedules:
            nodes = frozenset().union(*(t for (_, o), t in self.tagged.items() if o == option))
            sched = timeline.schedule(self.tg, nodes, self.prefetch)
            self._option_schedules[option] = sched, timeline.live_profile(sched)
        return self._option_schedules[option]

    def _layer_of(self, n: fx.Node, option: str) -> str:
        """Which layer's recompute a changed storage belongs to: its own, or its first recomputed reader's."""
        layer = recompute.layer_of(n)
        if (layer, option) in self.tagged:
            return layer
        for u in n.users:
            if u in self.tagged.get((recompute.layer_of(u), option), ()):
                return recompute.layer_of(u)
        return ""

    def _changes_at(self, step: int, option: str, copy: timeline.Recomputed | None) -> dict[str, tuple[list, list]]:
        """Per layer, the storages its ``option`` frees and keeps alive at ``step`` (at ``copy``'s
        run, where the option recomputes it), in schedule order (they depend on the trace alone:
        computed once for every solve, round and re-solve)."""
        if (step, option, copy) not in self._changes:
            frees, keeps = memory.recompute_changes(self.schedule, *self._option_schedule(option), step, copy)
            by_layer: dict[str, tuple[list, list]] = {}
            for side, nodes in enumerate((frees, keeps)):
                for n in sorted(nodes, key=self.schedule.step.__getitem__):
                    by_layer.setdefault(self._layer_of(n, option), ([], []))[side].append(n)
            self._changes[(step, option, copy)] = dict(sorted(by_layer.items()))
        return self._changes[(step, option, copy)]

    def _point(self, sched: timeline.Schedule, at: int, moving: bool) -> Point:
        """Where a row bounds the bytes a plan's schedule ``sched`` holds at its step ``at`` (with
        ``moving``, while the op's inputs move): a copy recomputed by an option is at the backward
        op that triggers its chain (the next entry of the base schedule), at the copy, whose row
        counts the copy's moves beside its run."""
        base = self.schedule.step  # its own recomputed copies (regathered weights) are original entries
        t = at
        while sched.order[t] not in base:
            t += 1
        if sched.order[at] in base:
            return base[sched.order[t]], None, moving
        return base[sched.order[t]], sched.order[at], False

    def over(
        self,
        sched: timeline.Schedule,
        live: np.ndarray,
        chosen: dict[fx.Node, Strategy],
        outputs: dict[int, Placements],
        budget: float,
        solved: tuple[PlacementProblem, dict[fx.Node, int], tuple[str, ...]] | None = None,
    ) -> list[tuple[Point, float]]:
        """Where rows would bound a plan's bytes ``live`` over ``budget`` (its peak first, then
        other local maxima above it, at most ``MAX_POINTS``), and the bytes each row does not count:
        one round bounds several peaks at once, not one peak per round.

        ``solved`` (the problem, its unit strategies and the options on) measures those bytes
        against the row itself. Without it they are measured against the linear walk on the plan's
        own schedule, which the rows match where nothing is recomputed; with recompute on, a row
        counts what the options free and keep on the base schedule, which misses what the
        recomputed schedule holds elsewhere (8B on 16x8 under a 13 GiB cap: 1.2-1.5 GiB at the steps bounded)."""
        left, right = np.r_[-np.inf, live[:-1]], np.r_[live[1:], -np.inf]
        maxima = np.flatnonzero((live > budget) & (live >= left) & (live > right))
        top = [int(np.argmax(live))] + [int(t) for t in maxima[np.argsort(-live[maxima], kind="stable")]]
        grads = self.grads if sched is self.schedule else memory.scheduled_gradients(self.gradient_moves, sched)
        found: dict[Point, float] = {}
        args = chosen, self.params, self.mesh_shape, self.optimizer, self.move_bytes, grads
        forward_end = self.schedule.order[self.schedule.forward_end]
        for at in dict.fromkeys(top):
            running = memory.linear_peak_bytes(sched, at, *args)
            if sched.order[at] is forward_end:  # where the lowering moves the outputs
                running += memory.output_move_bytes(self.tg, chosen, outputs, self.move_bytes, sched)
            moving = -np.inf
            if timeline.node_of(sched.order[at]).op == "call_function":
                moving = memory.linear_peak_bytes(sched, at, *args, moving=True)
            point = self._point(sched, at, moving > running)
            if point in found:
                continue
            counted = max(running, moving) if solved is None else self.row_bytes(solved[0], point, outputs, *solved[1:])
            found[point] = float(live[at]) - counted
            if len(found) == MAX_POINTS:
                break
        return list(found.items())

    def bound(self, steps: dict[Point, float], point: Point, missed: float) -> None:
        """Bound the peak at ``point`` less ``missed``, and at its analogues in identical layers."""
        steps[point] = missed
        for a in self._analogues(point):
            steps.setdefault(a, 0.0)

    def _analogues(self, point: Point) -> list[Point]:
        """The same point in every other layer tied to its layer: a peak found in one of identical
        layers is bounded in all of them at once, not one round per layer."""
        t, copy, moving = point
        op = self.schedule.order[t]
        node = timeline.node_of(op)  # a regathered weight's copy stands for its layer's too
        layer = self.clustering.instance.get(node, "")
        tied = next((c for c in self.clustering.classes if layer in c), ())
        out = []
        for where in tied:
            other = self._twin.get((self.clustering.rep[node], where))
            if other is not None and isinstance(op, timeline.Recomputed):
                other = timeline.Recomputed(other)
            twin = self._twin.get((self.clustering.rep[copy.node], where)) if copy is not None else None
            if where == layer or other not in self.schedule.step or (copy is not None and twin is None):
                continue
            out.append((self.schedule.step[other], None if twin is None else timeline.Recomputed(twin), moving))
        return out

    def _rerun_layer(self, copy: timeline.Recomputed | None, option: str) -> str | None:
        """The layer whose ``option`` runs ``copy`` again, if any."""
        if copy is None:
            return None
        layer = recompute.layer_of(copy.node)
        return layer if copy.node in self.tagged.get((layer, option), ()) else None

    def rows(
        self,
        problem: PlacementProblem,
        peak_budget: float | None,
        outputs: dict[int, Placements],
        steps: dict[Point, float],
        options: list[RecomputeVar],
    ) -> list[BudgetRow]:
        """The estimated peak at each bounded step, linear in the placements and recompute choices:
        at a recomputed copy's run, the base op's moves and the copy's hold all their buffers; else
        while the step's op runs, its moves hold their results, or while they run, before the op
        makes its own storage, all their buffers (``memory.walk``)."""
        if peak_budget is None:
            return []
        index = {o.name: i for i, o in enumerate(options)}
        order = sorted(steps.items(), key=lambda kv: (kv[0][0], _name(kv[0][1]), kv[0][2]))
        return [self._row(problem, point, peak_budget, missed, outputs, index) for point, missed in order]

    def row_bytes(
        self, problem: PlacementProblem, point: Point, outputs: dict[int, Placements], choice, recompute
    ) -> float:
        """The bytes the row at ``point`` counts for the unit strategies ``choice`` (unit -> index)
        with the options named in ``recompute`` on: what ``over`` holds a plan's walk against."""
        index = {name: i for i, name in enumerate(recompute)}
        return self._row(problem, point, 0.0, 0.0, outputs, index).at(problem, choice)

    def _row(
        self,
        problem: PlacementProblem,
        point: Point,
        peak_budget: float,
        missed: float,
        outputs: dict[int, Placements],
        index: dict[str, int],
    ) -> BudgetRow:
        """The row bounding the peak at ``point`` by ``peak_budget`` less ``missed`` (``index``: the
        recompute options' columns by name)."""
        step, copy, moving = point
        stored = timeline.stored_at(self.schedule, step, moving)
        alive = [timeline.node_of(k) for k in stored]
        made = {timeline.node_of(k) for k in timeline.live_storages(self.schedule, step)} - set(alive)
        terms, recomputable = [], set()
        for option in recompute.OPTIONS:
            if not any(option_name(layer, option) in index for layer in self.layers):
                continue
            changes = dict(self._changes_at(step, option, copy))
            rerun = self._rerun_layer(copy, option)  # its keeps include the copy's input moves
            if rerun is not None:
                changes.setdefault(rerun, ([], []))
            for layer, (f, k) in changes.items():
                recomputable.update(f)
                if (i := index.get(option_name(layer, option))) is not None:
                    keeps = self.storage_bytes(problem, k)
                    if layer == rerun:
                        keeps.add(self._input_prices(problem, [copy.node], self.move_bytes))
                    terms.append((i, self.storage_bytes(problem, [n for n in f if n not in made]), keeps))
        coeffs = tuple(self.storage_bytes(problem, alive).units.items())
        # what a recompute option frees is taken off on its own term, not twice
        held = [
            (o, v)
            for o, v in memory.held_by_views(self.schedule, stored, step)
            if timeline.node_of(o) not in recomputable
        ]
        ops, views = memory.moves_at(self.schedule, step)
        before = moving or copy is not None
        moves = self._input_prices(problem, ops, self.move_bytes if before else self.copied)
        moves.add(self._input_prices(problem, views, self.copied))
        moves.add(self._input_prices(problem, [timeline.node_of(v) for _, v in held], self._dead_source))
        # the gathers issued ahead of their reader (a layer's bucket, or prefetch), and the
        # bucket's flat buffer where it is copied out
        early = memory.issued_early(self.schedule, step) + memory.copied_out_at(self.schedule, step)
        values = self.schedule.param_values
        gathered = [(m, self.gathered) for n in early for m in self.into.get(n, ()) if m.value in values]
        moves.add(priced_moves(problem, gathered, self._priced[1]))
        grads = memory.gradient_prices(self.grads, step, self.move_bytes, self.mesh_shape, before)
        moves.add(priced_moves(problem, [(g.move, price) for g, price in grads]))
        if step == self.schedule.forward_end and not before:  # where the lowering moves the outputs
            # as ``build_problem`` sums them: those into tangents' placements, then those into constraints
            sinks = sorted(output_moves(self.tg, outputs), key=lambda m: m.dst is None)
            moves.add(priced_moves(problem, [(m, self.move_bytes) for m in sinks]))
        group = peak_group(peak_budget)
        name = copy.name if copy is not None else self.schedule.order[step].name
        where = f"{name}, its inputs moving" if moving else name
        limit = peak_budget - missed
        return BudgetRow(f"{group} (at {where})", coeffs, limit, tuple(terms), peak_budget, moves)

    def _dead_source(self, made: Placements, read: Placements, meta) -> float:
        """Minus the bytes of a value a view reads moved, where that view alone kept it alive
        (``memory.held_by_views``): the storage dies at the move."""
        return -float(local_bytes(meta, made, self.mesh_shape)) if made != read else 0.0

    def _input_prices(self, problem: PlacementProblem, nodes, price) -> Linear:
        """``price`` of the moves of ``nodes``' tensor inputs, as a function of the choice."""
        if self._priced[0] is not problem:
            self._priced = (problem, {})
        return priced_moves(problem, [(m, price) for n in nodes for m in self.into.get(n, ())], self._priced[1])

    def least_params(self, problem: PlacementProblem, row: BudgetRow, fixed: list[FixedRows]) -> tuple[int, dict]:
        """The fewest parameter bytes per device a plan stores under the pins ``fixed``, from the
        parameter row ``row``: each unit at the allowed strategy with the fewest bytes (units are
        independent here: nothing else bounds a parameter's placement). Also that strategy per unit
        (``param_shards`` names what it stores). Units the pins leave no strategy are skipped: their
        conflict is reported on its own."""
        allowed: dict[fx.Node, np.ndarray] = {}
        for f in fixed:
            for u, idx in f.items:
                ok = np.isin(np.arange(len(problem.unit_cost[u])), idx)
                allowed[u] = allowed[u] & ok if u in allowed else ok
        total, best = 0.0, {}
        for unit, coeffs in row.coeffs:
            ok = ~problem.forbidden[unit] & allowed.get(unit, True)
            if ok.any():
                best[unit] = int(np.flatnonzero(ok)[np.argmin(coeffs[ok])])
                total += coeffs[best[unit]]
        return round(total), best

    def param_shards(self, problem: PlacementProblem, best: dict[fx.Node, int]) -> list[ParamShard]:
        """Each parameter's largest shard under its unit's strategy in ``best``, largest first (ties
        by name)."""
        shards = []
        for fqn, n in self.tg.placeholder_for("param").items():
            rep = problem.clustering.rep[n]
            unit, m = problem.root[rep]
            if unit in best:
                pl = problem.strategies[rep][m[best[unit]]].output
                val = n.meta["val"]
                nbytes = local_bytes(tensor_meta(val), pl, self.mesh_shape)
                shards.append(ParamShard(fqn, tuple(val.shape), val.dtype, nbytes, pl))
        return sorted(shards, key=lambda p: (-p.nbytes, p.fqn))

    def param_row(self, problem: PlacementProblem, budget: float) -> BudgetRow:
        coeffs: dict[fx.Node, np.ndarray] = {}
        for n in self.tg.placeholder_for("param").values():
            rep = problem.clustering.rep[n]
            if rep is not n:
                continue
            unit, m = problem.root[rep]
            meta = tensor_meta(n.meta["val"])
            per = [local_bytes(meta, problem.strategies[rep][i].output, self.mesh_shape) for i in m]
            coeffs[unit] = coeffs.get(unit, 0) + np.array(per, dtype=float) * problem.clustering.multiplicity[rep]
        return BudgetRow(param_group(budget), tuple(coeffs.items()), budget)


@dataclass(frozen=True)
class ParamShard:
    """A parameter's largest shard under some placement: bytes per device (``autoplan.shard.uneven``)."""

    fqn: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int
    placements: Placements


def _name(copy: timeline.Recomputed | None) -> str:
    return "" if copy is None else copy.name
