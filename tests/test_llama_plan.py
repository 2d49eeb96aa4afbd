"""LLaMA-3 debug on a 2x4 mesh: plans are valid for DTensor, optimal against hand-written plans, and
the reduced ILP prices exactly what the expanded plan costs."""

import dataclasses
import math
import warnings

import numpy as np
import pytest
import torch
from conftest import fake_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.utils._pytree import tree_flatten, tree_unflatten

from autoplan import AutoParallel
from autoplan.adapters.dtensor import make_spec, propagate_output_placements, tensor_meta
from autoplan.bench.models.llama3 import LLAMA3_CONFIGS, Transformer
from autoplan.shard.strategies import _OWN_RULES

R, S0, S1, S2 = Replicate(), Shard(0), Shard(1), Shard(2)
BATCH, SEQ = 8, 16


def plan_llama(pins=(), memory_fraction=1 / 8, n_layers=2, **kwargs):
    """Plan LLaMA-3 debug with batch-sharded I/O, a parameter budget (or none) and optional pins."""
    mesh = fake_mesh((2, 4), ("dp", "tp"))
    with torch.device("meta"):
        model = Transformer(dataclasses.replace(LLAMA3_CONFIGS["debug"], n_layers=n_layers))
    with AutoParallel(model, mesh, input_fn=lambda: torch.randint(0, 256, (BATCH, SEQ)), **kwargs) as ap:
        ap.add_input_constraints([(S0, R)])
        ap.add_output_constraints([(S0, R)])
        if memory_fraction is not None:
            ap.add_memory_constraint(param_fraction=memory_fraction)
        for target, placements in pins:
            ap.add_node_constraint(target, placements)
        return ap.optimize_placement(), ap.traced, mesh


@pytest.fixture(scope="module")
def llama():
    return plan_llama()


def test_every_node_agrees_with_dtensor_propagation(llama):
    plan, traced, mesh = llama
    checked = 0
    for node in traced.gm.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        chosen = plan.nodes[node.name]
        if node.target in _OWN_RULES:  # DTensor has no rule to compare against
            continue
        flat, spec = tree_flatten((node.args, node.kwargs))
        placements = iter(chosen.inputs)
        flat = [
            make_spec(mesh, next(placements), tensor_meta(a.meta["val"])) if isinstance(a, torch.fx.Node) else a
            for a in flat
        ]
        args, kwargs = tree_unflatten(flat, spec)
        outs = propagate_output_placements(node.target, tuple(args), kwargs)
        expected = tuple(o for o in chosen.outputs)
        assert outs[: len(expected)] == expected, (node.name, node.target, chosen.inputs, outs, expected)
        checked += 1
    assert checked > 400


def test_reported_cost_is_the_expanded_cost(llama):
    """The ILP's objective is the expanded plan's cost but for one latency per bucket of a layer's
    parameter or gradient moves, which it leaves out (``CostModel.bucketed``)."""
    plan, _, _ = llama
    assert math.isclose(plan.ilp["objective"], plan.cost.total - plan.cost.bucket_latency, rel_tol=1e-9)


def test_a_3d_plan_costs_what_its_ilp_says_and_its_re_solves_keep_their_start():
    """LLaMA-3 debug (4 layers) on a (2, 2, 2) mesh: the reduced ILP's objective is the expanded
    plan's cost, and priced again from scratch it is the same; the boundary re-solves ran."""
    from autoplan.cost.costs import CostModel
    from autoplan.solve.evaluate import reprice

    mesh = fake_mesh((2, 2, 2), ("dp", "fsdp", "tp"))
    with torch.device("meta"):
        model = Transformer(dataclasses.replace(LLAMA3_CONFIGS["debug"], n_layers=4))
    with AutoParallel(model, mesh, input_fn=lambda: torch.randint(0, 256, (BATCH, SEQ))) as ap:
        ap.add_input_constraints([(S0, R, R)])
        ap.add_output_constraints([(S0, R, R)])
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # "reduced ILP objective ... differs from the expanded plan's cost"
            plan = ap.optimize_placement()
        again = reprice(ap.traced, plan, CostModel(mesh, ap.device_profile), ap._outputs)
    assert plan.mesh_shape == (2, 2, 2) and plan.solver["gap"] <= 0.01
    assert math.isclose(plan.ilp["objective"], plan.cost.total - plan.cost.bucket_latency, rel_tol=1e-9)
    assert math.isclose(again.cost.total, plan.cost.total, rel_tol=1e-9)
    assert [r["layers"] for r in plan.ilp["refinements"]] == [["layers.0"], ["layers.3"]]
    assert any(any(p != R for p in pl) for n in plan.nodes.values() for pl in n.outputs if pl is not None)


@pytest.mark.slow  # three plans of four layers: the reductions' exactness, checked in CI's slow set
def test_reductions_do_not_change_the_optimum():
    # four layers: two middle ones share decisions, the first and last are re-solved on their own
    plan, _, _ = plan_llama(memory_fraction=None, n_layers=4)
    unclustered, _, _ = plan_llama(memory_fraction=None, n_layers=4, cluster_layers=False)
    unmerged, _, _ = plan_llama(memory_fraction=None, n_layers=4, merge_followers=False)
    assert plan.ilp["n_clustered"] > 0 and plan.ilp["n_merged"] > 0
    assert unclustered.ilp["n_clustered"] == 0 and unmerged.ilp["n_merged"] == 0
    # identical layers in the same position gain nothing from differing, and single-use views lose
    # nothing by following
    assert math.isclose(plan.cost.total, unclustered.cost.total, rel_tol=1e-6)
    assert math.isclose(plan.cost.total, unmerged.cost.total, rel_tol=1e-6)
    assert plan.ilp["n_vars"] < unclustered.ilp["n_vars"] / 2
    assert [r["layers"] for r in plan.ilp["refinements"]] == [["layers.0"], ["layers.3"]]


@pytest.fixture(scope="module")
def four_layers_budget():
    return plan_llama(n_layers=4)


def test_boundary_layers_are_re_solved_on_their_own(four_layers_budget):
    """The first and last layers, tied to the middle ones for the main solve, are each re-solved on
    their own against the rest: certified within the gap, never worse than the tied plan (it is
    their start), kept only when they gain, and the reported cost is the plan's. (Under the overlap-aware costs the
    first layer's Partial-sum gradient no longer pays off on this model: its moves hide.)"""
    plan, _, _ = four_layers_budget
    first, last = plan.ilp["refinements"]
    assert first["layers"] == ["layers.0"] and last["layers"] == ["layers.3"]
    for r in (first, last):
        assert r["status"] in ("optimal", "feasible") and r["gap"] <= 0.01
        assert r["gain_s"] >= -1e-9 * plan.cost.total
        assert r["kept"] == (r["gain_s"] > 1e-9 * plan.cost.total)
        assert r["n_vars"] < 1.1 * plan.ilp["n_vars"]
    kept = [r["layers"][0] for r in (first, last) if r["kept"]]
    assert all(f"{layer} (-" in plan.summary() for layer in kept)
    assert [i for c in plan.layer_classes for i in c if i in kept] == []
    assert math.isclose(plan.ilp["objective"], plan.cost.total - plan.cost.bucket_latency, rel_tol=1e-9)


def test_a_re_solve_certifies_its_start_without_its_lp(monkeypatch):
    """A boundary re-solve starts from the main plan, usually its best already. A Lagrangian bound
    found from the re-solve's own structure (``autoplan.solve.certify``) proves that within the gap, so
    its LP never runs; and the bound is a true one, never above that LP's optimum."""
    import autoplan.solve.certify as certify_module
    import autoplan.solve.ilp as ilp_module
    from solvers.highs_backend import solve_highs
    from solvers.result import SolverOptions

    real, seen, makers = ilp_module.certifier, [], {}
    real_bound = certify_module.lagrangian_bound
    monkeypatch.setattr(ilp_module, "CERTIFY_MIN_ROWS", 0)  # this small ILP's LP is cheaper, so try it here

    def recording(problem, layout, model, gap):
        certify = real(problem, layout, model, gap)

        def run(x, objective):
            bound, y = certify(x, objective)
            seen.append((model, x, bound, objective, gap))
            return bound, y

        # each model keeps its own certifier maker
        makers[id(model)] = lambda g: real(problem, layout, model, g)
        return run

    monkeypatch.setattr(ilp_module, "certifier", recording)
    plan, _, _ = plan_llama(n_layers=4)
    assert len(seen) == 2
    for model, x, bound, objective, gap in seen:
        lp = solve_highs(model, False, SolverOptions(presolve=False)).bound
        assert bound <= lp + 1e-9 * abs(lp) and objective - bound <= gap * objective
        # the start came completed (pairs, hidden seconds) as the completion LP would have it
        completed = solve_highs(model.restricted(model.integer, x)[0], False, SolverOptions(presolve=False))
        assert model.objective_value(x) == pytest.approx(completed.bound, rel=1e-9) == objective
    for r in plan.ilp["refinements"]:
        assert r["status"] == "feasible" and 0 < r["gap"] <= 0.01 and not r["kept"]
    # asked to prove a start 1% under the LP's optimum, the ascent gives up long before its cap
    checks = []
    monkeypatch.setattr(certify_module, "lagrangian_bound", lambda *a: checks.append(1) or real_bound(*a))
    (model, x, _, _, _), make = seen[0], makers[id(seen[0][0])]
    lp = solve_highs(model, False, SolverOptions(presolve=False)).bound
    assert make(1e-6)(x, 0.99 * lp)[0] <= lp + 1e-9 * abs(lp)
    assert len(checks) < certify_module.MAX_SWEEPS // certify_module._CHECK / 2


@pytest.mark.slow  # ~15 s each; every default plan of LLaMA runs the priced solve
@pytest.mark.parametrize("way", ["priced", "screened"])
def test_a_main_solve_without_a_start_shrinks_its_lp_and_finds_the_same_optimum(monkeypatch, way):
    """Above ``CERTIFY_MIN_ROWS`` rows the main solve's LP never runs whole: column generation
    (``solvers.pricing``) solves it over the pair columns it prices in, or, where pricing is off,
    the columns the ascent's multipliers price out of every plan near their bound are left out
    before it runs (``solvers.Screen``). Either way the plan costs what the whole model's optimum
    costs."""
    import importlib

    import autoplan.solve.ilp as ilp_module

    solve_module = importlib.import_module("solvers.solve")
    real, lps, priced = solve_module._BACKENDS["highs"], [], []

    def recording(model, integral, opts):
        if not integral:
            lps.append(model.n_cols)
        return real(model, integral, opts)

    monkeypatch.setitem(solve_module._BACKENDS, "highs", recording)
    whole, _, _ = plan_llama(n_layers=4, mip_rel_gap=1e-9)
    whole_lp = lps[0]
    monkeypatch.setattr(ilp_module, "CERTIFY_MIN_ROWS", 0)
    real_priced = solve_module.priced_lp
    monkeypatch.setattr(solve_module, "priced_lp", lambda *a: priced.append(1) or real_priced(*a))
    if way == "screened":
        monkeypatch.setattr(solve_module, "_priced", lambda *a: None)
    lps.clear()
    shrunk, _, _ = plan_llama(n_layers=4, mip_rel_gap=1e-9)
    if way == "priced":
        assert priced and all(n < whole_lp for n in lps)
    else:
        assert not priced and lps[0] < whole_lp
    assert shrunk.cost.total == pytest.approx(whole.cost.total, rel=1e-9)
    assert shrunk.solver["bound"] <= shrunk.solver["objective"] * (1 + 1e-9)


@pytest.mark.slow
def test_refined_plan_is_the_unclustered_optimum():
    """Both solved exactly (within the default 1% gap either could stop short)."""
    refined, _, _ = plan_llama(n_layers=4, mip_rel_gap=1e-6)
    unclustered, _, _ = plan_llama(n_layers=4, cluster_layers=False, mip_rel_gap=1e-6)
    assert math.isclose(refined.cost.total, unclustered.cost.total, rel_tol=1e-6)


FSDP = [("*.weight", (S0, S0))]
# torchtitan-style FSDP on dp + TP on tp: column-parallel wq/wk/wv/w1/w3 and output, row-parallel wo/w2,
# vocab-parallel embedding, replicated norms on tp.
FSDP_TP = [
    ("layers.*.attention.w[qkv].weight", (S0, S0)),
    ("layers.*.attention.wo.weight", (S0, S1)),
    ("layers.*.feed_forward.w[13].weight", (S0, S0)),
    ("layers.*.feed_forward.w2.weight", (S0, S1)),
    ("*norm.weight", (S0, R)),
    ("tok_embeddings.weight", (S1, S0)),
    ("output.weight", (S1, S0)),
]


@pytest.mark.parametrize(
    "pins, budget", [(FSDP, 1 / 8), pytest.param(FSDP_TP, 1 / 4, marks=pytest.mark.slow)], ids=["fsdp", "fsdp+tp"]
)
def test_unpinned_optimum_beats_hand_written_plans(llama, pins, budget):
    free = llama[0] if budget == 1 / 8 else plan_llama(memory_fraction=budget)[0]
    pinned, _, _ = plan_llama(pins=pins, memory_fraction=budget)
    for target, placements in pins:
        for fqn, pl in pinned.param_placements.items():
            if __import__("fnmatch").fnmatchcase(fqn, target):
                assert pl == placements, fqn
    assert free.cost.total <= pinned.cost.total * (1 + 1e-9)


def test_boundary_re_solves_run_one_after_another_against_the_plan_so_far(monkeypatch):
    """The boundary layers are re-solved in turn: when one is kept, the next is solved against the
    plan it left, each once. The first re-solve is made to look like a gain here (its true cost is
    then reported, with a warning)."""
    import autoplan.solve.planner as planner_module

    real = planner_module.Planner._refine
    calls = []

    def refine(self, request, clustering, group, *rest):
        split, re = real(self, request, clustering, group, *rest)
        calls.append((group, clustering.classes))
        if group == ("layers.0",):
            faked = dataclasses.replace(re.solved, objective_without_tie_break=0.0)
            re = dataclasses.replace(re, solved=faked)
        return split, re

    monkeypatch.setattr(planner_module.Planner, "_refine", refine)
    with pytest.warns(UserWarning, match="differs from the expanded plan"):
        plan, _, _ = plan_llama(memory_fraction=None, n_layers=4)
    first, last = plan.ilp["refinements"]
    assert first["kept"] and first["layers"] == ["layers.0"] and last["layers"] == ["layers.3"]
    tied = (("layers.0", "layers.1", "layers.2", "layers.3"),)  # the main solve's classes
    assert calls == [
        (("layers.0",), tied),
        (("layers.3",), (("layers.1", "layers.2", "layers.3"),)),  # against the plan layers.0's kept
    ]


def test_an_unclustered_plan_hides_moves_per_layer_as_it_is_priced():
    """Without clustering each node decides alone but still sits in its layer: the ILP hid FSDP
    gathers under one segment spanning the whole model, so its objective was 0.7% below the plan's
    expanded cost (and the plan 0.6% worse than the clustered one)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "reduced ILP objective ... differs from the expanded plan's cost"
        unclustered, _, _ = plan_llama(n_layers=4, cluster_layers=False, prefetch=True)
    ilp_cost = unclustered.cost.total - unclustered.cost.bucket_latency
    assert math.isclose(unclustered.ilp["objective"], ilp_cost, rel_tol=1e-9)
    assert unclustered.cost.hidden_comm > 0


def test_the_ascent_goes_on_while_its_gains_can_close_the_gap():
    """The bound checks (every 5 sweeps) of the layers.0 re-solves of LLaMA-3 8B on 8x4x4 and 70B
    on 16x8x8: their gains shrink fast, then slowly, and still add up to the 1% gap, so the ascent
    goes on (8B certifies at sweep ~170, 70B at ~210); against a start 2% further away the same
    climbs give up early, saving their sweeps for the LP."""
    from autoplan.solve.certify import _CHECK, _may_reach

    climb_8b = [322706.993, 371416.791, 377658.604, 381138.139, 383642.558, 385523.840, 387048.929]
    climb_8b += [388313.023, 389320.437, 390197.518, 391004.972, 391720.374, 392393.994, 392995.565]
    climb_8b += [393555.300, 394063.696, 394532.310, 394947.410, 395336.872, 395674.890, 395983.713]
    climb_8b += [396262.069, 396520.419, 396756.978, 396973.885, 397178.300, 397362.827, 397537.173]
    climb_8b += [397692.105, 397841.721, 397977.040]
    climb_70b = [1632529.891, 1677281.343, 1685518.422, 1690943.689, 1694860.703, 1697740.084]
    climb_70b += [1700461.076, 1702628.372, 1704776.982, 1706550.198, 1708160.104, 1709534.028]
    climb_70b += [1710716.446, 1711661.769, 1712407.323, 1713037.784, 1713589.441, 1714068.889]
    climb_70b += [1714493.834, 1714874.127, 1715231.351, 1715541.647, 1715823.429, 1716069.966]
    climb_70b += [1716317.151, 1716535.823, 1716758.113, 1716958.330, 1717165.718, 1717356.476]
    climb_70b += [1717551.869, 1717731.877, 1717914.123, 1718083.240, 1718254.111, 1718413.998]
    climb_70b += [1718574.687, 1718725.643, 1718876.085, 1719016.275, 1719159.023, 1719290.807]

    def stops_at(climb, objective):
        """The sweep the ascent stops at (None: it climbs the whole recorded way or certifies)."""
        target, floor = 0.99 * objective, 1e-5 * objective
        for k in range(2, len(climb)):
            rise, previous = climb[k] - climb[k - 1], climb[k - 1] - climb[k - 2]
            if climb[k] >= target:
                return None
            if not _may_reach(rise, previous, target - climb[k], k * _CHECK, floor):
                return k * _CHECK
        return None

    for climb, objective in [(climb_8b, 402458.35), (climb_70b, 1736532.67)]:
        assert stops_at(climb, objective) is None
        gives_up = stops_at(climb, 1.02 * objective)
        assert gives_up is not None and gives_up <= 100


def test_a_sweeps_batches_colour_the_groups_so_that_none_share_a_unit():
    """The ascent updates a batch's groups at once: on random graphs (repeated pairs, and groups
    whose two sides are one unit) every group is in one batch, no two groups of a batch touch the
    same unit, and each took the first batch free of its units when its turn came in the order,
    so there are at most ``2 * degree - 1`` batches."""
    import random
    from types import SimpleNamespace

    from autoplan.solve.certify import _colours

    rng = random.Random(0)
    for _ in range(200):
        n_units = rng.randint(1, 12)
        edges = [SimpleNamespace(src=rng.randrange(n_units), dst=rng.randrange(n_units)) for _ in range(30)]
        order = rng.sample(range(len(edges)), len(edges))
        batches = _colours(SimpleNamespace(edges=edges), order)
        batch_of = {i: k for k, members in enumerate(batches) for i in members}
        assert sorted(batch_of) == sorted(order) and sum(map(len, batches)) == len(order)
        for members in batches:
            touched = [u for i in members for u in {edges[i].src, edges[i].dst}]
            assert len(touched) == len(set(touched))
            assert members == sorted(members, key=order.index)
        for a, i in enumerate(order):  # every earlier batch held a group (before i) touching one of its units
            ends = {edges[i].src, edges[i].dst}
            for k in range(batch_of[i]):
                assert any(ends & {edges[j].src, edges[j].dst} for j in order[:a] if batch_of[j] == k)
        degree = max(sum((e.src == u) + (e.dst == u and e.dst != e.src) for e in edges) for u in range(n_units))
        assert len(batches) <= max(1, 2 * degree - 1)


def _plain_sweeps(problem, layout, open_, n):
    """The certificate's ascent written plainly: a dense pair matrix and a message vector per side
    of each group, one group at a time, batch after batch (``_colours``: the groups coloured in
    their order, every sweep). Returns each unit's beliefs and the flat messages (every group's
    producer side, then every consumer side)."""
    import numpy as np

    import autoplan.solve.certify as certify_module

    order = [i for batch in certify_module._colours(problem, list(range(len(problem.edges)))) for i in batch]

    beliefs = {u: open_[layout.offsets[u] + np.arange(len(layout.kept[u]))].copy() for u in problem.units}
    steps = []
    for g, (cols, oi, qi), (src, dst) in zip(problem.edges, layout.edges, layout.marginals):
        t = np.full((len(src), len(dst)), np.inf)
        t[oi, qi] = open_[cols]
        labels = (g.src_label[layout.kept[g.src]], g.dst_label[layout.kept[g.dst]])
        steps.append((g, t, labels, np.zeros(len(src)), np.zeros(len(dst))))

    def least(values, labels, n):
        out = np.full(n, np.inf)
        np.minimum.at(out, labels, values)
        return out

    def half(to, m):
        out = np.clip(0.5 * (to - m), -certify_module._CAP, certify_module._CAP)
        out[~np.isfinite(m)] = 0.0
        return out

    with np.errstate(invalid="ignore"):
        for _ in range(n):
            for g, t, (sl, dl), alpha, beta in (steps[i] for i in order):
                ma = least(beliefs[g.src], sl, len(alpha)) - alpha
                mb = least(beliefs[g.dst], dl, len(beta)) - beta
                new_a, new_b = half((t + mb).min(axis=1), ma), half((t.T + ma).min(axis=1), mb)
                beliefs[g.src] += (new_a - alpha)[sl]
                beliefs[g.dst] += (new_b - beta)[dl]
                alpha[:], beta[:] = new_a, new_b
    return beliefs, np.concatenate([a for *_, a, _ in steps] + [b for *_, b in steps])


def _batched_sweeps(plan, belief, open_, n):
    import autoplan.solve.certify as certify_module

    msg = np.zeros(len(plan.rows))
    batches = [certify_module._prices(b, belief, open_) for b in plan.batches]
    for _ in range(n):
        certify_module._sweep(batches, belief, msg)
    return msg


def test_a_batched_sweep_on_random_groups_moves_every_message_as_in_turn():
    """Random small problems with what the LLaMA ones lack: strategies held at 0 (a label with no
    strategy left), pairs without a column (a label no pair takes, priced out at the cap), a group
    whose two sides are one unit, and costs large enough that the cap clamps finite messages."""
    from types import SimpleNamespace

    from autoplan.solve.certify import Layout, _Sweeps

    rng = np.random.default_rng(0)
    for case in range(60):
        n_units, scale = int(rng.integers(2, 6)), 10.0 ** rng.integers(0, 10)
        kept = {u: np.arange(int(rng.integers(1, 5))) for u in range(n_units)}
        offsets = dict(zip(range(n_units), np.cumsum([0] + [len(k) for k in kept.values()])[:-1].tolist()))
        at = sum(len(k) for k in kept.values())
        groups, edges, marginals, rows = [], [], [], 0
        for _ in range(int(rng.integers(1, 8))):
            src, dst = int(rng.integers(n_units)), int(rng.integers(n_units))
            n_o, n_q = int(rng.integers(1, 4)), int(rng.integers(1, 4))
            src_label, dst_label = rng.integers(0, n_o, len(kept[src])), rng.integers(0, n_q, len(kept[dst]))
            oi, qi = np.nonzero(rng.random((n_o, n_q)) < 0.7)
            edges.append((at + np.arange(len(oi)), oi, qi))
            at += len(oi)
            marginals.append((rows + np.arange(n_o), rows + n_o + np.arange(n_q)))
            rows += n_o + n_q
            groups.append(SimpleNamespace(src=src, dst=dst, src_label=src_label, dst_label=dst_label))
        open_ = rng.random(at) * scale
        open_[rng.random(at) < 0.15] = np.inf  # held at 0
        problem = SimpleNamespace(units=list(range(n_units)), edges=groups)
        layout = Layout(kept, offsets, edges, marginals, np.zeros(0, int), np.zeros(0, int))
        plan = _Sweeps.of(problem, layout)
        belief = np.full(at, np.inf)
        belief[plan.units] = open_[plan.units]
        msg = _batched_sweeps(plan, belief, open_, 7)
        beliefs, flat = _plain_sweeps(problem, layout, open_, 7)
        for u in problem.units:
            assert np.array_equal(belief[offsets[u] + kept[u]], beliefs[u]), case
        assert np.array_equal(msg, flat), case


def test_a_batched_sweep_moves_every_message_as_the_groups_in_turn_would(monkeypatch):
    """The certificate's batched sweeps (groups coloured apart, both sides of a batch in one vector
    step, pairs without a column left out) against the ascent written plainly, one edge group at
    a time in the batches' order: after three sweeps every belief and message is the same, bit for
    bit, on both boundary re-solves of a 4-layer LLaMA."""
    import autoplan.solve.certify as certify_module
    import autoplan.solve.ilp as ilp_module
    from solvers.bound import tightened

    seen = []
    monkeypatch.setattr(ilp_module, "CERTIFY_MIN_ROWS", 0)
    real = ilp_module.certifier

    def recording(problem, layout, model, gap):
        seen.append((problem, layout, model))
        return real(problem, layout, model, gap)

    monkeypatch.setattr(ilp_module, "certifier", recording)
    plan_llama(n_layers=4)
    assert len(seen) == 2
    for problem, layout, model in seen:
        model = tightened(model)
        plan = certify_module._Sweeps.of(problem, layout)
        open_, belief, _, _ = certify_module._start(plan, model, np.zeros(model.n_rows))
        msg = _batched_sweeps(plan, belief, open_, 3)
        beliefs, flat = _plain_sweeps(problem, layout, open_, 3)
        for u in problem.units:
            assert np.array_equal(belief[layout.offsets[u] + np.arange(len(layout.kept[u]))], beliefs[u])
        assert np.array_equal(msg, flat) and np.any(flat != 0)
