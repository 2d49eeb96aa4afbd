"""PuLP export and the CBC backend (PuLP's bundled ``cbc`` binary)."""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Sequence
from time import perf_counter

import numpy as np
import pulp

from .model import LinearModel
from .result import OPTIMALITY_GAP, RawSolution, SolverOptions, SolveStatus

# CBC's defaults are already fixed seeds (0 would mean "time of day"); pin them anyway.
_CBC_SEED_OPTIONS = ["randomCbcSeed 1", "randomSeed 1234567"]


def _safe_names(names: Sequence[str]) -> list[str]:
    """Names PuLP keeps verbatim: word characters only, made unique (PuLP keys rows by name)."""
    seen: set[str] = set()
    out = []
    for name in names:
        safe = re.sub(r"[^A-Za-z0-9_]", "_", name) or "_"
        while safe in seen:
            safe += "_"
        seen.add(safe)
        out.append(safe)
    return out


def _finite_or_none(v: float) -> float | None:
    return float(v) if math.isfinite(v) else None


def _build_pulp(model: LinearModel) -> tuple[pulp.LpProblem, list[pulp.LpVariable]]:
    """PuLP problem plus its variables in column order.

    Every expression is built from a complete (variable, coefficient) list in one call. Ranged
    rows become a ``_lo`` and a ``_hi`` constraint since PuLP has no ranged constraint; free
    rows are omitted. Every variable appears in the objective (zero coefficients included) so
    that PuLP knows all columns, even unused ones.
    """
    prob = pulp.LpProblem(_safe_names([model.name])[0], pulp.LpMinimize)
    col_names = _safe_names(model.col_names) if model.col_names else [f"x{i}" for i in range(model.n_cols)]
    row_names = _safe_names(model.row_names) if model.row_names else [f"r{i}" for i in range(model.n_rows)]
    xs = [
        prob.add_variable(
            name, _finite_or_none(lb), _finite_or_none(ub), pulp.LpInteger if is_int else pulp.LpContinuous
        )
        for name, lb, ub, is_int in zip(col_names, model.col_lb.tolist(), model.col_ub.tolist(), model.integer.tolist())
    ]
    prob.setObjective(pulp.LpAffineExpression(zip(xs, model.cost.tolist()), constant=model.constant))
    start, cols, vals = model.csr_start.tolist(), model.csr_col.tolist(), model.csr_val.tolist()
    for i, (name, lo, hi) in enumerate(zip(row_names, model.row_lo.tolist(), model.row_hi.tolist())):
        terms = [(xs[c], v) for c, v in zip(cols[start[i] : start[i + 1]], vals[start[i] : start[i + 1]])]
        if lo == hi:
            prob.addConstraint(pulp.LpConstraint(pulp.LpAffineExpression(terms), pulp.LpConstraintEQ, name, lo))
            continue
        ranged = math.isfinite(lo) and math.isfinite(hi)
        if math.isfinite(lo):
            lo_name = f"{name}_lo" if ranged else name
            prob.addConstraint(pulp.LpConstraint(pulp.LpAffineExpression(terms), pulp.LpConstraintGE, lo_name, lo))
        if math.isfinite(hi):
            hi_name = f"{name}_hi" if ranged else name
            prob.addConstraint(pulp.LpConstraint(pulp.LpAffineExpression(terms), pulp.LpConstraintLE, hi_name, hi))
    return prob, xs


def to_pulp(model: LinearModel) -> pulp.LpProblem:
    """The model as a PuLP problem (minimisation), for CBC or for callers who want a PuLP object."""
    return _build_pulp(model)[0]


def _cbc(integral: bool, opts: SolverOptions) -> pulp.PULP_CBC_CMD:
    with warnings.catch_warnings():
        # PuLP 3.3 flags its bundled CBC as going away in 4.0; it is still the one CBC we can rely on.
        warnings.filterwarnings("ignore", message="PULP_CBC_CMD is deprecated", category=DeprecationWarning)
        return pulp.PULP_CBC_CMD(
            mip=integral,
            msg=opts.verbose,
            timeLimit=opts.time_limit,
            gapRel=opts.mip_rel_gap if integral else None,
            threads=opts.threads,
            presolve=opts.presolve,
            warmStart=integral and opts.start is not None,
            options=list(_CBC_SEED_OPTIONS),
        )


def _status(prob: pulp.LpProblem) -> tuple[SolveStatus, bool]:
    """(status, hit_limit) from PuLP's pair of status codes."""
    if prob.sol_status == pulp.LpSolutionOptimal:
        return SolveStatus.OPTIMAL, False
    if prob.sol_status == pulp.LpSolutionIntegerFeasible:
        return SolveStatus.FEASIBLE, True
    if prob.status == pulp.LpStatusInfeasible:
        return SolveStatus.INFEASIBLE, False
    if prob.status == pulp.LpStatusUnbounded:
        return SolveStatus.UNBOUNDED, False
    return SolveStatus.NO_SOLUTION, prob.status == pulp.LpStatusNotSolved


def solve_cbc(model: LinearModel, integral: bool, opts: SolverOptions) -> RawSolution:
    """Solve ``model`` with CBC, as a MIP if ``integral`` else as its LP relaxation.

    CBC does not report its dual bound through PuLP, so the bound is derived from the gap CBC was
    told to close (exact when that gap is within ``OPTIMALITY_GAP``), or ``-inf`` after a stop.
    """
    t0 = perf_counter()
    prob, xs = _build_pulp(model)
    is_mip = integral and model.n_integer > 0
    if is_mip and opts.start is not None:
        for v, value in zip(xs, opts.start):
            v.setInitialValue(float(value))
    solver = _cbc(is_mip, opts)
    t1 = perf_counter()
    prob.solve(solver)
    status, hit_limit = _status(prob)
    has_x = status in (SolveStatus.OPTIMAL, SolveStatus.FEASIBLE)
    x = np.array([v.varValue for v in xs], dtype=np.float64) if has_x else None
    bound = -math.inf
    if status is SolveStatus.OPTIMAL:
        objective = model.objective_value(x)
        slack = 0.0 if not integral or opts.mip_rel_gap <= OPTIMALITY_GAP else opts.mip_rel_gap * abs(objective)
        bound = objective - slack
    return RawSolution(status, x, bound, hit_limit, build_time=t1 - t0, solve_time=perf_counter() - t1)
