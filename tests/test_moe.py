"""Mixtures of experts in fp32: ``torch._grouped_mm`` (ATen's takes bfloat16 only) traced, planned and
run through ``autoplan::grouped_mm``, with single-device numerics on 8 simulated ranks."""

import pytest
import torch
from conftest import fake_mesh
from parallel_run import check_run, graph_report, one_value, parallel_run, plan_and_apply, reference_run
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.tensor import Replicate, Shard

from autoplan import AutoParallel
from autoplan.trace.grouped_mm import grouped_mm

S0, S1, S2, R = Shard(0), Shard(1), Shard(2), Replicate()
# experts stored split over dp on the expert dim (FSDP) and over tp inside each expert (TP)
EXPERT_TP = [("w[13]", (S0, S2)), ("w2", (S0, S1)), ("*weight", (S0, S0))]


def _layout(name: str):
    g = torch.Generator().manual_seed(0)
    e, m, k, n = 3, 8, 16, 32
    sizes = [0, 48, 16]  # uneven groups, one empty
    offs = torch.tensor(sizes, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    shapes = {"2d x 3d": ((64, k), (e, k, n)), "3d x 3d": ((e, m, k), (e, k, n)),
              "2d x 2d": ((k, 64), (64, n)), "3d x 2d": ((e, m, k), (k, 64))}[name]  # fmt: skip
    a, b = (torch.randn(s, generator=g).to(torch.bfloat16) for s in shapes)
    return a, b, None if name == "3d x 3d" else offs


@pytest.mark.parametrize("name", ["2d x 3d", "3d x 3d", "2d x 2d", "3d x 2d"])
def test_grouped_mm_in_any_dtype_is_atens_product_and_differentiates(name):
    """On bfloat16-exact inputs, the fp64 product of ``autoplan::grouped_mm`` rounds to ATen's
    bfloat16 one; its backward (written in terms of itself) passes gradcheck in fp64."""
    a, b, offs = _layout(name)
    ours = grouped_mm(a.double(), b.double(), offs)
    assert torch.equal(ours.to(torch.bfloat16), torch._grouped_mm(a, b, offs))
    a64, b64 = a.double().requires_grad_(), b.double().requires_grad_()
    assert torch.autograd.gradcheck(lambda x, y: grouped_mm(x, y, offs), (a64, b64))


@pytest.mark.parametrize("pins", [[], EXPERT_TP], ids=["free", "fsdp+expert_tp"])
def test_fp32_moe_runs_with_single_device_numerics(pins):
    """A torchtitan-style MoE (router, tokens sorted by expert, grouped-matmul SwiGLU experts, shared
    expert) in fp32: the joint graph holds the grouped matmuls, forward and backward, and three
    AdamW steps of the parallel module match single-device losses and gradients."""
    mesh = fake_mesh((2, 4), ("dp", "tp"))
    ref = reference_run("moe", batch_rows=8)
    plan, lowered, pmod = plan_and_apply(mesh, "moe", pins, batch_rows=8)
    grouped = [n for n in lowered.forward.graph.nodes if n.target is torch.ops.autoplan.grouped_mm.default]
    assert len(grouped) == 3
    with LocalTensorMode(8):
        r = parallel_run(mesh, pmod, ref, False, plain=one_value)
    check_run(r | {"ref_losses": ref.losses} | graph_report(plan, lowered))
    if pins:  # each rank multiplies its quarter of every expert's hidden units
        assert plan.param_placements["w1"] == (S0, S2) and plan.param_placements["w2"] == (S0, S1)
        w1 = next(n for n in grouped if n.args[1].meta["val"].shape[-1] != 32)
        assert tuple(w1.args[1].meta["val"].shape) == (4, 32, 8)


def test_moe_transformer_expert_parallel_matches_single_device():
    """The in-repo MoE decoder (a dense first layer, then top-2 of 4 experts with a shared expert
    and the load-balancing loss, routing in regions) with its experts split over dp: the buffers
    travel by all-to-all, and three AdamW steps (the auxiliary loss's gradients included) match one
    device."""
    mesh = fake_mesh((2, 4), ("dp", "tp"))
    ref = reference_run("moe_transformer", batch_rows=8)
    experts = (S0, R)
    pins = [("layers.*.feed_forward.w[123]", experts), ("bmm*", experts)]
    plan, lowered, pmod = plan_and_apply(mesh, "moe_transformer", pins, batch_rows=8)
    assert lowered.collective_counts()["all_to_all"] >= 4
    with LocalTensorMode(8):
        r = parallel_run(mesh, pmod, ref, False, plain=one_value)
    check_run(r | {"ref_losses": ref.losses} | graph_report(plan, lowered))


@pytest.mark.parametrize("name", ["deepseek-v3-16b", "qwen3-30b-a3b"])
def test_named_moe_models_plan_with_experts_split(name):
    """``autoplan plan --model deepseek-v3-16b`` and ``qwen3-30b-a3b`` (3 layers here) on 16x8: the
    routed experts' weights are split over the experts on some mesh dim, chosen by costs."""
    from autoplan.bench.workloads import model_batch, named_model

    mesh = fake_mesh((16, 8))
    model, cfg = named_model(name, torch.bfloat16, layers=3)
    batch, seq = model_batch(cfg, None, None, 16)
    with AutoParallel(model, mesh, input_fn=lambda: torch.randint(0, cfg.vocab_size, (batch, seq))) as ap:
        ap.add_input_constraints([(S0, R)])
        ap.add_output_constraints([(S0, R)])
        plan = ap.optimize_placement()
    experts = [p for fqn, p in plan.param_placements.items() if fqn.endswith(("feed_forward.w1", "feed_forward.w2"))]
    assert experts and all(S0 in p for p in experts)
