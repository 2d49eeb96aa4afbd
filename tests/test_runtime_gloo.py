"""Ground truth: plans executed on a 2x2 gloo mesh (4 CPU processes) match single-device numerics.

Each spawn runs several configurations of one model (unconstrained, FSDP pins, TP pins) to pay
the process start-up once: three AdamW steps, losses and every gradient compared to a
single-device run with the same weights and inputs, and the lowered collectives counted against
the plan.
"""

import pytest
import torch
from gloo import run_gloo
from parallel_run import (
    BF16,
    FSDP,
    LLAMA_TP,
    MLP_TP,
    S0,
    R,
    check_run,
    graph_report,
    parallel_run,
    plan_and_apply,
    reference_run,
    round_trip_pins,
)
from torch.distributed.tensor import Shard


def _run_config(
    mesh,
    name: str,
    pins,
    compiled: bool,
    return_dtensor: bool,
    reshard: bool = True,
    round_trips: bool = True,
    policy=None,
) -> dict:
    ref = reference_run(name, policy=policy, **({} if policy is None else {"tolerance": BF16, "optimizer": "sgd"}))
    plan, lowered, pmod = plan_and_apply(
        mesh,
        name,
        pins,
        settings={"mp_policy": policy},
        return_dtensor=return_dtensor,
        reshard_after_forward=reshard,
        remove_round_trips=round_trips,
    )
    return parallel_run(mesh, pmod, ref, compiled) | {"ref_losses": ref.losses} | graph_report(plan, lowered)


def _worker(rank: int, name: str, configs: list) -> list:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    return [_run_config(mesh, name, *config) for config in configs]


def _check(results: list, n_configs: int) -> None:
    for rank_results in results:
        assert len(rank_results) == n_configs
        for r in rank_results:
            check_run(r)


@pytest.mark.slow  # by default examples/example_llama3.py --execute trains llama on gloo, LocalTensorMode runs TP
def test_llama_debug():
    """FSDP on dp with tensor parallelism on tp, on real gloo collectives (LocalTensorMode covers the
    other configurations in one process, the slow matrix below all of them on gloo)."""
    results = run_gloo(_worker, 4, "llama", [(LLAMA_TP, False, False)])
    _check(results, 1)
    assert results[0][0]["regathers"] > 0
    assert any("Shard" in v for v in results[0][0]["params"].values())


@pytest.mark.slow  # by default test_precision runs mixed precision on 8 simulated ranks
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "inductor"])
def test_llama_debug_mixed_precision(compiled):
    """fp32 parameters and optimizer, bf16 compute and gathers, fp32 gradient reductions
    (``MixedPrecisionPolicy``), on real gloo collectives: FSDP and TP pins train three steps as one
    device running the same policy does (``parallel_run.BF16``'s tolerances)."""
    from test_precision import MP

    configs = [(FSDP, compiled, False, True, True, MP), (LLAMA_TP, compiled, False, True, True, MP)]
    results = run_gloo(_worker, 4, "llama", configs)
    _check(results, len(configs))
    assert results[0][0]["regathers"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "inductor"])
def test_llama_debug_matrix(compiled):
    configs = [([], compiled, False), (FSDP, compiled, False), (LLAMA_TP, compiled, False)]
    if not compiled:  # FSDP keeping its gathered weights (reshard_after_forward=False) computes the same
        configs.append((FSDP, compiled, False, False))
        # round trips provoked by pins: removed, or kept with the pass off, both compute the same
        configs += [(round_trip_pins, compiled, False, True, True), (round_trip_pins, compiled, False, True, False)]
    results = run_gloo(_worker, 4, "llama", configs)
    _check(results, len(configs))
    assert results[0][1]["regathers"] > 0
    sharded = results[0][1]["params"]
    assert all("Shard(dim=0), Shard(dim=0)" in v for k, v in sharded.items() if k.endswith("weight"))
    assert compiled or results[0][3]["regathers"] == 0
    assert compiled or (results[0][4]["round_trips"] > 0 and results[0][5]["round_trips"] == 0)


@pytest.mark.slow  # ~30 s of Inductor on 4 processes; compiled numerics stay in test_local_tensor
def test_small_model_compiled():
    """The Inductor-compiled module, tensor parallel, on real gloo collectives."""
    _check(run_gloo(_worker, 4, "mlp", [(MLP_TP, True, False)]), 1)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mlp", "tied", "weightnorm"])
def test_small_models(name):
    pins = MLP_TP if name == "mlp" else []
    configs = [([], False, False), (FSDP, False, False), (pins, True, False), ([], False, True), ([], True, True)]
    _check(run_gloo(_worker, 4, name, configs), len(configs))


def _checkpoint_worker(rank: int, path: str) -> bool:
    import torch.distributed.checkpoint as dcp
    from models import MLP
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from autoplan import AutoParallel
    from autoplan.lower.validate import LoweringError

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    ref = MLP(32, 64, 32)
    with torch.device("meta"):
        model = MLP(32, 64, 32)
    with AutoParallel(model, mesh, input_fn=lambda: torch.randn(8, 32)) as ap:
        ap.add_input_constraints([(S0, R)])
        ap.add_memory_constraint(param_fraction=1 / 4)
        plan = ap.optimize_placement()
        with pytest.raises(LoweringError, match="gloo"):  # parameter gathers in flight: gloo aborts
            ap.apply_placement(plan, prefetch=True)
        saved, restored = ap.apply_placement(plan), ap.apply_placement(plan)
    saved.to_empty(device="cpu")
    saved.load_state_dict(ref.state_dict())
    restored.to_empty(device="cpu")
    state = saved.state_dict()
    assert all(isinstance(v, DTensor) for v in state.values())
    dcp.save(state, checkpoint_id=path)
    target = restored.state_dict()
    dcp.load(target, checkpoint_id=path)
    restored.load_state_dict(target)
    return all(
        torch.equal(p.full_tensor(), q.full_tensor()) and p.placements == q.placements
        for p, q in zip(saved.parameters(), restored.parameters())
    ) and any(isinstance(pl, Shard) for p in saved.parameters() for pl in p.placements)


@pytest.mark.slow  # ~25 s on 4 gloo processes
def test_distributed_checkpoint_round_trip(tmp_path):
    assert all(run_gloo(_checkpoint_worker, 4, str(tmp_path / "ckpt")))


def _plan_on_one_of_two(rank: int) -> str:
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh

    from autoplan import AutoParallel, ConstraintError

    mesh = DeviceMesh("cpu", torch.tensor([0]), _init_backend=False)  # rank 0 alone, of a world of two
    try:
        AutoParallel(nn.Linear(4, 4), mesh, input_fn=lambda: torch.randn(2, 4))
    except ConstraintError as e:
        return str(e)
    return "planned"


def test_a_run_mesh_must_span_the_world():
    """On a real backend the ranks outside the mesh would never join its collectives: refused on
    every rank before any work (planning alone, on the fake backend, may use part of the world)."""
    for said in run_gloo(_plan_on_one_of_two, 2, timeout=120):
        assert "mesh (1,) has 1 ranks but the process group has 2" in said, said
