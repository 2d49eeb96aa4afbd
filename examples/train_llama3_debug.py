"""Train LLaMA-3 `debug` with an autoplan plan: ``torchrun --nproc_per_node=4 examples/train_llama3_debug.py``.

NCCL on GPUs, gloo on CPU: the device comes from the mesh. Every rank plans (planning is
deterministic, so all ranks get the same plan), then runs its local shard of each batch. Any world
size works: an even one gets a (2, world/2) mesh, an odd one (a single GPU too) a (1, world) mesh.
``--compile`` compiles the per-rank program region by region with Inductor. An error autoplan raises
on purpose while planning is printed once (by rank 0) as one message, exit status 1.
"""

import argparse
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from autoplan import AutoParallel
from autoplan.bench.models.llama3 import LLAMA3_CONFIGS, Transformer
from autoplan.errors import AutoplanError
from solvers import InfeasibleError, SolverTimeoutError


def build_parser() -> argparse.ArgumentParser:
    """The script's arguments (also what the README's commands are checked against)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--compile", action="store_true")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    if device == "cuda":
        torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    world = dist.get_world_size()
    dp = 2 if world % 2 == 0 else 1
    mesh = init_device_mesh(device, (dp, world // dp), mesh_dim_names=("dp", "tp"))
    cfg = LLAMA3_CONFIGS["debug"]
    batch, seq = 8, 32
    with torch.device("meta"):
        model = Transformer(cfg)
    try:
        with AutoParallel(model, mesh, input_fn=lambda: torch.randint(0, cfg.vocab_size, (batch, seq))) as ap:
            ap.add_input_constraints([(Shard(0), Replicate())])
            ap.add_output_constraints([(Shard(0), Replicate())])
            ap.add_memory_constraint(param_fraction=1 / world)
            plan = ap.optimize_placement()
            pmod = ap.apply_placement(plan, compile=args.compile)
    except (AutoplanError, InfeasibleError, SolverTimeoutError) as e:  # every rank plans the same
        if dist.get_rank() == 0:
            print(f"train_llama3_debug.py: planning on mesh {tuple(mesh.shape)} failed: {e}", file=sys.stderr)
        dist.destroy_process_group()
        return 1
    pmod.to_empty(device=device)
    torch.manual_seed(0)
    pmod.init_weights()
    opt = torch.optim.AdamW(pmod.parameters(), lr=1e-3)
    for step in range(args.steps):
        tokens = torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(step))
        local = distribute_tensor(tokens.to(device), mesh, (Shard(0), Replicate())).to_local()
        logits = pmod(local)
        loss = logits.float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if dist.get_rank() == 0:
            print(f"step {step}: local loss {loss.item():.6f}")
    if dist.get_rank() == 0:
        print(plan.summary().splitlines()[1])
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
