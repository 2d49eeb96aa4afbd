"""The planner: from a traced graph, its strategies and the user's constraints to a ``Plan``.

It prices the reduced problem, adds the user's rows (pins, parameter and peak budgets, recompute
options), solves, re-solves the boundary layers on their own, and prices the expanded plan. The
peak cap is bounded lazily: at a few candidate steps first, then at each step where the plan's
estimated peak still exceeds the cap, until it does not (the rows come from ``peak``, the estimates
from ``memory``). ``AutoParallel`` is the front that collects the constraints; this module owns
the solve.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
import warnings
from dataclasses import dataclass, field

import torch.fx as fx
from torch.distributed.device_mesh import DeviceMesh

from autoplan.cost import memory, overlap, timeline
from autoplan.cost.costs import CostModel
from autoplan.cost.devices import DeviceProfile, dtype_name
from autoplan.errors import ConstraintError, InfeasiblePlanError, SolverLimitError
from autoplan.heap import collector_paused
from autoplan.plan import (
    REPLICATED_SHARE,
    CostBreakdown,
    MemoryReport,
    NodePlan,
    Plan,
    Redistribution,
    forward_compute,
    placements_str,
    replicated,
    replicated_compute,
)
from autoplan.shard.strategies import NodeStrategies, Placements, Strategy
from autoplan.solve import mismatch
from autoplan.solve.evaluate import alternatives, evaluate, expand_choice
from autoplan.solve.ilp import POLISH_S, TRIAL_S, FixedRows, NoSeedError, RecomputeVar, UnitChoice, solve_placement
from autoplan.solve.peak import PEAK_GROUP, ParamShard, PeakRows, Point, option_name, param_group, peak_group
from autoplan.solve.problem import (
    PlacementProblem,
    Shared,
    allowed_strategies,
    build_problem,
    forward_costs,
)
from autoplan.solve.reports import IlpReport, Refinement, SolverReport
from autoplan.trace import recompute
from autoplan.trace.clustering import Clustering, untie
from autoplan.trace.tracing import TracedGraph
from solvers import OPTIMALITY_GAP, STOP_RESTRICTED, STOP_TIME_LIMIT, InfeasibleError, SolveOptions, SolverTimeoutError

log = logging.getLogger(__name__)
_PEAK_ROUNDS = 5  # solves at most, each bounding the peak at more steps
DEFAULT_GAP = 1e-2  # relative MIP gap a plan is certified within by default (``AutoParallel``)
NO_RECOMPUTE = "none"
_SMALLEST_PEAK_S = 60.0  # time for finding the least peak an infeasible cap's error reports
_SPLIT_S = 10.0  # time for the plan splitting the forward compute a mostly replicated plan is compared with


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
    polish_s: float | None = None  # the plan is the polish's, which had these seconds at most


@dataclass
class _Refined:
    """The plan after the boundary re-solves: its clustering, objective, strategies and the peak
    steps bounded, with a record of each group tried."""

    clustering: Clustering
    objective: float
    chosen: dict[fx.Node, Strategy]
    steps: dict[Point, float]
    refinements: list[Refinement]


@dataclass(frozen=True)
class _Priced:
    """A plan priced for its report (``Planner._priced``)."""

    nodes: dict[str, NodePlan]
    cost: CostBreakdown
    memory: MemoryReport
    redistributions: list[Redistribution]
    budget: dict[str, float]
    rerun: frozenset[fx.Node]


@dataclass
class Planner:
    tg: TracedGraph
    clustering: Clustering
    strategies: dict[fx.Node, NodeStrategies]
    mesh: DeviceMesh
    device_profile: DeviceProfile
    optimizer: memory.OptimizerSpec
    solve_options: SolveOptions = field(default_factory=lambda: SolveOptions(mip_rel_gap=DEFAULT_GAP))
    merge_followers: bool = True
    expert_imbalance: float = 1.0  # see ``CostModel``
    prefetch: bool = False  # the lowering gathers parameters a layer ahead (``timeline.schedule``)

    def __post_init__(self) -> None:
        self.mesh_shape = tuple(self.mesh.shape)
        self._started = time.perf_counter()  # when the current ``plan`` began: progress lines say since when
        self.shared = Shared(self.tg, self.clustering, self.prefetch)
        self.peak = PeakRows(
            self.tg, self.clustering, self.mesh, self.device_profile, self.optimizer, self.shared, self.prefetch
        )

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

    def _options(self, problem: PlacementProblem, request: Request, cost_model: CostModel) -> list[RecomputeVar]:
        """Recompute options worth a variable: every layer's when a peak cap could want them, but
        only the pinned option of a pinned layer (a layer pinned to ``"none"`` has none)."""
        if request.peak_budget is None and not request.recompute:
            return []
        offered = [
            (layer, option, nodes)
            for (layer, option), nodes in self.peak.tagged.items()
            if nodes and request.recompute.get(layer, option if request.peak_budget is not None else None) == option
        ]
        seconds = forward_costs(self.tg, problem, cost_model, [nodes for _, _, nodes in offered])
        return [
            RecomputeVar(option_name(layer, option), layer, s, layer in request.recompute, option)
            for (layer, option, _), s in zip(offered, seconds)
        ]

    # ---- solves -------------------------------------------------------------------------

    def _solve(
        self,
        request: Request,
        clustering: Clustering,
        strategies: dict[fx.Node, NodeStrategies],
        cost_model: CostModel,
        steps: dict[Point, float],
        opts: SolveOptions,
        *,
        start: dict[fx.Node, Strategy] | None = None,
        start_recompute: tuple[str, ...] = (),
        smallest_peak: bool = False,
        least: dict[fx.Node, float] | None = None,
    ) -> tuple[PlacementProblem, UnitChoice, dict[fx.Node, Strategy]]:
        """Build and solve the ILP for one clustering under ``opts``; returns the solve and every
        node's strategy (``start``, ``start_recompute``, ``smallest_peak``: see ``solve_placement``;
        ``least``: see ``build_problem``)."""
        problem = build_problem(
            self.tg, clustering, strategies, cost_model, request.outputs, self.shared, self.merge_followers, least
        )
        options = self._options(problem, request, cost_model)
        budgets = self.peak.rows(problem, request.peak_budget, request.outputs, steps, options)
        fixed = self._fixed_rows(problem, request)
        if request.param_budget is not None:
            row = self.peak.param_row(problem, request.param_budget)
            least, best = self.peak.least_params(problem, row, fixed)
            if least > request.param_budget:
                raise _param_budget_error(request.param_budget, least, self.peak.param_shards(problem, best))
            budgets.append(row)
        solved = solve_placement(
            problem,
            fixed,
            budgets,
            dataclasses.replace(opts, mip_rel_gap=max(opts.mip_rel_gap, OPTIMALITY_GAP)),
            start=start,
            start_recompute=start_recompute,
            options=options,
            smallest_peak=smallest_peak,
        )
        return problem, solved, expand_choice(self.tg, problem, solved.choice)

    def recomputed(self, choice: dict[str, str]) -> frozenset[fx.Node]:
        return frozenset().union(*(self.peak.tagged[(layer, o)] for layer, o in choice.items()))

    def estimate(self, chosen: dict[fx.Node, Strategy], choice: dict[str, str], request: Request):
        """The memory report of a plan and the schedule it was walked on."""
        report, sched, _ = self.walk(chosen, choice, request)
        return report, sched

    def walk(self, chosen: dict[fx.Node, Strategy], choice: dict[str, str], request: Request):
        """The memory report of a plan, the schedule it was walked on and the bytes alive at each step."""
        sched = timeline.schedule(self.tg, self.recomputed(choice), self.prefetch) if choice else self.peak.schedule
        move = self.peak.move_bytes
        grads = self.peak.gradient_moves
        walk = memory.walk(self.tg, chosen, self.mesh_shape, self.optimizer, sched, move, request.outputs, grads)
        return walk.report, sched, walk.live

    def _solve_within_peak(self, request: Request, solve_with, steps: dict[Point, float], what: str) -> _Solved:
        """``solve_with(steps)`` with the peak bounded at ``steps``; where the plan's estimated peak
        still exceeds the cap (at other steps, or through bytes the rows miss), bound those steps
        too (``PeakRows.over``: the peak and the other local maxima over the cap), each less what
        its row misses (or, where it is bounded already, less the overshoot), and solve again, at
        most ``_PEAK_ROUNDS`` times. Each round's plan is logged at INFO as ``what``'s progress."""
        steps, build_s, solve_s = dict(steps), 0.0, 0.0
        for round_no in range(1, _PEAK_ROUNDS + 1):
            problem, solved, chosen = solve_with(steps)
            build_s, solve_s = build_s + solved.build_time, solve_s + solved.solve_time
            if request.peak_budget is None:
                self._progress(what, solved)
                return _Solved(problem, solved, chosen, True, steps, build_s, solve_s)
            report, sched, live = self.walk(chosen, _choice(solved.recompute), request)
            over = _over(report, request)
            peak = f"estimated peak {_size(report.peak_bytes)} {'over' if over else 'within'} the cap"
            self._progress(
                f"{what}, round {round_no} of at most {_PEAK_ROUNDS}", solved, f"{peak} of {_size(request.peak_budget)}"
            )
            if not over:
                return _Solved(problem, solved, chosen, True, steps, build_s, solve_s)
            bounded = set(steps)  # not the analogues this round adds
            at = (problem, solved.choice, solved.recompute)
            for t, missed in self.peak.over(sched, live, chosen, request.outputs, request.peak_budget, at):
                missed = max(steps.get(t, 0.0), missed)
                if t in bounded and missed <= steps[t]:  # the row holds only within the solver's tolerance
                    missed = steps[t] + report.peak_bytes - request.peak_budget
                self.peak.bound(steps, t, missed)
        return _Solved(problem, solved, chosen, False, steps, build_s, solve_s)

    def _progress(self, what: str, solved: UnitChoice, extra: str = "") -> None:
        """One INFO line of a solve's progress: its plan's step time (the incumbent), the gap to the
        solver's bound, and the seconds since planning began."""
        log.info(
            "%s: incumbent %.3f ms per step, gap %s%s, %.1f s elapsed",
            what,
            solved.objective_without_tie_break * 1e3,
            _percent(solved.result.gap),
            f", {extra}" if extra else "",
            time.perf_counter() - self._started,
        )

    def _main_solve(self, request: Request, cost_model: CostModel) -> _Solved:
        """The solve with identical layers tied, bounded at two candidate steps to begin with.

        Under a cap with free recompute options, each round takes the fixed-option trials' plan as
        it is (``polish_s=0``), and only the last round's plan, once within the cap, is polished by
        the full MIP: the polish is the slow part, and an earlier round's is thrown away."""
        capped = request.peak_budget is not None
        steps = {(t, None, False): 0.0 for t in timeline.candidate_steps(self.peak.schedule, count=2)} if capped else {}
        t0 = time.perf_counter()

        start = self._start_of(request.start)

        def solve_with(steps, opts=self.solve_options, **kw):
            if start is not None:
                kw.setdefault("start", start)
                kw.setdefault("start_recompute", tuple(option_name(*lo) for lo in request.start.recompute.items()))
            try:
                return self._solve(request, self.clustering, self.strategies, cost_model, steps, opts, **kw)
            except InfeasibleError as e:
                if capped and any(g.startswith(PEAK_GROUP) for g in e.groups):
                    raise self._smallest_peak_error(e, request, cost_model, steps) from e
                raise

        def round_solve(steps):
            """A round takes the trials' plan as it is. When no trial finds one, the least peak of
            each option on every layer says whether the cap can be met at all, far sooner than the
            full MIP proves that it cannot."""
            try:
                return solve_with(steps, dataclasses.replace(self.solve_options, polish_s=0.0, seed_only=True))
            except NoSeedError:
                least = self._least_peak(request, cost_model, steps)
                if least is not None and least > request.peak_budget:
                    group = peak_group(request.peak_budget)
                    raise _cap_error((group,), f"No plan meets the {group}.", least) from None
                return solve_with(steps, dataclasses.replace(self.solve_options, polish_s=0.0))

        done = self._solve_within_peak(request, round_solve, steps, "main solve")
        if not (done.solved.seeded and done.within):
            return done
        limit = self.solve_options.time_limit
        left = POLISH_S if limit is None else min(POLISH_S, limit - (time.perf_counter() - t0))
        if left <= 0:
            return done
        log.info("polishing the capped plan with the full MIP (at most %.0f s)", left)
        try:
            polish = dataclasses.replace(self.solve_options, time_limit=left, diagnose=False)
            problem, solved, chosen = solve_with(
                done.steps, polish, start=done.chosen, start_recompute=done.solved.recompute
            )
        except (InfeasibleError, SolverTimeoutError):
            return done
        self._progress("polish", solved)
        spent = dataclasses.replace(
            done, build_s=done.build_s + solved.build_time, solve_s=done.solve_s + solved.solve_time
        )
        report, _ = self.estimate(chosen, _choice(solved.recompute), request)
        if _over(report, request) or solved.objective_without_tie_break > done.solved.objective_without_tie_break:
            return spent  # the polish moved the peak where no row bounds it, or found nothing better
        return dataclasses.replace(spent, problem=problem, solved=solved, chosen=chosen, polish_s=left)

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
        options' MIP is not. Raises ``InfeasibleError`` when the other constraints conflict.

        The option that recomputes the most ops goes first, and each gets an even share of the time left
        (one that finishes early leaves its time to the rest): the least peak is nearly always the
        most recompute's, and one option's search must not spend the others' time."""
        end = time.perf_counter() + _SMALLEST_PEAK_S
        least = None
        ops = dict.fromkeys(recompute.OPTIONS, 0)
        for (_, option), tagged in self.peak.tagged.items():
            ops[option] += len(tagged)
        options = (*sorted((o for o in ops if ops[o]), key=lambda o: -ops[o]), NO_RECOMPUTE)
        for i, option in enumerate(options):
            deadline = time.perf_counter() + (end - time.perf_counter()) / (len(options) - i)
            pins = {**dict.fromkeys(self.peak.layers, option), **request.recompute}
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
                opts = dataclasses.replace(self.solve_options, time_limit=left)
                problem, solved, chosen = self._solve(
                    request, self.clustering, self.strategies, cost_model, steps, opts, smallest_peak=True
                )
            except SolverTimeoutError:
                break
            report, sched, live = self.walk(chosen, _choice(solved.recompute), request)
            least = report.peak_bytes if least is None else min(least, report.peak_bytes)
            if report.peak_bytes <= solved.peak + 1.0:
                break
            at = (problem, solved.choice, solved.recompute)
            points = self.peak.over(sched, live, chosen, request.outputs, solved.peak + 1.0, at)
            if all(t in steps and missed <= steps[t] for t, missed in points):
                break
            for t, missed in points:
                self.peak.bound(steps, t, max(steps.get(t, 0.0), missed))
        return least

    def _refine(self, request, clustering, group, chosen, recomputed, cost_model, steps, time_limit, least):
        """Solve again with the layers of ``group`` deciding on their own.

        Every other repeated layer keeps its choice (one strategy left), so the ILP is the size of
        one layer plus the nodes outside repeated layers, which are free to meet the group halfway.
        Recompute choices stay as the main solve made them. Under a peak cap the re-solve is bounded
        in rounds like the main solve. The start is kept without an LP when a bound from the
        re-solve's structure proves it within ``mip_rel_gap`` (``autoplan.solve.certify``): a gain under
        the gap the user allows is not looked for. ``least``: each base representative's fastest compute (the
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
            pins = {**{layer: NO_RECOMPUTE for layer in self.peak.layers}, **_choice(recomputed)}
            pinned = dataclasses.replace(request, recompute=pins)

        own_least = {n: least[self.clustering.rep[n]] for n in strategies}

        opts = dataclasses.replace(self.solve_options, time_limit=time_limit, diagnose=False, keep_start=True)

        def solve_with(steps):
            return self._solve(pinned, split, strategies, cost_model, steps, opts, start=chosen, least=own_least)

        return split, self._solve_within_peak(request, solve_with, steps, f"re-solve of {'+'.join(group)}")

    def plan(self, request: Request, trace_timings: dict[str, float]) -> Plan:
        """Solve for the cheapest plan under ``request``.

        Identical layers share decisions. The first and last layers are tied to the others for the
        main solve, then each is re-solved on its own against the rest (``plan.ilp["refinements"]``):
        their neighbours differ, so their best choices can too.
        """
        with collector_paused():
            return self._plan(request, trace_timings)

    def _plan(self, request: Request, trace_timings: dict[str, float]) -> Plan:
        tg = self.tg
        t0 = self._started = time.perf_counter()
        cost_model = CostModel(self.mesh, self.device_profile, self.expert_imbalance)
        try:
            main = self._main_solve(request, cost_model)
        except SolverTimeoutError as e:
            raise SolverLimitError(e, time.perf_counter() - t0) from e
        problem, solved = main.problem, main.solved
        self._warn_if_stopped_early(main)
        t1 = time.perf_counter()
        refined = self._refine_boundaries(request, cost_model, main, t0)
        t2 = time.perf_counter()
        choice = _choice(solved.recompute)
        priced = self._priced(request, cost_model, problem, refined, choice)
        t3 = time.perf_counter()
        split = self._split_objective(request, cost_model, main, priced.nodes)
        t4 = time.perf_counter()
        log.info(
            "solved (%s, gap %s): estimated step %.3f ms, %.1f s elapsed",
            solved.result.status.value,
            _percent(solved.result.gap),
            refined.objective * 1e3,
            t3 - t0,
        )
        timings = {
            **trace_timings,
            "costs": t1 - t0 - main.build_s - main.solve_s,
            "ilp_build": main.build_s,
            "solve": main.solve_s,
            "refine": t2 - t1,
            "plan": t3 - t2,
            **({"split": t4 - t3} if split is not None else {}),
        }
        return Plan(
            mesh_shape=self.mesh_shape,
            mesh_dim_names=tuple(self.mesh.mesh_dim_names) if self.mesh.mesh_dim_names else None,
            device=self.device_profile.name,
            nodes=priced.nodes,
            param_placements={fqn: refined.chosen[n].output for fqn, n in tg.placeholder_for("param").items()},
            cost=priced.cost,
            memory=priced.memory,
            redistributions=priced.redistributions,
            solver=SolverReport.of(solved.result),
            ilp=IlpReport(
                n_vars=solved.n_vars,
                n_rows=solved.n_rows,
                n_edge_vars=solved.n_edge_vars,
                n_dropped_strategies=solved.n_dropped,
                n_units=len(problem.units),
                n_merged=problem.n_merged,
                n_clustered=refined.clustering.n_clustered,
                n_nodes=len(tg.gm.graph.nodes),
                n_peak_steps=len(refined.steps),
                objective=refined.objective,
                refinements=refined.refinements,
                split_objective=split,
            ),
            timings=timings,
            layer_classes=[list(c) for c in refined.clustering.classes],
            recompute=dict(sorted(choice.items(), key=lambda kv: _layer_key(kv[0]))),
            checkpointed=tg.checkpointed(priced.rerun),
            overlap_budget=priced.budget,
            signature=mismatch.signature(tg),
            prefetch=self.prefetch,
            precision=tg.precision,
        )

    def _split_objective(
        self, request: Request, cost_model: CostModel, main: _Solved, nodes: dict[str, NodePlan]
    ) -> float | None:
        """Where replicated ops take at least ``REPLICATED_SHARE`` of the forward compute time
        (``replicated_compute``), the ILP objective of the best plan in which each forward compute
        op that has a strategy splitting it takes one, for the summary to say what splitting costs
        (the layers tied, as in the main solve, within ``_SPLIT_S``); else, or where no such plan is
        found, ``None``."""
        if replicated_compute(nodes.values())[2] < REPLICATED_SHARE:
            return None
        names = {c.name for c in forward_compute(nodes.values())}
        strategies = dict(self.strategies)
        for n in self.tg.gm.graph.nodes:
            r = self.clustering.rep.get(n)
            if n.name in names and r in strategies:
                split = tuple(s for s in self.strategies[r].strategies if not replicated(s.outputs, s.inputs))
                if split:
                    strategies[r] = dataclasses.replace(self.strategies[r], strategies=split)
        opts = dataclasses.replace(self.solve_options, time_limit=_SPLIT_S, diagnose=False, polish_s=0.0)
        try:
            _, solved, _ = self._solve(
                request, self.clustering, strategies, cost_model, main.steps, opts, least=main.problem.least_compute
            )
        except (InfeasibleError, SolverTimeoutError, ConstraintError) as e:
            log.info("no plan splitting the replicated forward compute within %.0f s: %s", _SPLIT_S, e)
            return None
        return solved.objective_without_tie_break

    def _warn_if_stopped_early(self, main: _Solved) -> None:
        """A warning when the main solve's plan is outside the gap asked for, saying what ended the
        search (``_stop_reason``)."""
        mip_rel_gap, result = self.solve_options.mip_rel_gap, main.solved.result
        if result.gap > max(mip_rel_gap, OPTIMALITY_GAP) * (1 + 1e-9):
            why, advice = _stop_reason(main, self.solve_options)
            warnings.warn(
                f"the solver {why}, with the best plan so far, within {result.gap:.2%} of its bound"
                f" (mip_rel_gap={mip_rel_gap:g} was asked){advice}",
                stacklevel=4,
            )

    def _refine_boundaries(self, request: Request, cost_model: CostModel, main: _Solved, t0: float) -> _Refined:
        """The boundary groups re-solved on their own (``_refine``), one after another, each against
        the plan the last one left (the certificates are Python and numpy, which threads do not run
        side by side), until the time limit counted from ``t0`` is spent; a group's plan is kept
        where it is cheaper."""
        time_limit = self.solve_options.time_limit
        solved = main.solved
        out = _Refined(self.clustering, solved.objective_without_tie_break, main.chosen, main.steps, [])
        for group in self.clustering.boundary:
            left = None if time_limit is None else time_limit - (time.perf_counter() - t0)
            if left is not None and left <= 0:
                break
            try:
                split, re = self._refine(
                    request,
                    out.clustering,
                    group,
                    out.chosen,
                    solved.recompute,
                    cost_model,
                    out.steps,
                    left,
                    main.problem.least_compute,
                )
            except (SolverTimeoutError, InfeasibleError):  # the group's own bounds may not meet a cap
                break
            gain = out.objective - re.solved.objective_without_tie_break
            # below 1e-9 it is the tie-break trading cost for fewer changes
            kept = re.within and gain > 1e-9 * out.objective
            out.refinements.append(_refinement(group, re.solved, gain, kept))
            if kept:
                out.clustering, out.chosen, out.steps = split, re.chosen, re.steps
                out.objective = re.solved.objective_without_tie_break
        return out

    def _priced(
        self,
        request: Request,
        cost_model: CostModel,
        problem: PlacementProblem,
        refined: _Refined,
        choice: dict[str, str],
    ) -> _Priced:
        """The refined plan priced node by node (``evaluate``), each node's alternatives for
        ``explain``, its recompute's seconds and its memory report; warns where the peak is over the
        cap or the expanded cost is not the ILP's objective."""
        tg, chosen, reps = self.tg, refined.chosen, self.clustering.rep
        rules = {n: self.strategies[reps[n]].source for n in chosen if reps[n] in self.strategies}
        budget = overlap.budgets(tg, lambda n: problem.least_compute.get(reps[n], 0.0))
        all_moves = self.shared.moves(request.outputs)
        ev = evaluate(chosen, cost_model, all_moves, rules, budget)
        why = alternatives(chosen, self._explain_options(request, rules), cost_model, all_moves, budget)
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
                f" ({len(refined.steps)}) did not catch it",
                stacklevel=4,
            )
        if not math.isclose(cost.total - cost.bucket_latency, refined.objective, rel_tol=1e-6, abs_tol=1e-9):
            warnings.warn(
                f"reduced ILP objective {refined.objective:.6g}s differs from the expanded plan's"
                f" cost {cost.total:.6g}s less its buckets' unshared latency {cost.bucket_latency:.6g}s; the"
                " reported cost is the expanded one",
                stacklevel=4,
            )
        return _Priced(nodes, cost, report, ev.redistributions, budget, rerun)

    def _explain_options(self, request: Request, nodes) -> dict[fx.Node, tuple]:
        """The strategies each node may take under the user's constraints (for ``explain``)."""
        options = {n: self.strategies[self.clustering.rep[n]].strategies for n in nodes}
        for _, fixed, placements in request.fixed:
            for n in fixed:
                if n in options:
                    options[n] = tuple(s for s in options[n] if s.outputs[0] == tuple(placements))
        return options


def _stop_reason(main: _Solved, opts: SolveOptions) -> tuple[str, str]:
    """What ended the main solve short of its gap, with its ILP seconds (``main.solve_s``, every
    round), and what to do about it: a pass at its time limit (the capped plan's polish at
    ``POLISH_S`` or what was left of ``time_limit``, a recompute trial at ``TRIAL_S``, else the
    user's ``time_limit`` or, without one, the MIP improving a found plan at ``improve_s``), the
    search's end over the columns its LP screen or pricing kept, or neither (a bound no pass
    tightened)."""
    solved, spent = main.solved, f"{main.solve_s:.1f} s of solving"
    if solved.result.stop == STOP_TIME_LIMIT:
        # the polish and the trials have limits of their own, which a longer time_limit does not raise
        if main.polish_s is not None:
            return f"stopped at its {main.polish_s:.3g} s limit for polishing the capped plan, after {spent}", ""
        if solved.seeded and (opts.time_limit is None or opts.time_limit > TRIAL_S):
            return f"stopped at the {TRIAL_S:g} s limit of the recompute trial whose plan it kept, after {spent}", ""
        if opts.time_limit is not None:
            limit = f"time_limit={opts.time_limit} s"
        else:
            limit = f"its {opts.improve_s:g} s limit for improving a found plan"
        return f"stopped at {limit}, after {spent}", ": raise time_limit for a better one"
    if solved.result.stop == STOP_RESTRICTED:
        why = f"ended after {spent}, no time limit reached: it searched to its end the columns its LP kept"
        return why, " (its bound is the whole model's LP, which may sit below any plan: more time does not help)"
    return f"ended after {spent} without proving its gap, no time limit reached", " (its bound is the LP's)"


def _choice(names: tuple[str, ...]) -> dict[str, str]:
    """Recompute option names ("layers.3: full") as layer -> option."""
    return dict(name.split(": ", 1) for name in names)


def _cap_error(groups: tuple[str, ...], why: str, least: int) -> InfeasiblePlanError:
    message = (
        f"{why}\nThe smallest estimated peak a plan reaches is {_size(least)} per device"
        f" ({least} bytes; searched for at most {_SMALLEST_PEAK_S:.0f} s): raise bytes_per_device to at"
        " least that, or relax the other constraints"
    )
    return InfeasiblePlanError(groups, message, least)


def _percent(gap: float) -> str:
    """A relative gap as a percentage (``unknown`` while the solver has no bound)."""
    return f"{gap:.2%}" if math.isfinite(gap) else "unknown"


_NAMED_PARAMS = 5  # parameters a parameter budget's error lists


def _param_budget_error(budget: float, least: int, shards: list[ParamShard]) -> InfeasiblePlanError:
    """No plan stores the parameters within ``budget``: name the largest (at their smallest shard,
    under the other constraints) and the least budget that any plan meets."""
    group = param_group(budget)
    listed = [
        f"  {p.fqn} {p.shape} {dtype_name(p.dtype)}: {p.nbytes} bytes as {placements_str(p.placements)}"
        for p in shards[:_NAMED_PARAMS]
    ]
    if len(shards) > _NAMED_PARAMS:
        listed.append(f"  ... and {len(shards) - _NAMED_PARAMS} more")
    message = (
        f"No plan meets the {group}: split as finely as the mesh and the other constraints allow, the"
        f" parameters still take {least} bytes ({_size(least)}) per device. The largest, at their smallest"
        " shards:\n" + "\n".join(listed) + f"\nRaise param_bytes to at least {least} (a pinned parameter"
        " counts at its pinned placement)"
    )
    return InfeasiblePlanError([group], message, smallest_param_bytes=least)


def _size(n: float) -> str:
    return f"{n / 2**30:.3f} GiB" if n >= 2**30 else f"{n / 2**20:.3f} MiB"


def _layer_key(layer: str) -> tuple:
    return tuple(int(p) if p.isdigit() else p for p in layer.split("."))


def _over(report, request: Request) -> bool:
    return request.peak_budget is not None and report.peak_bytes > request.peak_budget * (1 + 1e-9)


def _rerun_seconds(ev, rerun: frozenset[fx.Node], tg: TracedGraph) -> float:
    """Seconds the recomputed ops cost again: their compute, and their input moves (not from
    parameters, buffers or the batch, as the ILP prices them)."""
    names = {n.name for n in rerun}
    resident = {n.name for n in tg.resident()}
    compute = sum(ev.nodes[n].compute_s for n in names)
    return compute + sum(r.seconds for r in ev.redistributions if r.consumer in names and r.producer not in resident)


def _refinement(group: tuple[str, ...], step, gain: float, kept: bool) -> Refinement:
    """What re-solving one boundary group found (``gain``: seconds saved)."""
    return Refinement(
        layers=list(group),
        n_vars=step.n_vars,
        n_rows=step.n_rows,
        status=step.result.status.value,
        gap=step.result.gap,
        solve_s=step.build_time + step.solve_time,
        gain_s=gain,
        kept=kept,
    )
