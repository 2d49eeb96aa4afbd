"""Ground truth: a plan executed on a 2x2 gloo mesh (4 CPU processes) matches single-device numerics."""

import pytest
import torch
from gloo import run_gloo

pytestmark = pytest.mark.slow


def _close(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    """fp32 agreement: elementwise allclose(rtol=1e-5, atol=1e-6) and a relative norm error below 1e-5."""
    rel = float((actual - expected).norm() / expected.norm().clamp_min(1e-30))
    return bool(torch.allclose(actual, expected, rtol=1e-5, atol=1e-6)) and rel < 1e-5


def loss_scale(local_out: torch.Tensor, mesh) -> int:
    """Number of elements of the global output (each rank holds a batch shard)."""
    return local_out.numel() * mesh.size(0)


def _llama_worker(rank: int, pins: list, steps: int) -> dict:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    from autoplan import AutoParallel
    from autoplan.models.llama3 import LLAMA3_CONFIGS, Transformer

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    cfg = LLAMA3_CONFIGS["debug"]
    torch.manual_seed(0)
    ref = Transformer(cfg)
    ref.init_weights()
    batches = [
        torch.randint(0, cfg.vocab_size, (4, 16), generator=torch.Generator().manual_seed(s)) for s in range(steps)
    ]
    with torch.device("meta"):
        model = Transformer(cfg)
    with AutoParallel(model, mesh, input_fn=lambda: torch.randint(0, cfg.vocab_size, (4, 16))) as ap:
        ap.add_input_constraints([(Shard(0), Replicate())])
        ap.add_output_constraints([(Shard(0), Replicate())])
        for target, placements in pins:
            ap.add_node_constraint(target, placements)
        plan = ap.optimize_placement()
        pmod = ap.apply_placement(plan)
    pmod.to_empty(device="cpu")
    pmod.init_weights()
    pmod.load_state_dict(ref.state_dict())

    out = pmod(distribute_tensor(batches[0], mesh, (Shard(0), Replicate())).to_local())
    loss = DTensor.from_local(out, mesh, (Shard(0), Replicate()), run_check=False).full_tensor().mean()
    out.backward(torch.full_like(out, 1 / loss_scale(out, mesh)))
    ref_loss = ref(batches[0]).mean()
    ref_loss.backward()
    grads_ok = {
        n: _close(p.grad.full_tensor(), dict(ref.named_parameters())[n].grad) for n, p in pmod.named_parameters()
    }
    return {
        "loss": float(loss),
        "ref_loss": float(ref_loss),
        "grads_ok": grads_ok,
        "lowered": ap.lowered.collective_counts(),
        "planned": plan.collective_counts(),
    }


def test_llama_debug_unconstrained_matches_single_device():
    results = run_gloo(_llama_worker, 4, [], 1)
    for r in results:
        assert r["loss"] == pytest.approx(r["ref_loss"], rel=1e-5)
        assert all(r["grads_ok"].values()), [n for n, ok in r["grads_ok"].items() if not ok]
