"""A lower bound on a placement ILP without solving its LP, to certify a start that cannot be beaten.

A boundary re-solve starts from the main plan, which is usually already its best: on LLaMA-3 8B's
(8, 4, 4) mesh its LP (~10 s) only proves the start within 0.01%. Any row multipliers give a
Lagrangian bound (``solvers.bound``); these are found from the model's structure instead:

- columns no integer point can use (off a pin, too heavy for the parameter budget) are held at 0
  first (``solvers.bound.tightened``), so those rows need no multiplier (without it the bound sat
  12.6% under the start on LLaMA-3 8B's 16x8 re-solves);
- each overlap row takes the multiplier complementary slackness gives it at the start (0 where
  the start hides its whole budget with hideable seconds to spare, the objective's weight where
  it hides all it can);
- the edge groups' marginal rows start at 0 and are raised by block coordinate ascent: one group
  at a time, its two sides' multipliers split the group's best pairing evenly between its two
  units (MPLP's edge step, Globerson and Jaakkola, NIPS 2007), which never lowers the bound.

Ten to two hundred sweeps (0.2-2.5 s on a 3-D mesh) take the bound within the 1% gap of the start
where its LP takes 9-10 s.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch.fx as fx

from autoplan.problem import PlacementProblem
from solvers import LinearModel
from solvers.bound import choice_rows, lagrangian_bound, tightened
from solvers.result import relative_gap

# Sweeps over every edge group at most; the bound is checked after every ``_CHECK`` of them and the
# ascent stops when a check certifies the start, gains less than ``_STALL`` of the objective, or
# its gains, shrinking as they do, cannot add up to the rest of the gap. After ``_SETTLE`` sweeps
# the projection is their geometric sum at the last check's ratio, times ``_REACH``: the gains
# shrink fast at first and then slowly (by 10-20% a check, then ~5%, on LLaMA-3 8B's 8x4x4 and 70B's
# 16x8x8 layers.0 re-solves, certified at ~170 and ~210 sweeps from bounds 20% and 6% under their
# starts), so a short window underestimates what is left (at twice it, 70B gave up at 70 sweeps).
MAX_SWEEPS = 400
_CHECK = 5
_STALL = 1e-5
_SETTLE = 50
_REACH = 4.0
_CAP = 1e9  # a multiplier's largest magnitude (microseconds): a label no pair can take is priced out


@dataclass(frozen=True)
class Layout:
    """Where a placement problem's parts sit in its built model."""

    kept: dict[fx.Node, np.ndarray]  # per unit, the strategies that have a column
    offsets: dict[fx.Node, int]  # per unit, its first column
    edges: list[tuple[np.ndarray, np.ndarray, np.ndarray]]  # per group: columns, producer and consumer labels
    marginals: list[tuple[np.ndarray, np.ndarray]]  # per group: producer and consumer rows
    overlap: np.ndarray  # per segment: its hiding row
    hidden: np.ndarray  # per segment: its ``h`` column


def certifier(
    problem: PlacementProblem, layout: Layout, model: LinearModel, gap: float
) -> Callable[[np.ndarray, float], float]:
    """``certify(x, objective)`` for ``solvers.solve``: the bound, stopping once it is within
    ``gap`` of ``objective``. Columns no feasible point sets (off a pin, too heavy for a budget)
    are fixed at 0 first: the bound then needs no multipliers for those rows."""
    model = tightened(model)
    choose = choice_rows(model)  # the ascent bounds this one model every few sweeps

    def certify(x: np.ndarray, objective: float) -> float:
        y = np.zeros(model.n_rows)
        y[layout.overlap] = _slackness(model, layout, x)
        return _ascent(problem, layout, model, choose, y, objective, gap)

    return certify


def _slackness(model: LinearModel, layout: Layout, x: np.ndarray) -> np.ndarray:
    """Overlap rows' multipliers that complementary slackness allows at ``x``: 0 where the row is
    slack (more hideable than ``h`` takes), minus ``h``'s weight where ``h`` is below its budget
    (it must price ``h`` at 0); half of it where both bind (either may be the one that gives)."""
    out = np.zeros(len(layout.overlap))
    for i, (row, h) in enumerate(zip(layout.overlap, layout.hidden)):
        lo, hi = model.csr_start[row], model.csr_start[row + 1]
        activity = float(model.csr_val[lo:hi] @ x[model.csr_col[lo:hi]])
        weight, budget = -float(model.cost[h]), float(model.col_ub[h])
        tol = 1e-9 * max(1.0, budget)
        if activity < -tol:
            out[i] = 0.0
        elif x[h] < budget - tol:
            out[i] = -weight
        else:
            out[i] = -weight / 2
    return out


def _ascent(
    problem: PlacementProblem, layout: Layout, model: LinearModel, choose: np.ndarray, y, objective: float, gap: float
) -> float:
    """The best bound of ``y`` with its edge rows' multipliers raised sweep by sweep (the others as
    given): a unit's belief is its strategies' reduced costs less the choice row, each group's
    step reads its two units' beliefs without its own messages, per label, and splits the best
    pairing of each label evenly between them (every pair's reduced cost stays >= 0)."""
    d0 = model.cost - np.bincount(model.entry_col, weights=model.csc_val * y[model.csc_row], minlength=model.n_cols)
    belief = {}
    for u in problem.units:
        cols = layout.offsets[u] + np.arange(len(layout.kept[u]))
        belief[u] = np.where(model.col_ub[cols] > 0, d0[cols], np.inf)
    sides = [(g.src, g.dst) for g in problem.edges]
    theta, alpha, beta = [], [], []
    for (cols, oi, qi), (src, dst) in zip(layout.edges, layout.marginals):
        t = np.full((len(src), len(dst)), np.inf)
        t[oi, qi] = np.where(model.col_ub[cols] > 0, d0[cols], np.inf)  # a pair held at 0 is no pairing
        theta.append(t)
        alpha.append(np.zeros(len(src)))
        beta.append(np.zeros(len(dst)))
    labels = [(g.src_label[layout.kept[g.src]], g.dst_label[layout.kept[g.dst]]) for g in problem.edges]
    gathers = [(_by_label(sl, len(a)), _by_label(dl, len(b))) for (sl, dl), a, b in zip(labels, alpha, beta)]
    best = last = lagrangian_bound(model, y, choose)
    target, rise = objective - gap * abs(objective), np.inf
    floor = _STALL * abs(objective)
    steps = [(*sides[i], *labels[i], *gathers[i], theta[i], theta[i].T.copy(), i) for i in range(len(theta))]
    for sweep in range(MAX_SWEEPS):
        with np.errstate(invalid="ignore"):  # inf - inf where a label has no strategy: masked below
            for a_unit, b_unit, sl, dl, ga, gb, t, t_by_q, i in steps if sweep % 2 == 0 else reversed(steps):
                # alternate: news travels both ways; a label's alpha is the same for all its strategies
                ma = _least(belief[a_unit], ga) - alpha[i]
                mb = _least(belief[b_unit], gb) - beta[i]
                new_a = _half_step((t + mb).min(axis=1), ma)
                new_b = _half_step((t_by_q + ma).min(axis=1), mb)
                belief[a_unit] += (new_a - alpha[i])[sl]
                belief[b_unit] += (new_b - beta[i])[dl]
                alpha[i], beta[i] = new_a, new_b
        if (sweep + 1) % _CHECK:
            continue
        for (src, dst), a, b in zip(layout.marginals, alpha, beta):
            y[src], y[dst] = a, b
        bound = lagrangian_bound(model, y, choose)
        best = max(best, bound)
        if relative_gap(objective, best) <= gap or not _may_reach(bound - last, rise, target - best, sweep + 1, floor):
            break
        rise, last = bound - last, bound
    return best


def _may_reach(rise: float, previous: float, short: float, sweeps: int, floor: float) -> bool:
    """Whether a bound that rose by ``rise`` at its last check (``previous`` at the one before)
    may still climb ``short`` more: it must gain at least ``floor`` a check, and once settled its
    gains, shrinking by ``rise / previous`` a check, must sum (``_REACH`` times) to ``short``."""
    if rise < floor:
        return False
    ratio = rise / previous
    if sweeps <= _SETTLE or not 0 < ratio < 1:
        return True
    return _REACH * rise * ratio / (1 - ratio) >= short


def _half_step(to: np.ndarray, m: np.ndarray) -> np.ndarray:
    """A group's new message to one side: half the gap between its best pairing and the side's
    own belief, per label (0 for a label the side has no strategy for; capped where no pairing is)."""
    out = 0.5 * (to - m)
    np.clip(out, -_CAP, _CAP, out=out)
    out[~np.isfinite(m)] = 0.0
    return out


def _by_label(labels: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """How ``_least`` groups a unit's strategies by label: their order, where each label's run
    starts, which labels have one, and how many labels there are."""
    order = np.argsort(labels, kind="stable")
    ordered = labels[order]
    starts = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]])
    return order, starts, ordered[starts], n


def _least(values: np.ndarray, by: tuple[np.ndarray, np.ndarray, np.ndarray, int]) -> np.ndarray:
    """Per label, the least of ``values`` over the strategies with that label (``inf`` for none)."""
    order, starts, present, n = by
    least = np.minimum.reduceat(values[order], starts)
    if len(present) == n:  # every label has a strategy: ``present`` is 0..n-1
        return least
    out = np.full(n, np.inf)
    out[present] = least
    return out
