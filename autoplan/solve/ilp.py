"""The placement ILP: one-hot strategy per unit, placement-grouped edge variables, user constraints.

    min  sum_u c_u . x_u  +  sum_edges sum_{o,q} (R[o,q] + eps [o != q]) e[o,q]
    s.t. sum_r x[u,r] = 1                              for every unit u
         sum_q e[o,q] = sum_{r: src(r) = o} x[src,r]   for every edge group and producer placement o
         sum_o e[o,q] = sum_{s: dst(s) = q} x[dst,s]   for every edge group and consumer placement q
         pins / I/O constraints / per-device parameter bytes and peak bytes
Edge variables are continuous: with integral x they are forced to the product, and the LP
relaxation is usually integral (``solvers`` tries the LP first).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from dataclasses import dataclass, replace

import numpy as np
import torch.fx as fx

from autoplan.shard.strategies import Strategy
from autoplan.solve.certify import Layout, certifier, dual_guess
from autoplan.solve.problem import Linear, PlacementProblem
from solvers import InfeasibleError, ModelBuilder, Screen, SolveOptions, SolveResult, SolverTimeoutError, solve

# The solver sees microseconds: step costs in seconds (~1e-5 per op) would sit at the level of
# HiGHS's absolute tolerances and ties would be broken by noise.
SCALE = 1e6
# Budget rows count MiB: byte counts (~1e10) beside the 0/1 coefficients of their big-M rows would
# strain the solver's tolerances, and GiB would make its feasibility tolerance (1e-7) hundreds of bytes.
MIB = 2.0**-20
# Microseconds added per placement change: far below any real cost, it breaks ties toward fewer changes.
TIE_BREAK = 1e-3
# Seeding a peak-capped solve (``_seed``): seconds per trial solve, for all trials, and by default
# for the full MIP that improves the seed (``SolveOptions.polish_s``: its LP bound is weak under a
# tight cap, proving the gap can take many minutes, while the seed is rarely improved by more than
# a few percent).
TRIAL_S = 10.0
_SEED_S = 90.0
POLISH_S = SolveOptions.polish_s
# Rows above which a re-solve first tries ``autoplan.solve.certify``'s bound on its start: below, its own
# LP is the cheaper proof; above, the dual simplex's time grows much faster than the ascent's.
CERTIFY_MIN_ROWS = 10_000
# HiGHS's threads, fixed so that a plan does not depend on the planning host's core count. One: every
# rank plans at once under torchrun, and on a small host two threads each oversubscribe its cores
# (4 gloo ranks on 2 cores planning LLaMA debug: 53 s each, against 8.7 s with one thread, which
# is as fast as two for a lone planner)
SOLVER_THREADS = 1

# a long MIP's progress at INFO; at DEBUG the solver prints its own log too
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class UnitChoice:
    """Strategy index chosen for each unit."""

    choice: dict[fx.Node, int]
    recompute: tuple[str, ...]  # names of the recompute options chosen
    peak: float | None  # with ``smallest_peak``: the least peak rows' value, bytes
    result: SolveResult
    n_vars: int
    n_rows: int
    n_edge_vars: int
    n_dropped: int  # strategies never given a variable (dominated or impossible)
    objective_without_tie_break: float
    build_time: float
    solve_time: float
    seeded: bool = False  # a fixed-option trial's plan, not yet polished by the full MIP


class NoSeedError(Exception):
    """No fixed-option trial met the rows of a ``solve_placement(seed_only=True)``."""


@dataclass(frozen=True)
class FixedRows:
    """A user constraint: for each (unit, allowed unit strategies) pair, one of them must be chosen."""

    group: str
    items: tuple[tuple[fx.Node, tuple[int, ...]], ...]


@dataclass(frozen=True)
class RecomputeVar:
    """A recompute option (``autoplan.trace.recompute``): a binary ``r`` whose seconds ``w`` enter the
    objective, ``w >= seconds(x, e) - M (1 - r)``; the options of one ``group`` (a layer) exclude
    each other. ``pinned``: forced on by the user (an option pinned off gets no variable).
    ``kind``: which option (``"full"``, ``"selective"``) of its layer."""

    name: str
    group: str
    seconds: Linear
    pinned: bool = False
    kind: str = ""


@dataclass(frozen=True)
class BudgetRow:
    """``coeffs . x + moves(x) - sum s_i + sum a_i <= limit``: per recompute option i,
    ``s_i = frees(x) r_i`` and ``a_i = keeps(x) r_i`` (big-M rows), so the bytes an option frees
    count only when it is chosen."""

    group: str
    coeffs: tuple[tuple[fx.Node, np.ndarray], ...]  # per unit: bytes per unit strategy
    limit: float
    recompute: tuple[tuple[int, Linear, Linear], ...] = ()  # (option index, bytes freed, bytes kept)
    cap: float | None = None  # a peak row's cap (``limit`` = cap - bytes the row misses)
    moves: Linear | None = None  # bytes of the copies the step's op makes of its moved inputs

    def at(self, problem: PlacementProblem, choice: dict[fx.Node, int]) -> float:
        """The row's bytes where each unit takes strategy ``choice[unit]`` and every option in
        ``recompute`` is on, as the solve's columns read them (``_recompute_bytes``:
        ``0 <= s <= frees``, ``a >= max(keeps, 0)``)."""
        total = sum(float(c[choice[u]]) for u, c in self.coeffs)
        total += self.moves.at(problem, choice) if self.moves is not None else 0.0
        for _, frees, keeps in self.recompute:
            total += max(keeps.at(problem, choice), 0.0) - max(frees.at(problem, choice), 0.0)
        return total


def undominated(
    problem: PlacementProblem,
    fixed: list[FixedRows],
    budgets: list[BudgetRow],
    options: list[RecomputeVar] = (),
    keep: dict[fx.Node, Strategy] | None = None,
) -> dict[fx.Node, np.ndarray]:
    """Per unit, the strategies worth a variable: finite, and cheapest among those that look the same
    to every edge, constraint and budget (the others can only cost more in any plan), and ``keep``'s
    (a start's strategies: its point must exist in the model)."""
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
        moves = [budget.moves] if budget.moves is not None else []
        for lin in [*moves, *(side for _, frees, keeps in budget.recompute for side in (frees, keeps))]:
            for u, c in lin.units.items():
                signature[u].append(c)
    for option in options:
        for u, c in option.seconds.units.items():
            signature[u].append(c)
    for seg in problem.overlap:
        for u, c in seg.hideable.units.items():
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
        chosen = set(best.values())
        if keep is not None and keep.get(u) in problem.strategies[u]:
            i = problem.strategies[u].index(keep[u])
            if not problem.forbidden[u][i]:
                chosen.add(i)
        kept[u] = np.array(sorted(chosen), dtype=np.int64)
    return kept


def _one_hot_rows(b: ModelBuilder, offsets: dict[fx.Node, int], kept: dict[fx.Node, np.ndarray]) -> None:
    units = list(offsets)
    rows = np.concatenate([np.full(len(kept[u]), i) for i, u in enumerate(units)])
    cols = np.concatenate([offsets[u] + np.arange(len(kept[u])) for u in units])
    b.add_rows(rows, cols, 1.0, lo=np.ones(len(units)), hi=np.ones(len(units)))


def _edge_rows(
    b: ModelBuilder,
    problem: PlacementProblem,
    offsets: dict[fx.Node, int],
    kept: dict[fx.Node, np.ndarray],
    weight: float = 1.0,
) -> tuple[int, np.ndarray, list[tuple], list[tuple[np.ndarray, np.ndarray]]]:
    """Edge variables and their marginal rows; returns (count, true cost per edge variable, per
    group its variables' columns and placement pairs, and per group its producer and consumer rows)."""
    n_edge = 0
    true_costs, columns, marginals = [], [], []
    for g in problem.edges:
        # only placement pairs some kept strategy on each side can produce get a variable
        used_o = np.isin(np.arange(g.cost.shape[0]), g.src_label[kept[g.src]])
        used_q = np.isin(np.arange(g.cost.shape[1]), g.dst_label[kept[g.dst]])
        oi, qi = np.nonzero(np.isfinite(g.cost) & used_o[:, None] & used_q[None, :])
        cost = g.cost[oi, qi]
        e_cost = weight * (SCALE * cost + TIE_BREAK * g.changes[oi, qi])
        e = b.add_vars(len(oi), cost=e_cost, lb=0.0, ub=1.0, integer=False)
        n_edge += len(oi)
        true_costs.append(cost)
        columns.append((e, oi, qi))
        n_o, n_q = g.cost.shape
        # producer marginals: rows 0..n_o-1; consumer marginals: rows n_o..n_o+n_q-1
        src_x = offsets[g.src] + np.arange(len(kept[g.src]))
        dst_x = offsets[g.dst] + np.arange(len(kept[g.dst]))
        rows = np.concatenate([oi, n_o + qi, g.src_label[kept[g.src]], n_o + g.dst_label[kept[g.dst]]])
        cols = np.concatenate([e, e, src_x, dst_x])
        vals = np.concatenate([np.ones(2 * len(oi)), -np.ones(len(src_x) + len(dst_x))])
        at = b.add_rows(rows, cols, vals, lo=np.zeros(n_o + n_q), hi=np.zeros(n_o + n_q))
        marginals.append((at[:n_o], at[n_o:]))
    return n_edge, np.concatenate(true_costs) if true_costs else np.zeros(0), columns, marginals


def _terms(lin: Linear, offsets, kept, edge_columns) -> tuple[np.ndarray, np.ndarray, float, float]:
    """Columns and values of a ``Linear`` on this model's variables, and its largest and least
    values (each unit and edge group takes one strategy, one placement pair)."""
    cols, vals, top, bottom = [], [], 0.0, 0.0
    for u, c in lin.units.items():
        cols.append(offsets[u] + np.arange(len(kept[u])))
        vals.append(np.asarray(c, dtype=float)[kept[u]])
    for g, c in lin.edges.items():
        e, oi, qi = edge_columns[g]
        cols.append(e)
        vals.append(np.asarray(c, dtype=float)[oi, qi])
    for v in vals:
        top += float(v.max(initial=0.0))
        bottom += float(v.min()) if v.size else 0.0  # ``initial=0`` would clamp a positive least value to 0
    if not cols:
        return np.zeros(0, dtype=np.int64), np.zeros(0), 0.0, 0.0
    return np.concatenate(cols), np.concatenate(vals), top, bottom


def _recompute_rows(
    b: ModelBuilder, options: list[RecomputeVar], terms, weight: float = 1.0
) -> tuple[np.ndarray, np.ndarray]:
    """The option binaries ``r`` and their seconds ``w``: returns both column arrays."""
    lb = [float(o.pinned) for o in options]
    r = b.add_vars(len(options), lb=lb, ub=1.0, integer=True, names=[f"recompute {o.name}" for o in options])
    w = b.add_vars(len(options), cost=weight, lb=0.0, ub=np.inf, integer=False)  # microseconds, like the objective
    for i, o in enumerate(options):
        cols, vals, top, bottom = terms(o.seconds)
        vals, top, bottom = vals * SCALE, top * SCALE, bottom * SCALE
        # w - seconds(x, e) - M r >= -M
        row = np.zeros(len(cols) + 2, dtype=np.int64)
        b.add_rows(row, np.r_[w[i], r[i], cols], np.r_[1.0, -top, -vals], lo=-top, hi=np.inf)
        # w >= (least seconds) r: implied at integral points, it prices a fractional r in the LP,
        # where the big-M row alone lets r = 1 - eps cost nothing
        b.add_rows(np.zeros(2, dtype=np.int64), [w[i], r[i]], [1.0, -bottom], lo=0.0, hi=np.inf)
    groups: dict[str, list[int]] = {}
    for i, o in enumerate(options):
        groups.setdefault(o.group, []).append(int(r[i]))
    for members in groups.values():
        if len(members) > 1:
            b.add_rows(np.zeros(len(members), dtype=np.int64), members, 1.0, lo=-np.inf, hi=1.0)
    return r, w


def _overlap_rows(
    b: ModelBuilder, problem: PlacementProblem, terms, weight: float = 1.0
) -> tuple[np.ndarray, np.ndarray]:
    """Per overlap segment, ``h <= budget`` and ``h <= hideable(x, e)``, with ``-h`` in the
    objective: the solve pushes ``h`` up to the lesser of the two. Returns the ``h`` columns and
    the segments' rows."""
    budgets = [seg.budget * SCALE for seg in problem.overlap]
    h = b.add_vars(len(problem.overlap), cost=-weight, lb=0.0, ub=budgets, integer=False)  # microseconds
    rows = []
    for col, seg in zip(h, problem.overlap):
        cols, vals, _, _ = terms(seg.hideable)
        row = np.zeros(len(cols) + 1, dtype=np.int64)
        rows.append(b.add_rows(row, np.r_[col, cols], np.r_[1.0, -vals * SCALE], lo=-np.inf, hi=0.0)[0])
    return h, np.array(rows, dtype=np.int64)


def _recompute_bytes(b: ModelBuilder, budget: BudgetRow, r: np.ndarray, terms) -> tuple[list, list]:
    """For one budget row, ``s_i <= frees(x)``, ``s_i <= M r_i`` and ``a_i >= keeps(x) - M (1 - r_i)``;
    returns the row's extra columns and values (``-s_i``, ``+a_i``)."""
    cols, vals = [], []
    for i, frees, keeps in budget.recompute:
        fc, fv, ftop, _ = terms(frees)
        kc, kv, ktop, kbottom = terms(keeps)
        fv, ftop, kv, ktop, kbottom = fv * MIB, ftop * MIB, kv * MIB, ktop * MIB, kbottom * MIB
        s, a = b.add_vars(2, lb=0.0, ub=np.inf, integer=False)
        b.add_rows(np.zeros(len(fc) + 1, dtype=np.int64), np.r_[s, fc], np.r_[1.0, -fv], lo=-np.inf, hi=0.0)
        b.add_rows(np.zeros(2, dtype=np.int64), [s, r[i]], [1.0, -ftop], lo=-np.inf, hi=0.0)
        row = np.zeros(len(kc) + 2, dtype=np.int64)
        b.add_rows(row, np.r_[a, r[i], kc], np.r_[1.0, -ktop, -kv], lo=-ktop, hi=np.inf)
        b.add_rows(np.zeros(2, dtype=np.int64), [a, r[i]], [1.0, -kbottom], lo=0.0, hi=np.inf)  # as for w
        cols += [s, a]
        vals += [-1.0, 1.0]
    return cols, vals


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
        own, wanted = problem.strategies[u], start.get(u)
        # by identity first: a re-solve's start holds the very strategies (equality runs in Python)
        hits = [j for j, i in enumerate(kept[u]) if own[i] is wanted]
        hits = hits or [j for j, i in enumerate(kept[u]) if own[i] == wanted]
        if not hits:
            return None
        x[offsets[u] + hits[0]] = 1.0
    return x


def _complete(x: np.ndarray, problem: PlacementProblem, layout: Layout, model) -> None:
    """Fill in ``x``'s (a start's strategy columns) edge pairs and hidden seconds, each the one
    value the choice leaves it: the pair both sides' placements name, the lesser of each segment's
    budget and what its moves hide (``solvers.solve`` then needs no completion LP)."""
    for g, (cols, oi, qi) in zip(problem.edges, layout.edges):
        a = layout.offsets[g.src] + np.arange(len(layout.kept[g.src]))
        b = layout.offsets[g.dst] + np.arange(len(layout.kept[g.dst]))
        o = g.src_label[layout.kept[g.src][np.argmax(x[a])]]
        q = g.dst_label[layout.kept[g.dst][np.argmax(x[b])]]
        x[cols[(oi == o) & (qi == q)]] = 1.0
    for row, h in zip(layout.overlap, layout.hidden):
        lo, hi = model.csr_start[row], model.csr_start[row + 1]
        cols, vals = model.csr_col[lo:hi], model.csr_val[lo:hi]
        hideable = -float(vals[cols != h] @ x[cols[cols != h]])
        x[h] = min(max(hideable, 0.0), float(model.col_ub[h]))


def solve_placement(
    problem: PlacementProblem,
    fixed: list[FixedRows],
    budgets: list[BudgetRow],
    opts: SolveOptions | None = None,
    *,
    start: dict[fx.Node, Strategy] | None = None,
    start_recompute: tuple[str, ...] = (),
    options: list[RecomputeVar] = (),
    smallest_peak: bool = False,
) -> UnitChoice:
    """The cheapest strategy per unit and recompute options, solved under ``opts``; ``start`` (a
    strategy per unit, e.g. an earlier plan's, with the options ``start_recompute`` on) seeds the
    search. Without a start and with free options, a fixed-option trial's plan (``_seed``) is the
    start, and the full MIP gets at most ``opts.polish_s`` to improve on it (0: the trial's plan is
    returned as it is); when no trial finds a plan, the full MIP searches, or with
    ``opts.seed_only`` ``NoSeedError`` is raised. With ``smallest_peak`` the peak rows' caps give
    way to one variable ``P`` the solve minimises instead (step time only breaks ties): the least
    peak any plan reaches, in ``UnitChoice.peak``. ``opts.keep_start``: see ``solvers.solve``; on a
    large model (``CERTIFY_MIN_ROWS``) the start is first offered to ``autoplan.solve.certify``'s bound,
    which keeps it without the LP when it proves it within ``opts.mip_rel_gap``."""
    opts = opts or SolveOptions()
    time_limit = opts.time_limit
    t0 = time.perf_counter()
    if start is None and not smallest_peak and any(not o.pinned for o in options):
        seeded = _seed(problem, fixed, budgets, opts, list(options))
        if seeded is None and opts.seed_only:
            raise NoSeedError()
        time_limit = _polish_limit(opts, seeded, t0)
        if seeded is not None and time_limit <= 0:  # every trial's seconds count as the solve's
            return dataclasses.replace(seeded, solve_time=time.perf_counter() - t0 - seeded.build_time)
        if seeded is not None:
            start = {u: problem.strategies[u][i] for u, i in seeded.choice.items()}
            start_recompute = seeded.recompute
    t_seed = time.perf_counter()
    kept = undominated(problem, fixed, budgets, options, start)
    model, layout, edge_costs, r, w, peak = _build(problem, fixed, budgets, options, kept, smallest_peak)
    offsets, n_edge = layout.offsets, len(edge_costs)
    t1 = time.perf_counter()
    seed = _start_vector(problem, offsets, kept, start, model.n_cols) if start is not None else None
    if seed is not None:
        seed[[col for o, col in zip(options, r) if o.name in start_recompute]] = 1.0
    certified = opts.keep_start and seed is not None and model.n_rows > CERTIFY_MIN_ROWS
    if certified:
        _complete(seed, problem, layout, model)
    result = solve(
        model,
        replace(
            opts,
            time_limit=time_limit,
            threads=SOLVER_THREADS if opts.threads is None else opts.threads,
            verbose=log.isEnabledFor(logging.DEBUG),
            log=log,
        ),
        rounding=functools.partial(_one_hot, problem, layout),
        start=seed,
        certify=certifier(problem, layout, model, opts.mip_rel_gap) if certified else None,
        screen=_screen(problem, layout, model, seed, certified),
    )
    t2 = time.perf_counter()
    x = result.x
    choice = {u: int(kept[u][np.argmax(x[offsets[u] : offsets[u] + len(kept[u])])]) for u in problem.units}
    return UnitChoice(
        choice=choice,
        recompute=tuple(o.name for o, col in zip(options, r) if x[col] > 0.5),
        peak=float(x[peak[0]]) / MIB if peak is not None else None,
        result=result,
        n_vars=model.n_cols,
        n_rows=model.n_rows,
        n_edge_vars=n_edge,
        n_dropped=sum(len(problem.unit_cost[u]) - len(kept[u]) for u in problem.units),
        objective_without_tie_break=_objective(problem, layout, x, choice, edge_costs, w),
        build_time=t1 - t_seed,
        solve_time=t2 - t1 + t_seed - t0,
    )


def _build(problem: PlacementProblem, fixed, budgets, options, kept, smallest_peak: bool):
    """The MIP over the strategies ``kept``: one-hot strategy columns per unit, edge columns with
    their marginal rows, recompute and overlap columns, pins and budget rows; with
    ``smallest_peak`` a peak variable ``P`` whose cost dwarfs the step time's. Returns the model,
    its layout, each edge column's true cost, the recompute option and seconds columns, and ``P``."""
    weight = 1e-9 if smallest_peak else 1.0
    b = ModelBuilder("placement")
    offsets: dict[fx.Node, int] = {}
    for u in problem.units:
        unit_costs = weight * SCALE * problem.unit_cost[u][kept[u]]
        offsets[u] = int(b.add_vars(len(kept[u]), cost=unit_costs, integer=True)[0])
    _one_hot_rows(b, offsets, kept)
    _, edge_costs, edge_columns, marginals = _edge_rows(b, problem, offsets, kept, weight)
    terms = lambda lin: _terms(lin, offsets, kept, edge_columns)  # noqa: E731
    r, w = _recompute_rows(b, list(options), terms, weight) if options else (np.zeros(0, np.int64),) * 2
    hidden, overlap_rows = _overlap_rows(b, problem, terms, weight)
    peak = b.add_vars(1, cost=1.0, lb=0.0, ub=np.inf, integer=False) if smallest_peak else None
    _pin_rows(b, fixed, offsets, kept)
    _budget_rows(b, budgets, offsets, kept, r, terms, peak)
    layout = Layout(kept, offsets, edge_columns, marginals, overlap_rows, hidden)
    return b.build(), layout, edge_costs, r, w, peak


def _polish_limit(opts: SolveOptions, seeded: UnitChoice | None, t0: float) -> float | None:
    """The seconds left for the full MIP after the seed trials begun at ``t0``: at most
    ``opts.polish_s`` to improve on a trial's plan, else what is left of ``opts.time_limit``."""
    time_limit = opts.time_limit
    if time_limit is not None:
        time_limit = time_limit - (time.perf_counter() - t0)
    if seeded is not None:
        time_limit = opts.polish_s if time_limit is None else min(time_limit, opts.polish_s)
    return time_limit


def _one_hot(problem: PlacementProblem, layout: Layout, x: np.ndarray) -> np.ndarray:
    """``x`` rounded: the recompute options to 0 or 1, each unit's strategy columns one-hot at its largest."""
    out = np.round(x)
    for u in problem.units:
        lo, hi = layout.offsets[u], layout.offsets[u] + len(layout.kept[u])
        out[lo:hi] = 0.0
        out[lo + int(np.argmax(x[lo:hi]))] = 1.0
    return out


def _screen(problem: PlacementProblem, layout: Layout, model, seed, certified: bool) -> Screen | None:
    """On a large model, the LP screen (``solvers.Screen``): with a start being certified (it takes
    the certificate's multipliers, should it fall short), or without a start (the multipliers of
    ``dual_guess``). Every pair column is 0 or 1 wherever the strategies are."""
    if not (certified or (model.n_rows > CERTIFY_MIN_ROWS and seed is None)):
        return None
    pairs = np.zeros(model.n_cols, dtype=bool)
    pairs[np.concatenate([cols for cols, _, _ in layout.edges] or [np.zeros(0, np.int64)])] = True
    return Screen(dual_guess(problem, layout, model) if seed is None else None, model.integer | pairs)


def _objective(problem: PlacementProblem, layout: Layout, x, choice, edge_costs, recompute_cols) -> float:
    """The step time of solution ``x`` without the tie-break: strategies, edges and recompute, less
    what hides under compute (the columns are scaled by ``SCALE``)."""
    x_cost = sum(float(problem.unit_cost[u][r]) for u, r in choice.items())
    n_x = sum(len(k) for k in layout.kept.values())
    n_edge = len(edge_costs)
    e_cost = float(edge_costs @ x[n_x : n_x + n_edge]) if n_edge else 0.0
    w_cost = float(sum(x[col] for col in recompute_cols)) / SCALE
    h_cost = float(sum(x[col] for col in layout.hidden)) / SCALE
    return x_cost + e_cost + w_cost - h_cost


def _pin_rows(b: ModelBuilder, fixed: list[FixedRows], offsets: dict[fx.Node, int], kept) -> None:
    """One row per pinned unit: exactly one of the strategies its pin allows."""
    for f in fixed:
        cols = [offsets[u] + np.flatnonzero(np.isin(kept[u], allowed)) for u, allowed in f.items]
        rows = [np.full(len(c), i) for i, c in enumerate(cols)]
        b.add_rows(
            np.concatenate(rows), np.concatenate(cols), 1.0, lo=np.ones(len(cols)), hi=np.ones(len(cols)), group=f.group
        )


def _budget_rows(b: ModelBuilder, budgets: list[BudgetRow], offsets, kept, r, terms, peak) -> None:
    """One row per memory budget, in MiB: the stored bytes of each unit's strategy, what the
    recompute options ``r`` change and the moves' buffers; with ``peak`` (the smallest-peak solve)
    the cap gives way to the variable ``P`` (sum - P <= limit - cap)."""
    for budget in budgets:
        extra_cols, extra_vals = _recompute_bytes(b, budget, r, terms)
        if budget.moves is not None:
            moved_cols, moved_vals, _, _ = terms(budget.moves)
            extra_cols, extra_vals = [*extra_cols, *moved_cols], [*extra_vals, *(moved_vals * MIB)]
        cols = np.concatenate([offsets[u] + np.arange(len(kept[u])) for u, _ in budget.coeffs] + [extra_cols])
        vals = np.concatenate([c[kept[u]] * MIB for u, c in budget.coeffs] + [extra_vals])
        limit = budget.limit * MIB
        if peak is not None and budget.cap is not None:
            cols, vals, limit = np.r_[cols, peak], np.r_[vals, -1.0], (budget.limit - budget.cap) * MIB
        b.add_rows(np.zeros(len(cols), dtype=np.int64), cols, vals, lo=-np.inf, hi=limit, group=budget.group)


def _with_options_on(problem, fixed, budgets, opts: SolveOptions, options, on: set[int]):
    """The plan with the options ``on`` (and the pinned ones) forced and the others off, a
    placement ILP as fast as one without recompute; ``None`` when none is found in ``opts.time_limit``."""
    keep = [i for i, o in enumerate(options) if o.pinned or i in on]
    index = {old: new for new, old in enumerate(keep)}
    rows = [
        dataclasses.replace(b, recompute=tuple((index[i], f, k) for i, f, k in b.recompute if i in index))
        for b in budgets
    ]
    forced = [dataclasses.replace(options[i], pinned=True) for i in keep]
    try:
        return solve_placement(problem, fixed, rows, replace(opts, diagnose=False), options=forced)
    except (InfeasibleError, SolverTimeoutError):
        return None


def _seed(problem, fixed, budgets, opts: SolveOptions, options) -> UnitChoice | None:
    """A good plan to start a peak-capped solve from (a feasible plan of the full problem).

    The recompute options' big-M rows make the MIP an order of magnitude slower, and its LP bound
    weak, while with the options fixed it is a placement ILP solved in seconds. So try, each within
    ``TRIAL_S``: no option on (often within the gap of the LP bound already); else, per option
    kind, the fewest layers recomputing it, the earliest first (their saved activations live
    longest: recomputing an earlier layer frees as much at every step as a later one's), found
    by bisection; the cheapest of those. ``None`` when no trial finds a plan within ``_SEED_S``.
    """
    deadline = time.perf_counter() + (_SEED_S if opts.time_limit is None else min(opts.time_limit, _SEED_S))

    def trial(on: set[int]) -> UnitChoice | None:
        left = min(deadline - time.perf_counter(), TRIAL_S)
        if left <= 0:
            return None
        return _with_options_on(problem, fixed, budgets, replace(opts, time_limit=left), options, on)

    found = [trial(set())]
    if found[0] is None:
        free = [i for i, o in enumerate(options) if not o.pinned]
        for kind in sorted({options[i].kind for i in free}):
            order = [i for i in free if options[i].kind == kind]
            lo, hi, best = 1, len(order), trial(set(order))
            while best is not None and lo < hi:  # the fewest layers, given that all of them fit
                mid = (lo + hi) // 2
                got = trial(set(order[:mid]))
                lo, hi, best = (lo, mid, got) if got is not None else (mid + 1, hi, best)
            found.append(best)
    found = [f for f in found if f is not None]
    if not found:
        return None
    return dataclasses.replace(min(found, key=lambda f: f.objective_without_tie_break), seeded=True)
