"""All 8 ranks of a 2x4 mesh simulated in one process (LocalTensorMode): the planned joint graph,
executed on DTensors with the plan's placements, matches the single-device loss and gradients."""

import pytest
import torch
from conftest import fake_mesh
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from autoplan import AutoParallel
from autoplan.lowering import run_eagerly
from autoplan.models.llama3 import LLAMA3_CONFIGS, Transformer

R, S0, S1 = Replicate(), Shard(0), Shard(1)
TP = [
    ("layers.*.attention.w[qkv].weight", (S0, S0)),
    ("layers.*.attention.wo.weight", (S0, S1)),
    ("layers.*.feed_forward.w[13].weight", (S0, S0)),
    ("layers.*.feed_forward.w2.weight", (S0, S1)),
]


@pytest.mark.parametrize("pins, budget", [([], None), ([], 1 / 8), (TP, None)], ids=["free", "fsdp-budget", "tp"])
def test_llama_debug_on_eight_simulated_ranks(pins, budget):
    mesh = fake_mesh((2, 4), ("dp", "tp"))
    cfg = LLAMA3_CONFIGS["debug"]
    torch.manual_seed(0)
    ref = Transformer(cfg)
    ref.init_weights()
    tokens = torch.randint(0, cfg.vocab_size, (8, 16), generator=torch.Generator().manual_seed(1))
    with torch.device("meta"):
        model = Transformer(cfg)
    with AutoParallel(model, mesh, input_fn=lambda: torch.randint(0, cfg.vocab_size, (8, 16))) as ap:
        ap.add_input_constraints([(S0, R)])
        ap.add_output_constraints([(S0, R)])
        for target, placements in pins:
            ap.add_node_constraint(target, placements)
        if budget:
            ap.add_memory_constraint(param_fraction=budget)
        plan = ap.optimize_placement()
    tg = ap.traced
    out_ref = ref(tokens)
    tangent = torch.full_like(out_ref, 1 / out_ref.numel())  # d(mean)/d(out)
    out_ref.backward(tangent)
    full = {("param", n): p.detach() for n, p in ref.named_parameters()}
    full |= {("buffer", n): b for n, b in ref.named_buffers()}
    full |= {("input", 0): tokens, ("tangent", 0): tangent}
    with LocalTensorMode(8):
        local = [
            distribute_tensor(full[label], mesh, plan.nodes[ph.name].outputs[0]).to_local()
            for label, ph in zip(tg.input_labels, tg.placeholders)
        ]
        n_primals = len(local) - 1
        outs = run_eagerly(tg, plan, mesh, ap._outputs, local[:n_primals], local[n_primals:])
        results = {}
        for (kind, target), value, pl in zip(tg.output_labels, outs, _targets(tg, plan, ap)):
            results[(kind, target)] = DTensor.from_local(value, mesh, pl, run_check=False).full_tensor()
    assert torch.allclose(results[("output", 0)], out_ref.detach(), rtol=1e-5, atol=1e-6)
    for name, p in ref.named_parameters():
        got = results[("grad_param", name)]
        assert torch.allclose(got, p.grad, rtol=1e-5, atol=1e-6), name
    if pins or budget:  # the plan really splits parameters across the simulated ranks
        assert any(isinstance(p, Shard) for pls in plan.param_placements.values() for p in pls)


def _targets(tg, plan, ap):
    from autoplan.lowering import output_targets

    return output_targets(tg, plan, ap._outputs)
