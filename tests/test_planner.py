"""Placements must emerge from costs: DDP, FSDP and TP, with no special cases in the planner."""

import dataclasses

import pytest
import torch
from conftest import fake_mesh
from models import MLP, Block
from torch.distributed.tensor import Partial, Replicate, Shard

from autoplan import AutoParallel
from autoplan.bench.models.llama3 import LlamaConfig
from autoplan.trace.tracing import PHASE_KEY

R, S0, S1, P = Replicate(), Shard(0), Shard(1), Partial()


def plan_mlp(memory_fraction=None):
    """An MLP with 16K parameters on a batch of 262144 rows over 8 ranks.

    At 65536 rows gathering the batch activations (three 16 MB all-gathers, one per reader group)
    already cost about what all-reducing the four tiny gradients does (latency-bound: 70 us each).
    """
    mesh = fake_mesh((8,), ("dp",))
    with torch.device("meta"):
        model = MLP()
    with AutoParallel(model, mesh, input_fn=lambda: torch.randn(262144, 64)) as ap:
        ap.add_input_constraints([(S0,)])
        ap.add_output_constraints([(S0,)])
        if memory_fraction is not None:
            ap.add_memory_constraint(param_fraction=memory_fraction)
        return ap.optimize_placement(), ap.traced


def forward_path(node):
    """Edges from a parameter through the views applied to it (``t``) to the forward op computing with it."""
    edges = []
    while True:
        (user,) = [u for u in node.users if u.meta.get(PHASE_KEY) == "forward"]
        edges.append((node.name, user.name))
        if not getattr(user.target, "is_view", False):
            return edges
        node = user


def test_mlp_large_batch_small_weights_is_data_parallel():
    plan, _ = plan_mlp()
    assert all(pl == (R,) for pl in plan.param_placements.values()), plan.param_placements
    # one all-reduce per gradient, in the backward (just before or after the gradient's last view:
    # the same tensor, so the same cost), and nothing else moves a parameter
    assert plan.collective_counts() == {"all_reduce": len(plan.param_placements)}
    assert all(r.phase == "backward" for r in plan.redistributions)
    params = {n.name for n in plan.nodes.values() if n.op.startswith("primals")}
    assert not [r for r in plan.redistributions if r.producer in params]


def test_mlp_with_param_budget_is_fully_sharded():
    plan, traced = plan_mlp(memory_fraction=1 / 8)
    assert all(isinstance(pl[0], Shard) for pl in plan.param_placements.values()), plan.param_placements
    assert plan.memory.param_bytes <= (64 * 128 + 128 + 128 * 64 + 64) * 4 / 8
    # each parameter is all-gathered (to replicated) right before the forward op that uses it ...
    moves = {(r.producer, r.consumer): r for r in plan.redistributions}
    for fqn, node in traced.placeholder_for("param").items():
        path_moves = [moves[e] for e in forward_path(node) if e in moves]
        assert [m.collectives for m in path_moves] == [(("all_gather", 0),)], fqn
        assert path_moves[0].dst == (R,)
    # ... and each gradient is reduced once, by a reduce-scatter to its shard: no all-reduce anywhere
    first = dataclasses.replace(plan, redistributions=[r for r in plan.redistributions if not r.again])
    assert first.collective_counts() == {"all_gather": 4, "reduce_scatter": 4}
    # the backward gathers again the one weight it reads (the second linear's, for the input's
    # gradient of its matmul; the first one's input takes no gradient), and the plan prices it
    again = [r for r in plan.redistributions if r.again]
    assert [(r.collectives, r.phase) for r in again] == [((("all_gather", 0),), "backward")]
    assert plan.nodes[again[0].consumer].module == "fc2"


@pytest.fixture(scope="module")
def block_plan():
    """One LLaMA block at 8B dims on 2x4 with its parameters split 4 ways (unbounded, DDP wins: its
    gradients' all-reduce over the whole mesh hides under the backward)."""
    mesh = fake_mesh((2, 4), ("dp", "tp"))
    cfg = LlamaConfig(dim=4096, n_layers=1, n_heads=32, n_kv_heads=32, vocab_size=128, ffn_dim=14336, max_seq_len=512)
    with torch.device("meta"):
        model = Block(cfg).to(torch.bfloat16)
    with AutoParallel(model, mesh, input_fn=lambda: torch.randn(8, 512, 4096, dtype=torch.bfloat16)) as ap:
        ap.add_input_constraints([(S0, R)])
        ap.add_output_constraints([(S0, R)])
        ap.add_memory_constraint(param_fraction=1 / 4)
        return ap.optimize_placement()


def forward_mms(plan, module):
    return [n for n in plan.nodes.values() if n.op == "aten.mm.default" and n.module == module and n.phase == "forward"]


def test_transformer_block_ffn_is_column_then_row_parallel_on_tp(block_plan):
    tp = 1
    (w1,) = forward_mms(block_plan, "block.feed_forward.w1")
    (w3,) = forward_mms(block_plan, "block.feed_forward.w3")
    (w2,) = forward_mms(block_plan, "block.feed_forward.w2")
    for col in (w1, w3):  # mm(x, w.t()): weight split on output features, activations whole on tp
        assert col.inputs[0][tp] == R and col.inputs[1][tp] == S1 and col.outputs[0][tp] == S1
    assert w2.inputs[0][tp] == S1 and w2.inputs[1][tp] == S0 and w2.outputs[0][tp] == P
    # one reduction on tp in the forward FFN: w2's partial sum, nothing between the column and row matmuls
    ffn_fwd = {
        n.name for n in block_plan.nodes.values() if n.module.startswith("block.feed_forward") and n.phase == "forward"
    }
    tp_moves = [
        r for r in block_plan.redistributions if r.consumer in ffn_fwd and any(d == tp for _, d in r.collectives)
    ]
    assert tp_moves == []
    reductions = [
        r for r in block_plan.redistributions if r.producer == w2.name or r.producer in _views_of(block_plan, w2.name)
    ]
    tp_reductions = [
        r for r in reductions if any(k in ("all_reduce", "reduce_scatter") and d == tp for k, d in r.collectives)
    ]
    assert len(tp_reductions) == 1


def _views_of(plan, name):
    """Names of the forward views of ``name``'s module (an mm output is reshaped before its
    reduction; the view aliases it, so no redistribution links the two)."""
    mm = plan.nodes[name]
    view_ops = {"aten._unsafe_view.default", "aten.view.default"}
    return {n.name for n in plan.nodes.values() if n.op in view_ops and n.module == mm.module and n.phase == mm.phase}


def test_tracing_planning_and_lowering_pause_the_cyclic_collector_and_restore_it(monkeypatch):
    """Tracing, planning and lowering build millions of long-lived objects, and every full
    collection walks them all: the collector is off while they run, and as it was after (on, or
    off where the caller had turned it off)."""
    import gc

    import autoplan.api as api_module
    import autoplan.solve.planner as planner_module
    from autoplan.heap import collector_paused

    seen = []

    def watched(module, name):
        real = getattr(module, name)

        def run(*args, **kwargs):
            seen.append((name, gc.isenabled()))
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, run)

    watched(api_module, "trace_joint")
    watched(api_module, "enumerate_strategies")
    watched(planner_module.Planner, "_plan")
    watched(api_module, "lower")
    with torch.device("meta"):
        model = MLP()
    with AutoParallel(model, fake_mesh((8,), ("dp",)), input_fn=lambda: torch.randn(1024, 64)) as ap:
        plan = ap.optimize_placement()
        ap.apply_placement(plan)
    assert plan.param_placements and gc.isenabled()
    assert seen == [("trace_joint", False), ("enumerate_strategies", False), ("_plan", False), ("lower", False)]
    with collector_paused():
        with collector_paused():
            pass
        assert not gc.isenabled()  # an inner pause leaves the outer one be
    assert gc.isenabled()
    gc.disable()
    try:
        plan_mlp()
        assert not gc.isenabled()
    finally:
        gc.enable()
