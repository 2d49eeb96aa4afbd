"""Ground truth on 8 simulated ranks (a 2x4 mesh, ``LocalTensorMode``, one process): the parallel
module itself, built from the lowered per-rank graphs, trains three AdamW steps with the
single-device losses and gradients, eager and through the Inductor backend.

One graph serves all simulated ranks, so this also checks that the lowered graph is rank-generic
(chunk choices indexed by the mesh-coordinate input, not baked in from the tracing rank).
"""

import pytest
import torch
from conftest import fake_mesh
from parallel_run import (
    FSDP,
    LLAMA_TP,
    MLP_TP,
    check_run,
    graph_report,
    one_value,
    parallel_run,
    plan_and_apply,
    reference_run,
    round_trip_pins,
)
from torch.distributed._local_tensor import LocalTensor, LocalTensorMode
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.experimental import implicit_replication

from autoplan import AutoParallel, ConstraintError
from autoplan.lower.collectives import is_c10d

RANKS = 8
R, P, S0, S1 = Replicate(), Partial(), Shard(0), Shard(1)


def _run(name: str, pins: list, compiled: bool, return_dtensor: bool = False, **apply_options) -> dict:
    mesh = fake_mesh((2, 4), ("dp", "tp"))
    ref = reference_run(name, batch_rows=8)
    plan, lowered, pmod = plan_and_apply(mesh, name, pins, batch_rows=8, return_dtensor=return_dtensor, **apply_options)
    with LocalTensorMode(RANKS):
        result = parallel_run(mesh, pmod, ref, compiled, plain=one_value)
    return result | {"ref_losses": ref.losses} | graph_report(plan, lowered)


@pytest.mark.parametrize(
    "pins", [[], pytest.param(FSDP, marks=pytest.mark.slow), LLAMA_TP], ids=["free", "fsdp", "tp"]
)  # fsdp: by default test_stamping runs FSDP's numerics on an 8-layer LLaMA
def test_llama_debug_eager(pins):
    r = _run("llama", pins, compiled=False)
    check_run(r)
    if pins:  # the plan really splits parameters across the simulated ranks
        assert any("Shard" in v for v in r["params"].values())


@pytest.mark.parametrize("option", ["full", pytest.param("selective", marks=pytest.mark.slow)])  # ~13 s each
def test_llama_debug_recompute(option):
    """Layers recomputed in backward (all their forward ops, or the cheap ones) under FSDP pins: the
    backward runs the recomputed ops again and the numerics are single-device's."""
    r = _run("llama", FSDP, compiled=False, recompute=[("layers.*", option)])
    check_run(r)
    assert set(r["recompute"].values()) == {option} and r["recomputed_ops"] > 0


@pytest.mark.slow  # ~15 s
def test_a_mesh_dim_of_one_rank_runs_no_collective():
    """On a (2, 1) mesh the TP pins split weights over a mesh dim of one rank: the plan prices no
    move over it, so the program runs none (a gloo group of one would still copy and sync), and
    the numerics are single-device's."""
    mesh = fake_mesh((2, 1), ("dp", "tp"))
    ref = reference_run("llama", batch_rows=8)
    plan, lowered, pmod = plan_and_apply(mesh, "llama", LLAMA_TP, batch_rows=8)
    with LocalTensorMode(2):
        r = parallel_run(mesh, pmod, ref, False, plain=lambda t: one_value(t, 2))
    check_run(r | {"ref_losses": ref.losses} | graph_report(plan, lowered))
    tp = mesh.get_group("tp").group_name
    on_tp = [n for g in (lowered.forward, lowered.backward) for n in g.graph.nodes if is_c10d(n) and tp in n.args]
    assert not on_tp, on_tp


def test_llama_debug_keeping_gathered_weights():
    """FSDP with ``reshard_after_forward=False``: the backward reuses the forward's gathers."""
    r = _run("llama", FSDP, compiled=False, reshard_after_forward=False)
    check_run(r)
    assert r["regathers"] == 0


@pytest.mark.parametrize("remove", [True, pytest.param(False, marks=pytest.mark.slow)], ids=["removed", "kept"])
def test_llama_debug_round_trips(remove):
    """Round trips provoked by pins compute the same whether the pass removes them or not."""
    r = _run("llama", round_trip_pins, compiled=False, remove_round_trips=remove)
    check_run(r)
    assert (r["round_trips"] > 0) == remove


@pytest.mark.slow  # ~47 s: Inductor compiles every region (compiled numerics stay in the default run:
# test_small_models' mlp, test_sharded_dtensor_output_backpropagates)
def test_llama_debug_inductor_regional():
    """``apply_placement(compile=True)``: four layers, the two middle ones sharing compiled regions."""
    check_run(_run("llama4", LLAMA_TP, compiled=False, compile=True))


@pytest.mark.parametrize(
    "name, compiled",
    [
        ("mlp", False),
        pytest.param("mlp", True, marks=pytest.mark.slow),  # ~20 s; test_sharded_dtensor_output_... compiles
        ("tied", False),
        pytest.param("tied", True, marks=pytest.mark.slow),
        ("weightnorm", False),
        pytest.param("weightnorm", True, marks=pytest.mark.slow),
        ("corners", False),
    ],
)
def test_small_models(name, compiled):
    check_run(_run(name, MLP_TP if name == "mlp" else FSDP, compiled))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "inductor"])
def test_sharded_dtensor_output_backpropagates(compiled):
    r = _run("mlp", MLP_TP, compiled, return_dtensor=True)
    check_run(r)
    assert "Shard" in r["params"]["fc1.weight"]  # a really sharded (tensor-parallel) output path


def test_optimizer_steps_each_simulated_rank_once():
    """After ``to_empty`` each simulated rank owns its shard's storage: a shared plain tensor would
    take the in-place update once per rank (here 8 SGD steps instead of one)."""
    mesh = fake_mesh((2, 4), ("dp", "tp"))
    _, _, pmod = plan_and_apply(mesh, "mlp", MLP_TP, batch_rows=8)
    with LocalTensorMode(RANKS) as mode:
        pmod.to_empty(device="cpu")
        for p in pmod.parameters():
            torch.nn.init.zeros_(p)
            ones = mode.rank_map(lambda _, p=p: torch.ones(p.to_local().shape))  # a gradient computed per rank
            p.grad = DTensor.from_local(ones, mesh, p.placements, run_check=False)
        torch.optim.SGD(pmod.parameters(), lr=0.5).step()
        assert all(torch.equal(one_value(p.full_tensor()), torch.full(p.shape, -0.5)) for p in pmod.parameters())


def _local_values(mesh, src, full: torch.Tensor) -> DTensor:
    """``full`` placed as ``src`` on every simulated rank; a Partial source holds a different addend per rank."""
    from torch.distributed.tensor import distribute_tensor

    if not any(p.is_partial() for p in src):
        return distribute_tensor(full, mesh, src)
    plain = [Replicate() if p.is_partial() else p for p in src]
    shard = distribute_tensor(full, mesh, plain).to_local()
    shards = shard._local_tensors if isinstance(shard, LocalTensor) else dict.fromkeys(range(RANKS), shard)
    addends = {r: t * (r + 1) for r, t in shards.items()}  # sums differ from any one rank's value
    return DTensor.from_local(LocalTensor(addends), mesh, src, run_check=False)


@pytest.mark.parametrize(
    "src, dst",
    [((R, S1), (R, R)), ((S0, S1), (S0, R)), ((R, P), (R, S1)), ((P, S0), (S1, S0))],
    ids=["gather-dim1", "gather-dim1-under-dp", "reduce-scatter-dim1", "reduce-scatter-dim1-on-dp"],
)
def test_non_leading_dim_collectives_are_one_copy(src, dst):
    """A gather or reduce-scatter on tensor dim 1 runs on dim 0 with one re-layout copy (DTensor's
    own path splits into one chunk per rank and concatenates), with DTensor's values on every rank."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from autoplan.adapters.dtensor import redistribute
    from autoplan.adapters.local_tensor import mesh_coordinate

    mesh = fake_mesh((2, 4), ("dp", "tp"))
    torch.manual_seed(0)
    full = torch.randn(8, 16, 4)
    with LocalTensorMode(RANKS):
        value = _local_values(mesh, src, full)
        expected = value.redistribute(mesh, dst).to_local()
        ours = redistribute(value, dst, mesh_coordinate(mesh)).to_local()
        for r in range(RANKS):
            assert torch.allclose(ours._local_tensors[r], expected._local_tensors[r], rtol=1e-6, atol=1e-6)
        local = value.to_local()
        rank0 = local._local_tensors[0] if isinstance(local, LocalTensor) else local
    coordinate = torch.zeros(2, dtype=torch.int64)

    def move(t: torch.Tensor) -> torch.Tensor:
        return redistribute(DTensor.from_local(t, mesh, src, run_check=False), dst, coordinate).to_local()

    ops = [n.target for n in make_fx(move)(rank0).graph.nodes if n.op == "call_function"]
    aten = torch.ops.aten
    assert not {aten.cat.default, aten.split.Tensor, aten.chunk.default} & set(ops)
    assert ops.count(aten.clone.default) == 1  # the re-layout; the collective itself is the only other work


class _Positions(torch.nn.Module):
    """Token plus learned position embeddings; the positions are a non-persistent ``arange`` buffer."""

    def __init__(self, seq: int = 8):
        super().__init__()
        self.tok, self.pos, self.out = torch.nn.Embedding(32, 16), torch.nn.Embedding(seq, 16), torch.nn.Linear(16, 4)
        self.register_buffer("positions", torch.arange(seq), persistent=False)

    def forward(self, x):
        return self.out(self.tok(x) + self.pos(self.positions))


def test_unfilled_non_persistent_buffer_is_named_before_it_runs():
    """A meta model given ``to_empty`` + ``load_state_dict``: the positions buffer is not in the state
    dict, so it still holds what ``to_empty`` left (the largest int64, never a valid index). The
    first step names it and the fix; once it is filled (through the DTensor, which leaves the
    local tensor's version counter alone) the step runs to single-device numerics."""
    torch.manual_seed(0)
    real = _Positions()
    x = torch.randint(0, 32, (8, 8))
    with torch.device("meta"):
        meta = _Positions()
    mesh = fake_mesh((2, 4), ("dp", "tp"))
    with AutoParallel(meta, mesh, input_fn=lambda: x) as ap:
        ap.add_input_constraints([(R, R)])
        ap.add_output_constraints([(R, R)])
        pmod = ap.apply_placement(ap.optimize_placement())
    with LocalTensorMode(RANKS):
        pmod.to_empty(device="cpu")
        # marked, not left as whatever the memory held: it may hold the very values an init writes
        assert torch.all(one_value(pmod.get_buffer("positions")) == torch.iinfo(torch.int64).max)
        pmod.load_state_dict(real.state_dict())
        with pytest.raises(ConstraintError, match=r"buffer 'positions' is not in the state dict .* init_weights"):
            pmod(x)
        with implicit_replication():
            pmod.get_buffer("positions").copy_(torch.arange(8))
        out = one_value(pmod(x))
    torch.testing.assert_close(out, real(x), rtol=1e-5, atol=1e-6)
