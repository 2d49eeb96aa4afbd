"""Plan LLaMA-3 8B for 128 GPUs (mesh dp=16 x tp=8) on one CPU machine, on a fake process group.

Run: python examples/example_llama3.py [--out llama3_8b_16x8.json]
"""

import argparse

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.testing._internal.distributed.fake_pg import FakeStore

from autoplan import AutoParallel
from autoplan.models.llama3 import LLAMA3_CONFIGS, Transformer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="llama3_8b_16x8.json")
    args = parser.parse_args()

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=128)
    mesh = init_device_mesh("cpu", (16, 8), mesh_dim_names=("dp", "tp"))
    cfg = LLAMA3_CONFIGS["8b"]
    with torch.device("meta"):
        model = Transformer(cfg).to(torch.bfloat16)

    with AutoParallel(model, mesh, input_fn=lambda: torch.randint(0, cfg.vocab_size, (32, 8192))) as ap:
        ap.add_input_constraints([(Shard(0), Replicate())])
        ap.add_output_constraints([(Shard(0), Replicate())])
        ap.add_memory_constraint(param_fraction=1 / 128)
        plan = ap.optimize_placement()
    print(plan.summary())
    plan.to_json(args.out)
    print(f"\nplan written to {args.out}")


if __name__ == "__main__":
    main()
