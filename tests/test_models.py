"""Models users bring beyond decoders, written the usual way: each planned on a fake (2, 4) mesh, run
for two AdamW steps on 8 simulated ranks (``LocalTensorMode``) and checked against the same model on
one device: the losses, every parameter's gradient and every buffer the step writes."""

import math

import pytest
import torch
from conftest import fake_mesh
from models import CheckpointedMLP, ResNet, ViT
from parallel_run import close, one_value
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from autoplan import AutoParallel, Plan

STEPS = 2
R, S0 = Replicate(), Shard(0)
IO = (S0, R)
aten = torch.ops.aten


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """A squared error against fixed targets: BatchNorm makes the gradients of a plain mean of the
    outputs cancel to round-off, which no fp32 comparison could check."""
    return (out - target).square().mean()


def run_both(build, batches, targets, constrain=lambda ap: None, shape=(2, 4), **settings):
    """Two AdamW steps of ``build()`` on one device and of its plan on a simulated mesh of ``shape``
    (inputs and outputs split on the batch over its first dim; a batch is one tensor or a tuple of
    ``forward``'s positional arguments; ``settings``: more ``AutoParallel`` keywords). Returns the
    plan, the lowered graph's collectives and what differs (an empty list when all match)."""
    batches = [b if isinstance(b, tuple) else (b,) for b in batches]
    torch.manual_seed(0)
    ref = build()
    state = {k: v.clone() for k, v in ref.state_dict().items()}
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    ref_losses, ref_grads = [], {}
    for step, (x, y) in enumerate(zip(batches, targets)):
        loss = _loss(ref(*x), y)
        loss.backward()
        if step == 0:
            ref_grads = {n: None if p.grad is None else p.grad.clone() for n, p in ref.named_parameters()}
        ref_losses.append(loss.detach())
        opt.step()
        opt.zero_grad()

    mesh, io, ranks = fake_mesh(shape), (S0, *[R] * (len(shape) - 1)), math.prod(shape)
    with torch.device("meta"):
        model = build()
    example = [(t.shape, t.dtype) for t in batches[0]]  # input_fn runs under fake tensors: no data in it
    with AutoParallel(model, mesh, lambda: tuple(torch.zeros(s, dtype=d) for s, d in example), **settings) as ap:
        ap.add_input_constraints([io] * len(example))
        ap.add_output_constraints([io])
        constrain(ap)
        plan = ap.optimize_placement()
        pmod = ap.apply_placement(plan)
    differ = []
    with LocalTensorMode(ranks):
        pmod.to_empty(device="cpu")
        pmod.load_state_dict(state)
        opt = torch.optim.AdamW(pmod.parameters(), lr=1e-2)
        for step, (x, y) in enumerate(zip(batches, targets)):
            local = [distribute_tensor(t, mesh, io).to_local() for t in x]
            out = DTensor.from_local(pmod(*local), mesh, io, run_check=False)
            loss = _loss(out, distribute_tensor(y, mesh, io))
            loss.backward()
            if not close(one_value(loss, ranks), ref_losses[step]):
                differ.append(f"loss {step}")
            if step == 0:
                grads = [(n, None if p.grad is None else one_value(p.grad, ranks)) for n, p in pmod.named_parameters()]
                for n, g in grads:  # a frozen parameter has no gradient on either side
                    want = ref_grads[n]
                    if (g is None) != (want is None) or (g is not None and not close(g, want)):
                        differ.append(n)
            opt.step()
            opt.zero_grad()
        for name, b in pmod.named_buffers():
            want = ref.get_buffer(name)
            got = one_value(b, ranks)
            if not (torch.equal(got, want) if not want.is_floating_point() else close(got, want)):
                differ.append(f"buffer {name}")
    return plan, ap.lowered.collective_counts(), differ


def _batchnorm_means(ap: AutoParallel) -> list:
    """The per-channel means of the BatchNorm statistics (4-D, forward): the reductions over the batch."""
    return [
        n
        for n in ap.traced.gm.graph.nodes
        if n.target is aten.mean.dim and n.meta["val"].ndim == 4 and n.meta.get("autoplan_phase") == "forward"
    ]


def test_resnet_with_batchnorm_in_training_mode_matches_one_device():
    """A ResNet whose BasicBlocks of growing widths sit in one ``nn.Sequential``, BatchNorm in training
    mode. Pinned to split the batch at every convolution, with each statistic reduced from the local
    shards (``SyncBatchNorm``'s contract): the step is one device's, running statistics included."""

    def split_batch(ap):
        for name in ("convolution", "convolution_[0-9]*", "relu*"):
            ap.add_node_constraint(name, IO)
        for n in _batchnorm_means(ap):
            ap.add_node_constraint(n, (Partial("avg"), R))

    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(16, 3, 16, 16, generator=g) for _ in range(STEPS)]
    targets = [torch.randn(16, 10, generator=g) for _ in range(STEPS)]
    plan, collectives, differ = run_both(lambda: ResNet(classes=10), batches, targets, split_batch)
    assert not differ, differ
    assert collectives.get("all_reduce", 0) > 0  # the statistics, summed over the batch shards
    assert plan.nodes["convolution"].inputs[0] == IO


def test_batchnorm_statistics_over_the_split_batch_emerge_from_costs():
    """At ResNet-18 widths on a batch of 256 64x64 images, nothing pinned: the planner splits the batch
    over all 8 ranks and reduces every BatchNorm statistic across them, because that costs less than
    gathering the activations."""
    mesh = fake_mesh((2, 4))
    with torch.device("meta"):
        model = ResNet(widths=(64, 128, 256, 512), classes=8)
    with AutoParallel(model, mesh, lambda: torch.randn(256, 3, 64, 64)) as ap:
        ap.add_input_constraints([IO])
        ap.add_output_constraints([IO])
        ap.add_memory_constraint(param_fraction=1 / 8)
        plan = ap.optimize_placement()
        means = _batchnorm_means(ap)
    assert len(means) == 2 * 20  # mean and variance of the stem's and the blocks' 19 BatchNorms
    for n in means:
        strategy = plan.nodes[n.name]
        assert all(isinstance(p, Shard) for p in strategy.inputs[0]), (n.name, strategy)
        assert all(isinstance(p, Partial) for p in strategy.outputs[0]), (n.name, strategy)
    assert plan.collective_counts().get("all_reduce", 0) >= len(means)


def test_vit_with_a_class_token_and_197_positions_matches_one_device():
    """A ViT: patch embedding, a class token, 197 learned positions (no mesh dim splits them evenly) and
    a 10-class head, under the README's parameter budget of 1/8: stored unevenly where they do not
    split, and trained as one device trains it."""
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(8, 3, 56, 56, generator=g) for _ in range(STEPS)]
    targets = [torch.randn(8, 10, generator=g) for _ in range(STEPS)]
    plan, _, differ = run_both(ViT, batches, targets, lambda ap: ap.add_memory_constraint(param_fraction=1 / 8))
    assert not differ, differ
    assert plan.param_placements["pos"] != (R, R)


def test_frozen_parameters_plan_and_train_like_one_device():
    """A parameter with ``requires_grad=False`` (a frozen embedding or backbone, Whisper's positions,
    a LoRA base weight): it has no gradient, in the plan or on one device, and the rest trains as
    on one device."""

    def build():
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))
        model[0].weight.requires_grad_(False)
        return model

    batches = [torch.randn(16, 32, generator=torch.Generator().manual_seed(s)) for s in range(STEPS)]
    targets = [torch.randn(16, 32, generator=torch.Generator().manual_seed(10 + s)) for s in range(STEPS)]
    plan, _, differ = run_both(build, batches, targets)
    assert not differ, differ


def test_checkpointed_closures_and_a_custom_autograd_function_match_one_device():
    """``torch.utils.checkpoint`` over closures that read the layer's parameters, a custom
    ``autograd.Function`` inside: planned, lowered and run as one device runs it."""
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(16, 32, generator=g) for _ in range(STEPS)]
    targets = [torch.randn(16, 32, generator=g) for _ in range(STEPS)]
    plan, _, differ = run_both(CheckpointedMLP, batches, targets)
    assert not differ, differ
    # the recomputation is kept, and the plan says so: each layer's first linear runs again in backward
    assert {f"layers.{i}.0" for i in range(3)} <= set(plan.checkpointed)
    assert "the model's own checkpointing reruns" in plan.summary()
    assert Plan.from_json(plan.to_json()).checkpointed == plan.checkpointed


def test_the_models_own_checkpointing_is_kept_unless_a_cap_lets_the_planner_drop_it():
    """Uncapped, the layers' own checkpointing is the ``checkpoint`` recompute option, pinned. Under a
    cap the planner chooses: with room for the fastest plan that saves every value it drops the
    recomputation (a faster step, run as one device runs it), and below the least peak of such a
    plan it recomputes again. On a 4-way mesh; the batch (512 rows) makes the activations outweigh
    the parameters."""
    from autoplan.errors import InfeasiblePlanError

    with torch.device("meta"):
        model = CheckpointedMLP()
    with AutoParallel(model, fake_mesh((4,)), lambda: torch.randn(512, 32)) as ap:
        ap.add_input_constraints([(S0,)])
        ap.add_output_constraints([(S0,)])
        kept = ap.optimize_placement()
        ap.add_recompute_constraint("layers.*", "none")
        saved = ap.optimize_placement()
        ap.add_memory_constraint(bytes_per_device=1)
        with pytest.raises(InfeasiblePlanError) as info:
            ap.optimize_placement()
        least_saving_all = info.value.smallest_peak_bytes
        ap.remove_recompute_constraint()
        ap.add_memory_constraint(bytes_per_device=least_saving_all * 0.99)
        tight = ap.optimize_placement()
    assert kept.recompute == {f"layers.{i}": "checkpoint" for i in range(3)}
    assert "the model's own checkpointing reruns" in kept.summary() and kept.cost.recompute > 0
    assert not saved.recompute and not saved.checkpointed and saved.cost.total < kept.cost.total
    assert tight.recompute and tight.memory.peak_bytes <= least_saving_all * 0.99

    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(512, 32, generator=g) for _ in range(STEPS)]
    targets = [torch.randn(512, 32, generator=g) for _ in range(STEPS)]
    roomy = saved.memory.peak_bytes
    dropped, _, differ = run_both(
        CheckpointedMLP, batches, targets, lambda ap: ap.add_memory_constraint(bytes_per_device=roomy), (4,)
    )
    assert not differ, differ
    assert not dropped.recompute and not dropped.checkpointed and "checkpointing" not in dropped.summary()


@pytest.mark.parametrize("momentum", [0.1, None], ids=["exponential", "cumulative"])
def test_traced_batchnorm_follows_the_module(momentum, monkeypatch):
    """The batch norm that tracing substitutes (``autoplan.trace.batch_norm``) normalises, updates the running
    statistics (with a momentum or as the cumulative average, ``momentum=None``) and counts batches as
    ``nn.BatchNorm2d`` does, in training and in eval mode."""
    from torch import nn

    from autoplan.trace.batch_norm import batch_norm

    torch.manual_seed(0)
    x = torch.randn(6, 4, 5, 5)
    ref, ours = nn.BatchNorm2d(4, momentum=momentum), nn.BatchNorm2d(4, momentum=momentum)
    with torch.no_grad():
        outputs = [ref(x) for _ in range(3)] + [ref.eval()(x)]
    monkeypatch.setattr(torch.nn.functional, "batch_norm", batch_norm)
    with torch.no_grad():
        assert all(close(ours(x), want) for want in outputs[:3]) and close(ours.eval()(x), outputs[3])
    for name in ("running_mean", "running_var"):
        assert close(ours.get_buffer(name), ref.get_buffer(name))
    assert ours.num_batches_tracked == ref.num_batches_tracked == 3
