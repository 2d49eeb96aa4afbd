"""``solve``: LP-first strategy, backend dispatch, and infeasibility diagnosis over user groups."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from time import perf_counter
from typing import Any

import numpy as np

from .bound import reduced_costs, screening, tightened
from .highs_backend import available as highs_available
from .highs_backend import solve_highs
from .model import LinearModel
from .pricing import priced_lp
from .pulp_backend import solve_cbc
from .result import (
    OPTIMALITY_GAP,
    STOP_RESTRICTED,
    STOP_TIME_LIMIT,
    InfeasibleError,
    RawSolution,
    SolveOptions,
    SolveResult,
    SolverOptions,
    SolverTimeoutError,
    SolveStatus,
    relative_gap,
)

Backend = Callable[[LinearModel, bool, SolverOptions], RawSolution]

_BACKENDS: dict[str, Backend] = {"highs": solve_highs, "cbc": solve_cbc}
INTEGRALITY_TOL = 1e-6
# the column-row-column steps a neighbourhood MIP reaches out from the LP's fractional columns,
# tried in turn: the units where a near-optimal plan differs from the LP's rounding sit a few steps
# from the fractional ones, and each wider neighbourhood finds more of them at a higher cost.
NEIGHBOURHOOD_HOPS = (2, 4, 6)
# The largest share of the integer columns a neighbourhood MIP leaves free: a wider one costs about
# what the whole MIP does, which then runs on top.
NEIGHBOURHOOD_MAX_FREE = 0.25
# A step goes only through rows of at most this many times the mean row's entries: a dense row (a
# layer's overlap budget, a memory cap) ties every column of a layer together, and stepping through
# it frees the whole layer at once, a larger MIP that finds no better plan.
DENSE_ROW = 10
# A screened solve's first limit: the screen's bound plus this fraction of it. A guess: once the
# solve finds a point under it the screen was sound; above it, the point found is the next limit.
SCREEN_MARGIN = 0.25
# Column generation (``_priced``) starts from each pool row's this many columns of least reduced
# cost under the screen's multipliers: with one, the first LP leans on its artificial columns and
# is slow; with two, later rounds add few columns (3-D placement LPs: about 10% of the pool).
FIRST_PER_ROW = 2
# Pricing stops once its LP is within this share of ``mip_rel_gap`` of its bound (the rest of the
# gap is left for rounding the LP's point to a plan), on a pool of at least PRICED_STOP_MIN_POOL
# columns: there the last rounds cost seconds (3-D meshes), while a smaller LP is priced to its
# optimum, which is often integral and so proves the plan optimal (``Plan.explain`` needs that).
PRICED_SHARE = 0.25
PRICED_STOP_MIN_POOL = 200_000


@dataclass(frozen=True)
class Screen:
    """Reduced-cost fixing before the LP (``bound.screening``): row multipliers ``y`` (``None``: the
    certificate's, once it falls short of proving the start), and the columns ``unit`` that every
    integer point sets to 0 or 1 (binaries, and columns the rows force to a product of binaries)."""

    y: np.ndarray | None
    unit: np.ndarray


def _backend_name(backend: str) -> str:
    if backend == "auto":
        return "highs" if highs_available() else "cbc"
    if backend not in _BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of auto, {', '.join(_BACKENDS)}")
    return backend


def _is_integral(model: LinearModel, x: np.ndarray) -> bool:
    xi = x[model.integer]
    return bool(np.all(np.abs(xi - np.round(xi)) <= INTEGRALITY_TOL))


def _rounded(model: LinearModel, x: np.ndarray) -> np.ndarray:
    out = x.copy()
    out[model.integer] = np.round(out[model.integer])
    return out


def _remaining(opts: SolverOptions, started: float) -> SolverOptions:
    """Options whose time limit is what is left of the overall budget after earlier passes."""
    if opts.time_limit is None:
        return opts
    return replace(opts, time_limit=max(opts.time_limit - (perf_counter() - started), 0.0))


def _diagnose(model: LinearModel, run: Backend, opts: SolverOptions) -> InfeasibleError:
    """Deletion filter over user groups: the groups left form a minimal infeasible set.

    Feasibility is tested on the LP relaxation when that is already infeasible (cheap), else on
    the MIP itself. A test that ends without a verdict (e.g. at a time limit) counts as feasible,
    so the group stays in the reported set instead of being dropped on a guess.
    """
    relaxation = run(model.feasibility_model(model.groups), False, opts).status is SolveStatus.INFEASIBLE

    def feasible(groups: list[str]) -> bool:
        return run(model.feasibility_model(groups), not relaxation, opts).status is not SolveStatus.INFEASIBLE

    if not feasible([]):
        return InfeasibleError(
            [], f"The {model.name} problem is infeasible even without user constraints: its structural rows conflict."
        )
    conflict = list(model.groups)
    for group in model.groups:
        rest = [g for g in conflict if g != group]
        if not feasible(rest):
            conflict = rest
    return InfeasibleError(
        conflict, f"The {model.name} problem is infeasible. Conflicting constraints: {', '.join(conflict)}"
    )


def _timeout(model: LinearModel, backend: str, opts: SolverOptions) -> SolverTimeoutError:
    return SolverTimeoutError(
        f"No feasible solution of {model.name!r} found within the time limit of {opts.time_limit} s "
        f"(backend {backend})",
        opts.time_limit,
        backend,
        model.n_cols,
        model.n_rows,
    )


def _result(
    model: LinearModel,
    backend: str,
    passes: list[RawSolution],
    status: SolveStatus,
    x: np.ndarray,
    objective: float,
    bound: float,
    lp_was_integral: bool = False,
    stop: str = "",
) -> SolveResult:
    return SolveResult(
        status=status,
        objective=objective,
        bound=bound,
        gap=relative_gap(objective, bound),
        x=x,
        backend=backend,
        lp_was_integral=lp_was_integral,
        build_time=sum(p.build_time for p in passes),
        solve_time=sum(p.solve_time for p in passes),
        n_vars=model.n_cols,
        n_rows=model.n_rows,
        n_nonzeros=model.n_nonzeros,
        n_integer=model.n_integer,
        stop=stop,
    )


def _finish(
    model: LinearModel,
    backend: str,
    run: Backend,
    opts: SolverOptions,
    passes: list[RawSolution],
    lp_bound: float,
    best: tuple[np.ndarray, float] | None = None,
    diagnose: bool = True,
) -> SolveResult:
    """Turn the final pass into a result, or raise for infeasibility / a fruitless time limit.

    ``best`` is a feasible point found before the last pass; it stands when that pass found nothing
    better. Without ``diagnose`` an infeasibility names every user group (no deletion filter).
    """
    raw = passes[-1]
    if raw.status is SolveStatus.INFEASIBLE:
        if not diagnose:
            raise InfeasibleError(list(model.groups), f"The {model.name} problem is infeasible (not diagnosed).")
        raise _diagnose(model, run, opts)
    if raw.status is SolveStatus.NO_SOLUTION and raw.hit_limit and best is None:
        raise _timeout(model, backend, opts)
    points = [best] if best is not None else []
    if raw.status in (SolveStatus.OPTIMAL, SolveStatus.FEASIBLE):
        x = _rounded(model, raw.x)
        points.insert(0, (x, model.objective_value(x)))  # first: the last pass wins ties
    if points:
        x, objective = min(points, key=lambda p: p[1])
        bound = max(raw.bound, lp_bound)
        tight = opts.mip_rel_gap <= OPTIMALITY_GAP or relative_gap(objective, bound) <= OPTIMALITY_GAP
        status = SolveStatus.OPTIMAL if raw.status is SolveStatus.OPTIMAL and tight else SolveStatus.FEASIBLE
        stop = STOP_TIME_LIMIT if raw.hit_limit else ""
        return _result(model, backend, passes, status, x, objective, bound, stop=stop)
    x = raw.x if raw.x is not None else np.full(model.n_cols, np.nan)
    objective = -math.inf if raw.status is SolveStatus.UNBOUNDED else math.nan
    return _result(model, backend, passes, raw.status, x, objective, -math.inf)


def _point_with(
    model: LinearModel,
    run: Backend,
    opts: SolverOptions,
    columns: np.ndarray,
    values: np.ndarray,
    passes: list[RawSolution],
) -> tuple[np.ndarray, float] | None:
    """Fix ``columns`` to ``values`` and solve for the rest (a MIP if integer columns stay free):
    a feasible point and its objective, or ``None``. Without probing: on these small MIPs HiGHS
    would spend most of its time probing binaries in presolve, for the same plans."""
    sub, full, free = model.restricted(columns, np.round(values))
    raw = run(sub, sub.n_integer > 0, replace(opts, probing=False))
    if raw.x is not None:
        full[free] = raw.x
        raw = replace(raw, x=full)
    passes.append(raw)
    if raw.status not in (SolveStatus.OPTIMAL, SolveStatus.FEASIBLE):
        return None
    x = _rounded(model, raw.x)
    return x, model.objective_value(x)


def _within(gap: float) -> SolveStatus:
    """The status of a point within the asked gap of a bound."""
    return SolveStatus.OPTIMAL if gap <= OPTIMALITY_GAP else SolveStatus.FEASIBLE


def _whole_point(model: LinearModel, x: np.ndarray) -> tuple[np.ndarray, float] | None:
    """``x`` and its objective when it is a feasible point of every column (the caller completed
    it), else ``None``: its continuous part then needs no completion LP."""
    tol = 1e-7
    if not np.all(np.isfinite(x)) or np.any(x < model.col_lb - tol) or np.any(x > model.col_ub + tol):
        return None
    if not _is_integral(model, x):
        return None
    activity = model.activity(x)
    slack = tol * np.maximum(1.0, np.abs(activity))
    if np.any(activity < model.row_lo - slack) or np.any(activity > model.row_hi + slack):
        return None
    x = _rounded(model, x)
    return x, model.objective_value(x)


def _neighbourhoods(model: LinearModel, fractional: np.ndarray) -> list[np.ndarray]:
    """The integer columns a neighbourhood MIP leaves free: the fractional ones, then those within
    ``NEIGHBOURHOOD_HOPS`` steps of them; growing, and never all of them (that is the full MIP)
    nor more than ``NEIGHBOURHOOD_MAX_FREE`` of them."""
    out: list[np.ndarray] = []
    widest = DENSE_ROW * max(1, model.n_nonzeros // max(1, model.n_rows))
    reach, done = fractional, 0  # every column reached, continuous ones included: paths run through them
    for hops in (0, *NEIGHBOURHOOD_HOPS):
        reach, done = model.near(reach, hops - done, widest), hops  # each ring grows from the last one
        free = reach & model.integer
        wide = free.sum() > NEIGHBOURHOOD_MAX_FREE * model.n_integer
        if wide or np.array_equal(free, model.integer) or (out and np.array_equal(free, out[-1])):
            break
        out.append(free)
    return out


def _distinct(model: LinearModel, guesses: list[np.ndarray]) -> list[np.ndarray]:
    """``guesses`` less those whose integer columns repeat an earlier one's (a re-solve's start is
    often the LP's rounding): each try is a solve."""
    kept: list[np.ndarray] = []
    for g in guesses:
        if not any(np.array_equal(np.round(g[model.integer]), np.round(k[model.integer])) for k in kept):
            kept.append(g)
    return kept


def solve(
    model: LinearModel,
    options: SolveOptions | None = None,
    *,
    rounding: Callable[[np.ndarray], np.ndarray] | None = None,
    start: np.ndarray | None = None,
    certify: Callable[[np.ndarray, float], tuple[float, np.ndarray]] | None = None,
    screen: Screen | None = None,
    **knobs: Any,
) -> SolveResult:
    """Minimise ``model`` under ``options`` (``SolveOptions``; its fields may be given as keywords
    instead, or on top).

    With ``lp_first`` the LP relaxation is solved first and accepted when its integer columns
    are already integral (placement LPs usually are, and the LP is several times cheaper);
    otherwise the MIP is solved within what is left of ``time_limit``. Raises ``InfeasibleError``
    naming a minimal set of conflicting user groups, or ``SolverTimeoutError`` when the time
    limit passes without any feasible point.

    ``rounding`` maps a fractional LP solution to integer values for the integer columns (e.g. an
    argmax per one-hot group). The continuous rest is then re-optimised with those fixed; if that
    point is within ``mip_rel_gap`` of the LP bound it is provably good enough and the MIP is skipped.
    ``start`` gives integer values known to be feasible (e.g. a previous plan), completed the same
    way, and so is the LP rounded only where it is integral (the fractional rest searched). The
    best point found is the MIP's starting incumbent. ``keep_start``: the start is completed first
    and kept when within ``mip_rel_gap`` of the LP bound, the rounding untried (a re-solve that
    cannot gain keeps its plan, at one completion). ``diagnose=False`` skips the search for the
    conflicting groups (when only feasibility matters, e.g. a try whose failure has a fallback).
    ``certify``: with ``keep_start``, a lower bound on the optimum worked out without the LP (e.g.
    ``bound.lagrangian_bound`` of dual guesses) and the row multipliers that give it, given the
    completed start and its objective (it may stop once that is certified); a start it certifies
    within ``mip_rel_gap`` is kept and the LP never runs.
    ``screen``: the columns that no integer point under a limit can use are left out before the LP
    (``_screened``); the bound is then on the integer optimum, not the LP's. Without a start the
    limit is a margin over the screen's bound; after a certificate that falls short, it is the
    start's objective, and the multipliers are the certificate's (``Screen.y`` ``None``).
    ``verbose`` prints the backend's own log; ``log`` gets a long MIP's progress at INFO (HiGHS).
    """
    o = replace(options or SolveOptions(), **knobs)
    whole = partial(_whole, o)
    # every pass gets what is left of the time limit from here, a screened try's time included
    started = perf_counter()
    screening_ok = screen is not None and o.lp_first and model.n_integer > 0
    name = _backend_name(o.backend)
    opts = SolverOptions(o.time_limit, o.mip_rel_gap, o.threads, o.verbose, log=o.log)
    st = _Solve(model, o, name, _BACKENDS[name], opts, started)
    if screening_ok and start is None and not o.keep_start and screen.y is not None:
        if name == "highs" and (found := _priced(st, screen, rounding)) is not None:
            return found
        if (found := _screened(model, screen, whole, rounding, o.time_limit, name)) is not None:
            return found
    if o.keep_start and start is not None and certify is not None and model.n_integer > 0:
        if (found := _kept_start(st, start, certify, screen if screening_ok else None, whole, rounding)) is not None:
            return found
    if o.lp_first or model.n_integer == 0:
        if (found := _lp_first(st, rounding, start)) is not None:
            return found
    return _mip(st)


@dataclass
class _Solve:
    """What the passes of one ``solve`` share: the backend, the options each pass gets less the time
    spent since ``started``, the passes run so far, the LP's bound and the best point found yet."""

    model: LinearModel
    options: SolveOptions
    name: str
    run: Backend
    opts: SolverOptions
    started: float
    passes: list[RawSolution] = field(default_factory=list)
    lp_bound: float = -math.inf
    best: tuple[np.ndarray, float] | None = None


def _kept_start(
    st: _Solve,
    start: np.ndarray,
    certify: Callable[[np.ndarray, float], tuple[float, np.ndarray]],
    screen: Screen | None,
    whole: Callable[[LinearModel, Callable | None, float | None, np.ndarray | None], SolveResult],
    rounding: Callable[[np.ndarray], np.ndarray] | None,
) -> SolveResult | None:
    """Complete ``start`` into ``st.best`` and keep it when ``certify`` proves it within the gap, so
    the LP never runs; short of that, a screened solve under its objective (with ``screen``).
    ``None``: the solve goes on."""
    model = st.model
    st.best = _whole_point(model, start) or _point_with(model, st.run, st.opts, model.integer, start, st.passes)
    if st.best is None:
        return None
    bound, y = certify(*st.best)
    gap = relative_gap(st.best[1], bound)
    # a bound above a feasible point's value is a tolerance artefact, not a proof
    sound = bound <= st.best[1] + 1e-9 * max(1.0, abs(st.best[1]))
    if sound and gap <= max(st.options.mip_rel_gap, OPTIMALITY_GAP):
        return _result(model, st.name, st.passes, _within(gap), *st.best, bound)
    if screen is None:
        return None
    screened = replace(screen, y=y if screen.y is None else screen.y)
    left = _remaining(st.opts, st.started).time_limit
    return _screened(model, screened, whole, rounding, left, st.name, st.best)


def _lp_first(
    st: _Solve, rounding: Callable[[np.ndarray], np.ndarray] | None, start: np.ndarray | None
) -> SolveResult | None:
    """Solve the LP relaxation and take its point when integral (placement LPs usually are), else
    the best completion near it (``_completions``) within the gap of its bound. A model without
    integer columns, or with an infeasible LP, ends here (``_finish``); an LP that used up the time
    limit raises. ``None``: the MIP runs, with ``st.lp_bound`` set when the LP was solved."""
    model = st.model
    # the relaxation without presolve: on placement LPs HiGHS's presolve costs more than it saves
    lp = st.run(model, False, replace(_remaining(st.opts, st.started), presolve=False))
    st.passes.append(lp)
    if lp.status is SolveStatus.OPTIMAL and _is_integral(model, lp.x):
        x = _rounded(model, lp.x)
        objective = model.objective_value(x)
        return _result(model, st.name, st.passes, SolveStatus.OPTIMAL, x, objective, lp.bound, lp_was_integral=True)
    if model.n_integer == 0 or lp.status is SolveStatus.INFEASIBLE:
        return _finish(model, st.name, st.run, st.opts, st.passes, st.lp_bound, diagnose=st.options.diagnose)
    if lp.hit_limit:  # no integer point yet and no time left for the MIP
        raise _timeout(model, st.name, st.opts)
    if lp.status is not SolveStatus.OPTIMAL:
        return None
    st.lp_bound = lp.bound
    gap = relative_gap(st.best[1], st.lp_bound) if st.best is not None else math.inf
    if gap <= max(st.options.mip_rel_gap, OPTIMALITY_GAP):  # the start, completed already, is within the gap
        return _result(model, st.name, st.passes, _within(gap), *st.best, st.lp_bound)
    return _completions(st, lp.x, rounding, start)


def _completions(
    st: _Solve, lp_x: np.ndarray, rounding: Callable[[np.ndarray], np.ndarray] | None, start: np.ndarray | None
) -> SolveResult | None:
    """Complete integer points near the LP's ``lp_x``, cheapest tries first: the rounded LP, the
    given start, then small MIPs over the columns the LP left fractional and those within a few
    rows of them, the others fixed at their LP value (far cheaper than the whole MIP, and on
    placement ILPs they find plans as good). The best point within the gap of ``st.lp_bound``;
    ``None`` when none is (``st.best`` then holds the best found, the MIP's start)."""
    model, keep_start = st.model, st.options.keep_start
    settled = model.integer & (np.abs(lp_x - np.round(lp_x)) <= INTEGRALITY_TOL)
    given = [start] if start is not None and st.best is None else []  # else completed by ``_kept_start``
    rounded = [rounding(lp_x)] if rounding is not None else []
    guesses = _distinct(model, given + rounded if keep_start else rounded + given)
    tries = [(model.integer, g) for g in guesses] + [
        (model.integer & ~f, lp_x) for f in _neighbourhoods(model, model.integer & ~settled)
    ]
    for k, (columns, values) in enumerate(tries):
        point = _point_with(model, st.run, _remaining(st.opts, st.started), columns, values, st.passes)
        if point is not None and (st.best is None or point[1] < st.best[1]):
            st.best = point
        gap = relative_gap(st.best[1], st.lp_bound) if st.best is not None else math.inf
        # every whole guess is tried before one is taken (the start may beat the rounding),
        # unless the start is kept whenever it is good enough
        settled = keep_start or k >= len(guesses) - 1 or gap <= OPTIMALITY_GAP
        if gap <= max(st.options.mip_rel_gap, OPTIMALITY_GAP) and settled:
            return _result(model, st.name, st.passes, _within(gap), *st.best, st.lp_bound)
    return None


def _first_columns(model: LinearModel, screen: Screen, pool: np.ndarray) -> np.ndarray:
    """The pool columns column generation starts from: in each row, the ``FIRST_PER_ROW`` of least
    reduced cost under the screen's multipliers."""
    d, _ = reduced_costs(model, screen.y)
    entries = pool[model.entry_col]
    cols, rows = model.entry_col[entries], model.csc_row[entries]
    order = np.lexsort((d[cols], rows))
    rows, cols = rows[order], cols[order]
    starts = np.r_[0, np.flatnonzero(np.diff(rows)) + 1]
    rank = np.arange(len(rows)) - np.repeat(starts, np.diff(np.r_[starts, len(rows)]))
    first = np.zeros(model.n_cols, dtype=bool)
    first[cols[rank < FIRST_PER_ROW]] = True
    return first


def _priced(st: _Solve, screen: Screen, rounding: Callable[[np.ndarray], np.ndarray] | None) -> SolveResult | None:
    """The LP by column generation over the screen's continuous columns (``pricing.priced_lp``, on
    a large pool stopped within a share of the gap asked), its point taken when integral; else
    integer points completed near it over the columns the LP used (its bound, one on the whole LP,
    still bounds the whole model), then over every column, and at last the MIP over the columns
    the LP or the best point use. A point near a fractional LP often needs pair columns pricing
    never added: the LP had no use for them. ``None``: the whole model is solved as usual."""
    model = st.model
    held = tightened(model)  # the same integer points, a tighter LP
    pool = screen.unit & ~model.integer & (held.col_ub > 0)
    first = _first_columns(held, screen, pool)
    within = st.options.mip_rel_gap * PRICED_SHARE if pool.sum() >= PRICED_STOP_MIN_POOL else 0.0
    found = priced_lp(held, pool, first, _remaining(st.opts, st.started), within)
    if found is None:
        return None
    lp = found.solution
    st.passes.append(lp)
    st.lp_bound = lp.bound
    if _is_integral(model, lp.x):
        x = _rounded(model, lp.x)
        objective = model.objective_value(x)
        status = _within(relative_gap(objective, lp.bound))
        return _result(model, st.name, st.passes, status, x, objective, lp.bound, lp_was_integral=True)
    sub, full, keep = model.restricted(~found.active, np.zeros(model.n_cols))
    sub_st = _Solve(sub, st.options, st.name, st.run, _remaining(st.opts, st.started), perf_counter(), st.passes)
    sub_st.lp_bound = lp.bound
    try:
        point = _completions(sub_st, lp.x[keep], _sub_rounding(rounding, full, keep), None)
        if point is None:  # no plan over the priced columns within the gap: look past them
            if (whole := _completions(st, lp.x, rounding, None)) is not None:
                return whole
            if st.best is not None and (sub_st.best is None or st.best[1] < sub_st.best[1]):
                sub, full, keep = model.restricted(~(found.active | (st.best[0] != 0)), np.zeros(model.n_cols))
                sub_st = replace(sub_st, model=sub, best=(st.best[0][keep], st.best[1]))
            point = _mip(sub_st)
    except (InfeasibleError, SolverTimeoutError):
        return None
    if point.status not in (SolveStatus.OPTIMAL, SolveStatus.FEASIBLE):
        return None
    x = full.copy()
    x[keep] = point.x
    objective = model.objective_value(x)
    gap = relative_gap(objective, lp.bound)
    stop = ""  # short of the gap, the MIP over the columns kept ended: at its limit, or at their optimum
    if gap > max(st.options.mip_rel_gap, OPTIMALITY_GAP):
        stop = point.stop or STOP_RESTRICTED
    return _result(model, st.name, st.passes, _within(gap), x, objective, lp.bound, stop=stop)


def _sub_rounding(
    rounding: Callable[[np.ndarray], np.ndarray] | None, full: np.ndarray, keep: np.ndarray
) -> Callable[[np.ndarray], np.ndarray] | None:
    """``rounding`` for a restricted model (``LinearModel.restricted``'s ``full`` point and ``keep``
    mask): its columns written into the whole point, rounded, and read back."""
    if rounding is None:
        return None

    def round_sub(xs: np.ndarray) -> np.ndarray:
        x = full.copy()
        x[keep] = xs
        return rounding(x)[keep]

    return round_sub


def _mip(st: _Solve) -> SolveResult:
    """The whole MIP within what is left of the time limit, from the best point found (if any).

    From a feasible point and with no time limit, the search gets ``improve_s`` seconds: a bound
    that cannot reach ``mip_rel_gap`` (a relaxation weaker than that, as memory rows make it) would
    otherwise hold the plan back without end, where the point and its measured gap are the answer.
    That search skips presolve's probing, as the completions do: from a good point, probing the
    binaries costs HiGHS much of its time and rarely changes the plan."""
    mip_opts = _remaining(st.opts, st.started)
    if st.best is not None:
        limit = st.options.improve_s if mip_opts.time_limit is None else mip_opts.time_limit
        mip_opts = replace(mip_opts, start=st.best[0], time_limit=limit, probing=False)
    st.passes.append(st.run(st.model, True, mip_opts))
    return _finish(st.model, st.name, st.run, st.opts, st.passes, st.lp_bound, st.best, st.options.diagnose)


def _whole(
    options: SolveOptions,
    sub: LinearModel,
    round_sub: Callable[[np.ndarray], np.ndarray] | None,
    limit: float | None,
    sub_start: np.ndarray | None = None,
) -> SolveResult:
    """``solve`` of ``_screened``'s smaller model ``sub`` within ``limit`` seconds, undiagnosed (its
    failure has a fallback), keeping ``sub_start`` when it is good enough."""
    sub_opts = replace(options, time_limit=limit, diagnose=False, keep_start=sub_start is not None)
    return solve(sub, sub_opts, rounding=round_sub, start=sub_start)


def _screened(
    model: LinearModel,
    screen: Screen,
    whole: Callable[[LinearModel, Callable | None, float | None, np.ndarray | None], SolveResult],
    rounding: Callable[[np.ndarray], np.ndarray] | None,
    time_limit: float | None,
    backend: str,
    point: tuple[np.ndarray, float] | None = None,
) -> SolveResult | None:
    """Solve ``model`` without the columns ``screen`` rules out under a limit: ``point``'s objective
    (a feasible point), else ``SCREEN_MARGIN`` above the screen's bound. A point found under the
    limit proves the screen sound: the optimum is no higher, so no column left out could be in
    it. A point above becomes the limit of one more screened solve, sound by that point; the
    point a limit comes from starts its solve. When a solve finds nothing in time, the best point
    known stands with the screen's own bound; ``None`` (the caller solves the whole model) when
    there is none, or the screen has no finite bound."""
    started = perf_counter()
    bound, off = screening(model, screen.y, screen.unit)
    if not math.isfinite(bound):
        return None
    limit, best = (point[1], point) if point is not None else (bound + SCREEN_MARGIN * abs(bound), None)
    for _ in range(2):
        sub, full, keep = model.restricted(off(limit), np.zeros(model.n_cols))
        sub_start = None
        if best is not None:
            if np.any(best[0][~keep] != full[~keep]):  # a column of the point left out, at the tolerance's edge
                return None
            sub_start = best[0][keep]
        left = None if time_limit is None else max(time_limit - (perf_counter() - started), 0.0)
        stop = STOP_RESTRICTED
        try:
            found = whole(sub, _sub_rounding(rounding, full, keep), left, sub_start)
        except InfeasibleError:
            found = None
        except SolverTimeoutError:
            found, stop = None, STOP_TIME_LIMIT
        if found is None or found.status not in (SolveStatus.OPTIMAL, SolveStatus.FEASIBLE):
            if best is None:
                return None
            return _result(model, backend, [], _within(relative_gap(best[1], bound)), *best, bound, stop=stop)
        x = full.copy()
        x[keep] = found.x
        objective = model.objective_value(x)
        if best is None or objective < best[1]:
            best = (x, objective)
        if objective <= limit + 1e-9 * max(1.0, abs(limit)) or limit == best[1]:
            x, objective = best
            gap = relative_gap(objective, found.bound)
            return replace(
                found,
                status=_within(gap),
                objective=objective,
                gap=gap,
                x=x,
                solve_time=perf_counter() - started - found.build_time,
                n_vars=model.n_cols,
                n_rows=model.n_rows,
                n_nonzeros=model.n_nonzeros,
                n_integer=model.n_integer,
            )
        limit = objective  # a point of the whole model: the next screen is sound by it
    return None
