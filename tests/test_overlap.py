"""Communication that runs under compute: parameter gathers hide under their layer's compute where
the program prefetches them, gradient reductions always, activation collectives never; the ILP
prices exactly what the plan costs."""

import dataclasses
import math
from collections import defaultdict

import pytest
import torch
from conftest import fake_mesh
from torch.distributed.tensor import Replicate, Shard

from autoplan import AutoParallel
from autoplan.bench.models.llama3 import LLAMA3_CONFIGS, Transformer

R, S0 = Replicate(), Shard(0)
BATCH, SEQ = 8, 16


def plan_llama(n_layers=4, prefetch=True, **constraints):
    mesh = fake_mesh((2, 4), ("dp", "tp"))
    with torch.device("meta"):
        model = Transformer(dataclasses.replace(LLAMA3_CONFIGS["debug"], n_layers=n_layers))
    inputs = lambda: torch.randint(0, 256, (BATCH, SEQ))  # noqa: E731
    with AutoParallel(model, mesh, input_fn=inputs, prefetch=prefetch) as ap:
        ap.add_input_constraints([(S0, R)])
        ap.add_output_constraints([(S0, R)])
        if constraints:
            ap.add_memory_constraint(**constraints)
        return ap.optimize_placement(), ap.traced


@pytest.fixture(scope="module")
def fsdp_like():
    return plan_llama(param_fraction=1 / 8)


@pytest.fixture(scope="module")
def fsdp_like_unprefetched():
    return plan_llama(prefetch=False, param_fraction=1 / 8)


def _parameter_only(traced) -> set[str]:
    """Names of nodes computed from parameters alone (the test's own walk of the graph)."""
    params = set(traced.placeholder_for("param").values())
    found = set()
    for n in traced.gm.graph.nodes:
        if n in params or (n.op == "call_function" and all(a.name in found for a in n.all_input_nodes)):
            found.add(n.name)
    return found


def _segment(module: str, phase: str) -> str:
    parts = module.split(".")
    layer = next((".".join(parts[: i + 1]) for i, p in enumerate(parts) if p.isdigit()), "")
    return f"{layer or '(outside layers)'} {phase}"


def _hideable(plan, traced, prefetch: bool) -> tuple[dict[str, float], float]:
    """Per segment, the seconds of the plan's moves that can hide there (the test's own reading of
    the rules), and the seconds of those that cannot."""
    early = _parameter_only(traced) if prefetch else set()
    hideable: dict[str, float] = defaultdict(float)
    exposed = 0.0
    for r in plan.redistributions:
        if r.consumer.startswith("grad:"):
            producer = plan.nodes[r.producer]
            hideable[_segment(producer.module, producer.phase)] += r.seconds
        elif r.producer in early and not r.consumer.startswith("output:"):
            reader = plan.nodes[r.consumer]
            hideable[_segment(reader.module, r.phase)] += r.seconds  # a regather runs in the backward
        else:
            exposed += r.seconds
    return hideable, exposed


def test_parameter_gathers_and_gradient_reductions_hide_under_their_layers_compute(fsdp_like):
    plan, traced = fsdp_like
    assert plan.prefetch
    assert all(isinstance(p[0], Shard) or isinstance(p[1], Shard) for p in plan.param_placements.values())
    hideable, exposed = _hideable(plan, traced, prefetch=True)
    assert any(k.startswith("layers.1 ") for k in hideable)
    expected = sum(min(plan.overlap_budget.get(s, 0.0), c) for s, c in hideable.items())
    cost = plan.cost
    assert cost.hidden_comm == pytest.approx(expected, rel=1e-9)
    assert 0 < cost.hidden_comm < sum(hideable.values()) + 1e-15
    assert cost.exposed_comm >= exposed - 1e-15  # activation moves are always paid
    assert cost.exposed_comm <= cost.comm
    assert cost.total == pytest.approx(cost.compute_forward + cost.compute_backward + cost.exposed_comm)
    # a layer's budget is its compute at the fastest strategies: at most what the plan computes there
    layer_compute = defaultdict(float)
    for node in plan.nodes.values():
        if node.phase:
            layer_compute[_segment(node.module, node.phase)] += node.compute_s
    for s, budget in plan.overlap_budget.items():
        assert 0 <= budget <= layer_compute[s] * (1 + 1e-9), s


def test_without_prefetch_parameter_gathers_are_paid(fsdp_like, fsdp_like_unprefetched):
    """The program issues an unprefetched gather right before its reader, which waits for it: only
    gradient reductions hide, and the plan costs more than where its gathers are prefetched."""
    plan, traced = fsdp_like_unprefetched
    assert not plan.prefetch
    hideable, exposed = _hideable(plan, traced, prefetch=False)
    expected = sum(min(plan.overlap_budget.get(s, 0.0), c) for s, c in hideable.items())
    # a reduction followed by a local chunk pick hides its collective, not the copy
    copies = sum(r.seconds for r in plan.redistributions if r.consumer.startswith("grad:") and len(r.collectives) > 1)
    assert expected - copies - 1e-15 <= plan.cost.hidden_comm <= expected * (1 + 1e-9) + 1e-15
    # the buckets' latency the moves' shares left unpaid is exposed (``CostBreakdown.bucket_latency``)
    total = exposed + sum(hideable.values()) + plan.cost.bucket_latency
    assert plan.cost.exposed_comm == pytest.approx(total - plan.cost.hidden_comm, rel=1e-9)
    gathered = [r for r in plan.redistributions if any(k == "all_gather" for k, _ in r.collectives)]
    assert gathered and plan.cost.exposed_comm >= sum(r.seconds for r in gathered) * (1 - 1e-9)
    assert plan.cost.total > fsdp_like[0].cost.total


@pytest.mark.parametrize("prefetch", [True, False], ids=["prefetch", "no prefetch"])
def test_the_ilp_prices_the_overlap_it_reports(prefetch, fsdp_like, fsdp_like_unprefetched):
    plan, _ = fsdp_like if prefetch else fsdp_like_unprefetched
    assert math.isclose(plan.ilp["objective"], plan.cost.total - plan.cost.bucket_latency, rel_tol=1e-9)
    if prefetch:
        assert plan.cost.hidden_comm > 0


def test_mfu_is_model_flops_over_devices_times_peak_times_step(fsdp_like):
    plan, _ = fsdp_like
    assert 0 < plan.cost.mfu < 1
    assert plan.cost.ideal_compute < plan.cost.compute_forward + plan.cost.compute_backward
    assert plan.cost.mfu == pytest.approx(plan.cost.ideal_compute / plan.cost.total)
    assert "MFU" in plan.summary() and "under compute" in plan.summary()


def test_overlap_survives_json(fsdp_like, tmp_path):
    plan, _ = fsdp_like
    from autoplan import Plan

    again = Plan.from_json(plan.to_json(tmp_path / "p.json"))
    assert again.overlap_budget == plan.overlap_budget
    assert again.cost.hidden_comm == plan.cost.hidden_comm and again.cost.total == plan.cost.total
