"""Lowering on a fake 2x4 mesh: the per-rank graphs carry exactly the plan's collectives."""

import pytest
import torch
from conftest import fake_mesh
from torch.distributed.tensor import Replicate, Shard

from autoplan import AutoParallel
from autoplan.lowering import count_collectives
from autoplan.models.llama3 import LLAMA3_CONFIGS, Transformer

R, S0 = Replicate(), Shard(0)


@pytest.fixture(scope="module")
def lowered_llama():
    mesh = fake_mesh((2, 4), ("dp", "tp"))
    cfg = LLAMA3_CONFIGS["debug"]
    with torch.device("meta"):
        model = Transformer(cfg)
    with AutoParallel(model, mesh, input_fn=lambda: torch.randint(0, cfg.vocab_size, (8, 16))) as ap:
        ap.add_input_constraints([(S0, R)])
        ap.add_output_constraints([(S0, R)])
        ap.add_memory_constraint(param_fraction=1 / 8)
        plan = ap.optimize_placement()
        pmod = ap.apply_placement(plan)
    return plan, ap.lowered, pmod


def expected_on_cpu(planned: dict) -> dict:
    """DTensor runs Shard->Shard (all-to-all) on CPU groups as an all-gather plus a local chunk."""
    counts = {k: v for k, v in planned.items() if k != "local"}
    moved = counts.pop("all_to_all", 0)
    if moved:
        counts["all_gather"] = counts.get("all_gather", 0) + moved
    return counts


def test_lowered_collectives_are_exactly_the_planned_ones(lowered_llama):
    plan, lowered, _ = lowered_llama
    assert lowered.collective_counts() == expected_on_cpu(plan.collective_counts())
    fwd, bwd = count_collectives(lowered.forward), count_collectives(lowered.backward)
    # partitioning neither drops nor re-runs a collective
    assert {k: fwd.get(k, 0) + bwd.get(k, 0) for k in lowered.collective_counts()} == lowered.collective_counts()
    # every gradient arrives in its parameter's (sharded) placement through reduce-scatters: the
    # plan has no all-reduce of a gradient, so the graph has no extra one either
    grad_moves = [r for r in plan.redistributions if r.consumer.startswith("grad:")]
    assert grad_moves and all("all_reduce" not in [k for k, _ in r.collectives] for r in grad_moves)
    assert lowered.collective_counts().get("all_reduce", 0) == plan.collective_counts().get("all_reduce", 0)


def test_graphs_have_local_shapes(lowered_llama):
    plan, lowered, _ = lowered_llama
    params = {n.name: n for n in lowered.joint.graph.nodes if n.op == "placeholder"}
    wq = next(p for p in params.values() if tuple(p.meta["val"].shape) != (64, 64) and p.meta["val"].ndim == 2)
    assert wq.meta["val"].numel() < 64 * 64  # a sharded parameter arrives as its shard
    for (local, glob), pl in zip(lowered.local_shapes, lowered.input_placements):
        if any(isinstance(p, Shard) for p in pl):
            assert torch.Size(local).numel() < torch.Size(glob).numel()


def test_parallel_module_keeps_fqns_and_dtensor_params(lowered_llama):
    plan, _, pmod = lowered_llama
    from torch.distributed.tensor import DTensor

    names = dict(pmod.named_parameters())
    assert set(names) == set(plan.param_placements)
    for fqn, p in names.items():
        assert isinstance(p, DTensor) and tuple(p.placements) == plan.param_placements[fqn]
    assert all(isinstance(v, DTensor) for v in pmod.state_dict().values())


def test_wrong_input_shape_names_the_input_and_shapes(lowered_llama):
    _, _, pmod = lowered_llama
    with pytest.raises(ValueError, match=r"input 0 has shape \(8, 16\).*local shard of shape \(4, 16\).*global"):
        pmod(torch.zeros(8, 16, dtype=torch.long))
