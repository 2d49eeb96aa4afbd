"""The placement ILP: one-hot strategy per unit, placement-grouped edge variables, user constraints.

    min  sum_u c_u . x_u  +  sum_edges sum_{o,q} (R[o,q] + eps [o != q]) e[o,q]
    s.t. sum_r x[u,r] = 1                              for every unit u
         sum_q e[o,q] = sum_{r: src(r) = o} x[src,r]   for every edge group and producer placement o
         sum_o e[o,q] = sum_{s: dst(s) = q} x[dst,s]   for every edge group and consumer placement q
         pins / I/O constraints / per-device parameter bytes
Edge variables are continuous: with integral x they are forced to the product, and the LP
relaxation is usually integral (``solvers`` tries the LP first).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch.fx as fx

from autoplan.problem import PlacementProblem
from autoplan.strategies import Strategy
from solvers import ModelBuilder, SolveResult, solve

# The solver sees microseconds: step costs in seconds (~1e-5 per op) would sit at the level of
# HiGHS's absolute tolerances and ties would be broken by noise.
SCALE = 1e6
# Microseconds added per placement change: far below any real cost, it breaks ties toward fewer changes.
TIE_BREAK = 1e-3


@dataclass(frozen=True)
class UnitChoice:
    """Strategy index chosen for each unit."""

    choice: dict[fx.Node, int]
    result: SolveResult
    n_vars: int
    n_rows: int
    n_edge_vars: int
    n_dropped: int  # strategies never given a variable (dominated or impossible)
    objective_without_tie_break: float
    build_time: float
    solve_time: float


@dataclass(frozen=True)
class FixedRows:
    """A user constraint: for each (unit, allowed unit strategies) pair, one of them must be chosen."""

    group: str
    items: tuple[tuple[fx.Node, tuple[int, ...]], ...]


@dataclass(frozen=True)
class BudgetRow:
    group: str
    coeffs: tuple[tuple[fx.Node, np.ndarray], ...]  # per unit: bytes per unit strategy
    limit: float


def undominated(
    problem: PlacementProblem, fixed: list[FixedRows], budgets: list[BudgetRow]
) -> dict[fx.Node, np.ndarray]:
    """Per unit, the strategies worth a variable: finite, and cheapest among those that look the same
    to every edge, constraint and budget (the others can only cost more in any plan)."""
    signature: dict[fx.Node, list[np.ndarray]] = {u: [] for u in problem.units}
    for g in problem.edges:
        signature[g.src].append(g.src_label)
        signature[g.dst].append(g.dst_label)
    for f in fixed:
        for u, allowed in f.items:
            signature[u].append(np.isin(np.arange(len(problem.unit_cost[u])), allowed))
    for budget in budgets:
        for u, c in budget.coeffs:
            signature[u].append(c)
    kept = {}
    for u in problem.units:
        cost = problem.unit_cost[u]
        n = len(cost)
        keys = np.stack(signature[u], axis=1) if signature[u] else np.zeros((n, 0))
        best: dict[bytes, int] = {}
        for i in np.flatnonzero(~problem.forbidden[u]):
            k = keys[i].tobytes()
            if k not in best or cost[i] < cost[best[k]]:
                best[k] = int(i)
        kept[u] = np.array(sorted(best.values()), dtype=np.int64)
    return kept


def _one_hot_rows(b: ModelBuilder, offsets: dict[fx.Node, int], kept: dict[fx.Node, np.ndarray]) -> None:
    units = list(offsets)
    rows = np.concatenate([np.full(len(kept[u]), i) for i, u in enumerate(units)])
    cols = np.concatenate([offsets[u] + np.arange(len(kept[u])) for u in units])
    b.add_rows(rows, cols, 1.0, lo=np.ones(len(units)), hi=np.ones(len(units)))


def _edge_rows(
    b: ModelBuilder, problem: PlacementProblem, offsets: dict[fx.Node, int], kept: dict[fx.Node, np.ndarray]
) -> tuple[int, np.ndarray]:
    """Edge variables and their marginal rows; returns (count, true cost per edge variable)."""
    n_edge = 0
    true_costs = []
    for g in problem.edges:
        # only placement pairs some kept strategy on each side can produce get a variable
        used_o = np.isin(np.arange(g.cost.shape[0]), g.src_label[kept[g.src]])
        used_q = np.isin(np.arange(g.cost.shape[1]), g.dst_label[kept[g.dst]])
        oi, qi = np.nonzero(np.isfinite(g.cost) & used_o[:, None] & used_q[None, :])
        cost = g.cost[oi, qi]
        e = b.add_vars(len(oi), cost=SCALE * cost + TIE_BREAK * g.changes[oi, qi], lb=0.0, ub=1.0, integer=False)
        n_edge += len(oi)
        true_costs.append(cost)
        n_o, n_q = g.cost.shape
        # producer marginals: rows 0..n_o-1; consumer marginals: rows n_o..n_o+n_q-1
        src_x = offsets[g.src] + np.arange(len(kept[g.src]))
        dst_x = offsets[g.dst] + np.arange(len(kept[g.dst]))
        rows = np.concatenate([oi, n_o + qi, g.src_label[kept[g.src]], n_o + g.dst_label[kept[g.dst]]])
        cols = np.concatenate([e, e, src_x, dst_x])
        vals = np.concatenate([np.ones(2 * len(oi)), -np.ones(len(src_x) + len(dst_x))])
        b.add_rows(rows, cols, vals, lo=np.zeros(n_o + n_q), hi=np.zeros(n_o + n_q))
    return n_edge, np.concatenate(true_costs) if true_costs else np.zeros(0)


def _start_vector(
    problem: PlacementProblem,
    offsets: dict[fx.Node, int],
    kept: dict[fx.Node, np.ndarray],
    start: dict[fx.Node, Strategy],
    n_cols: int,
) -> np.ndarray | None:
    """``start`` as values of the strategy columns, or ``None`` if some choice has no column."""
    x = np.zeros(n_cols)
    for u in problem.units:
        hits = [j for j, i in enumerate(kept[u]) if problem.strategies[u][i] == start.get(u)]
        if not hits:
            return None
        x[offsets[u] + hits[0]] = 1.0
    return x


def solve_placement(
    problem: PlacementProblem,
    fixed: list[FixedRows],
    budgets: list[BudgetRow],
    time_limit: float | None = None,
    backend: str = "highs",
    mip_rel_gap: float = 1e-6,
    start: dict[fx.Node, Strategy] | None = None,
) -> UnitChoice:
    """The cheapest strategy per unit; ``start`` (a strategy per unit, e.g. an earlier plan's) seeds the search."""
    t0 = time.perf_counter()
    kept = undominated(problem, fixed, budgets)
    b = ModelBuilder("placement")
    offsets: dict[fx.Node, int] = {}
    for u in problem.units:
        offsets[u] = int(b.add_vars(len(kept[u]), cost=SCALE * problem.unit_cost[u][kept[u]], integer=True)[0])
    _one_hot_rows(b, offsets, kept)
    n_edge, edge_costs = _edge_rows(b, problem, offsets, kept)

    for f in fixed:
        cols = [offsets[u] + np.flatnonzero(np.isin(kept[u], allowed)) for u, allowed in f.items]
        rows = [np.full(len(c), i) for i, c in enumerate(cols)]
        b.add_rows(
            np.concatenate(rows), np.concatenate(cols), 1.0, lo=np.ones(len(cols)), hi=np.ones(len(cols)), group=f.group
        )
    for budget in budgets:
        cols = np.concatenate([offsets[u] + np.arange(len(kept[u])) for u, _ in budget.coeffs])
        vals = np.concatenate([c[kept[u]] for u, c in budget.coeffs])
        b.add_rows(np.zeros(len(cols), dtype=np.int64), cols, vals, lo=-np.inf, hi=budget.limit, group=budget.group)

    model = b.build()
    t1 = time.perf_counter()

    def one_hot(x: np.ndarray) -> np.ndarray:
        out = np.zeros_like(x)
        for u in problem.units:
            out[offsets[u] + int(np.argmax(x[offsets[u] : offsets[u] + len(kept[u])]))] = 1.0
        return out

    seed = _start_vector(problem, offsets, kept, start, model.n_cols) if start is not None else None
    result = solve(model, backend=backend, time_limit=time_limit, mip_rel_gap=mip_rel_gap, rounding=one_hot, start=seed)
    t2 = time.perf_counter()
    x = result.x
    choice = {u: int(kept[u][np.argmax(x[offsets[u] : offsets[u] + len(kept[u])])]) for u in problem.units}
    x_cost = sum(float(problem.unit_cost[u][r]) for u, r in choice.items())
    n_x = sum(len(k) for k in kept.values())
    e_cost = float(edge_costs @ x[n_x : n_x + n_edge]) if n_edge else 0.0
    return UnitChoice(
        choice=choice,
        result=result,
        n_vars=model.n_cols,
        n_rows=model.n_rows,
        n_edge_vars=n_edge,
        n_dropped=sum(len(problem.unit_cost[u]) - len(kept[u]) for u in problem.units),
        objective_without_tie_break=x_cost + e_cost,
        build_time=t1 - t0,
        solve_time=t2 - t1,
    )
