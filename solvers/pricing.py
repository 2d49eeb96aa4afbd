"""Column generation: the LP relaxation of a model with very many continuous columns, solved over
a few of them and proven optimal over all.

A placement ILP on a 3-D mesh has over a million pair columns (one per pair of placements an edge
may join) and an optimum that uses a few thousand of them. The LP over a subset of the ``pool``
columns, plus one artificial column per row the pool enters (a stand-in of high cost, so any
subset is feasible), gives row duals ``y``; a pool column left out whose reduced cost
``c_j - a_j^T y`` is negative could lower the objective, and joins; when none is left, the
restricted LP's optimum is the whole LP's (the duals are feasible for every column). HiGHS
re-solves from its last basis after columns join, so each round after the first costs little.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from time import perf_counter

import numpy as np

from .model import LinearModel
from .result import RawSolution, SolverOptions, SolveStatus, relative_gap

# rounds of pricing at most; on placement LPs the columns that join shrink tenfold each round
MAX_ROUNDS = 50
# the artificial columns' cost, as a multiple of the largest pool cost (at least 1)
ARTIFICIAL_COST = 10.0
# a column joins when its reduced cost is below -REDUCED_TOL x max(1, |objective|)
REDUCED_TOL = 1e-9
# HiGHS's parallel dual simplex (PAMI): the same pivots as the serial one, a fifth faster on 2 cores
PARALLEL_DUAL = 2
# an artificial column above this is in use
ARTIFICIAL_TOL = 1e-9


@dataclass(frozen=True)
class Priced:
    """The whole LP's optimum (``solution.status`` optimal), or a point within ``within`` of its
    bound (feasible), found over the columns ``active`` (a mask; the others are 0 in
    ``solution.x``), after ``rounds`` rounds of pricing."""

    solution: RawSolution
    active: np.ndarray
    rounds: int


def _columns(model: LinearModel, cols: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Column-wise starts, rows and values of ``model``'s columns ``cols``."""
    lens = np.diff(model.csc_start)[cols]
    mask = np.zeros(model.n_cols, dtype=bool)
    mask[cols] = True
    entries = np.repeat(mask, np.diff(model.csc_start))
    starts = np.r_[0, np.cumsum(lens)[:-1]] if len(cols) else np.zeros(0)
    return starts.astype(np.int32), model.csc_row[entries].astype(np.int32), model.csc_val[entries]


def priced_lp(
    model: LinearModel, pool: np.ndarray, first: np.ndarray, opts: SolverOptions, within: float = 0.0
) -> Priced | None:
    """The LP relaxation of ``model`` by column generation over the columns ``pool`` (a mask of
    continuous columns of lower bound 0, each entering its rows with one sign per row), starting
    from the pool columns ``first`` (the other columns are always in). ``None`` when it cannot
    tell: the time limit passed, HiGHS stopped short, or an artificial column stays in use (the
    model may be infeasible; the caller solves it whole).

    With ``within``, pricing stops once the restricted optimum is within that fraction of a bound
    on the whole LP: its objective plus every left-out column's negative reduced cost at its upper
    bound (Farley's bound, free from the duals at hand). The solution's ``bound`` is that bound."""
    import highspy

    from .highs_backend import _new_highs, _run

    started = perf_counter()
    pool = np.asarray(pool, dtype=bool)
    in_pool = pool[model.entry_col]
    rows = np.unique(model.csc_row[in_pool])
    sign = np.zeros(model.n_rows)
    np.add.at(sign, model.csc_row[in_pool], np.sign(model.csc_val[in_pool]))
    counts = np.bincount(model.csc_row[in_pool], minlength=model.n_rows)
    if np.any(np.abs(sign[rows]) != counts[rows]) or np.any(model.col_lb[pool] != 0) or np.any(model.integer[pool]):
        return None
    active = ~pool | (np.asarray(first, dtype=bool) & pool)
    cols = np.flatnonzero(active)
    h = _new_highs(highspy, SolverOptions(opts.time_limit, threads=opts.threads, presolve=False))
    if opts.threads is None or opts.threads > 1:
        h.setOptionValue("simplex_strategy", PARALLEL_DUAL)
    h.passModel(_lp_over(highspy, model, cols))
    big = ARTIFICIAL_COST * max(1.0, float(np.abs(model.cost[pool]).max(initial=0.0)))
    n_art = len(rows)
    h.addCols(
        n_art,
        np.full(n_art, big),
        np.zeros(n_art),
        np.full(n_art, np.inf),
        n_art,
        np.arange(n_art, dtype=np.int32),
        rows.astype(np.int32),
        np.sign(sign[rows]),
    )
    added: list[np.ndarray] = []
    rounds = 0
    while True:
        if opts.time_limit is not None:
            left = opts.time_limit - (perf_counter() - started)
            if left <= 0:
                return None
            h.setOptionValue("time_limit", left)
        _run(highspy, h, opts)
        if h.getModelStatus() != highspy.HighsModelStatus.kOptimal:
            return None
        rounds += 1
        objective = h.getInfo().objective_function_value
        d = model.reduced_costs(np.asarray(h.getSolution().row_dual))
        join = np.flatnonzero(pool & ~active & (d < -REDUCED_TOL * max(1.0, abs(objective))))
        neg = np.flatnonzero(pool & ~active & (d < 0))
        with np.errstate(invalid="ignore"):
            bound = objective + float(d[neg] @ model.col_ub[neg]) if len(join) else objective
        if len(join) == 0 or rounds >= MAX_ROUNDS or _settled(h, len(cols), n_art, objective, bound, within):
            break
        starts, index, value = _columns(model, join)
        h.addCols(len(join), model.cost[join], model.col_lb[join], model.col_ub[join], len(index), starts, index, value)
        active[join] = True
        added.append(join)
    values = np.asarray(h.getSolution().col_value)
    if np.any(values[len(cols) : len(cols) + n_art] > ARTIFICIAL_TOL) or not math.isfinite(bound):
        return None
    if len(join) and relative_gap(objective, bound) > within:
        return None
    x = np.zeros(model.n_cols)
    x[cols] = values[: len(cols)]
    if added:
        joined = np.concatenate(added)
        x[joined] = values[len(cols) + n_art :]
    status = SolveStatus.FEASIBLE if len(join) else SolveStatus.OPTIMAL  # stopped within ``within``
    solution = RawSolution(status, x, bound, False, 0.0, perf_counter() - started)
    return Priced(solution, active, rounds)


def _settled(h, n_cols: int, n_art: int, objective: float, bound: float, within: float) -> bool:
    """Whether the restricted LP's point (no artificial column in use) is within ``within`` of
    ``bound``, so pricing may stop."""
    if within <= 0 or not math.isfinite(bound) or relative_gap(objective, bound) > within:
        return False
    return not np.any(np.asarray(h.getSolution().col_value)[n_cols : n_cols + n_art] > ARTIFICIAL_TOL)


def _lp_over(highspy, model: LinearModel, cols: np.ndarray):
    """``model``'s LP relaxation over the columns ``cols`` only (the others held at 0), every row
    kept with its bounds."""
    starts, index, value = _columns(model, cols)
    lp = highspy.HighsLp()
    lp.num_col_, lp.num_row_, lp.offset_ = len(cols), model.n_rows, model.constant
    lp.col_cost_, lp.col_lower_, lp.col_upper_ = model.cost[cols], model.col_lb[cols], model.col_ub[cols]
    lp.row_lower_, lp.row_upper_ = model.row_lo, model.row_hi
    a = lp.a_matrix_
    a.format_ = highspy.MatrixFormat.kColwise
    a.num_col_, a.num_row_ = len(cols), model.n_rows
    a.start_, a.index_, a.value_ = np.r_[starts, len(index)].astype(np.int32), index, value
    return lp
