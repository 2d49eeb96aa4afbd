"""A lower bound on a placement ILP without solving its LP, to certify a start that cannot be beaten.

A boundary re-solve starts from the main plan, which is usually already its best, and on a 3-D mesh
its LP is slow to prove that. Any row multipliers give a Lagrangian bound (``solvers.bound``);
these are found from the model's structure instead:

- columns no integer point can use (off a pin, too heavy for the parameter budget) are held at 0
  first (``solvers.bound.tightened``), so those rows need no multiplier (the bound is far weaker
  without it);
- each overlap row takes the multiplier complementary slackness gives it at the start (0 where
  the start hides its whole budget with hideable seconds to spare, the objective's weight where
  it hides all it can);
- the edge groups' marginal rows start at 0 and are raised by block coordinate ascent: one group
  at a time, its two sides' multipliers split the group's best pairing evenly between its two
  units (MPLP's edge step, Globerson and Jaakkola, NIPS 2007), which never lowers the bound.

Groups touching no common unit commute, so a sweep runs as batches of such groups, each one
vector step: a greedy edge colouring of the groups in their order, the same every sweep. It gives
few, large batches, and a fixed order, which converges in fewer sweeps than the orders that
alternate or sort the groups.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch.fx as fx

from autoplan.solve.problem import PlacementProblem
from solvers import LinearModel
from solvers.bound import choice_rows, lagrangian_bound, tightened
from solvers.result import relative_gap

# Sweeps over every edge group at most; the bound is checked after every ``_CHECK`` of them and the
# ascent stops when a check certifies the start, gains less than ``_STALL`` of the objective, or
# its gains, shrinking as they do, cannot add up to the rest of the gap. After ``_SETTLE`` sweeps
# the projection is their geometric sum at the last check's ratio, times ``_REACH``: the gains
# shrink fast at first and then slowly, so a short window underestimates what is left.
MAX_SWEEPS = 400
_CHECK = 5
_STALL = 1e-5
_SETTLE = 50
_REACH = 4.0
# Sweeps of a guess without a start (``dual_guess``): past the first few dozen, sweeps gain little.
GUESS_SWEEPS = 50
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
) -> Callable[[np.ndarray, float], tuple[float, np.ndarray]]:
    """``certify(x, objective)`` for ``solvers.solve``: the bound, stopping once it is within
    ``gap`` of ``objective``, and the row multipliers that give it (a screen's, when it falls
    short). Columns no feasible point sets (off a pin, too heavy for a budget) are fixed at 0
    first: the bound then needs no multipliers for those rows."""
    model = tightened(model)
    choose = choice_rows(model)  # the ascent bounds this one model every few sweeps
    plan = _Sweeps.of(problem, layout)

    def certify(x: np.ndarray, objective: float) -> tuple[float, np.ndarray]:
        y = np.zeros(model.n_rows)
        y[layout.overlap] = _slackness(model, layout, x)
        return _ascent(plan, model, choose, y, objective, gap), y

    return certify


def dual_guess(problem: PlacementProblem, layout: Layout, model: LinearModel, sweeps: int = GUESS_SWEEPS) -> np.ndarray:
    """Row multipliers for screening a model without a start (``solvers.Screen``): ``sweeps`` of
    the ascent from 0, each overlap row at half its ``h``'s weight (complementary slackness when
    both of its sides bind; with no plan yet, neither extreme is more likely)."""
    held = tightened(model)
    y = np.zeros(model.n_rows)
    y[layout.overlap] = model.cost[layout.hidden] / 2
    plan = _Sweeps.of(problem, layout)
    _, belief, msg, batches = _start(plan, held, y)
    for _ in range(sweeps):
        _sweep(batches, belief, msg)
    y[plan.rows] = msg
    return y


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


@dataclass(frozen=True)
class _Batch:
    """Edge groups no two of which touch the same unit: their steps read and write disjoint
    beliefs, so one vector step does what the groups' steps in turn would. Flattened over the
    batch, producer labels first, then consumer labels (local labels)."""

    labels: np.ndarray  # per local label: its place in the flat messages (and in ``_Sweeps.rows``)
    sorted_cols: np.ndarray  # the units' strategy columns, by (side, group, label)
    starts: np.ndarray  # where each (side, group, label) run of ``sorted_cols`` starts
    present: np.ndarray | None  # per run, its local label (``None``: every label has a run, in order)
    cols: np.ndarray  # the units' strategy columns, per side and group
    label_of: np.ndarray  # per entry of ``cols``, its local label
    pairs: np.ndarray  # pair columns, one row per local label (its pairs with the other side); -1: none at all
    other: np.ndarray  # per entry of ``pairs``, the other side's local label
    rows: np.ndarray  # where each local label's row of ``pairs`` starts
    repeated: bool  # some unit is on both sides of a group (``cols`` repeats a column)

    def least(self, belief: np.ndarray) -> np.ndarray:
        """Per local label, the least belief over its strategies (``inf`` for none)."""
        runs = np.minimum.reduceat(belief[self.sorted_cols], self.starts)
        if self.present is None:
            return runs
        out = np.full(len(self.labels), np.inf)
        out[self.present] = runs
        return out


@dataclass(frozen=True)
class _Sweeps:
    """The edge groups in a sweep's batches, and the marginal row each entry of the flat messages
    prices (every group's producer labels, then every group's consumer labels)."""

    units: np.ndarray  # every unit strategy column, unit by unit
    unit_starts: np.ndarray  # where each unit's columns start
    batches: tuple[_Batch, ...]  # the groups coloured in order
    rows: np.ndarray
    pairs: np.ndarray  # every pair column

    @staticmethod
    def of(problem: PlacementProblem, layout: Layout) -> _Sweeps:
        src_at = np.cumsum([0] + [len(src) for src, _ in layout.marginals], dtype=np.int64)
        dst_at = src_at[-1] + np.cumsum([0] + [len(dst) for _, dst in layout.marginals], dtype=np.int64)
        order = list(range(len(problem.edges)))
        groups = [_group(problem, layout, i) for i in order]
        sizes = [len(layout.kept[u]) for u in problem.units]
        units = np.concatenate([layout.offsets[u] + np.arange(n) for u, n in zip(problem.units, sizes)])
        rows = [src for src, _ in layout.marginals] + [dst for _, dst in layout.marginals]
        pairs = [cols for cols, _, _ in layout.edges]
        return _Sweeps(
            units,
            np.r_[0, np.cumsum(sizes)[:-1]],
            tuple(_batch(groups, m, src_at, dst_at) for m in _colours(problem, order)),
            np.concatenate(rows) if rows else np.zeros(0, np.int64),
            np.concatenate(pairs) if pairs else np.zeros(0, np.int64),
        )


def _colours(problem: PlacementProblem, order: list[int]) -> list[list[int]]:
    """The groups in batches no two of whose groups touch the same unit: each group, in ``order``,
    takes the first batch neither of its units is in yet (a greedy edge colouring, at most
    ``2 * degree - 1`` batches)."""
    taken: dict = defaultdict(set)
    colours: list[list[int]] = []
    for i in order:
        g = problem.edges[i]
        busy = taken[g.src] | taken[g.dst]
        colour = next(c for c in itertools.count() if c not in busy)
        if colour == len(colours):
            colours.append([])
        colours[colour].append(i)
        taken[g.src].add(colour)
        taken[g.dst].add(colour)
    return colours


@dataclass(frozen=True)
class _Side:
    """One side of an edge group, as a batch needs it (local labels)."""

    cols: np.ndarray  # the unit's strategy columns
    label: np.ndarray  # per column, its label
    sorted_cols: np.ndarray  # the columns by label
    begin: np.ndarray  # where each label's run of ``sorted_cols`` starts
    runs: np.ndarray  # each run's label


def _side(layout: Layout, unit: fx.Node, labels: np.ndarray) -> _Side:
    cols = layout.offsets[unit] + np.arange(len(layout.kept[unit]))
    label = labels[layout.kept[unit]]
    order = np.argsort(label, kind="stable")
    ordered = label[order]
    begin = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]])
    return _Side(cols, label, cols[order], begin, ordered[begin])


@dataclass(frozen=True)
class _Group:
    """One edge group as a batch needs it."""

    src: _Side
    dst: _Side
    by_src: np.ndarray  # pair columns by producer label, then consumer label (-1: no column)
    by_dst: np.ndarray  # by consumer label, then producer label
    dst_of: np.ndarray  # per entry of ``by_src``, its consumer label
    src_of: np.ndarray  # per entry of ``by_dst``, its producer label


def _group(problem: PlacementProblem, layout: Layout, i: int) -> _Group:
    g = problem.edges[i]
    n_o, n_q = len(layout.marginals[i][0]), len(layout.marginals[i][1])
    pair_cols, oi, qi = layout.edges[i]
    grid = np.full((n_o, n_q), -1, dtype=np.int64)
    grid[oi, qi] = pair_cols
    return _Group(
        _side(layout, g.src, g.src_label),
        _side(layout, g.dst, g.dst_label),
        grid.reshape(-1),
        grid.T.reshape(-1),
        np.tile(np.arange(n_q), n_o),
        np.tile(np.arange(n_o), n_q),
    )


def _runs(lengths: np.ndarray) -> np.ndarray:
    """``[0, 1, .., l0 - 1, 0, 1, .., l1 - 1, ...]``: each entry's place in its run."""
    total = int(lengths.sum())
    return np.arange(total) - np.repeat(np.cumsum(lengths) - lengths, lengths)


def _batch(groups: list[_Group], members: list[int], src_at: np.ndarray, dst_at: np.ndarray) -> _Batch:
    """One batch's groups flattened: per side and group its unit's strategies and their labels,
    its labels' places in the messages, and its pair columns row by row from that side."""
    m = np.asarray(members)
    n_o, n_q = src_at[m + 1] - src_at[m], dst_at[m + 1] - dst_at[m]
    sides = [groups[i].src for i in members] + [groups[i].dst for i in members]
    n = np.r_[n_o, n_q]
    base = np.cumsum(n) - n  # each side's first local label (producers' first)
    sizes = np.array([len(side.cols) for side in sides])
    at = np.cumsum(sizes) - sizes
    n_runs = np.array([len(side.runs) for side in sides])
    places = np.repeat(np.r_[src_at[m], dst_at[m]], n) + _runs(n)
    cells = n_o * n_q
    q_base, o_base = base[len(members) :], base[: len(members)]
    other = np.r_[
        np.concatenate([groups[i].dst_of for i in members]) + np.repeat(q_base, cells),
        np.concatenate([groups[i].src_of for i in members]) + np.repeat(o_base, cells),
    ]
    pairs = np.concatenate([groups[i].by_src for i in members] + [groups[i].by_dst for i in members])
    lengths = np.r_[np.repeat(n_q, n_o), np.repeat(n_o, n_q)]
    # only the pairs with a column, but one entry (no pairing: inf) for a label with none
    row_of = np.repeat(np.arange(len(lengths)), lengths)
    keep = pairs >= 0
    keep[(np.cumsum(lengths) - lengths)[np.bincount(row_of, weights=keep, minlength=len(lengths)) == 0]] = True
    counts = np.bincount(row_of[keep], minlength=len(lengths))
    present = np.concatenate([side.runs for side in sides]) + np.repeat(base, n_runs)
    cols_all = np.concatenate([side.cols for side in sides])
    return _Batch(
        places,
        np.concatenate([side.sorted_cols for side in sides]),
        np.concatenate([side.begin for side in sides]) + np.repeat(at, n_runs),
        None if np.array_equal(present, np.arange(int(n.sum()))) else present,
        cols_all,
        np.concatenate([side.label for side in sides]) + np.repeat(base, sizes),
        pairs[keep],
        other[keep],
        np.cumsum(counts) - counts,
        len(np.unique(cols_all)) < len(cols_all),
    )


def _ascent(plan: _Sweeps, model: LinearModel, choose: np.ndarray, y, objective: float, gap: float) -> float:
    """The best bound of ``y`` with its edge rows' multipliers raised sweep by sweep (the others as
    given; ``y`` ends with the last ones): a unit's belief is its strategies' reduced costs less
    the choice row, each group's step reads its two units' beliefs without its own messages, per
    label, and splits the best pairing of each label evenly between them (every pair's reduced
    cost stays >= 0).

    The checks between sweeps read the bound off the beliefs (each unit's least, the rest as at
    the start: the edge rows' multipliers move only unit and pair columns, and the steps keep
    the pairs' reduced costs >= 0); the bound returned is worked out in full."""
    open_, belief, msg, batches = _start(plan, model, y)

    def exact() -> float:
        y[plan.rows] = msg
        return lagrangian_bound(model, y, choose)

    def leasts() -> float:
        return float(np.minimum.reduceat(belief[plan.units], plan.unit_starts).sum())

    best = last = exact()
    # what the checks add to the units' leasts: the other columns and rows, and the pairs' terms
    rest = best - leasts() - float(np.minimum(open_[plan.pairs], 0.0).sum())
    target, rise = objective - gap * abs(objective), np.inf
    floor = _STALL * abs(objective)
    for sweep in range(MAX_SWEEPS):
        _sweep(batches, belief, msg)
        if (sweep + 1) % _CHECK:
            continue
        bound = rest + leasts()
        if relative_gap(objective, bound) <= gap:
            full = exact()
            best = max(best, full)
            if relative_gap(objective, best) <= gap:
                return best
            rest += full - bound  # the pairs' terms were not all >= 0 after all
            bound = full
        if not _may_reach(bound - last, rise, target - max(best, bound), sweep + 1, floor):
            break
        rise, last = bound - last, bound
    return max(best, exact())


def _start(plan: _Sweeps, model: LinearModel, y: np.ndarray) -> tuple:
    """The ascent's state at ``y`` with the edge rows' multipliers at 0: every column's reduced
    cost (inf where held at 0), the units' beliefs, the flat messages, and the batches with their
    prices (``_prices``)."""
    d0 = model.cost - np.bincount(model.entry_col, weights=model.csc_val * y[model.csc_row], minlength=model.n_cols)
    open_ = np.where(model.col_ub > 0, d0, np.inf)  # a column held at 0 is no strategy and no pairing
    belief = np.full(model.n_cols, np.inf)
    belief[plan.units] = open_[plan.units]
    batches = [_prices(b, belief, open_) for b in plan.batches]
    return open_, belief, np.zeros(len(plan.rows)), batches


def _sweep(batches: list[tuple], belief: np.ndarray, msg: np.ndarray) -> None:
    """One sweep, batch by batch: each group reads its two units' beliefs less its own messages,
    per label, and splits the best pairing of each label evenly between them."""
    with np.errstate(invalid="ignore"):  # inf - inf where a label has no strategy: set below
        for b, t, none in batches:
            old = msg[b.labels]
            m = b.least(belief)
            m -= old
            new = np.minimum.reduceat(t + m[b.other], b.rows)
            new -= m  # half the gap between each label's best pairing and its own belief
            new *= 0.5
            # a label no pair takes is priced out (np.clip's Python layers cost more than these two)
            np.minimum(new, _CAP, out=new)
            np.maximum(new, -_CAP, out=new)
            if none is not None:  # one with no strategy is left be
                new[none] = 0.0
            change = (new - old)[b.label_of]
            if b.repeated:
                np.add.at(belief, b.cols, change)
            else:
                belief[b.cols] += change
            msg[b.labels] = new


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


def _prices(b: _Batch, belief: np.ndarray, open_: np.ndarray) -> tuple:
    """A batch's pairs' reduced costs at the start (inf: no pairing), and its labels with no
    strategy (``None``: none). These stay so: a strategy held at 0 is inf throughout, and the
    messages are finite."""
    t = np.where(b.pairs >= 0, open_[b.pairs], np.inf)
    none = np.flatnonzero(~np.isfinite(b.least(belief)))
    return b, t, none if len(none) else None
