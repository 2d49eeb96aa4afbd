"""Tests for the solvers package: model building, both backends, LP-first, diagnosis, limits."""

import dataclasses
import importlib
import itertools
import json
import math
import warnings

import numpy as np
import pulp
import pytest

from solvers import (
    STOP_TIME_LIMIT,
    InfeasibleError,
    ModelBuilder,
    SolverTimeoutError,
    SolveStatus,
    solve,
    to_pulp,
)
from solvers.highs_backend import solve_highs
from solvers.pulp_backend import solve_cbc
from solvers.result import SolveOptions, SolverOptions

BACKENDS = ["highs", "cbc"]

# 4 items x 3 choices; each choice may take at most 2 items (a transportation problem: LP is integral).
ASSIGN_COST = np.array([[4.0, 1.0, 3.0], [2.0, 0.0, 5.0], [3.0, 2.0, 2.0], [1.0, 3.0, 6.0]])
CAPACITY = 2

KNAP_VALUE = np.array([10.0, 13.0, 7.0, 8.0, 9.0])
KNAP_WEIGHT = np.array([3.0, 4.0, 2.0, 3.0, 3.0])
KNAP_CAP = 7.0


def assignment_model(constant: float = 0.0):
    n_items, n_choices = ASSIGN_COST.shape
    b = ModelBuilder("assignment")
    x = b.add_vars(ASSIGN_COST.size, cost=ASSIGN_COST.ravel()).reshape(n_items, n_choices)
    b.add_rows(np.repeat(np.arange(n_items), n_choices), x.ravel(), 1.0, 1.0, 1.0, group="one_hot")
    b.add_rows(np.tile(np.arange(n_choices), n_items), x.ravel(), 1.0, -np.inf, CAPACITY, group="capacity")
    b.add_constant(constant)
    return b.build()


def assignment_brute_force() -> float:
    n_items, n_choices = ASSIGN_COST.shape
    best = math.inf
    for choice in itertools.product(range(n_choices), repeat=n_items):
        if max(choice.count(s) for s in range(n_choices)) <= CAPACITY:
            best = min(best, sum(ASSIGN_COST[v, s] for v, s in enumerate(choice)))
    return best


def knapsack_model():
    b = ModelBuilder("knapsack")
    x = b.add_vars(len(KNAP_VALUE), cost=-KNAP_VALUE)
    b.add_rows(np.zeros(len(x), dtype=int), x, KNAP_WEIGHT, -np.inf, KNAP_CAP)
    return b.build()


def knapsack_brute_force() -> float:
    best = 0.0
    for pick in itertools.product([0, 1], repeat=len(KNAP_VALUE)):
        if np.dot(pick, KNAP_WEIGHT) <= KNAP_CAP:
            best = max(best, float(np.dot(pick, KNAP_VALUE)))
    return -best


def multi_knapsack(n: int = 200, k: int = 10, seed: int = 0):
    """A multi-dimensional knapsack HiGHS needs well over a second to close."""
    rng = np.random.default_rng(seed)
    w = rng.integers(10, 100, size=(k, n)).astype(float)
    b = ModelBuilder("mkp")
    x = b.add_vars(n, cost=-rng.integers(10, 100, size=n).astype(float))
    b.add_rows(np.repeat(np.arange(k), n), np.tile(x, k), w.ravel(), -np.inf, w.sum(1) / 4)
    return b.build(), w


@pytest.mark.parametrize("backend", BACKENDS)
def test_assignment_matches_brute_force_and_lp_is_integral(backend):
    res = solve(assignment_model(), backend=backend)
    assert res.status is SolveStatus.OPTIMAL
    assert res.objective == pytest.approx(assignment_brute_force())
    assert res.lp_was_integral
    assert res.gap == 0.0
    assert res.bound == pytest.approx(res.objective)
    x = res.x.reshape(ASSIGN_COST.shape)
    assert set(np.unique(x)) <= {0.0, 1.0}
    assert (x.sum(axis=1) == 1).all() and (x.sum(axis=0) <= CAPACITY).all()
    assert res.backend == backend
    assert (res.n_vars, res.n_rows, res.n_nonzeros, res.n_integer) == (12, 7, 24, 12)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fractional_lp_falls_back_to_mip(backend):
    res = solve(knapsack_model(), backend=backend)
    assert res.status is SolveStatus.OPTIMAL
    assert not res.lp_was_integral
    assert res.objective == pytest.approx(knapsack_brute_force())
    assert res.gap <= 1e-6
    assert set(np.unique(res.x)) <= {0.0, 1.0}


@pytest.mark.parametrize("backend", BACKENDS)
def test_mip_start_is_the_incumbent_when_time_runs_out(backend):
    """A feasible start (e.g. the previous plan) is what a search stopped at once still returns."""
    run = {"highs": solve_highs, "cbc": solve_cbc}[backend]
    model, _ = multi_knapsack()
    start = np.zeros(model.n_cols)
    start[:3] = 1.0
    assert run(model, True, SolverOptions(time_limit=0.0)).status is SolveStatus.NO_SOLUTION
    seeded = run(model, True, SolverOptions(time_limit=0.0, start=start))
    assert seeded.status is SolveStatus.FEASIBLE
    assert model.objective_value(seeded.x) <= model.objective_value(start)


def test_without_a_time_limit_the_mip_improves_a_found_point_for_improve_s_only(monkeypatch):
    """A MIP that cannot close its gap stops after ``improve_s`` with the best point, reported
    feasible with its gap, rather than searching on without end (the closed search is optimal).
    Searching from a point, it skips presolve's probing."""
    solve_module = importlib.import_module("solvers.solve")
    runs = []
    real = solve_module._BACKENDS["highs"]
    monkeypatch.setitem(solve_module._BACKENDS, "highs", lambda m, i, o: runs.append(o) or real(m, i, o))
    model, _ = multi_knapsack()
    start = np.zeros(model.n_cols)
    start[:3] = 1.0
    stopped = solve(model, start=start, improve_s=0.0)
    assert stopped.status is SolveStatus.FEASIBLE and stopped.gap > 1e-4
    assert stopped.stop == STOP_TIME_LIMIT  # what ended it, for the planner's warning
    assert stopped.objective <= model.objective_value(start)
    assert runs[-1].start is not None and runs[-1].time_limit == 0.0 and not runs[-1].probing
    closed = solve(model, start=start)
    assert closed.status is SolveStatus.OPTIMAL and closed.gap <= 1e-6 and closed.stop == ""
    assert closed.objective <= stopped.objective
    assert runs[-1].time_limit == SolveOptions.improve_s


@pytest.mark.parametrize("backend", BACKENDS)
def test_start_is_completed_and_never_beaten_by_a_worse_answer(backend):
    model, _ = multi_knapsack(n=60, k=4)
    start = np.zeros(model.n_cols)
    start[:3] = 1.0
    res = solve(model, backend=backend, start=start)
    assert res.status is SolveStatus.OPTIMAL and res.objective <= model.objective_value(start)
    assert res.objective == pytest.approx(solve(model, backend=backend).objective)


def test_a_start_never_overrides_a_column_bound():
    """A guess below a binary's lower bound (an option the user forced on) is completed with the
    bound kept: the answer is never the cheaper point the bound forbids."""
    b = ModelBuilder("placement")
    x = b.add_vars(3, cost=[1.0, -1.0, -1.0], lb=[1.0, 0.0, 0.0])  # x0 is forced on and costs
    b.add_rows([0, 0], x[1:], [2.0, 2.0], -np.inf, 3.0)  # the LP takes x2 = 0.5: fractional
    res = solve(b.build(), start=np.array([0.0, 1.0, 0.0]))
    assert res.x[0] == 1.0 and res.objective == 0.0


def test_infeasibility_without_diagnosis_names_every_group():
    with pytest.raises(InfeasibleError) as err:
        solve(conflicting_model(), diagnose=False)
    assert set(err.value.groups) == set(conflicting_model().groups) and "not diagnosed" in str(err.value)


def test_without_lp_first_the_mip_is_solved_directly():
    res = solve(assignment_model(), lp_first=False)
    assert res.status is SolveStatus.OPTIMAL and not res.lp_was_integral
    assert res.objective == pytest.approx(assignment_brute_force())


def test_continuous_model_is_one_lp_solve():
    b = ModelBuilder("lp")
    x = b.add_vars(2, cost=[1.0, 2.0], ub=np.inf, integer=False)
    b.add_rows([0, 0], x, [1.0, 1.0], 1.5, np.inf)
    res = solve(b.build())
    assert res.status is SolveStatus.OPTIMAL
    np.testing.assert_allclose(res.x, [1.5, 0.0])
    assert res.objective == pytest.approx(1.5)


def conflicting_model():
    b = ModelBuilder("placement")
    x = b.add_vars(2)
    b.add_rows([0, 0], x, [1.0, 1.0], -np.inf, 2.0)  # structural, harmless
    b.add_rows([0], [x[0]], [1.0], 1.0, np.inf, group="a")
    b.add_rows([0], [x[1]], [1.0], -np.inf, 1.0, group="c")
    b.add_rows([0], [x[0]], [1.0], -np.inf, 0.0, group="b")
    return b.build()


@pytest.mark.parametrize("backend", BACKENDS)
def test_infeasibility_names_minimal_conflicting_groups(backend):
    with pytest.raises(InfeasibleError) as err:
        solve(conflicting_model(), backend=backend)
    assert err.value.groups == ["a", "b"]
    assert str(err.value) == "The placement problem is infeasible. Conflicting constraints: a, b"


def test_integer_only_infeasibility_is_diagnosed_on_the_mip():
    b = ModelBuilder("placement")
    x = b.add_vars(2)
    b.add_rows([0], [x[1]], [1.0], 0.0, 1.0, group="harmless")
    b.add_rows([0], [x[0]], [2.0], 1.0, 1.0, group="parity")  # LP-feasible at x0 = 0.5 only
    for lp_first in (True, False):
        with pytest.raises(InfeasibleError) as err:
            solve(b.build(), lp_first=lp_first)
        assert err.value.groups == ["parity"]


def test_structural_infeasibility_reports_no_groups():
    b = ModelBuilder("placement")
    x = b.add_vars(2)
    b.add_rows([0, 0], x, [1.0, 1.0], 3.0, np.inf)
    b.add_rows([0], [x[0]], [1.0], 0.0, 1.0, group="a")
    with pytest.raises(InfeasibleError) as err:
        solve(b.build())
    assert err.value.groups == []
    assert "structural" in str(err.value)


def test_to_pulp_shape_and_cbc_agrees_with_highs():
    b = ModelBuilder("shape")
    x = b.add_vars(4, cost=[3.0, -1.0, 2.0, -2.0], names=["a", "b c", "d-e", "b c"])
    b.add_vars(1, cost=0.0)  # used nowhere, but must still be a PuLP variable
    b.add_rows([0, 0, 1, 1, 2, 2], [x[0], x[1], x[1], x[2], x[2], x[3]], 1.0, [1.0, -np.inf, 0.5], [1.0, 1.0, 1.5])
    b.add_rows([0], [x[3]], [1.0], -np.inf, np.inf, names=["free"])
    model = b.build()
    prob = to_pulp(model)
    assert len(prob.variables()) == 5
    # equality + one-sided + ranged (split in two) rows; the free row is dropped
    assert prob.numConstraints() == 4
    assert {v.name for v in prob.variables()} == {"a", "b_c", "d_e", "b_c_", "x4"}
    with warnings.catch_warnings():  # PuLP 3.3 marks its bundled CBC as deprecated
        warnings.simplefilter("ignore", DeprecationWarning)
        cbc = pulp.PULP_CBC_CMD(msg=False)
    prob.solve(cbc)
    highs = solve(model, backend="highs")
    assert pulp.value(prob.objective) == pytest.approx(highs.objective)


def test_duplicates_summed_scalars_broadcast_constant_in_objective():
    b = ModelBuilder("m")
    x = b.add_vars(3, cost=1.0)
    rows = b.add_rows([0, 0, 1, 1], [x[1], x[1], x[0], x[2]], [2.0, 3.0, 1.0, 1.0], 1.0, np.inf)
    np.testing.assert_array_equal(rows, [0, 1])
    b.add_constant(10.0)
    b.add_constant(0.5)
    m = b.build()
    np.testing.assert_array_equal(m.row_lo, [1.0, 1.0])
    np.testing.assert_array_equal(m.row_hi, [np.inf, np.inf])
    np.testing.assert_array_equal(m.csr_col[m.csr_start[0] : m.csr_start[1]], [1])
    np.testing.assert_array_equal(m.csr_val[m.csr_start[0] : m.csr_start[1]], [5.0])
    assert m.n_nonzeros == 3
    assert not m.cost.flags.writeable
    for backend in BACKENDS:
        res = solve(m, backend=backend)
        assert res.objective == pytest.approx(12.5)  # x1 = 1 and one of x0, x2
        assert res.bound == pytest.approx(12.5)


def test_constant_enters_objective_and_bound_of_a_mip():
    res = solve(assignment_model(constant=100.0), lp_first=False)
    assert res.objective == pytest.approx(assignment_brute_force() + 100.0)
    assert res.bound == pytest.approx(res.objective)


def test_add_rows_validates_ids():
    b = ModelBuilder()
    x = b.add_vars(2)
    with pytest.raises(ValueError):
        b.add_rows([0], [x[1] + 1], [1.0], 0.0, 1.0)
    with pytest.raises(ValueError):
        b.add_rows([2], [x[0]], [1.0], [0.0, 0.0], [1.0, 1.0])


def test_time_limit_stops_with_incumbent_or_raises():
    model, w = multi_knapsack()
    try:
        res = solve(model, time_limit=0.05)
    except SolverTimeoutError as err:
        assert err.time_limit == 0.05 and err.backend == "highs"
        assert "0.05" in str(err) and "highs" in str(err)
        return
    assert res.status is SolveStatus.FEASIBLE
    assert res.bound <= res.objective and res.gap > 0
    assert res.gap == pytest.approx(abs(res.objective - res.bound) / abs(res.objective))
    assert set(np.unique(res.x)) <= {0.0, 1.0}
    assert (w @ res.x <= w.sum(1) / 4 + 1e-9).all()
    assert res.objective == pytest.approx(model.objective_value(res.x))


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_time_limit_raises_timeout(backend):
    model, _ = multi_knapsack()
    with pytest.raises(SolverTimeoutError, match=backend):
        solve(model, backend=backend, time_limit=0.0)


def test_deterministic_and_thread_count_can_change():
    model = knapsack_model()
    first = solve(model, threads=1, lp_first=False)
    second = solve(model, threads=2, lp_first=False)
    np.testing.assert_array_equal(first.x, second.x)
    assert first.objective == second.objective


def test_to_dict_is_json_friendly():
    res = solve(knapsack_model())
    d = json.loads(json.dumps(res.to_dict()))
    assert d["status"] == "optimal" and d["backend"] == "highs"
    assert d["x"] == res.x.tolist()


def test_auto_backend_and_unknown_backend():
    assert solve(knapsack_model(), backend="auto").backend == "highs"
    with pytest.raises(ValueError):
        solve(knapsack_model(), backend="gurobi")


def test_a_start_equal_to_the_rounding_is_completed_once(monkeypatch):
    """A re-solve's start is often the LP's rounding: each guess is a solve, so a repeat is skipped."""
    solve_module = importlib.import_module("solvers.solve")  # the package exports a function of that name
    runs = []
    real = solve_module._BACKENDS["highs"]
    monkeypatch.setitem(solve_module._BACKENDS, "highs", lambda *a: runs.append(a[1]) or real(*a))
    model, _ = multi_knapsack(n=60, k=4)
    guess = np.zeros(model.n_cols)
    guess[:3] = 1.0
    other = np.zeros(model.n_cols)
    other[3:6] = 1.0
    counts = []
    for start in (guess.copy(), other):
        runs.clear()
        res = solve(model, rounding=lambda x: guess, start=start)
        assert res.objective <= min(model.objective_value(guess), model.objective_value(other))
        counts.append(len(runs))
    assert counts[1] == counts[0] + 1


def test_the_relaxation_runs_without_presolve_and_the_mip_with_it(monkeypatch):
    """HiGHS's presolve costs more than it saves on placement LPs; the MIP search keeps it."""
    solve_module = importlib.import_module("solvers.solve")
    runs = []
    real = solve_module._BACKENDS["highs"]
    monkeypatch.setitem(solve_module._BACKENDS, "highs", lambda m, i, o: runs.append((i, o.presolve)) or real(m, i, o))
    res = solve(knapsack_model())
    assert res.objective == pytest.approx(knapsack_brute_force())
    assert runs[0] == (False, False) and runs[-1] == (True, True)


def test_a_mip_without_probing_switches_off_probing_and_finds_the_same_optimum(capfd):
    """The presolve rule bit switched off is the one this HiGHS names Probing (rule numbers differ
    between HiGHS versions; its log lists the rules switched off), and the optimum is unchanged."""
    for probing in (True, False):
        raw = solve_highs(knapsack_model(), True, SolverOptions(probing=probing, verbose=not probing))
        assert raw.status is SolveStatus.OPTIMAL
        assert raw.bound == pytest.approx(knapsack_brute_force())
    log = capfd.readouterr().out
    switched = log[log.index("Presolve rules switched off") :].splitlines()[1]
    assert switched.strip().endswith("Probing"), switched


def test_a_neighbourhood_mip_around_the_fractional_columns_spares_the_full_search(monkeypatch):
    """Independent knapsacks: the LP leaves one item of each tight block fractional (one block in
    five: the neighbourhood stays within ``NEIGHBOURHOOD_MAX_FREE``). Freeing the columns that
    share a row with those (the rest fixed at the LP's values) already gives a plan within the
    gap, so the full MIP never runs."""
    solve_module = importlib.import_module("solvers.solve")
    free_counts, probed = [], []
    real = solve_module._BACKENDS["highs"]

    def counting(m, integral, o):
        if integral:
            free_counts.append(int(np.count_nonzero(m.integer & (m.col_lb != m.col_ub))))
            probed.append(o.probing)
        return real(m, integral, o)

    monkeypatch.setitem(solve_module._BACKENDS, "highs", counting)
    rng = np.random.default_rng(4)
    blocks, items = 30, 6
    b = ModelBuilder("blocks")
    x = b.add_vars(blocks * items, cost=-rng.integers(10, 100, size=blocks * items).astype(float))
    weights = rng.integers(10, 60, size=(blocks, items)).astype(float)
    for k in range(blocks):
        cap = weights[k].sum() / (1 if k % 5 else 2)  # the other blocks take all their items: integral
        b.add_rows(np.zeros(items, np.int64), x[k * items : (k + 1) * items], weights[k], -np.inf, cap)
    model = b.build()
    # the optimum is 1.8% above the LP bound; the LP with its fractional items dropped 3.8%
    res = solve(model, mip_rel_gap=0.025)
    assert res.gap <= 0.025 and res.status is SolveStatus.FEASIBLE
    assert free_counts and all(0 < c < model.n_integer for c in free_counts)
    assert not any(probed)  # HiGHS's probing is most of a small neighbourhood MIP's time
    exact = solve(model, lp_first=False, mip_rel_gap=1e-9).objective
    assert res.objective - exact <= 0.025 * abs(exact)


def test_a_start_within_the_gap_stands_and_one_outside_it_gives_way(monkeypatch):
    """A re-solve starts from the plan it may improve (``keep_start``): when the LP bound shows the
    start within ``mip_rel_gap`` it is kept after one completion (no rounding tried, no change of
    plan); a start outside the gap gives way to the rounding's better point. Without
    ``keep_start`` a start within the gap still loses to a better rounding."""
    solve_module = importlib.import_module("solvers.solve")
    runs = []
    real = solve_module._BACKENDS["highs"]
    monkeypatch.setitem(solve_module._BACKENDS, "highs", lambda *a: runs.append(a[1]) or real(*a))
    model, _ = multi_knapsack(n=60, k=4)
    best = solve(model, mip_rel_gap=1e-9).x
    poor = np.zeros(model.n_cols)
    poor[:3] = 1.0
    runs.clear()
    kept = solve(model, rounding=lambda x: poor, start=best, mip_rel_gap=0.05, keep_start=True)
    assert runs == [False, False]  # the relaxation, then the start's completion only
    np.testing.assert_array_equal(kept.x, best)
    runs.clear()
    replaced = solve(model, rounding=lambda x: best, start=poor, mip_rel_gap=0.05, keep_start=True)
    assert len(runs) == 3 and replaced.objective == pytest.approx(model.objective_value(best))
    near = best.copy()
    near[np.flatnonzero(best)[0]] = 0.0  # the optimum less one item: within 6% of the bound
    kept = solve(model, rounding=lambda x: best, start=near, mip_rel_gap=0.06, keep_start=True)
    assert kept.objective == pytest.approx(model.objective_value(near))
    assert model.objective_value(near) > model.objective_value(best)
    # without ``keep_start`` (a user's start, a capped plan's polish) the rounding is tried too
    tried = solve(model, rounding=lambda x: best, start=near, mip_rel_gap=0.06)
    assert tried.objective == pytest.approx(model.objective_value(best))


def _pairwise_model(seed: int = 0, pin: bool = True, budget: float | None = 5.0):
    """A placement-like model: 4 units of 3 binary choices, a chain of 3 edges priced by pair
    (continuous pair columns held to the product by marginal rows), a pin and a weight budget."""
    rng = np.random.default_rng(seed)
    b = ModelBuilder("pairwise")
    x = b.add_vars(12, cost=rng.uniform(0, 10, 12)).reshape(4, 3)
    b.add_rows(np.repeat(np.arange(4), 3), x.ravel(), 1.0, 1.0, 1.0)
    for u in range(3):
        e = b.add_vars(9, cost=rng.uniform(0, 10, 9), integer=False).reshape(3, 3)
        rows = np.r_[np.repeat(np.arange(3), 3), 3 + np.tile(np.arange(3), 3), np.arange(3), 3 + np.arange(3)]
        cols = np.r_[e.ravel(), e.ravel(), x[u], x[u + 1]]
        b.add_rows(rows, cols, np.r_[np.ones(18), -np.ones(6)], 0.0, 0.0)
    if pin:
        b.add_rows([0, 0], x[0, :2], 1.0, 1.0, 1.0, group="pin")
    if budget is not None:
        weight = np.array([1.0, 2.0, 4.0])
        b.add_rows(np.zeros(12, dtype=int), x.ravel(), np.tile(weight, 4), -np.inf, budget, group="budget")
    return b.build(), x


def _lp_duals(model):
    import highspy

    from solvers.highs_backend import _highs_lp

    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.passModel(_highs_lp(highspy, model))
    h.run()
    return h.getInfo().objective_function_value, np.asarray(h.getSolution().row_dual)


@pytest.mark.parametrize("seed", range(4))
def test_any_multipliers_bound_the_optimum_from_below_and_the_lps_reach_it(seed):
    from solvers.bound import lagrangian_bound

    model, _ = _pairwise_model(seed)
    optimum = solve(model, mip_rel_gap=1e-9).objective
    lp, duals = _lp_duals(model)
    assert lagrangian_bound(model, duals) == pytest.approx(lp, rel=1e-9)
    rng = np.random.default_rng(seed)
    for scale in (0.1, 1.0, 10.0, 100.0):
        for _ in range(20):
            y = rng.normal(0, scale, model.n_rows)
            assert lagrangian_bound(model, y) <= lp + 1e-9 * abs(lp)
    assert lp <= optimum + 1e-9


def test_tightening_holds_at_zero_only_what_no_feasible_point_uses():
    """Off the pin (unit 0 must take choice 0 or 1) and too heavy for the budget (weights 1, 2, 4
    against 5 over four units: a 4 leaves 1 for the other three, a 2 leaves 3): exactly what a
    brute force over all 81 choices never sets."""
    from solvers.bound import tightened

    model, x = _pairwise_model(pin=True, budget=5.0)
    closed = tightened(model).col_ub == 0
    weight = np.array([1.0, 2.0, 4.0])
    used = np.zeros(12, dtype=bool)
    for choice in itertools.product(range(3), repeat=4):
        if choice[0] < 2 and weight[list(choice)].sum() <= 5.0:
            used[[x[u, c] for u, c in enumerate(choice)]] = True
    assert not np.any(closed[:12] & used[x.ravel()])
    assert np.array_equal(closed[x.ravel()], ~used[x.ravel()])
    # pair columns whose choices are all held at 0 are held there too, and none a choice may use
    assert closed[12:].any() and (tightened(model).col_ub[12:] <= model.col_ub[12:]).all()


def test_tightening_leaves_a_balance_row_with_a_negative_column_alone():
    """``x0 + z - w = 0`` with ``z`` in [-1, 1] and ``w`` held at 0: ``x0`` may be 1 (``z = -1``), so
    neither it nor the bound may assume the row's positive side is 0."""
    from solvers.bound import lagrangian_bound, tightened

    b = ModelBuilder("balance")
    x = b.add_vars(2, cost=[-1.0, 0.0])
    z = b.add_vars(1, lb=-1.0, ub=1.0, integer=False)
    w = b.add_vars(1, lb=0.0, ub=0.0, integer=False)
    b.add_rows([0, 0], x, 1.0, 1.0, 1.0)
    b.add_rows([0, 0, 0], [x[0], z[0], w[0]], [1.0, 1.0, -1.0], 0.0, 0.0)
    model = b.build()
    assert solve(model).objective == pytest.approx(-1.0)
    held = tightened(model)
    assert held.col_ub[x[0]] == 1.0
    assert lagrangian_bound(held, np.zeros(model.n_rows)) <= -1.0


def test_a_start_the_certificate_covers_is_kept_without_the_lp(monkeypatch):
    """``certify`` (a bound worked out without the LP) given the completed start: within the gap,
    the start stands after its completion alone (none when the start sets every column feasibly);
    short of it, the LP runs as before."""
    solve_module = importlib.import_module("solvers.solve")
    runs = []
    real = solve_module._BACKENDS["highs"]
    monkeypatch.setitem(solve_module._BACKENDS, "highs", lambda *a: runs.append(a[1]) or real(*a))
    model, _ = _pairwise_model(seed=1)
    best = solve(model, mip_rel_gap=1e-9)
    seen = []

    def certify(x, objective):
        seen.append(objective)
        return objective * (1 - 0.005), np.zeros(model.n_rows)

    choices = np.where(model.integer, best.x, 0.0)  # the pair columns left for the completion
    runs.clear()
    kept = solve(model, start=choices, mip_rel_gap=0.01, keep_start=True, certify=certify)
    assert runs == [False] and seen == [pytest.approx(best.objective)]
    assert kept.status is SolveStatus.FEASIBLE and kept.gap == pytest.approx(0.005)
    np.testing.assert_array_equal(kept.x, best.x)
    runs.clear()
    assert solve(model, start=best.x, mip_rel_gap=0.01, keep_start=True, certify=certify).gap == kept.gap
    assert runs == []  # a whole feasible start is its own completion
    short = solve(model, start=choices, mip_rel_gap=0.001, keep_start=True, certify=certify)
    assert runs[:2] == [False, False] and short.objective == pytest.approx(best.objective)
    assert short.gap <= 0.001
    # a certificate that falls short where the LP's bound (6.0% under the optimum) does not: the
    # completed start stands after the LP, the rounding untried
    runs.clear()
    lp_kept = solve(
        model, start=choices, mip_rel_gap=0.1, keep_start=True, certify=lambda x, v: (v / 2, np.zeros(model.n_rows))
    )
    assert runs == [False, False] and lp_kept.objective == pytest.approx(best.objective)
    assert lp_kept.gap == pytest.approx(0.0602, abs=1e-4)


def test_neighbourhoods_grow_along_sparse_rows_not_through_a_dense_one():
    """A chain of pair rows under one row over every column (as an overlap budget spans a layer):
    stepping through the dense row would free everything at once; the neighbourhoods grow a few
    columns along the chain instead."""
    solve_module = importlib.import_module("solvers.solve")
    b = ModelBuilder("chain")
    x = b.add_vars(40)
    for i in range(39):
        b.add_rows([0, 0], [x[i], x[i + 1]], 1.0, -np.inf, 1.0)
    b.add_rows(np.zeros(40, dtype=int), x, 1.0, -np.inf, 20.0)
    model = b.build()
    first = np.zeros(40, dtype=bool)
    first[0] = True
    assert model.near(first, 2).all()
    assert np.flatnonzero(model.near(first, 2, widest=2)).tolist() == [0, 1, 2]
    rings = solve_module._neighbourhoods(model, first)
    # each ring reaches ``hops`` columns along the chain (every step goes through one pair row)
    expected = [[0]] + [list(range(h + 1)) for h in solve_module.NEIGHBOURHOOD_HOPS]
    assert [np.flatnonzero(r).tolist() for r in rings] == expected


def test_neighbourhoods_stop_before_freeing_more_than_their_share_of_the_integers():
    """A neighbourhood freeing a large share of the integer columns costs what the whole MIP does
    (which then runs on top): on a 20-column chain the rings of 1, 3 and 5 columns are tried, and
    the one of 7 (over a quarter) is left to the whole MIP."""
    solve_module = importlib.import_module("solvers.solve")
    b = ModelBuilder("chain")
    x = b.add_vars(20)
    for i in range(19):
        b.add_rows([0, 0], [x[i], x[i + 1]], 1.0, -np.inf, 1.0)
    model = b.build()
    first = np.zeros(20, dtype=bool)
    first[0] = True
    rings = solve_module._neighbourhoods(model, first)
    assert solve_module.NEIGHBOURHOOD_MAX_FREE == 0.25
    assert [int(r.sum()) for r in rings] == [1, 3, 5]


@pytest.mark.parametrize("seed", range(2))
def test_a_restricted_model_solves_as_the_model_with_those_columns_fixed(seed):
    """Fixed columns leave the model (their activity moves into the row bounds and the constant),
    with the pair columns their fixing closes: every choice of units 0 and 2, infeasible ones
    (off the pin, over the budget) included, gives the status, objective and point of the same
    model with those columns' bounds fixed."""
    model, x = _pairwise_model(seed, budget=7.0)
    fixed = np.zeros(model.n_cols, dtype=bool)
    fixed[x[[0, 2]].ravel()] = True
    outcomes = set()
    for a, c in itertools.product(range(3), repeat=2):
        values = np.zeros(model.n_cols)
        values[x[0, a]] = values[x[2, c]] = 1.0
        bounded = dataclasses.replace(
            model, col_lb=np.where(fixed, values, model.col_lb), col_ub=np.where(fixed, values, model.col_ub)
        )
        want = solve_highs(bounded, True, SolverOptions())
        sub, full, free = model.restricted(fixed, values)
        assert sub.n_cols < model.n_cols - fixed.sum()  # some pair columns closed too
        got = solve_highs(sub, True, SolverOptions())
        assert got.status is want.status
        outcomes.add(got.status)
        if want.status is SolveStatus.OPTIMAL:
            full[free] = got.x
            assert model.objective_value(full) == pytest.approx(got.bound) == pytest.approx(want.bound)
            assert np.allclose(full, want.x)
    assert outcomes == {SolveStatus.OPTIMAL, SolveStatus.INFEASIBLE}


def _pairwise_points(model, x):
    """Every integer point of ``_pairwise_model`` (pin and budget met): its objective and the
    columns it sets to 1, unit choices and edge pairs."""
    weight = np.array([1.0, 2.0, 4.0])
    out = []
    for choice in itertools.product(range(3), repeat=4):
        if choice[0] >= 2 or weight[list(choice)].sum() > 5.0:
            continue
        cols = [x[u, c] for u, c in enumerate(choice)] + [12 + 9 * u + 3 * choice[u] + choice[u + 1] for u in range(3)]
        out.append((float(model.cost[cols].sum()), cols))
    return out


def _unit_columns(model):
    """Unit choices and edge pairs: every integer point sets each of them to 0 or 1."""
    return np.ones(model.n_cols, dtype=bool)


@pytest.mark.parametrize("seed", range(4))
def test_a_screen_leaves_out_no_column_a_point_under_its_limit_uses(seed):
    """Reduced-cost fixing at any multipliers: whatever the limit, no integer point of objective
    at most it sets a column the screen leaves out; at the LP's duals and the optimum as limit,
    the screen does leave some out."""
    from solvers.bound import screening

    model, x = _pairwise_model(seed)
    points = _pairwise_points(model, x)
    optimum = min(v for v, _ in points)
    _, duals = _lp_duals(model)
    rng = np.random.default_rng(seed)
    left_out = 0
    for y in (np.zeros(model.n_rows), duals, rng.normal(0, 3, model.n_rows)):
        bound, off = screening(model, y, _unit_columns(model))
        assert bound <= optimum + 1e-9
        for limit in sorted({v for v, _ in points})[:6] + [optimum - 1.0]:
            cut = off(limit)
            assert not any(cut[cols].any() for v, cols in points if v <= limit)
        if y is duals:
            left_out = int(off(optimum).sum())
    assert left_out > 0


@pytest.mark.parametrize("margin", [0.25, 0.0, -0.3, -10.0])
def test_a_screened_solve_finds_the_optimum_whatever_its_first_limit(monkeypatch, margin):
    """A first limit above the optimum is sound as it is; below it, the screened model has a point
    only above the limit (which then becomes the limit of a second screen) or none (the whole
    model is solved): the optimum and a true bound every way, the LP on fewer columns where the
    screen left some out."""
    from solvers import Screen

    solve_module = importlib.import_module("solvers.solve")
    monkeypatch.setattr(solve_module, "SCREEN_MARGIN", margin)
    monkeypatch.setattr(solve_module, "_priced", lambda *a: None)  # the screen, not column generation
    real, runs = solve_module._BACKENDS["highs"], []
    monkeypatch.setitem(solve_module._BACKENDS, "highs", lambda m, *a: runs.append(m.n_cols) or real(m, *a))
    for seed in range(4):
        model, x = _pairwise_model(seed)
        optimum = min(v for v, _ in _pairwise_points(model, x))
        _, duals = _lp_duals(model)
        runs.clear()
        res = solve(model, mip_rel_gap=1e-9, screen=Screen(duals, _unit_columns(model)))
        assert res.objective == pytest.approx(optimum, abs=1e-9)
        assert res.bound <= optimum + 1e-9 and res.status is SolveStatus.OPTIMAL
        assert res.x.shape == (model.n_cols,) and model.objective_value(res.x) == pytest.approx(optimum)
        if margin >= 0:
            assert runs[0] < model.n_cols


def test_a_start_the_certificate_falls_short_of_is_screened_by_its_multipliers(monkeypatch):
    """A certificate that does not prove the start still gives multipliers: with a screen, the LP
    runs without the columns no point as good as the start can use (the start, a real point,
    makes the screen sound at once), and the solve ends at the optimum with a true bound."""
    from solvers import Screen

    solve_module = importlib.import_module("solvers.solve")
    real, runs = solve_module._BACKENDS["highs"], []
    monkeypatch.setitem(solve_module._BACKENDS, "highs", lambda m, *a: runs.append((a[0], m.n_cols)) or real(m, *a))
    for seed in range(4):
        model, x = _pairwise_model(seed)
        points = _pairwise_points(model, x)
        optimum = min(v for v, _ in points)
        worst = max(points)[1]  # the start: the costliest plan
        start = np.zeros(model.n_cols)
        start[worst] = 1.0
        _, duals = _lp_duals(model)
        runs.clear()
        res = solve(
            model,
            start=start,
            mip_rel_gap=1e-9,
            keep_start=True,
            certify=lambda x, v, duals=duals: (v - 1e3, duals),
            screen=Screen(None, _unit_columns(model)),
        )
        assert res.objective == pytest.approx(optimum, abs=1e-9) and res.bound <= optimum + 1e-9
        lps = [n for integral, n in runs if not integral]
        assert lps and lps[0] < model.n_cols


def test_a_screened_solve_keeps_the_point_it_found_when_the_next_screen_runs_out_of_time(monkeypatch):
    """A first limit just under the optimum: the first screened solve finds a point above it (the
    optimum itself), and the second screen, sound by that point, runs out of time. The point stands,
    with the screen's own bound, rather than a timeout."""
    from solvers import Screen, SolverTimeoutError
    from solvers.bound import screening

    solve_module = importlib.import_module("solvers.solve")
    model, x = _pairwise_model(0)
    optimum = min(v for v, _ in _pairwise_points(model, x))
    y, unit = np.zeros(model.n_rows), _unit_columns(model)
    bound, _ = screening(model, y, unit)
    monkeypatch.setattr(solve_module, "SCREEN_MARGIN", (optimum - 0.5 - bound) / abs(bound))
    monkeypatch.setattr(solve_module, "_priced", lambda *a: None)
    real, tries = solve_module._screened, []

    def screened(model, screen, whole, *rest):
        def flaky(*args):
            tries.append(1)
            if len(tries) == 2:
                raise SolverTimeoutError("out of time", 1.0, "highs")
            return whole(*args)

        return real(model, screen, flaky, *rest)

    monkeypatch.setattr(solve_module, "_screened", screened)
    res = solve(model, time_limit=5.0, mip_rel_gap=1e-9, screen=Screen(y, unit))
    assert len(tries) == 2
    assert res.objective == pytest.approx(optimum) and res.bound == pytest.approx(bound) and res.bound <= optimum


def test_a_screened_try_that_gives_up_leaves_the_whole_model_what_is_left_of_the_time_limit(monkeypatch):
    """The whole model's passes get the time limit less what the screened try took; a timeout
    still names the limit the caller gave."""
    import time

    from solvers import Screen, SolverTimeoutError

    solve_module = importlib.import_module("solvers.solve")
    model, x = _pairwise_model(0)
    optimum = min(v for v, _ in _pairwise_points(model, x))
    monkeypatch.setattr(solve_module, "_screened", lambda *a, **k: time.sleep(0.3))
    monkeypatch.setattr(solve_module, "_priced", lambda *a: None)
    real, limits = solve_module._BACKENDS["highs"], []
    monkeypatch.setitem(solve_module._BACKENDS, "highs", lambda m, i, o: limits.append(o.time_limit) or real(m, i, o))
    screen = Screen(np.zeros(model.n_rows), _unit_columns(model))
    assert solve(model, time_limit=10.0, mip_rel_gap=1e-9, screen=screen).objective == pytest.approx(optimum)
    assert limits and all(t <= 9.7 for t in limits)
    with pytest.raises(SolverTimeoutError, match="time limit of 0.2 s"):
        solve(model, time_limit=0.2, mip_rel_gap=1e-9, screen=screen)


def _chain_model(seed: int, units: int = 30, choices: int = 6, pin: bool = False):
    """``_pairwise_model`` at scale: a chain of ``units`` units of ``choices`` choices, each edge
    priced by pair as redistributions are (a pair of one placement costs little, a change much
    more); with ``pin``, two pins no plan can meet together (the first unit's choice 0, and the
    first edge without any pair leaving it)."""
    rng = np.random.default_rng(seed)
    b = ModelBuilder("chain")
    x = b.add_vars(units * choices, cost=rng.uniform(0, 10, units * choices)).reshape(units, choices)
    b.add_rows(np.repeat(np.arange(units), choices), x.ravel(), 1.0, 1.0, 1.0)
    n = choices
    for u in range(units - 1):
        pairs = [(o, q) for o in range(n) for q in range(n) if not (pin and u == 0 and o == 0)]
        o, q = np.array(pairs).T
        e = b.add_vars(
            len(pairs), cost=np.where(o == q, rng.uniform(0, 1, len(o)), rng.uniform(5, 50, len(o))), integer=False
        )
        rows = np.r_[o, n + q, np.arange(n), n + np.arange(n)]
        cols = np.r_[e, e, x[u], x[u + 1]]
        b.add_rows(rows, cols, np.r_[np.ones(2 * len(pairs)), -np.ones(2 * n)], 0.0, 0.0)
    if pin:
        b.add_rows([0], [x[0, 0]], 1.0, 1.0, 1.0, group="pin")
    return b.build(), x


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("first", ["cheapest", "none"])
def test_column_generation_reaches_the_whole_lp_over_few_columns(seed, first):
    """From each row's cheapest pair, or from none (every row on its artificial column), pricing
    adds the pair columns whose reduced cost is negative until none is: the LP optimum of the
    whole model, its point feasible there; from the cheapest pairs, over a small part of them."""
    from solvers.pricing import priced_lp

    model, _ = _chain_model(seed)
    whole, _ = _lp_duals(model)
    pool = ~model.integer
    start = np.zeros(model.n_cols, dtype=bool)
    if first == "cheapest":
        start[pool & (model.cost < 1.0)] = True
    found = priced_lp(model, pool, start, SolverOptions())
    assert found is not None and found.rounds > 1 and found.solution.status is SolveStatus.OPTIMAL
    assert found.solution.bound == pytest.approx(whole, rel=1e-9)
    assert model.objective_value(found.solution.x) == pytest.approx(whole, rel=1e-9)
    activity = model.activity(found.solution.x)
    assert np.all(activity >= model.row_lo - 1e-7) and np.all(activity <= model.row_hi + 1e-7)
    assert np.all(found.solution.x[~found.active] == 0)
    if first == "cheapest":
        assert (found.active & pool).sum() < 0.3 * pool.sum()


def test_column_generation_gives_up_where_the_artificials_stay():
    """A model no plan meets: the artificial columns stay in use, pricing says it cannot tell, and
    the solve falls back to the whole model, whose infeasibility names the pin."""
    from solvers import InfeasibleError, Screen
    from solvers.pricing import priced_lp

    model, _ = _chain_model(0, units=4, pin=True)
    assert priced_lp(model, ~model.integer, np.zeros(model.n_cols, dtype=bool), SolverOptions()) is None
    with pytest.raises(InfeasibleError) as err:
        solve(model, screen=Screen(np.zeros(model.n_rows), np.ones(model.n_cols, dtype=bool)))
    assert err.value.groups == ["pin"]


@pytest.mark.parametrize("seed", range(4))
def test_a_priced_solve_finds_the_optimum_with_a_true_bound(monkeypatch, seed):
    """Without a start, a screened model's LP is solved by column generation (the backend never
    gets the whole LP; a fractional point is completed by small MIPs) and the solve ends at the
    brute-force optimum, its bound at most that."""
    from solvers import Screen

    solve_module = importlib.import_module("solvers.solve")
    real, runs = solve_module._BACKENDS["highs"], []
    monkeypatch.setitem(solve_module._BACKENDS, "highs", lambda m, i, o: runs.append((m.n_cols, i)) or real(m, i, o))
    model, x = _pairwise_model(seed)
    optimum = min(v for v, _ in _pairwise_points(model, x))
    res = solve(model, mip_rel_gap=1e-9, screen=Screen(np.zeros(model.n_rows), _unit_columns(model)))
    assert res.objective == pytest.approx(optimum, abs=1e-9) and res.bound <= optimum + 1e-9
    assert res.x.shape == (model.n_cols,) and model.objective_value(res.x) == pytest.approx(optimum)
    assert (model.n_cols, False) not in runs  # the LP is priced; what runs on the side completes its point


def test_column_generation_stops_within_the_gap_it_is_given():
    """With ``within``, pricing stops at the first round whose point is within that fraction of
    Farley's bound: fewer rounds, a bound that still bounds the whole LP from below, and a point
    feasible in the whole model within the fraction of it."""
    from solvers.pricing import priced_lp
    from solvers.result import relative_gap

    model, _ = _chain_model(1, units=60)
    whole, _ = _lp_duals(model)
    pool = ~model.integer
    first = pool & (model.cost < 1.0)  # half the cheap pairs left out
    first[np.flatnonzero(first)[::2]] = False
    full = priced_lp(model, pool, first, SolverOptions())
    early = priced_lp(model, pool, first, SolverOptions(), within=0.2)
    assert early.rounds < full.rounds and early.solution.status is SolveStatus.FEASIBLE
    assert early.solution.bound <= whole + 1e-9 * abs(whole)
    objective = model.objective_value(early.solution.x)
    assert objective > whole and relative_gap(objective, early.solution.bound) <= 0.2
    activity = model.activity(early.solution.x)
    assert np.all(activity >= model.row_lo - 1e-7) and np.all(activity <= model.row_hi + 1e-7)


def test_a_priced_solve_completes_its_point_with_pair_columns_pricing_never_added():
    """The LP priced from each row's two cheapest pairs is fractional (half of each unit on the
    choice the budget allows once) and never needs the mixed pairs (0, 1) and (1, 0); the best
    plan uses one. The completion looks past the priced columns to find it, where a search over
    them alone ends at the (1, 1) plan, 6 dearer."""
    from solvers import Screen

    b = ModelBuilder("pool")
    x = b.add_vars(6, cost=[0.0, 10.0, 100.0] * 2).reshape(2, 3)
    pair = np.array([[0.0, 4.0, 3.0], [4.0, 0.0, 3.0], [3.0, 3.0, 0.0]])
    e = b.add_vars(9, cost=pair.ravel(), integer=False)
    o, q = np.divmod(np.arange(9), 3)
    b.add_rows(
        np.r_[o, 3 + q, np.arange(3), 3 + np.arange(3)],
        np.r_[e, e, x[0], x[1]],
        np.r_[np.ones(18), -np.ones(6)],
        0.0,
        0.0,
    )
    b.add_rows([0, 0], x[:, 0], 1.0, -np.inf, 1.0, group="budget")  # choice 0 for one unit only
    rest = b.add_vars(20, cost=np.tile([1.0, 2.0], 10)).reshape(10, 2)  # settled units: the fractional ones stay few
    b.add_rows(np.r_[0, 0, 0, 1, 1, 1, 2 + np.repeat(np.arange(10), 2)], np.r_[x.ravel(), rest.ravel()], 1.0, 1.0, 1.0)
    model = b.build()
    res = solve(model, mip_rel_gap=1e-9, screen=Screen(np.zeros(model.n_rows), _unit_columns(model)))
    assert res.objective == pytest.approx(10.0 + 4.0 + 10.0)
    assert {int(np.argmax(res.x[x[u]])) for u in range(2)} == {0, 1}
