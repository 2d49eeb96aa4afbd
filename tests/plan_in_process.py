"""Plan a small LLaMA on a fake 2x4 mesh and write the plan's JSON without timings to the file
``argv[2]`` (run as a separate process by the determinism test: nothing is shared with the
process that compares)."""

import dataclasses
import sys

import torch
from conftest import fake_mesh
from torch.distributed.tensor import Replicate, Shard

from autoplan import AutoParallel
from autoplan.bench.models.llama3 import LLAMA3_CONFIGS, Transformer

if __name__ == "__main__":
    cfg = dataclasses.replace(LLAMA3_CONFIGS["debug"], n_layers=3)
    torch.manual_seed(int(sys.argv[1]))  # a different global RNG state in every process
    with torch.device("meta"):
        model = Transformer(cfg)
    with AutoParallel(model, fake_mesh((2, 4), ("dp", "tp")), lambda: torch.randint(0, cfg.vocab_size, (8, 64))) as ap:
        ap.add_input_constraints([(Shard(0), Replicate())])
        ap.add_memory_constraint(param_fraction=1 / 4)
        ap.optimize_placement().to_json(sys.argv[2], timings=False)
