"""The placement ILP on hand-built problems: dominated strategies, edges, constraints."""

import numpy as np
import torch.fx as fx
from conftest import fake_mesh

from autoplan.solve.ilp import BudgetRow, FixedRows, solve_placement, undominated
from autoplan.solve.problem import EdgeGroup, PlacementProblem, _changes
from autoplan.trace.clustering import Clustering


def two_units(cost_a, cost_b, edge_cost, src_label, dst_label):
    g = fx.Graph()
    a, b = g.placeholder("a"), g.placeholder("b")
    edge = EdgeGroup(
        a,
        b,
        np.array(src_label),
        np.array(dst_label),
        np.array(edge_cost, dtype=float),
        (np.array(edge_cost) > 0).astype(float),
    )
    problem = PlacementProblem(
        units=[a, b],
        strategies={},
        unit_cost={a: np.array(cost_a, dtype=float), b: np.array(cost_b, dtype=float)},
        forbidden={a: ~np.isfinite(cost_a), b: ~np.isfinite(cost_b)},
        edges=[edge],
        root={},
        clustering=Clustering({}, {}, (), {}),
    )
    return problem, a, b


def test_dominated_and_impossible_strategies_get_no_variable():
    # a's strategies 0 and 1 look identical to the edge (label 0): only the cheaper one is kept;
    # strategy 3 is impossible (infinite folded cost)
    problem, a, b = two_units([3.0, 1.0, 2.0, np.inf], [0.0, 0.0], [[0.0, 5.0], [5.0, 0.0]], [0, 0, 1, 1], [0, 1])
    kept = undominated(problem, [], [])
    assert kept[a].tolist() == [1, 2] and kept[b].tolist() == [0, 1]
    solved = solve_placement(problem, [], [])
    assert solved.choice == {a: 1, b: 0} and solved.n_dropped == 2
    assert np.isclose(solved.objective_without_tie_break, 1.0)


def test_constraints_keep_strategies_they_distinguish():
    # same labels and costs: one copy suffices, unless a pin allows only the other one
    problem, a, b = two_units([1.0, 1.0], [0.0, 0.0], [[0.0, 4.0], [4.0, 0.0]], [0, 0], [0, 1])
    assert undominated(problem, [], [])[a].tolist() == [0]
    pin = FixedRows("pin a", ((a, (1,)),))
    assert undominated(problem, [pin], [])[a].tolist() == [0, 1]
    assert solve_placement(problem, [pin], []).choice[a] == 1
    budget = BudgetRow(
        "budget", ((a, np.array([2.0, 1.0]) * 2**20),), 1.5 * 2**20
    )  # MiB-sized, as budget rows are counted
    assert undominated(problem, [], [budget])[a].tolist() == [0, 1]
    solved = solve_placement(problem, [], [budget])
    assert solved.choice[a] == 1  # the only strategy within budget


def test_the_least_value_of_a_linear_sums_each_units_least_choice():
    """The rows ``w >= least * r`` price a fractional recompute option only if ``least`` is the true
    minimum; clamping it at zero made them no-ops."""
    from autoplan.solve.ilp import _terms
    from autoplan.solve.problem import Linear

    g = fx.Graph()
    a, b = g.placeholder("a"), g.placeholder("b")
    lin = Linear()
    lin.add_unit(a, np.array([3.0, 5.0, 4.0]))
    lin.add_unit(b, np.array([2.0, 7.0]))
    kept = {a: np.array([0, 1, 2]), b: np.array([1])}
    _, vals, top, bottom = _terms(lin, {a: 0, b: 3}, kept, {})
    assert list(vals) == [3.0, 5.0, 4.0, 7.0]
    assert (top, bottom) == (12.0, 10.0)


def test_the_tie_break_marks_exactly_the_pairs_whose_placements_differ():
    """Found by the cost model's numbers, not by comparing every pair: equal placements at
    different positions on the two sides (as distinct objects, and one a list), and placements
    present on one side only."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    from autoplan.cost.costs import CostModel

    srcs = [(Shard(0), Replicate()), (Replicate(), Replicate()), (Partial(), Shard(1))]
    dsts = [[Replicate(), Replicate()], (Shard(1), Shard(1)), (Shard(0), Replicate())]
    expected = np.array([[float(tuple(o) != tuple(q)) for q in dsts] for o in srcs])
    changes = _changes(srcs, dsts, CostModel(fake_mesh((2, 2))))
    np.testing.assert_array_equal(changes, expected)
    assert changes.sum() == 7
