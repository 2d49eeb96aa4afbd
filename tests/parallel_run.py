"""One training run of a planned model next to its single-device reference, shared by the gloo
(one process per rank) and LocalTensorMode (all ranks in one process) ground-truth tests."""

import copy
import dataclasses
from dataclasses import dataclass, field

import pytest
import torch
from conftest import expected_on_cpu
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from autoplan.lower.collectives import collective_kind, is_c10d
from autoplan.lower.passes.bucketing import members
from autoplan.lower.passes.fsdp_recompute import RECOMPUTE_KEY
from autoplan.trace import grouped_mm

R, S0, S1 = Replicate(), Shard(0), Shard(1)
IO = (S0, R)  # batch-sharded inputs and outputs
STEPS = 3
FSDP = [("*weight", (S0, S0))]
LLAMA_TP = [
    ("layers.*.attention.w[qkv].weight", (S0, S0)),
    ("layers.*.attention.wo.weight", (S0, S1)),
    ("layers.*.feed_forward.w[13].weight", (S0, S0)),
    ("layers.*.feed_forward.w2.weight", (S0, S1)),
]
MLP_TP = [("fc1.weight", (S0, S0)), ("fc2.weight", (S0, S1))]


def one_value(t: torch.Tensor, ranks: int = 8) -> torch.Tensor:
    """A replicated value as one tensor (a DTensor's full tensor), after checking every simulated rank
    holds it (to fp32 noise: compiled kernels may sum in a different order); a real rank's as it is."""
    from torch.distributed._local_tensor import LocalTensor

    if isinstance(t, DTensor):
        t = t.full_tensor()
    if not isinstance(t, LocalTensor):
        return t
    values = [t._local_tensors[r] for r in range(ranks)]
    for v in values[1:]:
        assert torch.allclose(v, values[0], rtol=1e-6, atol=1e-7)
    return values[0]


@dataclass(frozen=True)
class Tolerance:
    """How close a parallel run's values must be to single-device: elementwise ``allclose(rtol,
    atol)`` and a relative norm error below ``rel``."""

    rtol: float
    atol: float
    rel: float
    update: float  # the parameters' total update over the steps, relative norm error
    loss: float  # each step's loss, relative error
    loss_atol: float  # or absolute error (the mean of a model's outputs is near 0)


# updates: AdamW moves an element whose gradient is ~0 by about the learning rate, in the direction
# of that gradient's sign, which the order of a sum may flip: 1e-4 of the update's norm measured
FP32 = Tolerance(rtol=1e-5, atol=1e-6, rel=1e-5, update=1e-3, loss=1e-5, loss_atol=1e-6)
# bf16 compute (unit roundoff 2**-9, about 2e-3): a sharded contraction rounds each rank's partial
# sum to bf16 before they are summed, where one device rounds once, so values differ by a few
# roundoffs. Measured on LLaMA debug (FSDP, TP and free plans, eager and Inductor, 2x2 and 2x4, three
# SGD steps): gradients up to 0.69% apart (norm) and 1.5e-5 beyond rtol 2e-2 elementwise, updates
# 0.93%, losses (means of logits, near 0) 2.5e-5; the same policy against an fp32 run differs by 0.8%
# (gradients) and 0.87% (updates). Inductor computes a chain of bf16 ops without rounding between
# them, so it strays from eager bf16 about as far as fp32 does.
BF16 = Tolerance(rtol=2e-2, atol=1e-4, rel=1e-2, update=2e-2, loss=5e-3, loss_atol=1e-4)


def close(actual: torch.Tensor, expected: torch.Tensor, tol: Tolerance = FP32) -> bool:
    rel = float((actual - expected).norm() / expected.norm().clamp_min(1e-30))
    return bool(torch.allclose(actual, expected, rtol=tol.rtol, atol=tol.atol)) and rel < tol.rel


def same_update(actual: torch.Tensor, expected: torch.Tensor, ref, name: str) -> bool:
    """The parameter ``name`` after the steps moved as it did on one device: the relative norm
    error of its total update is below ``ref.tolerance.update``. AdamW's first steps move each
    element by about the learning rate whatever its gradient's size, so an element whose tiny
    gradient changes sign with the order of a sum moves the other way: elementwise checks do not
    hold even in fp32, the update's norm does. In bf16 so many gradients are near enough to 0 that
    AdamW's updates differ by several percent; SGD's follow the gradients (``optimizer="sgd"``)."""
    start = ref.initial_state[name]
    moved = (expected - start).norm().clamp_min(1e-30)
    err = float((actual - expected).norm() / moved)
    return err < ref.tolerance.update


def make(name: str, batch_rows: int = 4):
    from models import MLP, Corners, SelfAttention, TiedLM, WeightNormMLP

    from autoplan.bench.models.llama3 import LLAMA3_CONFIGS, Transformer

    if name in ("llama", "llama4", "llama8"):  # llama8: deep enough that tracing stamps its layers
        cfg = LLAMA3_CONFIGS["debug"]
        cfg = dataclasses.replace(cfg, n_layers=int(name[5:])) if name != "llama" else cfg
        return (lambda: Transformer(cfg)), (lambda g: torch.randint(0, cfg.vocab_size, (batch_rows, 16), generator=g))
    if name == "local_region":
        from models import LocalRegionMLP

        return LocalRegionMLP, (lambda g: torch.randn(2 * batch_rows, 32, generator=g))
    if name in ("moe_transformer", "moe_grouped"):  # no token dropped: a plan computes what one device does
        from autoplan.bench.models.moe import MOE_CONFIGS, MoETransformer

        experts = "grouped" if name == "moe_grouped" else "capacity"
        cfg = dataclasses.replace(MOE_CONFIGS["debug"], capacity_factor=4.0, experts=experts)
        return (lambda: MoETransformer(cfg)), (
            lambda g: torch.randint(0, cfg.vocab_size, (batch_rows, 16), generator=g)
        )
    if name == "data_dependent":
        from models import DataDependentMLP

        return DataDependentMLP, (lambda g: torch.randn(2 * batch_rows, 32, generator=g))
    if name == "capacity_moe":
        from models import CapacityMoE

        return (lambda: CapacityMoE(hidden=512)), (lambda g: torch.randn(batch_rows, 8, 32, generator=g))
    if name == "moe":
        from models import GroupedMoE

        return GroupedMoE, (lambda g: torch.randn(batch_rows, 8, 32, generator=g))
    if name == "tied":
        return TiedLM, (lambda g: torch.randint(0, 64, (batch_rows, 8), generator=g))
    if name == "mlp":
        return (lambda: MLP(32, 64, 32)), (lambda g: torch.randn(2 * batch_rows, 32, generator=g))
    if name == "uneven_mlp":  # 30 hidden units and 10 outputs: no mesh of 4 or 8 splits them evenly
        return (lambda: MLP(32, 30, 10)), (lambda g: torch.randn(2 * batch_rows, 32, generator=g))
    if name == "corners":
        return Corners, (lambda g: torch.randn(2 * batch_rows, 32, generator=g))
    if name == "weightnorm":
        return WeightNormMLP, (lambda g: torch.randn(2 * batch_rows, 32, generator=g))
    if name in ("attention_causal", "attention_masked"):  # masked: a non-causal sliding window
        masked = name == "attention_masked"
        build = lambda: SelfAttention(causal=not masked, window=8 if masked else None)  # noqa: E731
        return build, (lambda g: torch.randn(batch_rows, 32, 64, generator=g))
    if name == "attention_bias":  # a learned bias per head and position pair, as T5's
        return (lambda: SelfAttention(causal=False, learned_bias=True)), (
            lambda g: torch.randn(batch_rows, 32, 64, generator=g)
        )
    raise ValueError(name)


@dataclass
class Reference:
    model: torch.nn.Module
    batches: list
    initial_state: dict
    losses: list = field(default_factory=list)
    grads: dict = field(default_factory=dict)  # after the first step
    tolerance: Tolerance = FP32
    final: dict = field(default_factory=dict)  # the parameters after the last step
    optimizer: str = "adamw"  # what steps both runs: "adamw" (lr 1e-2) or "sgd" (lr 1e-1)


def make_optimizer(name: str, params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2) if name == "adamw" else torch.optim.SGD(params, lr=1e-1)


def reference_run(
    name: str, batch_rows: int = 4, policy=None, tolerance: Tolerance = FP32, optimizer: str = "adamw"
) -> Reference:
    """Three single-device optimizer steps (loss = mean of the outputs). With a mixed-precision
    ``policy``, as FSDP2 means it: the optimizer steps fp32 parameters, and each step runs a copy
    of the model whose parameters are cast to ``param_dtype`` (its inputs too, with
    ``cast_forward_inputs``; its outputs cast to ``output_dtype``), the copy's gradients cast back."""
    build, batch_fn = make(name, batch_rows)
    torch.manual_seed(0)
    model = build()
    batches = [batch_fn(torch.Generator().manual_seed(s)) for s in range(STEPS)]
    ref = Reference(model, batches, {}, tolerance=tolerance, optimizer=optimizer)
    ref.initial_state = {k: v.clone() for k, v in model.state_dict().items()}
    opt = make_optimizer(optimizer, model.parameters())
    work = model
    if policy is not None:
        work = copy.deepcopy(model)
        for p in work.parameters():
            p.data = p.data.to(policy.param_dtype)
    for step, batch in enumerate(ref.batches):
        if policy is not None:
            with torch.no_grad():
                for p, w in zip(model.parameters(), work.parameters()):
                    w.copy_(p)
            if policy.cast_forward_inputs and batch.dtype.is_floating_point:
                batch = batch.to(policy.param_dtype)
        with grouped_mm.any_dtype():  # an fp32 MoE's grouped matmuls (ATen's take bfloat16 only)
            out = work(batch)
            loss = (out if policy is None or policy.output_dtype is None else out.to(policy.output_dtype)).mean()
        loss.backward()
        if work is not model:
            for p, w in zip(model.parameters(), work.parameters()):
                p.grad, w.grad = None if w.grad is None else w.grad.to(p.dtype), None
        if step == 0:
            ref.grads = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
        ref.losses.append(float(loss.detach()))
        opt.step()
        opt.zero_grad()
    ref.final = {n: p.detach().clone() for n, p in model.named_parameters()}
    return ref


def plan_and_apply(
    mesh,
    name: str,
    pins,
    batch_rows: int = 4,
    attention: str = "auto",
    recompute=(),
    io=IO,
    settings: dict | None = None,
    **apply_options,
):
    """Plan ``name`` on ``mesh`` (I/O placed ``io``, batch-sharded by default; optional pins: a
    list, or a function of the traced graph giving one; ``attention`` picks the attention kernel;
    ``recompute``: (layers glob, option) pairs; ``settings``: more ``AutoParallel`` keywords) and
    build the parallel module.
    Returns the plan as lowered (after round-trip removal, with the pass report), the lowered graphs
    and the module."""
    from autoplan import AutoParallel

    build, batch_fn = make(name, batch_rows)
    with torch.device("meta"):
        model = build()
    inputs = lambda: batch_fn(torch.Generator())  # noqa: E731
    with AutoParallel(model, mesh, input_fn=inputs, attention=attention, **(settings or {})) as ap:
        ap.add_input_constraints([io])
        ap.add_output_constraints([io])
        for target, placements in pins(ap.traced) if callable(pins) else pins:
            ap.add_node_constraint(target, placements)
        for layers, option in recompute:
            ap.add_recompute_constraint(layers, option)
        plan = ap.optimize_placement()
        pmod = ap.apply_placement(plan, **apply_options)
    return ap.applied_plan, ap.lowered, pmod


def parallel_run(mesh, pmod, ref: Reference, compiled: bool, plain=lambda t: t, io=IO) -> dict:
    """The same three steps on the parallel module; ``plain`` turns a replicated value into a plain
    tensor (the identity on a real rank, a consistency check across simulated ranks)."""
    import autoplan.run.compile

    pmod.to_empty(device="cpu")
    if hasattr(pmod, "init_weights"):
        pmod.init_weights()
    pmod.load_state_dict(ref.initial_state)
    run = torch.compile(pmod, backend=autoplan.run.compile.backend()) if compiled else pmod
    opt = make_optimizer(ref.optimizer, pmod.parameters())
    return_dtensor = pmod._autoplan.return_dtensor
    losses, grads_ok = [], {}
    for step, batch in enumerate(ref.batches):
        out = run(distribute_tensor(batch, mesh, io).to_local())
        if return_dtensor:
            assert isinstance(out, DTensor) and out.placements == io
            loss = out.mean()  # a DTensor loss: backward flows through the sharded output
        else:
            loss = DTensor.from_local(out, mesh, io, run_check=False).mean()
        loss.backward()
        if step == 0:
            grads_ok = {
                n: (p.grad is None) == (ref.grads[n] is None)
                and (p.grad is None or close(plain(p.grad.full_tensor()), ref.grads[n], ref.tolerance))
                for n, p in pmod.named_parameters()
            }
        losses.append(float(plain(loss.full_tensor())))
        opt.step()
        opt.zero_grad()
    final = {n: plain(p.detach().full_tensor()) for n, p in pmod.named_parameters()}
    return {
        "losses": losses,
        "grads_ok": grads_ok,
        "tolerance": ref.tolerance,
        "final_ok": {n: final[n].dtype == p.dtype and same_update(final[n], p, ref, n) for n, p in ref.final.items()},
    }


def graph_report(plan, lowered) -> dict:
    """What the lowered graphs contain, for checking against the plan."""
    return {
        "lowered": lowered.collective_counts(),
        "forward": lowered.collective_counts(lowered.forward),
        "backward": lowered.collective_counts(lowered.backward),
        # the joint graph's moves, and the backward's regathers of parameters apart
        "planned": dataclasses.replace(
            plan, redistributions=[r for r in plan.redistributions if not r.again]
        ).collective_counts(),
        "recompute_chains": lowered.recompute.chains,
        "planned_regathers": [len(r.collectives) for r in plan.redistributions if r.again and r.collectives],
        "params": {k: str(v) for k, v in plan.param_placements.items()},
        "round_trips": plan.passes["round_trips_removed"],
        "fused": lowered.gather_fusion.fused,
        "fused_scatters": lowered.scatter_fusion.fused,
        "fused_reduces": lowered.reduce_fusion.fused,
        "recompute": plan.recompute,
        "recomputed_ops": lowered.activation_recompute,
        "regathers": sum(
            1
            for n in lowered.backward.graph.nodes
            if n.meta.get(RECOMPUTE_KEY) and getattr(n.target, "_opname", "") == "all_gather_into_tensor"
        ),
        "reruns": rerun_collectives(lowered.backward),
        "bucketed": dict(lowered.buckets.saved),
    }


def rerun_collectives(backward) -> dict[str, int]:
    """Collectives the backward runs again (tagged must-recompute: FSDP parameter chains), by kind."""
    reruns: dict[str, int] = {}
    for n in backward.graph.nodes:
        kind = collective_kind(n)
        if n.meta.get(RECOMPUTE_KEY) and kind and is_c10d(n):
            reruns[kind] = reruns.get(kind, 0) + members(n)
    return reruns


def check_run(r: dict) -> None:
    """Single-device numerics (losses, first-step gradients) and the plan's collectives in the graphs:
    the joint graph has exactly the planned ones (fused chains counted once), and forward plus
    backward add only the FSDP re-gathers, which the plan priced (each regathered move runs again,
    its chain of gathers fused into one collective or not)."""
    tol = r["tolerance"]
    assert r["losses"] == pytest.approx(r["ref_losses"], rel=tol.loss, abs=tol.loss_atol)
    bad = [n for n, ok in r["grads_ok"].items() if not ok]
    assert not bad, bad
    bad = [n for n, ok in r["final_ok"].items() if not ok]
    assert not bad, ("parameters after the last step", bad)
    planned = expected_on_cpu(r["planned"])
    if r["fused"]:
        planned["all_gather"] -= r["fused"]
    if r["fused_scatters"]:
        planned["reduce_scatter"] -= r["fused_scatters"]
    if r["fused_reduces"]:
        planned["all_reduce"] -= r["fused_reduces"]
    assert r["lowered"] == planned
    fwd, bwd = r["forward"], r["backward"]
    regathers = r["planned_regathers"] if r["recompute_chains"] else []  # else kept, not re-gathered
    assert len(regathers) <= sum(r["reruns"].values()) <= sum(regathers), (regathers, r["reruns"])
    # bucketing runs some of forward's and backward's collectives as one
    expected = {k: v + r["reruns"].get(k, 0) - r["bucketed"].get(k, 0) for k, v in r["lowered"].items()}
    assert {k: fwd.get(k, 0) + bwd.get(k, 0) for k in r["lowered"]} == expected


def round_trip_pins(traced) -> list:
    """Residual adds (the ops of ``layers.N`` itself) hidden-sharded on tp, their aliases gathered:
    the next residual add wants the add's own placement back, a round trip the pass removes."""
    import re

    from autoplan.lower.passes.alias_roundtrip import ALIAS_KEY
    from autoplan.trace.tracing import PATH_KEY, PHASE_KEY

    pins = []
    for n in traced.gm.graph.nodes:
        path = n.meta.get(PATH_KEY, "")
        residual = n.meta.get(PHASE_KEY) == "forward" and not n.meta.get(ALIAS_KEY)
        if n.op == "call_function" and residual and re.fullmatch(r"layers\.\d+", path):
            pins += [(n.name, (S0, Shard(2)))] + [(a.name, (S0, R)) for a in n.users if a.meta.get(ALIAS_KEY)]
    return pins
