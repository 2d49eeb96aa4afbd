"""Plan LLaMA-3 for a GPU cluster on one CPU machine, then (optionally) train with the plan.

Plan LLaMA-3 8B for 128 GPUs (mesh dp=16 x tp=8) on a fake process group, print it, save it:

    python examples/example_llama3.py [--model {debug,8b,70b}] [--mesh 16x8] [--seq-len 8192]
                                      [--batch 32] [--device-profile h100] [--mp {none,bf16,fp16}]
                                      [--out plan.json]

8B and 70B are planned with mixed precision by default (``--mp bf16``: fp32 parameters and
optimizer states, bf16 compute and parameter gathers, fp32 gradient reductions, FSDP2's
``MixedPrecisionPolicy`` as torchtitan trains); ``--mp none`` plans pure bf16.

Without ``--mesh`` the mesh suits the model: 16x8 for 8b and 70b, 2x2 for ``debug`` (its 0.2 MB of
parameters cannot be split 128 ways within the 1/ranks parameter budget). An error autoplan raises on
purpose (no plan meets the constraints, a bad mesh...) is printed as one message, exit status 1.

Check a plan for real on this machine: LLaMA-3 ``debug`` is planned once for a 2x2 mesh with the
same constraints (fp32), then 4 gloo processes load that plan, train 5 steps and print the losses
beside a single-device run:

    python examples/example_llama3.py --model debug --execute

On a cluster, under torchrun, every rank plans (planning is deterministic) and trains on its shard
of each batch (NCCL; the mesh must hold every rank), e.g. 16 nodes x 8 GPUs:

    torchrun --nnodes 16 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint $HEAD:29500 \\
        examples/example_llama3.py --model 8b --mesh 16x8 --steps 10
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from autoplan import AutoParallel, Plan
from autoplan.bench.models.llama3 import LLAMA3_CONFIGS, Transformer
from autoplan.bench.workloads import MP_CHOICES, MP_HELP, fake_mesh, model_batch, mp_policy, parse_mesh
from autoplan.cost.devices import DEVICE_PROFILES
from autoplan.errors import AutoplanError
from solvers import InfeasibleError, SolverTimeoutError

EXECUTE_MESH, EXECUTE_BATCH, EXECUTE_SEQ, EXECUTE_STEPS = (2, 2), 8, 32, 5
# the mesh planned on when --mesh is not given: debug is too small to be worth splitting over 128 ranks
DEFAULT_MESH = {"debug": "2x2", "8b": "16x8", "70b": "16x8"}
# mixed precision when --mp is not given: the large models train as torchtitan trains them
DEFAULT_MP = {"debug": "none", "8b": "bf16", "70b": "bf16"}
# errors autoplan raises on purpose: their message names the culprit, a traceback adds nothing
PLANNING_ERRORS = (AutoplanError, InfeasibleError, SolverTimeoutError)


def planning_failed(what: str, error: Exception) -> str:
    """One message for an error autoplan raised while planning ``what``."""
    return f"example_llama3.py: planning {what} failed: {error}"


def plan_llama(
    mesh, cfg, batch: int, seq: int, dtype: torch.dtype, profile, plan: Plan | None = None, policy=None
) -> tuple:
    """The constraints the README shows: batch-split inputs and outputs, parameters split over every
    rank. Given ``plan`` (one solved before, loaded from JSON), the model is traced and constrained
    alike but not re-planned. ``policy``: mixed precision (``--mp``); the parameters are then fp32."""
    with torch.device("meta"):
        model = Transformer(cfg).to(torch.float32 if policy is not None else dtype)
    io = (Shard(0),) + (Replicate(),) * (mesh.ndim - 1)
    input_fn = lambda: torch.randint(0, cfg.vocab_size, (batch, seq))  # noqa: E731
    with AutoParallel(model, mesh, input_fn, device_profile=profile, mp_policy=policy) as ap:
        ap.add_input_constraints([io])
        ap.add_output_constraints([io])
        ap.add_memory_constraint(param_fraction=1 / math.prod(mesh.shape))
        plan = plan or ap.optimize_placement()
    return ap, plan, io


def batch_tokens(cfg, batch: int, seq: int, step: int) -> torch.Tensor:
    """Step ``step``'s tokens (seq + 1 of them: inputs and next-token targets), the same on every rank."""
    return torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=torch.Generator().manual_seed(step))


def next_token_loss(logits: torch.Tensor, tokens: torch.Tensor, n_global: int) -> torch.Tensor:
    """This rank's share of the mean cross-entropy over the whole batch (shares sum to the loss)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten(), reduction="sum") / n_global


def train(pmod, mesh, io, cfg, batch: int, seq: int, steps: int, device: str) -> list[float]:
    """AdamW steps on the parallel module; returns the global losses (summed over the dp shards)."""
    opt = torch.optim.AdamW(pmod.parameters(), lr=1e-3)
    losses = []
    for step in range(steps):
        tokens = distribute_tensor(batch_tokens(cfg, batch, seq, step).to(device), mesh, io).to_local()
        loss = next_token_loss(pmod(tokens[:, :-1]), tokens, batch * seq)
        loss.backward()
        opt.step()
        opt.zero_grad()
        shares = (Partial(),) + (Replicate(),) * (mesh.ndim - 1)  # summed over dp, the same on every tp rank
        losses.append(float(DTensor.from_local(loss.detach().reshape(1), mesh, shares).full_tensor()))
    return losses


def single_device(cfg, batch: int, seq: int, steps: int) -> tuple[dict, list[float]]:
    """The reference: the same initial weights (seed 0) and batches on one device."""
    torch.manual_seed(0)
    model = Transformer(cfg)
    model.init_weights()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(steps):
        tokens = batch_tokens(cfg, batch, seq, step)
        loss = next_token_loss(model(tokens[:, :-1]), tokens, batch * seq)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return state, losses


def _execute_rank(rank: int, port: int, plan_file: str, result: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=math.prod(EXECUTE_MESH))
    try:
        cfg = LLAMA3_CONFIGS["debug"]
        mesh = init_device_mesh("cpu", EXECUTE_MESH, mesh_dim_names=("dp", "tp"))
        ap, plan, io = plan_llama(
            mesh, cfg, EXECUTE_BATCH, EXECUTE_SEQ, torch.float32, DEVICE_PROFILES["h100"], Plan.from_json(plan_file)
        )
        pmod = ap.apply_placement(plan)
        pmod.to_empty(device="cpu")
        pmod.init_weights()  # buffers (the RoPE table) too, which no state dict carries
        state, _ = single_device(cfg, EXECUTE_BATCH, EXECUTE_SEQ, 0)
        pmod.load_state_dict(state)
        losses = train(pmod, mesh, io, cfg, EXECUTE_BATCH, EXECUTE_SEQ, EXECUTE_STEPS, "cpu")
        if rank == 0:
            params = {k: str(v) for k, v in plan.param_placements.items()}
            with open(result, "w") as f:
                json.dump({"losses": losses, "params": params}, f)
    finally:
        dist.destroy_process_group()


def execute() -> int:
    """Plan LLaMA-3 debug for a 2x2 mesh once; 4 gloo processes train with that plan; compare with
    one device."""
    import torch.multiprocessing as mp

    cfg, profile = LLAMA3_CONFIGS["debug"], DEVICE_PROFILES["h100"]
    try:
        _, plan, _ = plan_llama(fake_mesh(EXECUTE_MESH), cfg, EXECUTE_BATCH, EXECUTE_SEQ, torch.float32, profile)
    except PLANNING_ERRORS as e:
        raise SystemExit(planning_failed(f"debug on mesh {EXECUTE_MESH}", e)) from None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        plan_file, result = os.path.join(tmp, "plan.json"), os.path.join(tmp, "losses.json")
        plan.to_json(plan_file)
        ranks = math.prod(EXECUTE_MESH)
        mp.start_processes(_execute_rank, args=(port, plan_file, result), nprocs=ranks, start_method="spawn")
        with open(result) as f:
            parallel = json.load(f)
    _, reference = single_device(LLAMA3_CONFIGS["debug"], EXECUTE_BATCH, EXECUTE_SEQ, EXECUTE_STEPS)
    print(f"\nLLaMA-3 debug, mesh {EXECUTE_MESH} on 4 gloo processes vs one device ({EXECUTE_STEPS} AdamW steps):")
    print(f"{'step':>4}  {'parallel':>12}  {'single':>12}  {'rel diff':>9}")
    worst = 0.0
    for step, (a, b) in enumerate(zip(parallel["losses"], reference)):
        rel = abs(a - b) / abs(b)
        worst = rel if math.isnan(rel) else max(worst, rel)
        print(f"{step:>4}  {a:>12.6f}  {b:>12.6f}  {rel:>9.2e}")
    ok = len(parallel["losses"]) == EXECUTE_STEPS and worst < 1e-5  # False for NaN too
    print(f"losses {'match' if ok else 'DIFFER from'} single-device (worst relative difference {worst:.2e})")
    return 0 if ok else 1


def run_distributed(args, cfg, shape, profile) -> int:
    """Under torchrun: every rank plans, then trains on its shard of each batch."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if math.prod(shape) != dist.get_world_size():
        raise SystemExit(f"--mesh {args.mesh} holds {math.prod(shape)} ranks; torchrun started {dist.get_world_size()}")
    mesh = init_device_mesh(device, shape, mesh_dim_names=("dp", "tp", "cp", "pp")[: len(shape)])
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    try:
        ap, plan, io = plan_llama(mesh, cfg, args.batch, args.seq_len, dtype, profile, policy=mp_policy(args.mp))
    except PLANNING_ERRORS as e:  # every rank plans the same: rank 0 reports it, once
        if dist.get_rank() == 0:
            print(planning_failed(f"{args.model} on mesh {args.mesh}", e), file=sys.stderr)
        dist.destroy_process_group()
        return 1
    pmod = ap.apply_placement(plan)
    pmod.to_empty(device=device)
    torch.manual_seed(0)
    pmod.init_weights()
    losses = train(pmod, mesh, io, cfg, args.batch, args.seq_len, args.steps, device)
    if dist.get_rank() == 0:
        print(plan.summary())
        print("losses: " + ", ".join(f"{x:.4f}" for x in losses))
    dist.destroy_process_group()
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The example's arguments (also what the README's commands are checked against)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(LLAMA3_CONFIGS), default="8b")
    parser.add_argument("--mesh", default=None, help="mesh shape, e.g. 16x8 or 128 (default 16x8; 2x2 for debug)")
    parser.add_argument("--seq-len", type=int, default=None, help="default: min(8192, the model's max)")
    parser.add_argument("--batch", type=int, default=32, help="global batch (split over the first mesh dim)")
    parser.add_argument("--device-profile", choices=sorted(DEVICE_PROFILES), default="h100")
    parser.add_argument("--out", default=None, help="plan JSON (default llama3_<model>_<mesh>.json)")
    parser.add_argument(
        "--mp",
        choices=MP_CHOICES,
        default=None,
        help=MP_HELP + " (default bf16 for 8b and 70b, as torchtitan trains them; none for debug)",
    )
    parser.add_argument("--execute", action="store_true", help="also train a 2x2 plan (fp32) on 4 gloo processes")
    parser.add_argument("--steps", type=int, default=10, help="training steps under torchrun")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cfg, profile = LLAMA3_CONFIGS[args.model], DEVICE_PROFILES[args.device_profile]
    args.mesh = args.mesh or DEFAULT_MESH[args.model]
    args.mp = args.mp or DEFAULT_MP[args.model]
    try:
        shape = parse_mesh(args.mesh)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    args.batch, args.seq_len = model_batch(cfg, args.batch, args.seq_len, shape[0])
    if args.batch % shape[0]:
        raise SystemExit(f"--batch {args.batch} does not split over the first mesh dim ({shape[0]})")
    if "TORCHELASTIC_RUN_ID" in os.environ:
        return run_distributed(args, cfg, shape, profile)

    try:
        policy = mp_policy(args.mp)
        _, plan, _ = plan_llama(fake_mesh(shape), cfg, args.batch, args.seq_len, torch.bfloat16, profile, policy=policy)
    except PLANNING_ERRORS as e:
        raise SystemExit(planning_failed(f"{args.model} on mesh {args.mesh}", e)) from None
    print(plan.summary())
    out = args.out or f"llama3_{args.model}_{args.mesh}.json"
    plan.to_json(out)
    print(f"\nplan written to {out}")
    return execute() if args.execute else 0


if __name__ == "__main__":
    sys.exit(main())
