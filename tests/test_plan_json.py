"""``Plan``: JSON round trip, determinism of planning, the summary, and agreement with the ILP."""

import json

import pytest
import torch
from conftest import fake_mesh
from torch.distributed.tensor import Partial, Replicate, Shard

from autoplan import AutoParallel, Plan
from autoplan.bench.models.llama3 import LLAMA3_CONFIGS, Transformer

R, S0 = Replicate(), Shard(0)
CFG = LLAMA3_CONFIGS["debug"]
WQ = "layers.*.attention.wq.weight"
PARAM_FRACTION = 1 / 8


def make_plan() -> tuple[Plan, str, int]:
    """Plan LLaMA debug on a (2, 4) mesh; returns the plan, the input node's name and the model's param bytes."""
    mesh = fake_mesh((2, 4), ("dp", "tp"))
    with torch.device("meta"):
        model = Transformer(CFG)
    with AutoParallel(model, mesh, input_fn=lambda: torch.randint(0, CFG.vocab_size, (8, 16))) as ap:
        ap.add_input_constraints([(S0, R)])
        ap.add_output_constraints([(S0, R)])
        ap.add_node_constraint(WQ, (S0, S0))
        ap.add_memory_constraint(param_fraction=PARAM_FRACTION)
        plan = ap.optimize_placement()
        input_name = ap.traced.placeholder_for("input")[0].name
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return plan, input_name, total


@pytest.fixture(scope="module")
def planned():
    return make_plan()


@pytest.fixture(scope="module")
def plan(planned) -> Plan:
    return planned[0]


def node_placements(plan: Plan) -> dict:
    return {k: (v.outputs, v.inputs) for k, v in plan.nodes.items()}


# ---- JSON --------------------------------------------------------------------------------------


def test_json_round_trip(plan):
    text = plan.to_json()
    again = Plan.from_json(text)
    assert again == plan
    assert again.to_json() == text
    # the round trip exercised every placement kind, not just replicas
    kinds = {type(p) for n in plan.nodes.values() for pls in n.outputs if pls is not None for p in pls}
    assert {Replicate, Shard, Partial} <= kinds
    assert plan.redistributions and again.redistributions == plan.redistributions


def test_json_round_trip_through_a_file(plan, tmp_path):
    path = tmp_path / "plan.json"
    text = plan.to_json(path)
    assert path.read_text() == text
    assert Plan.from_json(path) == plan
    assert Plan.from_json(str(path)) == plan


def test_json_is_plain_readable_data(plan):
    d = json.loads(plan.to_json())
    assert d["mesh_shape"] == [2, 4] and d["mesh_dim_names"] == ["dp", "tp"]
    assert d["param_placements"]["layers.0.attention.wq.weight"] == "S(0)S(0)"
    assert set(d["param_placements"]) == set(plan.param_placements)
    assert d["cost"]["compute_forward"] == plan.cost.compute_forward


def test_solver_and_ilp_reports_are_typed_and_save_as_the_dicts_they_replaced(plan):
    """``plan.solver`` and ``plan.ilp`` are typed reports; their JSON holds the keys, in order,
    that the plain dicts held, a plan saved without timings loads, and both still read like dicts."""
    import dataclasses

    from autoplan.solve.reports import IlpReport, Refinement, SolverReport

    # the debug model's two layers have no boundary to re-solve: one re-solve's report is added
    one = Refinement(["layers.0"], 10, 5, "optimal", 0.0, solve_s=0.5, gain_s=1e-6, kept=True)
    plan = dataclasses.replace(plan, ilp=dataclasses.replace(plan.ilp, refinements=[one]))
    assert isinstance(plan.solver, SolverReport) and isinstance(plan.ilp, IlpReport)
    d = json.loads(plan.to_json())
    assert list(d["solver"]) == ["status", "objective", "bound", "gap", "x", "backend", "lp_was_integral"] + [
        "build_time",
        "solve_time",
        "n_vars",
        "n_rows",
        "n_nonzeros",
        "n_integer",
    ]
    assert list(d["ilp"]) == ["n_vars", "n_rows", "n_edge_vars", "n_dropped_strategies", "n_units", "n_merged"] + [
        "n_clustered",
        "n_nodes",
        "n_peak_steps",
        "objective",
        "refinements",
        "split_objective",
    ]
    assert list(d["ilp"]["refinements"][0]) == ["layers", "n_vars", "n_rows", "status", "gap", "solve_s"] + [
        "gain_s",
        "kept",
    ]
    assert Plan.from_json(plan.to_json()) == plan
    untimed = Plan.from_json(plan.to_json(timings=False))
    assert untimed.to_json(timings=False) == plan.to_json(timings=False)
    assert untimed.ilp.refinements[0].layers == ["layers.0"] and untimed.ilp.refinements[0].kept
    assert plan.solver["gap"] == plan.solver.gap and plan.ilp.get("n_vars") == plan.ilp.n_vars
    assert plan.ilp.get("no such field", "absent") == "absent"
    with pytest.raises(KeyError):
        plan.solver["no such field"]


# ---- planning ----------------------------------------------------------------------------------


def test_constraints_are_honoured(planned):
    plan, input_name, total = planned
    assert plan.nodes[input_name].outputs == ((S0, R),)
    wq = {k: v for k, v in plan.param_placements.items() if k.endswith("attention.wq.weight")}
    assert wq == {f"layers.{i}.attention.wq.weight": (S0, S0) for i in range(CFG.n_layers)}
    assert 0 < plan.memory.param_bytes <= PARAM_FRACTION * total


def test_planning_is_deterministic(planned):
    plan, _, _ = planned
    other, _, _ = make_plan()
    assert other.param_placements == plan.param_placements
    assert node_placements(other) == node_placements(plan)
    assert other.cost == plan.cost
    assert other.redistributions == plan.redistributions


def test_reported_cost_agrees_with_the_ilp(plan):
    assert plan.cost.total > 0
    assert plan.ilp["objective"] == pytest.approx(plan.cost.total - plan.cost.bucket_latency, rel=1e-6)
    # within the requested gap of the solver's bound (1% by default), proven optimal or not
    assert plan.solver["status"] in ("optimal", "feasible") and plan.solver["gap"] <= 0.01
    assert plan.solver["objective"] >= plan.solver["bound"] - 1e-9 * abs(plan.solver["bound"])


# ---- summary -----------------------------------------------------------------------------------


def test_summary_groups_repeated_layers(plan):
    text = plan.summary()
    rows = [line.split() for line in text.splitlines()]
    wq_rows = [r for r in rows if r and r[0] == WQ]
    assert wq_rows == [[WQ, "S(0)S(0)", str(CFG.n_layers)]]
    # a layer's parameter gets its own row exactly when some copy is placed differently
    own_rows = {r[0] for r in rows if r and r[0].startswith(("layers.0.", "layers.1.")) and r[0].endswith("weight")}
    differing = {
        fqn
        for fqn, pl in plan.param_placements.items()
        if fqn.startswith("layers.") and pl != plan.param_placements["layers.0" + fqn[len("layers.N") :]]
    }
    assert own_rows == differing
    # every parameter is accounted for exactly once across the rows of the parameter table
    param_rows = [r for r in rows if len(r) == 3 and r[0].endswith((".weight", ".bias"))]
    assert sum(int(r[2]) for r in param_rows) == len(plan.param_placements)
    assert "ILP:" in text
    assert "planning time" in text
    assert "mesh (dp=2, tp=4)" in text
