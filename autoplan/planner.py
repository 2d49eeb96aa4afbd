"""The planner: from a traced graph, its strategies and the user's constraints to a ``Plan``.

It prices the reduced problem, adds the user's rows (pins, parameter and peak budgets, recompute
options), solves, re-solves the boundary layers on their own, and prices the expanded plan. The
peak cap is bounded lazily: at a few candidate steps first, then at each step where the plan's
estimated peak still exceeds the cap, until it does not (``memory``). ``AutoParallel`` is the front
that collects the constraints; this module owns the solve.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
import warnings
from dataclasses import dataclass, field

import numpy as np
import torch.fx as fx
from torch.distributed.device_mesh import DeviceMesh

from autoplan import memory, mismatch, overlap, recompute
from autoplan.adapters.dtensor import tensor_meta
from autoplan.clustering import Clustering, untie
from autoplan.costs import CostModel, local_bytes
from autoplan.devices import DeviceProfile
from autoplan.errors import ConstraintError, InfeasiblePlanError, SolverLimitError
from autoplan.evaluate import alternatives, evaluate, expand_choice
from autoplan.ilp import POLISH_S, BudgetRow, FixedRows, NoSeedError, RecomputeVar, UnitChoice, solve_placement
from autoplan.plan import Plan
from autoplan.problem import (
    Linear,
    PlacementProblem,
    allowed_strategies,
    build_problem,
    forward_costs,
    input_moves,
    output_moves,
)
from autoplan.strategies import NodeStrategies, Placements, Strategy
from autoplan.tracing import TracedGraph
from solvers import OPTIMALITY_GAP, InfeasibleError, SolverTimeoutError

log = logging.getLogger(__name__)
# where a peak row bounds the live bytes: a base schedule step, or the recomputed copy (run right
# before that step, which triggers its chain) at whose run the row measures what recomputing keeps
Point = tuple[int, "memory.Recomputed | None"]
_PEAK_ROUNDS = 5  # solves at most, each bounding the peak at one more step
DEFAULT_GAP = 1e-2  # relative MIP gap a plan is certified within by default (``AutoParallel``)
NO_RECOMPUTE = "none"
_PEAK_GROUP = "memory constraint: estimated peak"
_SMALLEST_PEAK_S = 60.0  # time for finding the least peak an infeasible cap's error reports


@dataclass(frozen=True)
class Request:
    """What the user asked for: fixed output placements (name, nodes, placements), the output
    placements of the model, the budgets, and recompute pins (layer -> option or ``"none"``)."""

    fixed: list[tuple[str, list[fx.Node], Placements]]
    outputs: dict[int, Placements]
    param_budget: float | None = None
    peak_budget: float | None = None
    recompute: dict[str, str] = field(default_factory=dict)
    start: Plan | None = None  # a plan the solve starts from: the result is never worse


@dataclass
class _Solved:
    """A solve bounded in rounds: the last round's problem, choice and every node's strategy,
    whether its plan is within the peak cap, the steps bounded, and the ILP seconds of all rounds."""

    problem: PlacementProblem
    solved: UnitChoice
    chosen: dict[fx.Node, Strategy]
    within: bool
    steps: dict[Point, float]
    build_s: float
    solve_s: float


@dataclass
class Planner:
    tg: TracedGraph
    clustering: Clustering
    strategies: dict[fx.Node, NodeStrategies]
    mesh: DeviceMesh
    device_profile: DeviceProfile
    optimizer: memory.OptimizerSpec
    solver_backend: str = "highs"
    time_limit: float | None = None
    mip_rel_gap: float = DEFAULT_GAP
    merge_followers: bool = True

    def __post_init__(self) -> None:
        self.mesh_shape = tuple(self.mesh.shape)
        self.params = set(self.tg.placeholder_for("param").values())
        self.schedule = memory.schedule(self.tg)
        # what a move holds while it runs depends on the mesh alone, not on the device profile
        self._move_bytes = CostModel(self.mesh, self.device_profile).redistribute_peak_bytes
        self.layers = recompute.layers(self.tg.gm.graph)
        self._tagged = {
            (layer, o): recompute.tagged(ops, o) for layer, ops in self.layers.items() for o in recompute.OPTIONS
        }
        self._option_schedules: dict[str, tuple[memory.Schedule, np.ndarray]] = {}
        self._changes: dict[tuple, dict[str, tuple[list, list]]] = {}
        where = self.clustering.instance
        self._twin = {(r, where[n]): n for n, r in self.clustering.rep.items() if where.get(n)}  # (rep, layer) -> node

    # ---- rows ---------------------------------------------------------------------------

    def _fixed_rows(self, problem: PlacementProblem, request: Request) -> list[FixedRows]:
        rows = []
        for group, nodes, placements in request.fixed:
            items = []
            for n in nodes:
                allowed = allowed_strategies(problem, n, placements)
                if not allowed:
                    raise ConstraintError(f"{group}: no strategy of node {n.name} ({n.target}) outputs that placement")
                unit = problem.root[problem.clustering.rep[n]][0]
                items.append((unit, tuple(allowed)))
            rows.append(FixedRows(group, tuple(items)))
        return rows

    def _bytes(self, problem: PlacementProblem, nodes) -> Linear:
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

    def _options(self, problem: PlacementProblem, request: Request, cost_model: CostModel) -> list[RecomputeVar]:
        """Recompute options worth a variable: every layer's when a peak cap could want them, but
        only the pinned option of a pinned layer (a layer pinned to ``"none"`` has none)."""
        if request.peak_budget is None and not request.recompute:
            return []
        offered = [
            (layer, option, nodes)
            for (layer, option), nodes in self._tagged.items()
            if nodes and request.recompute.get(layer, option if request.peak_budget is not None else None) == option
        ]
        seconds = forward_costs(self.tg, problem, cost_model, [nodes for _, _, nodes in offered])
        return [
            RecomputeVar(_option_name(layer, option), layer, s, layer in request.recompute, option)
            for (layer, option, _), s in zip(offered, seconds)
        ]

    def _option_schedule(self, option: str) -> tuple[memory.Schedule, np.ndarray]:
        """The schedule with every layer recomputing under ``option`` (what each layer frees is its
        own), and its unsharded live profile."""
        if option not in self._option_schedules:
            nodes = frozenset().union(*(t for (_, o), t in self._tagged.items() if o == option))
            sched = memory.schedule(self.tg, nodes)
            self._option_schedules[option] = sched, memory.live_profile(sched)
        return self._option_schedules[option]

    def _layer_of(self, n: fx.Node, option: str) -> str:
        """Which layer's recompute a changed storage belongs to: its own, or its first recomputed reader's."""
        layer = recompute.layer_of(n)
        if (layer, option) in self._tagged:
            return layer
        for u in n.users:
            if u in self._tagged.get((recompute.layer_of(u), option), ()):
                return recompute.layer_of(u)
        return ""

    def _changes_at(self, step: int, option: str, copy: memory.Recomputed | None) -> dict[str, tuple[list, list]]:
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

    def _point(self, sched: memory.Schedule, name: str) -> tuple[Point, int]:
        """Where a row bounds the peak a plan's schedule ``sched`` reaches at its entry ``name``,
        and that entry's step in ``sched``: a recomputed copy's point is the backward op that
        triggers its chain (the next original entry), at the copy."""
        at = next(i for i, k in enumerate(sched.order) if k.name == name)
        t = at
        while isinstance(sched.order[t], memory.Recomputed):
            t += 1
        copy = sched.order[at] if isinstance(sched.order[at], memory.Recomputed) else None
        return (self.schedule.step[sched.order[t]], copy), at

    def _missed(
        self, sched: memory.Schedule, report, chosen: dict[fx.Node, Strategy], request: Request
    ) -> tuple[Point, float]:
        """Where a row bounds the plan's estimated peak, and the bytes of it that row does not count."""
        t, at = self._point(sched, report.peak_at)
        linear = memory.linear_peak_bytes(
            sched, at, chosen, self.params, self.mesh_shape, self.optimizer, self._move_bytes
        )
        if t == (self.schedule.forward_end, None):
            linear += memory.output_move_bytes(self.tg, chosen, request.outputs, self._move_bytes)
        return t, report.peak_bytes - linear

    def _bound(self, steps: dict[Point, float], point: Point, missed: float) -> None:
        """Bound the peak at ``point`` less ``missed``, and at its analogues in identical layers."""
        steps[point] = missed
        for a in self._analogues(point):
            steps.setdefault(a, 0.0)

    def _analogues(self, point: Point) -> list[Point]:
        """The same point in every other layer tied to its layer: a peak found in one of identical
        layers is bounded in all of them at once, not one round per layer."""
        t, copy = point
        op = self.schedule.order[t]
        layer = self.clustering.instance.get(op, "")
        tied = next((c for c in self.clustering.classes if layer in c), ())
        out = []
        for where in tied:
            other = self._twin.get((self.clustering.rep[op], where))
            twin = self._twin.get((self.clustering.rep[copy.node], where)) if copy is not None else None
            if where == layer or other not in self.schedule.step or (copy is not None and twin is None):
                continue
            out.append((self.schedule.step[other], None if twin is None else memory.Recomputed(twin)))
        return out

    def _rerun_layer(self, copy: memory.Recomputed | None, option: str) -> str | None:
        """The layer whose ``option`` runs ``copy`` again, if any."""
        if copy is None:
            return None
        layer = recompute.layer_of(copy.node)
        return layer if copy.node in self._tagged.get((layer, option), ()) else None

    def _peak_rows(
        self, problem: PlacementProblem, request: Request, steps: dict[Point, float], options: list[RecomputeVar]
    ) -> list[BudgetRow]:
        """The estimated peak at each bounded step, linear in the placements and recompute choices."""
        if request.peak_budget is None:
            return []
        index = {o.name: i for i, o in enumerate(options)}
        rows = []
        for (step, copy), missed in sorted(steps.items(), key=lambda kv: (kv[0][0], _name(kv[0][1]))):
            alive = [memory.node_of(k) for k in memory.live_storages(self.schedule, step)]
            terms = []
            for option in recompute.OPTIONS:
                if not any(_option_name(layer, option) in index for layer in self.layers):
                    continue
                changes = dict(self._changes_at(step, option, copy))
                rerun = self._rerun_layer(copy, option)  # its keeps include the copy's input moves
                if rerun is not None:
                    changes.setdefault(rerun, ([], []))
                for layer, (f, k) in changes.items():
                    if (i := index.get(_option_name(layer, option))) is not None:
                        keeps = self._bytes(problem, k)
                        if layer == rerun:
                            keeps.add(input_moves(problem, [copy.node], self._move_bytes))
                        terms.append((i, self._bytes(problem, f), keeps))
            coeffs = tuple(self._bytes(problem, alive).units.items())
            ops, views = memory.moves_at(self.schedule, step)
            moves = input_moves(problem, ops, self._move_bytes)
            moves.add(input_moves(problem, views, memory.moved_copy_bytes(self.mesh_shape)))
            if step == self.schedule.forward_end and copy is None:  # where the lowering moves the outputs
                moves.add(output_moves(self.tg, problem, request.outputs, self._move_bytes))
            group = _peak_group(request)
            name = copy.name if copy is not None else self.schedule.order[step].name
            limit = request.peak_budget - missed
            row = BudgetRow(f"{group} (at {name})", coeffs, limit, tuple(terms), request.peak_budget, moves)
            rows.append(row)
        return rows

    def _param_row(self, problem: PlacementProblem, budget: float) -> BudgetRow:
        coeffs: dict[fx.Node, np.ndarray] = {}
        for n in self.tg.placeholder_for("param").values():
            rep = problem.clustering.rep[n]
            if rep is not n:
                continue
            unit, m = problem.root[rep]
            meta = tensor_meta(n.meta["val"])
            per = [local_bytes(meta, problem.strategies[rep][i].output, self.mesh_shape) for i in m]
            coeffs[unit] = coeffs.get(unit, 0) + np.array(per, dtype=float) * problem.clustering.multiplicity[rep]
        group = f"memory constraint: parameter bytes per device <= {budget:.6g}"
        return BudgetRow(group, tuple(coeffs.items()), budget)

    # ---- solves -------------------------------------------------------------------------

    def _solve(
        self,
        request: Request,
        clustering: Clustering,
        strategies: dict[fx.Node, NodeStrategies],
        cost_model: CostModel,
        steps: dict[Point, float],
        time_limit: float | None,
        start: dict[fx.Node, Strategy] | None = None,
        smallest_peak: bool = False,
        diagnose: bool = True,
        start_recompute: tuple[str, ...] = (),
        polish_s: float = POLISH_S,
        seed_only: bool = False,
        least: dict[fx.Node, float] | None = None,
    ) -> tuple[PlacementProblem, UnitChoice, dict[fx.Node, Strategy]]:
        """Build and solve the ILP for one clustering; returns the solve and every node's strategy
        (``diagnose``: name the conflicting constraints of an infeasible one; ``polish_s``: see
        ``solve_placement``; ``least``: see ``build_problem``)."""
        problem = build_problem(
            self.tg, clustering, strategies, cost_model, request.outputs, self.merge_followers, least
        )
        options = self._options(problem, request, cost_model)
        budgets = self._peak_rows(problem, request, steps, options)
        if request.param_budget is not None:
            budgets.append(self._param_row(problem, request.param_budget))
        solved = solve_placement(
            problem,
            self._fixed_rows(problem, request),
            budgets,
            time_limit=time_limit,
            backend=self.solver_backend,
            mip_rel_gap=max(self.mip_rel_gap, OPTIMALITY_GAP),
            start=start,
            options=options,
            smallest_peak=smallest_peak,
            diagnose=diagnose,
            start_recompute=start_recompute,
            polish_s=polish_s,
            seed_only=seed_only,
        )
        return problem, solved, expand_choice(self.tg, problem, solved.choice)

    def recomputed(self, choice: dict[str, str]) -> frozenset[fx.Node]:
        return frozenset().union(*(self._tagged[(layer, o)] for layer, o in choice.items()))

    def estimate(self, chosen: dict[fx.Node, Strategy], choice: dict[str, str], request: Request):
        """The memory report of a plan and the schedule it was walked on."""
        sched = memory.schedule(self.tg, self.recomputed(choice)) if choice else self.schedule
        report = memory.estimate(
            self.tg, chosen, self.mesh_shape, self.optimizer, sched, self._move_bytes, request.outputs
        )
        return report, sched

    def _solve_within_peak(self, request: Request, solve_with, steps: dict[Point, float]) -> _Solved:
        """``solve_with(steps)`` with the peak bounded at ``steps``; where the plan's estimated peak
        still exceeds the cap (at another step, or through bytes the rows miss: moved copies), bound
        that step too, less what its row misses (or, where it is bounded already, less the
        overshoot), and solve again, at most ``_PEAK_ROUNDS`` times."""
        steps, build_s, solve_s = dict(steps), 0.0, 0.0
        for _ in range(_PEAK_ROUNDS):
            problem, solved, chosen = solve_with(steps)
            build_s, solve_s = build_s + solved.build_time, solve_s + solved.solve_time
            if request.peak_budget is None:
                return _Solved(problem, solved, chosen, True, steps, build_s, solve_s)
            report, sched = self.estimate(chosen, _choice(solved.recompute), request)
            if not _over(report, request):
                return _Solved(problem, solved, chosen, True, steps, build_s, solve_s)
            t, missed = self._missed(sched, report, chosen, request)
            missed = max(steps.get(t, 0.0), missed)
            if t in steps and missed <= steps[t]:  # the row holds only within the solver's tolerance
                missed = steps[t] + report.peak_bytes - request.peak_budget
            self._bound(steps, t, missed)
        return _Solved(problem, solved, chosen, False, steps, build_s, solve_s)

    def _main_solve(self, request: Request, cost_model: CostModel) -> _Solved:
        """The solve with identical layers tied, bounded at two candidate steps to begin with.

        Under a cap with free recompute options, each round takes the fixed-option trials' plan as
        it is (``polish_s=0``), and only the last round's plan, once within the cap, is polished by
        the full MIP: the polish is the slow part, and an earlier round's is thrown away."""
        capped = request.peak_budget is not None
        steps = {(t, None): 0.0 for t in memory.candidate_steps(self.schedule, count=2)} if capped else {}
        t0 = time.perf_counter()

        start = self._start_of(request.start)

        def solve_with(steps, time_limit=self.time_limit, **kw):
            if start is not None:
                kw.setdefault("start", start)
                kw.setdefault("start_recompute", tuple(_option_name(*lo) for lo in request.start.recompute.items()))
            try:
                return self._solve(request, self.clustering, self.strategies, cost_model, steps, time_limit, **kw)
            except InfeasibleError as e:
                if capped and any(g.startswith(_PEAK_GROUP) for g in e.groups):
                    raise self._smallest_peak_error(e, request, cost_model, steps) from e
                raise

        def round_solve(steps):
            """A round takes the trials' plan as it is. When no trial finds one, the least peak of
            each option on every layer says whether the cap can be met at all, far sooner than the
            full MIP proves that it cannot."""
            try:
                return solve_with(steps, polish_s=0.0, seed_only=True)
            except NoSeedError:
                least = self._least_peak(request, cost_model, steps)
                if least is not None and least > request.peak_budget:
                    group = _peak_group(request)
                    raise _cap_error((group,), f"No plan meets the {group}.", least) from None
                return solve_with(steps, polish_s=0.0)

        done = self._solve_within_peak(request, round_solve, steps)
        if not (done.solved.seeded and done.within):
            return done
        left = POLISH_S if self.time_limit is None else min(POLISH_S, self.time_limit - (time.perf_counter() - t0))
        if left <= 0:
            return done
        try:
            problem, solved, chosen = solve_with(
                done.steps, left, start=done.chosen, start_recompute=done.solved.recompute, diagnose=False
            )
        except (InfeasibleError, SolverTimeoutError):
            return done
        spent = dataclasses.replace(
            done, build_s=done.build_s + solved.build_time, solve_s=done.solve_s + solved.solve_time
        )
        report, _ = self.estimate(chosen, _choice(solved.recompute), request)
        if _over(report, request) or solved.objective_without_tie_break > done.solved.objective_without_tie_break:
            return spent  # the polish moved the peak where no row bounds it, or found nothing better
        return dataclasses.replace(spent, problem=problem, solved=solved, chosen=chosen)

    def _start_of(self, plan: Plan | None) -> dict[fx.Node, Strategy] | None:
        """Every node's strategy in ``plan``, a plan of this graph on this mesh (``PlanMismatchError``
        listing what differs otherwise)."""
        if plan is None:
            return None
        mismatch.check(plan, self.tg, self.mesh_shape)
        out = {}
        for n in self.tg.gm.graph.nodes:
            if self.clustering.rep.get(n) not in self.strategies:
                continue
            node = plan.nodes.get(n.name)
            s = Strategy(node.outputs, node.inputs) if node is not None else None
            if s not in self.strategies[self.clustering.rep[n]].strategies:
                mismatch.refuse([f"node {n.name} has a strategy in the plan that it cannot take here"])
            out[n] = s
        return out

    def _smallest_peak_error(
        self, e: InfeasibleError, request: Request, cost_model: CostModel, steps: dict[Point, float]
    ) -> InfeasibleError:
        """The infeasibility of a peak cap, with the least estimated peak a plan reaches under the
        other constraints (``e`` as it is when they conflict on their own)."""
        try:
            least = self._least_peak(request, cost_model, steps)
        except InfeasibleError:
            return e
        return e if least is None else _cap_error(e.groups, str(e), least)

    def _least_peak(self, request: Request, cost_model: CostModel, steps: dict[Point, float]) -> int | None:
        """The least estimated peak of the plans found within ``_SMALLEST_PEAK_S``. Each recompute
        option on every layer (and none), as the user's pins allow, is tried on its own: with the
        options fixed, minimising the peak is a placement ILP solved in seconds, where the free
        options' MIP is not. Raises ``InfeasibleError`` when the other constraints conflict."""
        deadline = time.perf_counter() + _SMALLEST_PEAK_S
        least = None
        for option in (NO_RECOMPUTE, *recompute.OPTIONS) if self.layers else (NO_RECOMPUTE,):
            pins = {**dict.fromkeys(self.layers, option), **request.recompute}
            peak = self._smallest_peak(dataclasses.replace(request, recompute=pins), cost_model, steps, deadline)
            if peak is not None:
                least = peak if least is None else min(least, peak)
        return least

    def _smallest_peak(
        self, request: Request, cost_model: CostModel, steps: dict[Point, float], deadline: float
    ) -> int | None:
        """The least estimated peak of a plan under ``request`` (its cap aside) found by
        ``deadline``: minimise the bounded rows, bounding more steps the same way as under a cap
        until the plan's estimate is what the rows say."""
        steps, least = dict(steps), None
        while True:
            left = deadline - time.perf_counter()
            if left <= 0:
                break
            try:
                _, solved, chosen = self._solve(
                    request, self.clustering, self.strategies, cost_model, steps, left, smallest_peak=True
                )
            except SolverTimeoutError:
                break
            report, sched = self.estimate(chosen, _choice(solved.recompute), request)
            least = report.peak_bytes if least is None else min(least, report.peak_bytes)
            if report.peak_bytes <= solved.peak + 1.0:
                break
            t, missed = self._missed(sched, report, chosen, request)
            if t in steps and missed <= steps[t]:
                break
            self._bound(steps, t, missed)
        return least

    def _refine(self, request, clustering, group, chosen, recomputed, cost_model, steps, time_limit, least):
        """Solve again with the layers of ``group`` deciding on their own.

        Every other repeated layer keeps its choice (one strategy left), so the ILP is the size of
        one layer plus the nodes outside repeated layers, which are free to meet the group halfway.
        Recompute choices stay as the main solve made them. Under a peak cap the re-solve is bounded
        in rounds like the main solve. ``least``: each base representative's fastest compute (the
        fixed layers' own strategies no longer show it). Returns the split clustering and the solve.
        """
        split = untie(clustering, group)
        tied = {i for c in self.clustering.classes for i in c} - set(group)
        strategies = {}
        for n, r in split.rep.items():
            own = self.strategies.get(self.clustering.rep[n])
            if r is not n or own is None:
                continue
            fixed = split.instance.get(n, "") in tied
            strategies[n] = dataclasses.replace(own, strategies=(chosen[n],)) if fixed else own
        if request.peak_budget is None and not request.recompute:
            pinned = request  # no recompute variables at all
        else:
            pins = {**{layer: NO_RECOMPUTE for layer in self.layers}, **_choice(recomputed)}
            pinned = dataclasses.replace(request, recompute=pins)

        own_least = {n: least[self.clustering.rep[n]] for n in strategies}

        def solve_with(steps):
            return self._solve(
                pinned, split, strategies, cost_model, steps, time_limit, start=chosen, diagnose=False, least=own_least
            )

        return split, self._solve_within_peak(request, solve_with, steps)

    def plan(self, request: Request, trace_timings: dict[str, float]) -> Plan:
        """Solve for the cheapest plan under ``request``.

        Identical layers share decisions. The first and last layers are tied to the others for the
        main solve, then each is re-solved on its own against the rest (``plan.ilp["refinements"]``):
        their neighbours differ, so their best choices can too.
        """
        tg = self.tg
        t0 = time.perf_counter()
        cost_model = CostModel(self.mesh, self.device_profile)
        try:
            main = self._main_solve(request, cost_model)
        except SolverTimeoutError as e:
            raise SolverLimitError(e, time.perf_counter() - t0) from e
        problem, solved, chosen, steps = main.problem, main.solved, main.chosen, main.steps
        if solved.result.gap > max(self.mip_rel_gap, OPTIMALITY_GAP) * (1 + 1e-9):
            # without a user time_limit, the limit met is the one on polishing a capped plan
            limit = (
                f"time_limit={self.time_limit} s" if self.time_limit is not None else f"its {POLISH_S:g} s polish limit"
            )
            warnings.warn(
                f"the solver stopped at {limit} with the best plan found so far, within"
                f" {solved.result.gap:.2%} of its bound (mip_rel_gap={self.mip_rel_gap:g} was asked): raise"
                " time_limit for a better one",
                stacklevel=3,
            )
        t1 = time.perf_counter()
        clustering, objective, refinements = self.clustering, solved.objective_without_tie_break, []
        recomputed = solved.recompute
        for group in self.clustering.boundary:
            left = None if self.time_limit is None else self.time_limit - (time.perf_counter() - t0)
            if left is not None and left <= 0:
                break
            try:
                split, re = self._refine(
                    request, clustering, group, chosen, recomputed, cost_model, steps, left, problem.least_compute
                )
            except (SolverTimeoutError, InfeasibleError):  # the group's own bounds may not meet a cap
                break
            gain = objective - re.solved.objective_without_tie_break
            # below 1e-9 it is the tie-break trading cost for fewer changes
            kept = re.within and gain > 1e-9 * objective
            refinements.append(_refinement(group, re.solved, gain, kept))
            if kept:
                clustering, objective, chosen, steps = split, re.solved.objective_without_tie_break, re.chosen, re.steps
        t2 = time.perf_counter()
        choice = _choice(recomputed)
        reps = self.clustering.rep
        rules = {n: self.strategies[reps[n]].source for n in chosen if reps[n] in self.strategies}
        budget = overlap.budgets(tg, lambda n: problem.least_compute.get(reps[n], 0.0))
        ev = evaluate(tg, chosen, cost_model, request.outputs, rules, budget)
        why = alternatives(tg, chosen, self._explain_options(request, rules), cost_model, request.outputs, budget)
        nodes = {
            k: dataclasses.replace(v, comm_s=why[k][0], alternatives=why[k][1]) if k in why else v
            for k, v in ev.nodes.items()
        }
        rerun = self.recomputed(choice)
        cost = dataclasses.replace(ev.cost, recompute=_rerun_seconds(ev, rerun, tg))
        report, _ = self.estimate(chosen, choice, request)
        if _over(report, request):
            warnings.warn(
                f"the plan's estimated peak {report.peak_bytes:.6g} bytes per device (at {report.peak_at})"
                f" exceeds bytes_per_device={request.peak_budget:.6g}: the candidate steps bounded in the ILP"
                f" ({len(steps)}) did not catch it",
                stacklevel=3,
            )
        if not math.isclose(cost.total, objective, rel_tol=1e-6, abs_tol=1e-9):
            warnings.warn(
                f"reduced ILP objective {objective:.6g}s differs from the expanded plan's"
                f" cost {cost.total:.6g}s; the reported cost is the expanded one",
                stacklevel=3,
            )
        t3 = time.perf_counter()
        status, gap = solved.result.status.value, solved.result.gap
        log.info("solved (%s, gap %s): estimated step %.3f ms", status, gap, objective * 1e3)
        timings = {
            **trace_timings,
            "costs": t1 - t0 - main.build_s - main.solve_s,
            "ilp_build": main.build_s,
            "solve": main.solve_s,
            "refine": t2 - t1,
            "plan": t3 - t2,
        }
        return Plan(
            mesh_shape=self.mesh_shape,
            mesh_dim_names=tuple(self.mesh.mesh_dim_names) if self.mesh.mesh_dim_names else None,
            device=self.device_profile.name,
            nodes=nodes,
            param_placements={fqn: chosen[n].output for fqn, n in tg.placeholder_for("param").items()},
            cost=cost,
            memory=report,
            redistributions=ev.redistributions,
            solver=solved.result.to_dict() | {"x": None},
            ilp={
                "n_vars": solved.n_vars,
                "n_rows": solved.n_rows,
                "n_edge_vars": solved.n_edge_vars,
                "n_dropped_strategies": solved.n_dropped,
                "n_units": len(problem.units),
                "n_merged": problem.n_merged,
                "n_clustered": clustering.n_clustered,
                "n_nodes": len(tg.gm.graph.nodes),
                "n_peak_steps": len(steps),
                "objective": objective,
                "refinements": refinements,
            },
            timings=timings,
            layer_classes=[list(c) for c in clustering.classes],
            recompute=dict(sorted(choice.items(), key=lambda kv: _layer_key(kv[0]))),
            overlap_budget=budget,
            signature=mismatch.signature(tg),
        )

    def _explain_options(self, request: Request, nodes) -> dict[fx.Node, tuple]:
        """The strategies each node may take under the user's constraints (for ``explain``)."""
        options = {n: self.strategies[self.clustering.rep[n]].strategies for n in nodes}
        for _, fixed, placements in request.fixed:
            for n in fixed:
                if n in options:
                    options[n] = tuple(s for s in options[n] if s.outputs[0] == tuple(placements))
        return options


def _option_name(layer: str, option: str) -> str:
    return f"{layer}: {option}"


def _choice(names: tuple[str, ...]) -> dict[str, str]:
    """Recompute option names ("layers.3: full") as layer -> option."""
    return dict(name.split(": ", 1) for name in names)


def _peak_group(request: Request) -> str:
    return f"{_PEAK_GROUP} bytes per device <= {request.peak_budget:.6g}"


def _cap_error(groups: tuple[str, ...], why: str, least: int) -> InfeasiblePlanError:
    message = (
        f"{why}\nThe smallest estimated peak a plan reaches is {_size(least)} per device"
        f" ({least} bytes; searched for at most {_SMALLEST_PEAK_S:.0f} s): raise bytes_per_device to at"
        " least that, or relax the other constraints"
    )
    return InfeasiblePlanError(groups, message, least)


def _size(n: float) -> str:
    return f"{n / 2**30:.3f} GiB" if n >= 2**30 else f"{n / 2**20:.3f} MiB"


def _layer_key(layer: str) -> tuple:
    return tuple(int(p) if p.isdigit() else p for p in layer.split("."))


def _over(report, request: Request) -> bool:
    return request.peak_budget is not None and report.peak_bytes > request.peak_budget * (1 + 1e-9)


def _name(copy: memory.Recomputed | None) -> str:
    return "" if copy is None else copy.name


def _rerun_seconds(ev, rerun: frozenset[fx.Node], tg: TracedGraph) -> float:
    """Seconds the recomputed ops cost again: their compute, and their input moves (not from
    parameters, buffers or the batch, as the ILP prices them)."""
    names = {n.name for n in rerun}
    resident = {n.name for n in tg.resident()}
    compute = sum(ev.nodes[n].compute_s for n in names)
    return compute + sum(r.seconds for r in ev.redistributions if r.consumer in names and r.producer not in resident)


def _refinement(group: tuple[str, ...], step, gain: float, kept: bool) -> dict:
    """What re-solving one boundary group found (``gain``: seconds saved)."""
    return {
        "layers": list(group),
        "n_vars": step.n_vars,
        "n_rows": step.n_rows,
        "status": step.result.status.value,
        "gap": step.result.gap,
        "solve_s": step.build_time + step.solve_time,
        "gain_s": gain,
        "kept": kept,
    }
