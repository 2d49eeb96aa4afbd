"""Gathering a weight under its transpose (``lower.passes.transposed_gather``): FSDP weights read by
``mm`` through ``t(w)`` are gathered as rows and transposed after, with no relayout copy, and the
step keeps single-device numerics."""

import functools

import pytest
import torch
from conftest import fake_mesh
from parallel_run import check_run, graph_report, one_value, parallel_run, plan_and_apply, reference_run
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.tensor import Shard

from autoplan.lower.passes.transposed_gather import gather_under_transposes

c10d = torch.ops._c10d_functional
aten = torch.ops.aten
FSDP = [("*weight", (Shard(0),))]


def _relayouts(gm) -> int:
    """``permute`` nodes reading a gathered value through a view: the strided block moves."""
    out = 0
    for node in gm.graph.find_nodes(op="call_function", target=aten.permute.default):
        src = node.args[0]
        while src.op == "call_function" and src.target in (aten.view.default, aten._unsafe_view.default):
            src = src.args[0]
        out += src.op == "call_function" and src.target is c10d.wait_tensor.default
    return out


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["eager", "inductor"])
def test_fsdp_weights_gathered_under_their_transpose_keep_single_device_numerics(compiled):
    """LLaMA (debug) with every weight stored split on its rows over 4 ranks: the gathers of
    ``t(w)`` become gathers of ``w`` (no block relayout left after any gather), the pass finds
    nothing more to do on its own output, and three AdamW steps match one device, eager and
    compiled by Inductor."""
    mesh = fake_mesh((4,))
    io = (Shard(0),)
    ref = reference_run("llama", batch_rows=8)
    plan, lowered, pmod = plan_and_apply(mesh, "llama", FSDP, batch_rows=8, io=io)
    assert lowered.transposed_gathers.rewritten >= 8  # forward gathers and backward re-gathers
    assert _relayouts(lowered.joint) == 0
    assert gather_under_transposes(lowered.joint.graph).rewritten == 0
    with LocalTensorMode(4):
        r = parallel_run(mesh, pmod, ref, compiled, plain=functools.partial(one_value, ranks=4), io=io)
    check_run(r | {"ref_losses": ref.losses} | graph_report(plan, lowered))


def test_without_the_pass_the_same_plan_relays_out_its_gathered_weights(monkeypatch):
    """The oracle of the test above: the same plan lowered without the pass moves blocks after its
    gathers (the copies the pass removes)."""
    import autoplan.lower.lowering as lowering
    from autoplan.lower.passes.transposed_gather import TransposedGatherStats

    monkeypatch.setattr(lowering, "gather_under_transposes", lambda graph: TransposedGatherStats(0))
    _, lowered, _ = plan_and_apply(fake_mesh((4,)), "llama", FSDP, batch_rows=8, io=(Shard(0),))
    assert _relayouts(lowered.joint) >= 8
