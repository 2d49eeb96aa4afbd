"""Bucketing (``lower.passes.bucketing``): a layer's collectives issued together run as one on a flat
buffer, the next layer's bucketed gather is prefetched, and the values computed are exactly those
of the unbucketed program (on ``LocalTensorMode``'s simulated ranks and on gloo)."""

from collections import Counter

import pytest
import torch
from conftest import fake_mesh
from gloo import run_gloo
from parallel_run import FSDP, IO, LLAMA_TP, one_value, plan_and_apply, reference_run
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.tensor import DTensor, distribute_tensor

from autoplan.lower.collectives import collective_kind, is_c10d
from autoplan.lower.lowering import REGION_KEY
from autoplan.lower.passes.bucketing import BUCKET_KEY
from autoplan.lower.passes.fsdp_recompute import CHEAP

GATHER = "all_gather"


def _param_names(lowered) -> set[str]:
    joint = lowered.joint.graph.find_nodes(op="placeholder")
    return {n.name for n, (kind, _) in zip(joint, lowered.input_labels) if kind == "param"}


def _of_parameters(gather, params: set[str]) -> bool:
    """Is ``gather``'s input made from parameters (their shards, saved for the backward) by cheap
    ops (views, casts, the packing of a bucket) and collectives alone (a gather on another mesh
    dim first)?"""
    todo, seen = [gather.args[0]], set()
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder":
            if n.name not in params and n.name != "mesh_coordinate":
                return False
        elif n.op != "call_function" or not (n.target in CHEAP or is_c10d(n)):
            return False
        else:
            todo.extend(n.all_input_nodes)
    return True


def _parameter_gathers_per_layer(gm, params: set[str]) -> dict[tuple[str, str], int]:
    """(layer, process group) -> parameter all-gathers in ``gm``."""
    out: Counter = Counter()
    for n in gm.graph.nodes:
        if collective_kind(n) == GATHER and (layer := n.meta.get(REGION_KEY)) and _of_parameters(n, params):
            out[layer, n.args[-1]] += 1
    return dict(out)


@pytest.mark.parametrize("pins", [FSDP, LLAMA_TP], ids=["fsdp", "tp"])
def test_a_layers_parameter_gathers_run_as_one_collective_per_group_and_phase(pins):
    mesh = fake_mesh((2, 4), ("dp", "tp"))
    plan, lowered, _ = plan_and_apply(mesh, "llama", pins, batch_rows=8)
    params = _param_names(lowered)
    for phase, gm in (("forward", lowered.forward), ("backward", lowered.backward)):
        gathers = _parameter_gathers_per_layer(gm, params)
        assert gathers and max(gathers.values()) == 1, (phase, gathers)
        assert lowered.unbucketed_per_layer[phase][GATHER] > 1  # there was something to bucket
    # the summary prints a layer's collectives before and after bucketing
    assert plan.passes["all_gather_per_layer_forward_before_bucketing"] > plan.passes["all_gather_per_layer_forward"]
    assert "per layer forward before bucketing" in plan.summary()
    merged = sum(n.meta.get(BUCKET_KEY, 0) for g in (lowered.forward, lowered.backward) for n in g.graph.nodes)
    assert merged == lowered.buckets.merged > lowered.buckets.buckets > 0


def test_buckets_hold_at_most_bucket_bytes():
    """With a bound of two weights' gathered bytes, a layer's gathers split into several buckets,
    none over the bound; with no bound they are one."""
    mesh = fake_mesh((2, 4), ("dp", "tp"))
    _, one, _ = plan_and_apply(mesh, "llama", LLAMA_TP, batch_rows=8)
    biggest = max(
        n.meta["val"].numel() * n.meta["val"].element_size() // n.meta.get(BUCKET_KEY, 1)
        for n in one.forward.graph.nodes
        if collective_kind(n) == GATHER
    )
    bound = 2 * biggest
    _, split, _ = plan_and_apply(mesh, "llama", LLAMA_TP, batch_rows=8, bucket_bytes=bound)
    sizes = [
        n.meta["val"].numel() * n.meta["val"].element_size()
        for n in split.forward.graph.nodes
        if collective_kind(n) == GATHER and n.meta.get(REGION_KEY) == "layers.0"
    ]
    assert len(sizes) > 1 and max(sizes) <= bound


def test_the_next_layers_gather_is_issued_before_this_layers_first_matmul():
    """With prefetch (NCCL meshes), each layer's bucketed parameter gather is issued while the
    layer before it runs: before that layer's first matmul, in the forward and in the backward."""
    mesh = fake_mesh((2, 4), ("dp", "tp"))
    _, lowered, _ = plan_and_apply(mesh, "llama", FSDP, batch_rows=8, prefetch=True)
    for gm in (lowered.forward, lowered.backward):
        order = list(gm.graph.nodes)
        layers = list(dict.fromkeys(n.meta.get(REGION_KEY) for n in order if n.meta.get(REGION_KEY)))
        assert len(layers) >= 2
        for this, following in zip(layers, layers[1:]):
            first_mm = next(i for i, n in enumerate(order) if n.meta.get(REGION_KEY) == this and _is_matmul(n))
            gather = next(
                i for i, n in enumerate(order) if n.meta.get(REGION_KEY) == following and collective_kind(n) == GATHER
            )
            assert gather < first_mm, (this, following)
            assert order[gather].meta.get(BUCKET_KEY, 1) > 1


def _is_matmul(n) -> bool:
    return n.op == "call_function" and n.target in (torch.ops.aten.mm.default, torch.ops.aten.bmm.default)


def _one_step(mesh, pmod, ref, compiled: bool, plain, io=IO) -> dict[str, torch.Tensor]:
    """Loss and gradients of one forward and backward of ``pmod`` on ``ref``'s first batch."""
    import autoplan.run.compile

    pmod.to_empty(device="cpu")
    pmod.init_weights()
    pmod.load_state_dict(ref.initial_state)
    run = torch.compile(pmod, backend=autoplan.run.compile.backend()) if compiled else pmod
    out = run(distribute_tensor(ref.batches[0], mesh, io).to_local())
    loss = DTensor.from_local(out, mesh, io, run_check=False).mean()
    loss.backward()
    grads = {n: plain(p.grad.full_tensor()) for n, p in pmod.named_parameters()}
    return grads | {"loss": plain(loss.full_tensor())}


def _unchanged(bucketed: dict, plain: dict, exact: bool = True) -> list[str]:
    """What differs: bit for bit, or (Inductor, whose kernels fuse the packing and copies with the
    compute around them differently) beyond fp32 rounding."""
    if exact:
        return [k for k in plain if not torch.equal(bucketed[k], plain[k])]
    return [k for k in plain if not torch.allclose(bucketed[k], plain[k], rtol=1e-5, atol=1e-7)]


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["eager", "inductor"])
def test_bucketing_changes_no_value_on_simulated_ranks(compiled):
    """FSDP over both mesh dims of 2x4: the bucketed program's loss and gradients equal the
    unbucketed program's bit for bit (eager; within fp32 rounding compiled)."""
    mesh = fake_mesh((2, 4), ("dp", "tp"))
    ref = reference_run("llama", batch_rows=8)
    runs = {}
    for bucket_bytes in (0, None):
        options = {} if bucket_bytes is None else {"bucket_bytes": bucket_bytes}
        _, lowered, pmod = plan_and_apply(mesh, "llama", FSDP, batch_rows=8, **options)
        assert (lowered.buckets.merged > 0) == (bucket_bytes is None)
        with LocalTensorMode(8):
            runs[bucket_bytes] = _one_step(mesh, pmod, ref, compiled, one_value)
    assert not _unchanged(runs[None], runs[0], exact=not compiled)


def _gloo_worker(rank: int, compiled: bool) -> list[str]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    ref = reference_run("llama")
    fsdp, io = [(target, (pl[0],)) for target, pl in FSDP], (IO[0],)
    runs = []
    for options in ({"bucket_bytes": 0}, {}):
        _, lowered, pmod = plan_and_apply(mesh, "llama", fsdp, io=io, **options)
        runs.append(_one_step(mesh, pmod, ref, compiled, lambda t: t, io))
    return _unchanged(runs[1], runs[0], exact=not compiled)


@pytest.mark.slow  # ~40 s: two processes plan and run twice (LocalTensorMode checks the same by default)
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "inductor"])
def test_bucketing_changes_no_value_on_gloo(compiled):
    """On two gloo ranks (each sum has two terms, so the order cannot differ) the bucketed FSDP
    program's loss and gradients equal the unbucketed one's bit for bit (eager; within fp32
    rounding compiled)."""
    assert run_gloo(_gloo_worker, 2, compiled) == [[], []]
