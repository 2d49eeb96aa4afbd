"""A lower bound on a model's optimum from any guess of its row duals, without solving it.

For a box-bounded model, every row multiplier ``y`` gives the Lagrangian bound

    L(y) = sum_i (y_i lo_i if y_i > 0 else y_i hi_i) + sum_j min(d_j lb_j, d_j ub_j) + constant,
    d = c - A^T y,

valid whatever ``y`` is, once each multiplier has the sign its row's finite side allows: it costs one
product with the matrix, and good multipliers (``autoplan.solve.certify`` finds them from a placement
ILP's structure) bring it close to the LP bound. On a model ``tightened`` first it bounds the integer
optimum, and may then exceed the LP bound.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

import numpy as np

from .model import LinearModel, _frozen


def choice_rows(model: LinearModel) -> np.ndarray:
    """Rows ``sum x_j = 1`` over binary columns (pick one of them), no two sharing a column (where
    they would, e.g. a pin over some of a choice's columns, the longer row is the choice): given
    the other multipliers, a choice row's best is the least reduced cost among its columns."""
    binary = model.integer & (model.col_lb == 0.0) & np.isin(model.col_ub, (0.0, 1.0))  # some may be held at 0
    row_of = model.entry_row
    plain = (model.csr_val == 1.0) & binary[model.csr_col]
    length = np.diff(model.csr_start)
    whole = np.bincount(row_of, weights=plain, minlength=model.n_rows) == length
    candidates = np.flatnonzero((model.row_lo == 1.0) & (model.row_hi == 1.0) & whole & (length > 0))
    taken = np.zeros(model.n_cols, dtype=bool)
    rows = np.zeros(model.n_rows, dtype=bool)
    for r in sorted(candidates.tolist(), key=lambda r: (-length[r], r)):
        cols = model.csr_col[model.csr_start[r] : model.csr_start[r + 1]]
        if not taken[cols].any():
            taken[cols] = True
            rows[r] = True
    return rows


def tightened(model: LinearModel) -> LinearModel:
    """``model`` with the columns no integer-feasible point sets nonzero held at 0, so a bound sees
    the same integer points without multipliers for the rows that rule them out: beside a row that
    picks one of some of a choice row's columns (a pin), the choice row's other columns; in a
    ``<=`` row of nonnegative coefficients over choice columns, those that exceed the limit even
    with every other choice at its lightest column; then, in an equality row at 0 whose columns
    are all nonnegative, the positive side of a row whose negative side is all held at 0."""
    choose = choice_rows(model)
    row_of = model.entry_row
    choice_of = np.full(model.n_cols, -1)
    picked = choose[row_of]
    choice_of[model.csr_col[picked]] = row_of[picked]
    out = np.zeros(model.n_cols, dtype=bool)
    off_choice = np.bincount(row_of, weights=choice_of[model.csr_col] < 0, minlength=model.n_rows)
    for r in np.flatnonzero(~choose & (off_choice == 0) & (np.diff(model.csr_start) > 0)):
        lo, hi = model.csr_start[r], model.csr_start[r + 1]
        cols, vals = model.csr_col[lo:hi], model.csr_val[lo:hi]
        owners = choice_of[cols]
        if model.row_lo[r] == 1.0 and model.row_hi[r] == 1.0 and np.all(vals == 1.0) and np.all(owners == owners[0]):
            members = model.csr_col[model.csr_start[owners[0]] : model.csr_start[owners[0] + 1]]
            out[np.setdiff1d(members, cols)] = True
        elif np.isfinite(model.row_hi[r]) and np.all(vals >= 0.0):
            lightest: dict[int, float] = {}
            size = {int(c): int(model.csr_start[c + 1] - model.csr_start[c]) for c in np.unique(owners)}
            for c, v in zip(owners.tolist(), vals.tolist()):
                lightest[c] = min(lightest.get(c, v), v)
            counts = np.bincount(owners, minlength=model.n_rows)
            # a choice column off the row weighs 0 in it
            least = {c: (m if counts[c] == size[c] else 0.0) for c, m in lightest.items()}
            base = sum(least.values())
            slack = model.row_hi[r] - base
            over = vals - np.array([least[c] for c in owners.tolist()]) > slack + 1e-9 * max(1.0, abs(model.row_hi[r]))
            out[cols[over]] = True
    ub = np.where(out, 0.0, model.col_ub)
    # a sum of nonnegative terms at 0 holds each at 0
    signed = np.bincount(row_of, weights=model.col_lb[model.csr_col] < 0, minlength=model.n_rows) == 0
    balance = (model.row_lo == 0.0) & (model.row_hi == 0.0) & signed
    negative = model.csr_val < 0
    open_negative = np.bincount(row_of, weights=negative & (ub[model.csr_col] > 0), minlength=model.n_rows)
    dead = balance & (open_negative == 0) & (np.bincount(row_of, weights=negative, minlength=model.n_rows) > 0)
    ub[model.csr_col[dead[row_of] & ~negative]] = 0.0
    return replace(model, col_ub=_frozen(ub, np.float64))


def reduced_costs(model: LinearModel, y: np.ndarray, choose: np.ndarray | None = None) -> tuple[np.ndarray, float]:
    """Each column's reduced cost at ``y`` (made valid as ``lagrangian_bound`` does, the choice rows'
    multipliers at their best) and ``L(y)``: a point of objective ``v`` has ``v >= L(y) + d_j x_j``
    for every column ``j`` of ``d_j >= 0`` held at ``lb_j = 0`` in the bound (``screened``)."""
    y = np.asarray(y, dtype=np.float64)
    y = np.where((y > 0) & ~np.isfinite(model.row_lo) | (y < 0) & ~np.isfinite(model.row_hi), 0.0, y)
    choose = choice_rows(model) if choose is None else choose
    y = np.where(choose, 0.0, y)
    d = model.reduced_costs(y)
    row_of = model.entry_row
    picked = choose[row_of]
    cols, rows = model.csr_col[picked], row_of[picked]
    best = np.full(model.n_rows, np.inf)
    open_ = model.col_ub[cols] > 0  # a column fixed at 0 is no choice
    np.minimum.at(best, rows[open_], d[cols][open_])
    y[choose] = best[choose]
    d[cols] -= y[rows]  # each column sits in one choice row at most
    with np.errstate(invalid="ignore"):  # 0 * inf: a term that needs an infinite bound is NaN, then -inf
        low = np.where(d > 0, d * model.col_lb, np.where(d < 0, d * model.col_ub, 0.0))
        sides = np.where(y > 0, y * model.row_lo, np.where(y < 0, y * model.row_hi, 0.0))
    total = float(sides.sum() + low.sum() + model.constant)
    return d, (total if math.isfinite(total) else -math.inf)


def lagrangian_bound(model: LinearModel, y: np.ndarray, choose: np.ndarray | None = None) -> float:
    """``L(y)`` with ``y`` made valid (a multiplier whose row side is infinite is dropped) and the
    ``choice_rows`` multipliers set to their best; ``-inf`` when an unbounded column would need it.
    ``choose``: the model's ``choice_rows``, for a caller that bounds one model many times."""
    return reduced_costs(model, y, choose)[1]


def screening(model: LinearModel, y: np.ndarray, unit: np.ndarray) -> tuple[float, Callable[[float], np.ndarray]]:
    """``L(y)`` on the ``tightened`` model, and ``off(limit)``: the columns of ``unit`` (those every
    integer point sets to 0 or 1) that no integer point of objective at most ``limit`` sets to 1,
    ``L(y) + d_j > limit`` or held at 0 by ``tightened``. Reduced-cost fixing: a model without
    them keeps every such point, so its bound bounds the integer optimum once a point reaches ``limit``."""
    held = tightened(model)
    d, bound = reduced_costs(held, y)
    closed = unit & (held.col_lb == 0.0)
    always = closed & (held.col_ub == 0.0)

    def off(limit: float) -> np.ndarray:
        return always | closed & (d > limit - bound + 1e-9 * max(1.0, abs(limit)))

    return bound, off
