"""Mixed precision (``AutoParallel(mp_policy=...)``, FSDP2's ``MixedPrecisionPolicy``): the casts in the
traced step, parameters gathered as bf16 shards, gradients reduced in fp32, compute priced at the
compute dtype, and the numerics of the same policy on one device (8 simulated ranks here, gloo in
``test_runtime_gloo``)."""

import dataclasses

import pytest
import torch
from conftest import fake_mesh
from parallel_run import (
    BF16,
    FSDP,
    IO,
    LLAMA_TP,
    check_run,
    graph_report,
    one_value,
    parallel_run,
    plan_and_apply,
    reference_run,
)
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.fsdp import MixedPrecisionPolicy

from autoplan import AutoParallel
from autoplan.bench.models.llama3 import LLAMA3_CONFIGS, Transformer
from autoplan.lower.collectives import collective_kind
from autoplan.lower.passes.fsdp_recompute import RECOMPUTE_KEY
from autoplan.trace.tracing import PATH_KEY, PHASE_KEY, trace_joint

aten = torch.ops.aten
BF16_COMPUTE = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
MP = dataclasses.replace(BF16_COMPUTE, output_dtype=torch.float32)  # the loss in fp32, as torchtitan computes it
# ops a parameter's gradient passes through unchanged in its partial sums (what a test can tell from
# the graph alone: a reduction before one of these reduces the parameter's gradient itself)
_PASS_THROUGH = {
    aten._to_copy.default,
    aten.t.default,
    aten.view.default,
    aten._unsafe_view.default,
    aten.reshape.default,
    aten.permute.default,
    aten.transpose.int,
    aten.alias.default,
    aten.clone.default,
    aten.add.Tensor,
}


def _llama(layers: int = 2, size: str = "debug", seq: int = 16):
    cfg = dataclasses.replace(LLAMA3_CONFIGS[size], n_layers=layers)
    with torch.device("meta"):
        model = Transformer(cfg)
    return model, (lambda: torch.randint(0, cfg.vocab_size, (8, seq)))


def test_each_module_casts_its_own_parameters_in_its_forward():
    """Every parameter is cast to bf16 once, by the module that owns it, in the forward; its
    gradient reaches the graph's output in fp32, cast back from the bf16 one. An 8-layer stack
    is still traced as two layers and stamped: the casts are part of each layer."""
    model, inputs = _llama(8)
    tg = trace_joint(model, inputs, mp_policy=BF16_COMPUTE)
    assert tg.stamped == 6
    grads = tg.outputs_of("grad_param")
    for fqn, p in tg.placeholder_for("param").items():
        assert p.meta["val"].dtype == torch.float32
        casts = [u for u in p.users if u.target is aten._to_copy.default]
        assert len(casts) == 1 and casts[0].meta["val"].dtype == torch.bfloat16, fqn
        assert casts[0].meta[PHASE_KEY] == "forward" and casts[0].meta[PATH_KEY] == fqn.rpartition(".")[0]
        grad = grads[fqn]
        assert grad.meta["val"].dtype == torch.float32 and grad.target is aten._to_copy.default, fqn
        assert grad.args[0].meta["val"].dtype == torch.bfloat16
    plain = trace_joint(model, inputs)
    assert not any(u.target is aten._to_copy.default for p in plain.placeholder_for("param").values() for u in p.users)


def _gathers(graph) -> tuple[int, set]:
    """Bytes every rank receives from the all-gathers of ``graph``, and their dtypes."""
    total, dtypes = 0, set()
    for n in graph.graph.nodes:
        if collective_kind(n) == "all_gather":
            val = n.meta["val"]
            total += val.numel() * val.element_size()
            dtypes.add(val.dtype)
    return total, dtypes


def test_parameter_shards_are_cast_before_they_are_gathered():
    """FSDP pins on 2x4: the forward gathers bf16 shards, half the bytes of the fp32 plan's, and the
    cast and its gather are tagged so the backward casts and gathers again instead of keeping
    either copy. Free, under a parameter memory cap, the planner gathers bf16 shards too."""
    mesh = fake_mesh((2, 4), ("dp", "tp"))
    fp32 = plan_and_apply(mesh, "llama", FSDP, batch_rows=8)[1]
    mixed = plan_and_apply(mesh, "llama", FSDP, batch_rows=8, settings={"mp_policy": MP})[1]
    fp32_bytes, fp32_dtypes = _gathers(fp32.forward)
    mp_bytes, mp_dtypes = _gathers(mixed.forward)
    assert fp32_dtypes == {torch.float32} and mp_dtypes == {torch.bfloat16}
    assert mp_bytes * 2 == fp32_bytes
    regathers = [
        n for n in mixed.backward.graph.nodes if n.meta.get(RECOMPUTE_KEY) and collective_kind(n) == "all_gather"
    ]
    assert regathers
    for gather in regathers:  # each reads the fp32 shard, cast again in the backward
        chain, n = [], gather.args[0]
        while n.op != "placeholder":
            chain.append(n)
            n = n.all_input_nodes[0]
        assert n.meta["val"].dtype == torch.float32 and all(c.meta.get(RECOMPUTE_KEY) for c in chain)
        assert [c.meta["val"].dtype for c in chain if c.target is aten._to_copy.default] == [torch.bfloat16]
    model, inputs = _llama()
    with AutoParallel(model, mesh, inputs, mp_policy=MP) as ap:
        ap.add_input_constraints([IO])
        ap.add_output_constraints([IO])
        ap.add_memory_constraint(param_fraction=1 / 8)
        ap.apply_placement(ap.optimize_placement())
    free_bytes, free_dtypes = _gathers(ap.lowered.forward)
    assert free_dtypes == {torch.bfloat16} and free_bytes > 0


def _gradient_reductions(ap, plan) -> dict[str, torch.dtype]:
    """The backward's moves that sum a parameter's gradient (partial on some mesh dim, not after),
    by consumer, with the dtype they sum in. A gradient's sum is found from the graph: its value
    reaches a parameter's gradient output through ops its partial sums pass unchanged."""
    nodes = {n.name: n for n in ap.traced.gm.graph.nodes}
    grads = {g for g in ap.traced.outputs_of("grad_param").values() if g is not None}

    def feeds_gradient(n) -> bool:
        while n not in grads:
            users = [u for u in n.users if u.op == "call_function" and u.target in _PASS_THROUGH]
            if len(users) != 1:
                return False
            n = users[0]
        return True

    found = {}
    for r in plan.redistributions:
        if r.phase != "backward" or not any(a.is_partial() and not b.is_partial() for a, b in zip(r.src, r.dst)):
            continue
        producer = nodes[r.producer]
        if feeds_gradient(producer):
            found[r.consumer] = producer.meta["val"].dtype
    return found


@pytest.mark.parametrize("reduce_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gradients_are_reduced_in_reduce_dtype(reduce_dtype):
    """LLaMA-3 8B dims (one layer, 8 x 1024 tokens) on 8 ranks, the batch split and parameters
    split under a memory cap: every parameter gradient's reduction sums in ``reduce_dtype``. With
    bf16 allowed the planner takes it (half the bytes), so fp32 is what the policy holds it to."""
    model, inputs = _llama(1, "8b", 1024)
    policy = dataclasses.replace(MP, reduce_dtype=reduce_dtype)
    with AutoParallel(model, fake_mesh((8,)), inputs, mp_policy=policy) as ap:
        ap.add_input_constraints([(IO[0],)])
        ap.add_output_constraints([(IO[0],)])
        ap.add_memory_constraint(param_fraction=1 / 8)
        plan = ap.optimize_placement()
    reductions = _gradient_reductions(ap, plan)
    assert len(reductions) >= 5
    assert set(reductions.values()) == {reduce_dtype}, reductions


def test_compute_is_priced_at_the_compute_dtype():
    """LLaMA-3 8B dims (one layer, 8 x 1024 tokens) on H100s, whose bf16 matmuls run at 15x the fp32
    rate: the same FSDP plan's compute is estimated at a fraction of the fp32 step's, and its
    communication (bf16 gathers, fp32 reductions) at less."""
    model, inputs = _llama(1, "8b", 1024)
    costs = {}
    for name, policy in (("fp32", None), ("mp", MP)):
        with AutoParallel(model, fake_mesh((2, 4)), inputs, mp_policy=policy, device_profile="h100") as ap:
            ap.add_input_constraints([IO])
            ap.add_output_constraints([IO])
            for target, placements in FSDP:
                ap.add_node_constraint(target, placements)
            costs[name] = ap.optimize_placement().cost
    compute = {k: c.compute_forward + c.compute_backward for k, c in costs.items()}
    assert compute["mp"] < 0.5 * compute["fp32"], compute
    assert costs["mp"].comm < 0.8 * costs["fp32"].comm, (costs["mp"].comm, costs["fp32"].comm)


@pytest.mark.parametrize(
    "pins, compiled",
    [([], False), (LLAMA_TP, False), pytest.param(FSDP, True, marks=pytest.mark.slow)],
    ids=["free", "tp", "fsdp-inductor"],
)
def test_mixed_precision_matches_one_device_under_local_tensor(pins, compiled):
    """Three AdamW steps on 8 simulated ranks: losses, first gradients and the fp32 parameters after
    the last step match one device running the same policy (``parallel_run.BF16``'s tolerances)."""
    mesh = fake_mesh((2, 4), ("dp", "tp"))
    ref = reference_run("llama", batch_rows=8, policy=MP, tolerance=BF16, optimizer="sgd")
    plan, lowered, pmod = plan_and_apply(mesh, "llama", pins, batch_rows=8, settings={"mp_policy": MP})
    with LocalTensorMode(8):
        r = parallel_run(mesh, pmod, ref, compiled, plain=one_value)
    check_run(r | {"ref_losses": ref.losses} | graph_report(plan, lowered))
    assert all(p.dtype == torch.float32 for p in pmod.parameters())
