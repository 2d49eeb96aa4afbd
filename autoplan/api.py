"""``AutoParallel``: the user-facing entry point, from (model, mesh, inputs) to a ``Plan``."""

from __future__ import annotations

import dataclasses
import fnmatch
import logging
import math
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.fx as fx
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from autoplan import memory
from autoplan.adapters.dtensor import tensor_meta
from autoplan.attention import check_option as check_attention_option
from autoplan.clustering import Clustering, find_repeats, untie
from autoplan.compile import RegionStats, compile_regions
from autoplan.constraints import Pin
from autoplan.costs import H100_SXM, CostModel, DeviceProfile, local_bytes
from autoplan.errors import ConstraintError
from autoplan.evaluate import alternatives, evaluate, expand_choice
from autoplan.ilp import BudgetRow, FixedRows, solve_placement
from autoplan.lowering import lower
from autoplan.passes import alias_roundtrip
from autoplan.passes.alias_roundtrip import ALIAS_KEY, RoundTripStats, insert_aliases
from autoplan.plan import Plan, placements_str
from autoplan.problem import allowed_strategies, build_problem
from autoplan.runtime import build_parallel_module, make_executor
from autoplan.strategies import (
    NodeStrategies,
    Placements,
    Strategy,
    StrategyBuilder,
    enumerate_strategies,
    is_valid,
    output_vals,
)
from autoplan.tracing import PATH_KEY, PHASE_KEY, TracedGraph, trace_joint
from solvers import SolverTimeoutError

log = logging.getLogger(__name__)  # under "autoplan": the command's --verbose shows it
_PEAK_ROUNDS = 5  # solves at most, each bounding the peak at one more step
_PEAK_GAP = 1e-3  # relative MIP gap of solves under a peak cap


def _check_mesh(mesh: Any) -> DeviceMesh:
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a torch.distributed.device_mesh.DeviceMesh, got {type(mesh).__name__}")
    if mesh.ndim < 1 or any(s < 1 for s in mesh.shape):
        raise ValueError(f"mesh has an invalid shape {tuple(mesh.shape)}")
    return mesh


def _unsplittable(val: torch.Tensor, placements: Placements, mesh_shape: Sequence[int]) -> str:
    return (
        f"shape {tuple(val.shape)} cannot be placed as {placements_str(placements)} on mesh {tuple(mesh_shape)}"
        " (a sharded dim must be divisible by the product of the mesh dims that shard it)"
    )


def _executed_collectives(lowered) -> dict[str, int]:
    """Collectives a step runs: forward plus backward graphs (so FSDP re-gathers count)."""
    fwd, bwd = lowered.collective_counts(lowered.forward), lowered.collective_counts(lowered.backward)
    return {k: fwd.get(k, 0) + bwd.get(k, 0) for k in sorted({*fwd, *bwd})}


def _pass_report(plan: Plan, applied: Plan, trips: RoundTripStats, lowered) -> dict[str, int]:
    """What the post-solve passes did, and the collectives of one step before and after them.

    Before: the solved plan's redistributions. After round trips: the rewired plan's (``local`` counts
    shard-slicing steps, which is what a removed round trip's return leg usually is). After all
    passes: what the lowered forward and backward graphs run (gathers fused, FSDP re-gathers added).
    """
    return {
        "round_trips_removed": trips.removed,
        "aliases_dropped": trips.aliases_dropped,
        "gather_chains_fused": lowered.gather_fusion.fused,
        "gather_chains_rejected": lowered.gather_fusion.rejected,
        "recompute_chains_tagged": lowered.recompute.chains,
        "recompute_nodes_tagged": lowered.recompute.nodes,
        **{f"{k}_before_passes": v for k, v in plan.collective_counts().items()},
        **{f"{k}_after_round_trips": v for k, v in applied.collective_counts().items()},
        **{f"{k}_after_passes": v for k, v in _executed_collectives(lowered).items()},
    }


class AutoParallel:
    """Plan how to split a training step of ``model`` over ``mesh``.

    Use as a context manager: entering traces the model (on fake tensors) and enumerates
    strategies, constraints are then added, and ``optimize_placement`` solves the ILP.
    ``attention`` picks the kernel ``F.scaled_dot_product_attention`` traces to: ``"auto"`` (what
    the target GPU runs: flash for fp16/bf16 without a mask, else memory-efficient), ``"flash"``,
    ``"efficient"``, ``"cudnn"``, ``"math"`` or ``"cpu"`` (the host's kernel; CPU meshes only).
    Plans with GPU kernels still run on a CPU mesh: lowering computes them with the CPU kernel.
    """

    def __init__(
        self,
        model: nn.Module,
        mesh: DeviceMesh,
        input_fn: Callable[[], Any],
        loss_fn: Callable | None = None,
        device_profile: DeviceProfile = H100_SXM,
        *,
        strict: bool = False,
        cluster_layers: bool = True,
        merge_followers: bool = True,
        solver_backend: str = "highs",
        time_limit: float | None = None,
        attention: str = "auto",
        optimizer: memory.OptimizerSpec = memory.ADAMW,
    ):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        self.attention = check_attention_option(attention)
        self.model = model
        self.mesh = _check_mesh(mesh)
        self.input_fn = input_fn
        self.loss_fn = loss_fn
        self.device_profile = device_profile
        self.strict = strict
        self.cluster_layers = cluster_layers
        self.merge_followers = merge_followers
        self.solver_backend = solver_backend
        self.time_limit = time_limit
        self._inputs: dict[int, Placements] = {}
        self._outputs: dict[int, Placements] = {}
        self._pins: list[Pin] = []
        self._param_budget: float | None = None
        self._peak_budget: float | None = None
        self._peak_steps: dict[int, float] = {}  # schedule step the peak is bounded at -> bytes the row misses
        self.timings: dict[str, float] = {}
        self.traced: TracedGraph | None = None
        self.optimizer = optimizer

    # ---- lifecycle ------------------------------------------------------------------------

    def __enter__(self) -> AutoParallel:
        t0 = time.perf_counter()
        self.traced = trace_joint(
            self.model, self.input_fn, self.loss_fn, device=self.mesh.device_type, attention=self.attention
        )
        ta = time.perf_counter()
        self.aliases = insert_aliases(self.traced)
        t1 = time.perf_counter()
        self.clustering = self._cluster()
        self.strategies = enumerate_strategies(
            self.traced.gm.graph, self.clustering.rep, StrategyBuilder(self.mesh, strict=self.strict)
        )
        t2 = time.perf_counter()
        self.timings = {"trace": ta - t0, "aliases": t1 - ta, "strategies": t2 - t1}
        log.info(
            "traced %d nodes (%d after clustering) and enumerated strategies in %.2fs",
            len(self.traced.gm.graph.nodes),
            len(self.strategies),
            t2 - t0,
        )
        return self

    def __exit__(self, *exc) -> None:
        return None

    def _cluster(self) -> Clustering:
        if self.cluster_layers:
            return find_repeats(self.traced)
        nodes = list(self.traced.gm.graph.nodes)
        return Clustering({n: n for n in nodes}, {n: 1 for n in nodes}, (), {n: "" for n in nodes})

    def _require_traced(self) -> TracedGraph:
        if self.traced is None:
            raise RuntimeError("use AutoParallel as a context manager: `with AutoParallel(...) as ap:`")
        return self.traced

    # ---- constraints ----------------------------------------------------------------------

    def _check_placements(self, what: str, val, placements) -> Placements:
        placements = tuple(placements)
        if len(placements) != self.mesh.ndim:
            raise ConstraintError(f"{what}: {len(placements)} placements given for a {self.mesh.ndim}-D mesh")
        if not is_valid(placements, val, tuple(self.mesh.shape)):
            raise ConstraintError(f"{what}: {_unsplittable(val, placements, self.mesh.shape)}")
        return placements

    def add_input_constraints(self, constraints: Sequence[Sequence | None]) -> None:
        """Placements of the model inputs, in ``input_fn()`` order (``None`` leaves one free)."""
        inputs = self._require_traced().placeholder_for("input")
        if len(constraints) > len(inputs):
            raise ConstraintError(f"{len(constraints)} input constraints given, but the model has {len(inputs)} inputs")
        for i, c in enumerate(constraints):
            if c is not None:
                self._inputs[i] = self._check_placements(f"input {i}", inputs[i].meta["val"], c)

    def add_output_constraints(self, constraints: Sequence[Sequence | None]) -> None:
        """Placements of the model outputs (and of their incoming gradients)."""
        outputs = self._require_traced().outputs_of("output")
        if len(constraints) > len(outputs):
            raise ConstraintError(
                f"{len(constraints)} output constraints given, but the model has {len(outputs)} outputs"
            )
        for i, c in enumerate(constraints):
            if c is not None:
                self._outputs[i] = self._check_placements(f"output {i}", outputs[i].meta["val"], c)

    def add_node_constraint(self, target: fx.Node | str, placements: Sequence) -> None:
        """Pin the output placements of a node, a parameter FQN or a module's forward output (globs allowed).

        Repeated layers share decisions, so pinning a node of one layer pins its copies too. A node
        with several outputs (an attention kernel) is pinned by its first output.
        """
        name = target.name if isinstance(target, fx.Node) else str(target)
        nodes = self._pin_targets(name)
        if not nodes:
            raise ConstraintError(f"node constraint {name!r} matches no node, parameter or module")
        for n in nodes:
            self._check_placements(f"node constraint {name!r} ({n.name})", output_vals(n)[0], placements)
        self._pins.append(Pin(name, tuple(placements)))

    def remove_node_constraint(self, target: fx.Node | str) -> None:
        """Drop every pin added for ``target``: with ``add_*`` and a changed ``device_profile`` this
        explores what-ifs on one trace (each ``optimize_placement`` re-prices from scratch)."""
        name = target.name if isinstance(target, fx.Node) else str(target)
        kept = [p for p in self._pins if p.target != name]
        if len(kept) == len(self._pins):
            pinned = ", ".join(sorted({p.target for p in self._pins})) or "none"
            raise ConstraintError(f"no node constraint on {name!r} to remove (pinned: {pinned})")
        self._pins = kept

    def remove_memory_constraint(self) -> None:
        self._param_budget = self._peak_budget = None

    def add_memory_constraint(
        self,
        param_fraction: float | None = None,
        bytes_per_device: float | None = None,
        *,
        param_bytes: float | None = None,
    ) -> None:
        """Cap per-device memory: ``bytes_per_device`` bounds the estimated peak of a training step
        (parameters, gradients, optimizer states, saved activations and temporaries, see
        ``autoplan.memory``); ``param_fraction`` (of the whole model's) or ``param_bytes`` bound the
        parameter bytes alone. Each call replaces the caps it names."""
        if param_fraction is None and bytes_per_device is None and param_bytes is None:
            raise ConstraintError("give bytes_per_device (the step's peak), or param_fraction or param_bytes")
        if param_fraction is not None and param_bytes is not None:
            raise ConstraintError("give one of param_fraction or param_bytes: both cap the parameter bytes")
        for name, value in (("bytes_per_device", bytes_per_device), ("param_bytes", param_bytes)):
            if value is not None and not value > 0:
                raise ConstraintError(f"{name} must be a positive number of bytes, got {value}")
        if param_fraction is not None:
            if not 0 < param_fraction <= 1:
                raise ConstraintError(f"param_fraction must be in (0, 1], got {param_fraction}")
            total = sum(p.numel() * p.element_size() for p in self.model.parameters())
            param_bytes = param_fraction * total
        if param_bytes is not None:
            self._param_budget = float(param_bytes)
        if bytes_per_device is not None:
            self._peak_budget = float(bytes_per_device)

    def _pin_targets(self, name: str) -> list[fx.Node]:
        tg = self._require_traced()
        nodes = [n for n in tg.gm.graph.nodes if n.op != "output" and fnmatch.fnmatchcase(n.name, name)]
        params = tg.placeholder_for("param")
        nodes += [n for fqn, n in params.items() if fnmatch.fnmatchcase(fqn, name)]
        nodes += [params[c] for a, c in tg.tied.items() if c in params and fnmatch.fnmatchcase(a, name)]
        last_forward: dict[str, fx.Node] = {}
        for n in tg.gm.graph.nodes:
            if n.meta.get(PHASE_KEY) == "forward" and n.op == "call_function" and not n.meta.get(ALIAS_KEY):
                path = n.meta.get(PATH_KEY, "")
                for i in range(len(path.split("."))):
                    last_forward[".".join(path.split(".")[: i + 1])] = n
        nodes += [n for path, n in last_forward.items() if fnmatch.fnmatchcase(path, name)]
        return list(dict.fromkeys(nodes))

    # ---- solve ----------------------------------------------------------------------------

    def _fixed_outputs(self) -> list[tuple[str, list[fx.Node], Placements]]:
        """Every user constraint as (its name, the nodes it fixes, their output placements)."""
        tg = self._require_traced()
        inputs, tangents = tg.placeholder_for("input"), tg.placeholder_for("tangent")
        fixed = [(f"input constraint {i} = {placements_str(pl)}", [inputs[i]], pl) for i, pl in self._inputs.items()]
        fixed += [
            (f"output constraint {i} = {placements_str(pl)}", [tangents[i]], pl)
            for i, pl in self._outputs.items()
            if i in tangents
        ]
        for pin in self._pins:
            name = f"node constraint {pin.target} = {placements_str(pin.placements)}"
            fixed.append((name, self._pin_targets(pin.target), pin.placements))
        return fixed

    def _fixed_rows(self, problem) -> list[FixedRows]:
        rows = []
        for group, nodes, placements in self._fixed_outputs():
            items = []
            for n in nodes:
                allowed = allowed_strategies(problem, n, placements)
                if not allowed:
                    raise ConstraintError(f"{group}: no strategy of node {n.name} ({n.target}) outputs that placement")
                unit = problem.root[problem.clustering.rep[n]][0]
                items.append((unit, tuple(allowed)))
            rows.append(FixedRows(group, tuple(items)))
        return rows

    def _options(self, nodes) -> dict[fx.Node, tuple]:
        """The strategies each node may take under the user's constraints (for ``explain``)."""
        options = {n: self.strategies[self.clustering.rep[n]].strategies for n in nodes}
        for _, fixed, placements in self._fixed_outputs():
            for n in fixed:
                if n in options:
                    options[n] = tuple(s for s in options[n] if s.outputs[0] == tuple(placements))
        return options

    def _peak_rows(self, problem) -> list[BudgetRow]:
        """The estimated peak at each candidate step, linear in the placements (``autoplan.memory``)."""
        if self._peak_budget is None:
            return []
        mesh_shape, params = tuple(self.mesh.shape), set(self.traced.placeholder_for("param").values())
        names = {step: n.name for n, step in self.schedule.step.items()}
        rows = []
        for step, missed in sorted(self._peak_steps.items()):
            coeffs: dict[fx.Node, np.ndarray] = {}
            for n in memory.live_storages(self.schedule, step):
                rep = problem.clustering.rep.get(n)
                if rep not in problem.root:
                    continue
                unit, m = problem.root[rep]
                strategies = problem.strategies[rep]
                per = [memory.row_bytes(n, strategies[i].outputs, params, mesh_shape, self.optimizer) for i in m]
                coeffs[unit] = coeffs.get(unit, 0) + np.array(per)
            group = f"memory constraint: estimated peak bytes per device <= {self._peak_budget:.6g}"
            rows.append(BudgetRow(f"{group} (at {names[step]})", tuple(coeffs.items()), self._peak_budget - missed))
        return rows

    def _budget_rows(self, problem) -> list[BudgetRow]:
        rows = self._peak_rows(problem)
        if self._param_budget is None:
            return rows
        coeffs: dict[fx.Node, np.ndarray] = {}
        mesh_shape = tuple(self.mesh.shape)
        for n in self.traced.placeholder_for("param").values():
            rep = problem.clustering.rep[n]
            if rep is not n:
                continue
            unit, m = problem.root[rep]
            meta = tensor_meta(n.meta["val"])
            per = np.array([local_bytes(meta, problem.strategies[rep][i].output, mesh_shape) for i in m], dtype=float)
            coeffs[unit] = coeffs.get(unit, 0) + per * problem.clustering.multiplicity[rep]
        group = f"memory constraint: parameter bytes per device <= {self._param_budget:.6g}"
        return [*rows, BudgetRow(group, tuple(coeffs.items()), self._param_budget)]

    def apply_placement(
        self,
        plan: Plan,
        *,
        return_dtensor: bool = False,
        reshard_after_forward: bool = True,
        fuse_gathers: bool = True,
        remove_round_trips: bool = True,
        compile: bool = False,
    ) -> nn.Module:
        """The parallel module for ``plan``: DTensor parameters, the lowered graphs in forward/backward.

        Each rank passes its local shard of every input and gets local outputs (DTensors with
        ``return_dtensor``). A meta model is materialised with ``to_empty`` + ``init_weights()`` or
        ``load_state_dict`` of a full state dict. With ``remove_round_trips`` consumers that want a
        value in its producer's placement read it there instead of through a differently placed
        alias; with ``reshard_after_forward`` (FSDP's contract) the backward re-gathers sharded
        parameters instead of keeping the gathered copies; with ``fuse_gathers`` chained per-mesh-dim
        all-gathers become one over the flattened mesh. ``plan.passes`` reports what the passes did
        and the collectives before and after them; the plan actually lowered is ``self.applied_plan``.
        With ``compile`` the forward and backward graphs run through Inductor region by region:
        identical layers share one compiled region, so deep models compile in seconds
        (``self.regions`` says how many regions there are, how many were compiled and how many,
        too small to be worth it, run eagerly).
        """
        tg = self._require_traced()
        t0 = time.perf_counter()
        if remove_round_trips:
            cost_model = CostModel(self.mesh, self.device_profile)
            tg, applied, trips = alias_roundtrip.remove_round_trips(tg, plan, cost_model, self._outputs)
        else:
            applied, trips = plan, RoundTripStats(0, 0)
        lowered = lower(tg, applied, self.mesh, self._outputs, reshard_after_forward, fuse_gathers)
        regions: dict[fx.GraphModule, RegionStats] = {}

        def compile_graph(gm: fx.GraphModule) -> Callable:
            compiled, regions[gm] = compile_regions(gm)
            return compiled

        executor = make_executor(lowered, compile_graph if compile else None)
        self.regions = {"forward": regions[lowered.forward], "backward": regions[lowered.backward]} if compile else {}
        buffers = {fqn: plan.nodes[n.name].outputs[0] for fqn, n in tg.placeholder_for("buffer").items()}
        outputs = [
            (o.meta["val"].shape, o.meta["val"].stride()) if isinstance(o, fx.Node) else None
            for o in tg.outputs_of("output").values()
        ]
        pmod = build_parallel_module(
            self.model, self.mesh, lowered, plan.param_placements, buffers, outputs, executor, return_dtensor
        )
        self.timings["apply"] = time.perf_counter() - t0
        self.lowered, self.applied_plan = lowered, applied
        plan.passes = applied.passes = _pass_report(plan, applied, trips, lowered)
        return pmod

    def _solve(
        self,
        clustering: Clustering,
        strategies: dict[fx.Node, NodeStrategies],
        cost_model: CostModel,
        time_limit: float | None,
        start: dict[fx.Node, Strategy] | None = None,
    ):
        """Build and solve the ILP for one clustering; returns the solve and every node's strategy."""
        tg = self.traced
        problem = build_problem(tg, clustering, strategies, cost_model, self._outputs, merge=self.merge_followers)
        fixed, budgets = self._fixed_rows(problem), self._budget_rows(problem)
        # a peak cap makes the ILP a knapsack the solver proves slowly: 0.1% from the optimum is enough
        gap = _PEAK_GAP if self._peak_budget is not None else 1e-6
        solved = solve_placement(
            problem, fixed, budgets, time_limit=time_limit, backend=self.solver_backend, mip_rel_gap=gap, start=start
        )
        return problem, solved, expand_choice(tg, problem, solved.choice)

    def _over_peak_cap(self, report) -> bool:
        return self._peak_budget is not None and report.peak_bytes > self._peak_budget * (1 + 1e-9)

    def _solve_within_peak(self, cost_model: CostModel):
        """Solve with the peak bounded at candidate steps; where the plan's estimated peak still
        exceeds the cap (at another step, or through bytes the rows miss: moved copies), bound that
        step too, less what its row misses, and solve again."""
        self.schedule = memory.schedule(self.traced)
        capped = self._peak_budget is not None
        self._peak_steps = {t: 0.0 for t in memory.candidate_steps(self.schedule, count=2)} if capped else {}
        mesh_shape, params = tuple(self.mesh.shape), set(self.traced.placeholder_for("param").values())
        for _ in range(_PEAK_ROUNDS):
            problem, solved, chosen = self._solve(self.clustering, self.strategies, cost_model, self.time_limit)
            if self._peak_budget is None:
                break
            report = memory.estimate(self.traced, chosen, mesh_shape, self.optimizer, self.schedule)
            if not self._over_peak_cap(report):
                break
            t = next(step for n, step in self.schedule.step.items() if n.name == report.peak_at)
            linear = memory.linear_peak_bytes(self.schedule, t, chosen, params, mesh_shape, self.optimizer)
            missed = max(self._peak_steps.get(t, 0.0), report.peak_bytes - linear)
            if t in self._peak_steps and missed <= self._peak_steps[t]:
                break  # nothing new to bound: the estimate below says by how much the cap is missed
            self._peak_steps[t] = missed
        return problem, solved, chosen

    def _refine(
        self,
        clustering: Clustering,
        group: tuple[str, ...],
        chosen: dict[fx.Node, Strategy],
        cost_model: CostModel,
        time_limit: float | None,
    ):
        """Solve again with the layers of ``group`` deciding on their own.

        Every other repeated layer keeps its choice (one strategy left), so the ILP is the size of
        one layer plus the nodes outside repeated layers, which are free to meet the group halfway.
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
        return split, self._solve(split, strategies, cost_model, time_limit, start=chosen)

    def optimize_placement(self) -> Plan:
        """Solve for the cheapest plan under the constraints added so far.

        Identical layers share decisions. The first and last layers are tied to the others for the
        main solve, then each is re-solved on its own against the rest (``plan.ilp["refinements"]``):
        their neighbours differ, so their best choices can too.
        """
        tg = self._require_traced()
        t0 = time.perf_counter()
        cost_model = CostModel(self.mesh, self.device_profile)
        problem, solved, chosen = self._solve_within_peak(cost_model)
        t1 = time.perf_counter()
        clustering, objective, refinements = self.clustering, solved.objective_without_tie_break, []
        for group in self.clustering.boundary:
            left = None if self.time_limit is None else self.time_limit - (time.perf_counter() - t0)
            if left is not None and left <= 0:
                break
            try:
                split, (_, step, step_chosen) = self._refine(clustering, group, chosen, cost_model, left)
            except SolverTimeoutError:
                break
            gain = objective - step.objective_without_tie_break
            kept = gain > 1e-9 * objective  # below that it is the tie-break trading cost for fewer changes
            refinements.append(_refinement(group, step, gain, kept))
            if kept:
                clustering, objective, chosen = split, step.objective_without_tie_break, step_chosen
        t2 = time.perf_counter()
        rules = {
            n: self.strategies[self.clustering.rep[n]].source
            for n in chosen
            if self.clustering.rep[n] in self.strategies
        }
        ev = evaluate(tg, chosen, cost_model, self._outputs, rules)
        why = alternatives(tg, chosen, self._options(rules), cost_model, self._outputs)
        nodes = {
            k: dataclasses.replace(v, comm_s=why[k][0], alternatives=why[k][1]) if k in why else v
            for k, v in ev.nodes.items()
        }
        mesh_shape = tuple(self.mesh.shape)
        report = memory.estimate(tg, chosen, mesh_shape, self.optimizer, self.schedule)
        if self._over_peak_cap(report):
            warnings.warn(
                f"the plan's estimated peak {report.peak_bytes:.6g} bytes per device (at {report.peak_at})"
                f" exceeds bytes_per_device={self._peak_budget:.6g}: the candidate steps bounded in the ILP"
                f" ({len(self._peak_steps)}) did not catch it",
                stacklevel=2,
            )
        if not math.isclose(ev.cost.total, objective, rel_tol=1e-6, abs_tol=1e-9):
            warnings.warn(
                f"reduced ILP objective {objective:.6g}s differs from the expanded plan's"
                f" cost {ev.cost.total:.6g}s; the reported cost is the expanded one",
                stacklevel=2,
            )
        t3 = time.perf_counter()
        status, gap = solved.result.status.value, solved.result.gap
        log.info("solved (%s, gap %s): estimated step %.3f ms", status, gap, objective * 1e3)
        timings = {
            **self.timings,
            "costs": t1 - t0 - solved.build_time - solved.solve_time,
            "ilp_build": solved.build_time,
            "solve": solved.solve_time,
            "refine": t2 - t1,
            "plan": t3 - t2,
        }
        return Plan(
            mesh_shape=mesh_shape,
            mesh_dim_names=tuple(self.mesh.mesh_dim_names) if self.mesh.mesh_dim_names else None,
            device=self.device_profile.name,
            nodes=nodes,
            param_placements={fqn: chosen[n].output for fqn, n in tg.placeholder_for("param").items()},
            cost=ev.cost,
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
                "objective": objective,
                "refinements": refinements,
            },
            timings=timings,
            layer_classes=[list(c) for c in clustering.classes],
        )


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
