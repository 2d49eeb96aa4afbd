"""The ILP's plan against the hand-written plans users run (DDP, FSDP, HSDP, FSDP+TP as pins),
priced under one cost model: it is never worse, on two model sizes."""

import dataclasses

import pytest
import torch
from conftest import fake_mesh
from torch.distributed.tensor import Replicate, Shard

from autoplan import AutoParallel
from autoplan.bench.handplans import compare_plans, fit_to_shapes, hand_plan_pins, hand_plans
from autoplan.bench.models.llama3 import LLAMA3_CONFIGS, Transformer

R, S0 = Replicate(), Shard(0)


@pytest.mark.parametrize(
    "size", [dict(n_layers=2), pytest.param(dict(n_layers=3, dim=512, n_heads=8, n_kv_heads=4), marks=pytest.mark.slow)]
)
def test_the_ilp_plan_is_no_worse_than_any_hand_plan(size):
    mesh = fake_mesh((2, 4), ("dp", "tp"))
    cfg = dataclasses.replace(LLAMA3_CONFIGS["debug"], **size)
    with torch.device("meta"):
        model = Transformer(cfg)
    with AutoParallel(model, mesh, input_fn=lambda: torch.randint(0, cfg.vocab_size, (16, 64))) as ap:
        ap.add_input_constraints([(S0, R)])
        ap.add_output_constraints([(S0, R)])
        rows = {r["plan"]: r for r in compare_plans(ap, 2)}
    assert set(rows) == {"autoplan", "ddp", "fsdp", "hsdp", "fsdp+tp"}
    assert not [r for r in rows.values() if "error" in r]
    best = rows.pop("autoplan")
    for name, r in rows.items():
        assert best["step_ms"] <= r["step_ms"] * (1 + 1e-9), name
        assert r["exposed_comm_ms"] <= r["comm_ms"] + 1e-12
    # the pins took: FSDP keeps an eighth of DDP's parameters, HSDP a quarter
    assert rows["fsdp"]["param_bytes"] == pytest.approx(rows["ddp"]["param_bytes"] / 8, rel=0.02)
    assert rows["hsdp"]["param_bytes"] == pytest.approx(rows["ddp"]["param_bytes"] / 4, rel=0.02)
    assert rows["fsdp"]["step_ms"] != rows["ddp"]["step_ms"]


def test_hand_plans_by_mesh():
    assert hand_plans(1) == ("ddp", "fsdp", "tp")
    assert hand_plan_pins("fsdp", 2) == [("*.weight", (S0, S0))]
    with pytest.raises(ValueError, match="no hand plan 'hsdp' on a 1-D mesh"):
        hand_plan_pins("hsdp", 1)


def test_hand_plans_the_model_cannot_take_are_reported_not_fatal():
    """FSDP+TP names LLaMA modules an MLP lacks: its row says why (the pins are validated as they are
    added), the others are priced (FSDP splits the 12 x 5 weights unevenly, 12 rows over 8 ranks, as
    FSDP pads them: neither dim splits 8 ways evenly), and the ILP's plan, started from the cheapest
    of them, is no worse."""
    mesh = fake_mesh((2, 4), ("dp", "tp"))
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(5, 12), torch.nn.ReLU(), torch.nn.Linear(12, 5))
    with AutoParallel(model, mesh, input_fn=lambda: torch.randn(16, 5)) as ap:
        rows = {r["plan"]: r for r in compare_plans(ap, 2)}
        assert not ap._pins  # every hand plan's pins were taken back, the failed ones' too
    assert "'layers.*.attention_norm.weight' matches no node, parameter or module" in rows["fsdp+tp"]["error"]
    assert not [name for name in ("ddp", "fsdp", "hsdp") if "error" in rows[name]]
    # the weights split 8 ways (12 rows: 2, 2, 2, 0 per dp rank; 5 rows: 1, 1, 1, 0 | 1, 1, 0, 0): 10 and 12 floats
    assert rows["fsdp"]["param_bytes"] <= 4 * (10 + 12 + 12 + 5) < rows["ddp"]["param_bytes"] / 3
    fastest = min(rows[name]["step_ms"] for name in ("ddp", "fsdp", "hsdp"))
    assert rows["autoplan"]["step_ms"] <= fastest * (1 + 1e-9)


def test_a_stack_of_swiglu_blocks_gets_the_hand_plans_of_the_parts_it_has():
    """The MLP ``bench validate`` runs has LLaMA's feed-forwards and nothing else: its ``tp`` is
    Megatron's MLP split (w1/w3 column-wise, w2 row-wise, their outputs split on the features), the
    pins on attention, norms and embeddings it lacks left out rather than refusing the plan."""
    from autoplan.bench.handplans import hand_plan
    from autoplan.bench.models.mlp import factory

    model, input_fn = factory(batch=64)
    with AutoParallel(model, fake_mesh((4,), ("dp",)), input_fn) as ap:
        ap.add_input_constraints([(S0,)])
        ap.add_output_constraints([(S0,)])
        tp, ddp = hand_plan(ap, "tp", 1), hand_plan(ap, "ddp", 1)
        assert not ap._pins
    for i in range(4):
        w = f"layers.{i}.feed_forward"
        assert tp.param_placements[f"{w}.w1.weight"] == tp.param_placements[f"{w}.w3.weight"] == (S0,)
        assert tp.param_placements[f"{w}.w2.weight"] == (Shard(1),)
        assert ddp.param_placements[f"{w}.w2.weight"] == (R,)
    assert tp.memory.param_bytes == pytest.approx(ddp.memory.param_bytes / 4)


def test_uneven_dim0_falls_back_to_dim1_on_the_outer_mesh_dims():
    """LLaMA-3's 128256-row embedding cannot split 1024 ways: FSDP (which would pad) splits its dim 1
    on the outer dim instead; tensor parallelism keeps its row split on the inner one."""
    params = {"tok_embeddings.weight": torch.empty(128256, 8192, device="meta")}
    params |= {f"layers.{i}.attention.wq.weight": torch.empty(8192, 8192, device="meta") for i in range(2)}
    pins = fit_to_shapes(hand_plan_pins("fsdp", 2), params, (128, 8))
    assert pins == [("tok_embeddings.weight", (Shard(1), S0)), ("layers.*.attention.wq.weight", (S0, S0))]
    assert fit_to_shapes(hand_plan_pins("fsdp", 2), params, (16, 8)) == hand_plan_pins("fsdp", 2)  # 1002 rows each


@pytest.mark.slow  # ~85 s: seven plans of a mixture of experts
def test_moe_hand_plans_include_expert_parallel_and_the_ilp_is_no_worse():
    """A mixture of experts gets its experts pinned in every hand plan (FSDP+TP splits them inside each
    expert, and its dense layers and shared expert as LLaMA's) and two plans more, FSDP+EP
    (torchtitan's default) and EP+TP; all are priced, and the ILP's plan is no worse than any."""
    from autoplan.bench.models.moe import MOE_CONFIGS, MoETransformer

    mesh = fake_mesh((2, 4), ("dp", "tp"))
    cfg = dataclasses.replace(MOE_CONFIGS["debug"], n_experts=8)
    with torch.device("meta"):
        model = MoETransformer(cfg)
    with AutoParallel(model, mesh, input_fn=lambda: torch.randint(0, cfg.vocab_size, (16, 64))) as ap:
        ap.add_input_constraints([(S0, R)])
        ap.add_output_constraints([(S0, R)])
        rows = {r["plan"]: r for r in compare_plans(ap, 2)}
    assert {"fsdp+ep", "ep+tp"} <= set(rows)
    assert not [
        r["error"] for r in rows.values() if "error" in r
    ]  # fsdp+tp too: dense layers, shared and routed experts
    best = rows.pop("autoplan")
    assert all(best["step_ms"] <= r["step_ms"] * (1 + 1e-9) for r in rows.values() if "error" not in r)
    # the experts split 2 ways over the experts and 4 inside them (EP+TP), 8 ways with FSDP+EP
    assert rows["fsdp+ep"]["param_bytes"] < rows["ddp"]["param_bytes"] / 4
