"""Mixtures of experts in fp32: ``torch._grouped_mm`` (ATen's takes bfloat16 only) traced, planned and
run through ``autoplan::grouped_mm``, with single-device numerics on 8 simulated ranks."""

import pytest
import torch
from conftest import fake_mesh
from parallel_run import check_run, graph_report, one_value, parallel_run, plan_and_apply, reference_run
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from autoplan import AutoParallel, ConstraintError
from autoplan.shard.expert_rows import ExpertRows
from autoplan.trace.grouped_mm import expert_block, grouped_mm

S0, S1, S2, R, P, E = Shard(0), Shard(1), Shard(2), Replicate(), Partial(), ExpertRows()
# experts stored split over dp on the expert dim (FSDP) and over tp inside each expert (TP)
EXPERT_TP = [("w[13]", (S0, S2)), ("w2", (S0, S1)), ("*weight", (S0, S0))]
# the in-repo MoE decoder's experts split over dp, whole inside each rank
EXPERTS_OVER_DP = ("layers.*.feed_forward.w[123]", (S0, R))


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
    bfloat16 one; its backward (written in terms of itself) passes gradcheck in fp64 (fast mode: a
    random projection of the Jacobian rather than every entry, millions for these shapes)."""
    a, b, offs = _layout(name)
    ours = grouped_mm(a.double(), b.double(), offs)
    assert torch.equal(ours.to(torch.bfloat16), torch._grouped_mm(a, b, offs))
    a64, b64 = a.double().requires_grad_(), b.double().requires_grad_()
    assert torch.autograd.gradcheck(lambda x, y: grouped_mm(x, y, offs), (a64, b64), fast_mode=True)


@pytest.mark.parametrize("ways", [2, 4, 8])
def test_expert_blocks_make_the_whole_product(ways):
    """Each rank's block of experts (rows routed to them, a data-dependent run of the sorted tokens,
    some groups empty): the forward's blocks sum to the whole product, the weight gradient's
    blocks stack to the whole gradient, exactly."""
    g = torch.Generator().manual_seed(0)
    offs = torch.tensor([3, 0, 9, 4, 7, 0, 11, 6]).cumsum(0).to(torch.int32)
    x, w = torch.randn(40, 6, generator=g, dtype=torch.float64), torch.randn(8, 6, 5, generator=g, dtype=torch.float64)
    dy = torch.randn(40, 5, generator=g, dtype=torch.float64)
    n = 8 // ways
    blocks = [(torch.tensor(r), slice(r * n, (r + 1) * n)) for r in range(ways)]
    forward = sum(expert_block(grouped_mm, x, w[s], offs, r, n) for r, s in blocks)
    assert torch.equal(forward, grouped_mm(x, w, offs))
    weight_grad = torch.cat([expert_block(grouped_mm, x.t(), dy, offs, r, n) for r, _ in blocks])
    assert torch.equal(weight_grad, grouped_mm(x.t(), dy, offs))


@pytest.mark.parametrize("tp", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["ep", "ep+tp"])
def test_grouped_mm_expert_parallel_matches_single_device(tp):
    """The grouped-matmul experts split over the experts on dp (and, with ``tp``, inside each
    expert on tp, Megatron-style: gate and up column-wise, down row-wise): each rank multiplies the
    sorted tokens routed to its own experts, its experts' rows of the SwiGLU's hidden units stay on
    it (expert rows: no collective between the three matmuls), the outputs are summed back (after
    the combine's ``index_add``, on the tokens), the weight gradients are made split; three AdamW
    steps match one device."""
    mesh = fake_mesh((2, 4), ("dp", "tp"))
    ref = reference_run("moe", batch_rows=8)
    if tp:
        hidden, out = (E, S1), (E, P)
        pins = [("w[13]", (S0, S2)), ("w2", (S0, S1))]
    else:  # and the combine adds the experts' rows into their tokens before the one reduction
        hidden, out = (E, R), (E, R)
        pins = [("w[123]", (S0, R)), ("index_add", (P, R))]
    pins += [("grouped_mm", hidden), ("grouped_mm_1", hidden), ("grouped_mm_2", out)]
    plan, lowered, pmod = plan_and_apply(mesh, "moe", pins, batch_rows=8)
    for name in ("grouped_mm", "grouped_mm_1"):
        assert plan.nodes[name].inputs[1][0] == S0 and plan.nodes[name].inputs[0][0] == R
    # the down projection reads the hidden units where the gate and up projections left them
    assert plan.nodes["mul"].outputs[0] == hidden and plan.nodes["grouped_mm_2"].inputs[0] == hidden
    assert any(
        n.phase == "backward" and S0 in n.outputs[0] for n in plan.nodes.values() if n.op.endswith("grouped_mm.default")
    )
    with LocalTensorMode(8):
        r = parallel_run(mesh, pmod, ref, False, plain=one_value)
    check_run(r | {"ref_losses": ref.losses} | graph_report(plan, lowered))


@pytest.mark.parametrize("pins", [[], EXPERT_TP], ids=["free", "fsdp+expert_tp"])
def test_fp32_moe_runs_with_single_device_numerics(pins):
    """A torchtitan-style MoE (router, tokens sorted by expert, grouped-matmul SwiGLU experts, shared
    expert) in fp32: the joint graph holds the grouped matmuls, forward and backward, and three
    AdamW steps of the parallel module match single-device losses and gradients."""
    mesh = fake_mesh((2, 4), ("dp", "tp"))
    ref = reference_run("moe", batch_rows=8)
    # FSDP's weight gathers hide only where prefetched: the expert-TP plan is cheapest there
    plan, lowered, pmod = plan_and_apply(mesh, "moe", pins, batch_rows=8, settings={"prefetch": bool(pins)})
    grouped = [n for n in lowered.forward.graph.nodes if n.target is torch.ops.autoplan.grouped_mm.default]
    assert len(grouped) == 3
    with LocalTensorMode(8):
        r = parallel_run(mesh, pmod, ref, False, plain=one_value)
    check_run(r | {"ref_losses": ref.losses} | graph_report(plan, lowered))
    if pins:  # each rank multiplies its quarter of the hidden units of every expert (gathered over
        # dp) or of its half of them (expert parallel on dp: priced alike once gathers are bucketed)
        assert plan.param_placements["w1"] == (S0, S2) and plan.param_placements["w2"] == (S0, S1)
        w1 = next(n for n in grouped if n.args[1].meta["val"].shape[-1] != 32)
        assert tuple(w1.args[1].meta["val"].shape) in ((4, 32, 8), (2, 32, 8))


@pytest.mark.slow  # the gloo MoE test runs it too, eager and compiled
def test_moe_transformer_expert_parallel_matches_single_device():
    """The in-repo MoE decoder (a dense first layer, then top-2 of 4 experts with a shared expert
    and the load-balancing loss, routing in regions) with its experts split over dp: the buffers
    travel by all-to-all, and three AdamW steps (the auxiliary loss's gradients included) match one
    device."""
    mesh = fake_mesh((2, 4), ("dp", "tp"))
    ref = reference_run("moe_transformer", batch_rows=8)
    pins = [EXPERTS_OVER_DP, ("bmm*", EXPERTS_OVER_DP[1])]
    plan, lowered, pmod = plan_and_apply(mesh, "moe_transformer", pins, batch_rows=8)
    assert lowered.collective_counts()["all_to_all"] >= 4
    with LocalTensorMode(8):
        r = parallel_run(mesh, pmod, ref, False, plain=one_value)
    check_run(r | {"ref_losses": ref.losses} | graph_report(plan, lowered))


@pytest.mark.slow
def test_moe_transformer_with_grouped_experts_matches_single_device_expert_parallel():
    """The in-repo MoE decoder with its experts as grouped matmuls over tokens sorted by expert
    (``MoEConfig.experts="grouped"``, as torchtitan writes them: no regions, no capacity), its
    experts split over dp: the SwiGLU keeps each rank's expert rows, and three AdamW steps (the
    load-balancing loss's gradients included) match one device."""
    mesh = fake_mesh((2, 4), ("dp", "tp"))
    ref = reference_run("moe_grouped", batch_rows=8)
    pins = [EXPERTS_OVER_DP, *((f"grouped_mm{i}", (E, R)) for i in ("", "_1", "_2"))]
    plan, lowered, pmod = plan_and_apply(mesh, "moe_grouped", pins, batch_rows=8)
    assert plan.nodes["grouped_mm_2"].inputs[0] == (E, R)  # the hidden units, where w1 and w3 left them
    with LocalTensorMode(8):
        r = parallel_run(mesh, pmod, ref, False, plain=one_value)
    check_run(r | {"ref_losses": ref.losses} | graph_report(plan, lowered))


@pytest.mark.parametrize("name", ["deepseek-v3-16b", pytest.param("qwen3-30b-a3b", marks=pytest.mark.slow)])
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


def test_expert_imbalance_prices_the_busiest_ranks_experts():
    """``expert_imbalance``: a grouped matmul split over its experts is priced at the busiest
    rank's tokens (here 3x the mean); one split inside each expert is not, whatever the routing."""
    from models import GroupedMoE

    from autoplan.cost.costs import CostModel

    mesh = fake_mesh((8,))
    with torch.device("meta"):
        model = GroupedMoE(dim=256, hidden=512, experts=16, top_k=2)
    with AutoParallel(model, mesh, lambda: torch.randn(8, 256, 256)) as ap:
        node = next(n for n in ap.strategies if n.name == "grouped_mm")
        choices = ap.strategies[node].strategies
    over_experts = next(s for s in choices if s.inputs[1] == (S0,))
    inside_each = next(s for s in choices if s.inputs[1] == (S2,))
    balanced, busy = CostModel(mesh, ap.device_profile), CostModel(mesh, ap.device_profile, expert_imbalance=3.0)
    assert busy.op_seconds(node, over_experts) == pytest.approx(3 * balanced.op_seconds(node, over_experts))
    assert busy.op_seconds(node, inside_each) == balanced.op_seconds(node, inside_each)
    with pytest.raises(ConstraintError, match="expert_imbalance=0.5"):
        AutoParallel(model, mesh, lambda: torch.randn(8, 256, 256), expert_imbalance=0.5)


EP_GROUPED = [("w[123]", (S0, R)), *((f"grouped_mm{i}", (E, R)) for i in ("", "_1", "_2"))]
EP_CAPACITY = [("layers.*.feed_forward.w[123]", (S0, R)), ("bmm*", (S0, R))]


def _gloo_worker(rank: int, configs: list) -> list:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    results = []
    for name, pins, compiled in configs:
        ref = reference_run(name, batch_rows=4)
        plan, lowered, pmod = plan_and_apply(mesh, name, pins, batch_rows=4, compile=compiled)
        results.append(parallel_run(mesh, pmod, ref, False) | {"ref_losses": ref.losses} | graph_report(plan, lowered))
    return results


@pytest.mark.slow
def test_moe_plans_run_on_gloo_eager_and_regionally_compiled():
    """On 4 gloo processes (a 2x2 mesh), eagerly and with Inductor region by region: the grouped-
    matmul MoE with its experts split over dp, the in-repo MoE decoder moving its capacity buffers
    by all-to-all, and an untraced region of data-dependent shapes; each matches single-device
    losses and gradients over three AdamW steps."""
    from gloo import run_gloo

    configs = [
        ("moe", EP_GROUPED, False),
        ("moe", EP_GROUPED, True),
        ("moe_transformer", EP_CAPACITY, False),
        ("moe_transformer", EP_CAPACITY, True),
        ("data_dependent", [], True),
    ]
    for rank_results in run_gloo(_gloo_worker, 4, configs):
        assert len(rank_results) == len(configs)
        for r in rank_results:
            check_run(r)


@pytest.mark.slow
def test_moe_transformer_counts_the_tokens_it_drops():
    """With the capacity at the mean load (``capacity_factor=1.0``), each dp rank drops the routed
    tokens past its busier experts' capacity, and a planned step leaves in every MoE's replicated
    ``tokens_dropped`` buffer the sum over the ranks: what one device counts running each rank's
    rows on their own (the whole batch at once, with its larger capacity, would drop others)."""
    import dataclasses

    from autoplan.bench.models.moe import MOE_CONFIGS, MoETransformer

    cfg = dataclasses.replace(MOE_CONFIGS["debug"], capacity_factor=1.0, count_dropped=True)
    batch = torch.randint(0, cfg.vocab_size, (8, 16), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    ref = MoETransformer(cfg)
    with torch.no_grad():  # routing far from ties, so no rounding difference flips a choice
        for layer in ref.layers:
            layer.feed_forward.router.weight.mul_(50.0)
    state = {k: v.clone() for k, v in ref.state_dict().items()}
    with torch.no_grad():
        for rows in batch.chunk(2):  # dp rank r holds rows 4r..4r+3
            ref(rows)
    expected = [int(layer.feed_forward.tokens_dropped) for layer in ref.layers]
    assert all(n > 0 for n in expected)

    mesh = fake_mesh((2, 4), ("dp", "tp"))
    with torch.device("meta"):
        model = MoETransformer(cfg)
    with AutoParallel(model, mesh, input_fn=lambda: batch) as ap:
        ap.add_input_constraints([(S0, R)])
        ap.add_output_constraints([(S0, R)])
        pmod = ap.apply_placement(ap.optimize_placement())
    pmod.to_empty(device="cpu")
    pmod.init_weights()
    pmod.load_state_dict(state)
    with LocalTensorMode(8):
        local = distribute_tensor(batch, mesh, (S0, R)).to_local()
        out = pmod(local)
        DTensor.from_local(out, mesh, (S0, R), run_check=False).mean().backward()
        counted = [int(one_value(layer.feed_forward.tokens_dropped)) for layer in pmod.layers]
    assert counted == expected, (counted, expected)
