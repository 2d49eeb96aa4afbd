"""Planning benchmarks: ``python -m autoplan.bench plan --model llama3-8b --mesh 16x8 [--json out.json]``.

Plans on a fake process group (no GPUs, no peers), prints wall time per phase, ILP size, objective,
gap and peak RSS, then applies the plan (post-solve passes + lowering, timed as its own phase) to
report what the passes did and the collectives before and after them; writes it all to JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import sys
import time

import torch


def _fake_mesh(shape: tuple[int, ...], names: tuple[str, ...]):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=math.prod(shape))
    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def _model(name: str, dtype: torch.dtype):
    from autoplan.models.llama3 import LLAMA3_CONFIGS, Transformer

    family, _, size = name.partition("-")
    if family != "llama3" or size not in LLAMA3_CONFIGS:
        raise SystemExit(f"unknown model {name!r}; choose from " + ", ".join(f"llama3-{k}" for k in LLAMA3_CONFIGS))
    cfg = LLAMA3_CONFIGS[size]
    with torch.device("meta"):
        model = Transformer(cfg).to(dtype)
    return model, cfg


def _peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


def _planned(args: argparse.Namespace):
    """Plan the benchmark model on a fake mesh: batch-sharded I/O, parameters split over every rank."""
    from torch.distributed.tensor import Replicate, Shard

    from autoplan import AutoParallel

    shape = tuple(int(x) for x in args.mesh.lower().split("x"))
    mesh = _fake_mesh(shape, ("dp", "tp", "cp", "pp")[: len(shape)])
    model, cfg = _model(args.model, getattr(torch, args.dtype))
    seq = args.seq or min(8192, cfg.max_seq_len)
    batch, vocab = args.batch or max(32, shape[0]), cfg.vocab_size  # the batch must split over dp
    ap = AutoParallel(model, mesh, input_fn=lambda: torch.randint(0, vocab, (batch, seq)))
    with ap:
        batch_pl = (Shard(0),) + (Replicate(),) * (len(shape) - 1)
        ap.add_input_constraints([batch_pl])
        ap.add_output_constraints([batch_pl])
        ap.add_memory_constraint(param_fraction=1 / math.prod(shape))
        plan = ap.optimize_placement()
    return ap, plan, shape, batch, seq


def _applied(ap, plan) -> dict:
    """Run the post-solve passes and lowering on the plan (fake process group) and report what they did."""
    t0 = time.perf_counter()
    ap.apply_placement(plan)
    apply_s = time.perf_counter() - t0
    lowered = ap.lowered
    return {
        "apply_s": apply_s,
        "lowered_nodes": {
            "joint": len(lowered.joint.graph.nodes),
            "forward": len(lowered.forward.graph.nodes),
            "backward": len(lowered.backward.graph.nodes),
        },
        "collectives": {
            "planned": plan.collective_counts(),
            "after_round_trips": ap.applied_plan.collective_counts(),
            "forward": lowered.collective_counts(lowered.forward),
            "backward": lowered.collective_counts(lowered.backward),
        },
        "passes": plan.passes,
    }


def run_plan(args: argparse.Namespace) -> dict:
    """Plan, then apply it too, so the post-solve passes' counts are reported with the plan."""
    t0 = time.perf_counter()
    ap, plan, shape, batch, seq = _planned(args)
    wall = time.perf_counter() - t0
    applied = _applied(ap, plan)
    result = {
        "model": args.model,
        "mesh": list(shape),
        "batch": batch,
        "seq": seq,
        "dtype": args.dtype,
        "wall_s": wall,
        "phases_s": plan.timings | {"apply": applied["apply_s"]},
        "ilp": plan.ilp,
        "objective_s": plan.cost.total,
        "objective_after_round_trips_s": ap.applied_plan.cost.total,
        "solver": {
            k: plan.solver.get(k) for k in ("backend", "status", "objective", "bound", "gap", "lp_was_integral")
        },
        "collectives": applied["collectives"],
        "passes": applied["passes"],
        "peak_rss_gib": _peak_rss_gib(),
    }
    print(plan.summary())
    print()
    print(f"model -> plan: {wall:.2f} s wall   apply (passes + lowering): {applied['apply_s']:.2f} s")
    print(f"peak RSS {result['peak_rss_gib']:.2f} GiB")
    print("phases: " + "  ".join(f"{k} {v:.2f}s" for k, v in result["phases_s"].items()))
    print(
        f"ILP: {plan.ilp['n_vars']} variables ({plan.ilp['n_edge_vars']} edge), {plan.ilp['n_rows']} rows,"
        f" {plan.ilp['n_units']} units for {plan.ilp['n_nodes']} graph nodes"
    )
    print(
        f"objective {plan.cost.total * 1e3:.2f} ms/step ({ap.applied_plan.cost.total * 1e3:.2f} after round-trip"
        f" removal), gap {plan.solver.get('gap')}"
    )
    return result


def run_apply(args: argparse.Namespace) -> dict:
    """Plan, then time lowering the plan into the per-rank distributed graph (fake process group)."""
    ap, plan, shape, _, _ = _planned(args)
    result = {"model": args.model, "mesh": list(shape), "phases_s": ap.timings, **_applied(ap, plan)}
    result["peak_rss_gib"] = _peak_rss_gib()
    print(f"passes: {result['passes']}")
    print(f"apply (passes + lowering + partition + module): {result['apply_s']:.2f} s")
    print(f"peak RSS {result['peak_rss_gib']:.2f} GiB")
    print(f"lowered graph nodes: {result['lowered_nodes']}")
    print(f"collectives: {result['collectives']}")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m autoplan.bench", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("plan", help="time model -> Plan on a fake process group")
    p.add_argument("--model", default="llama3-8b")
    p.add_argument("--mesh", default="16x8")
    p.add_argument("--batch", type=int, default=None, help="global batch (default: max(32, dp size))")
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--json", default=None, help="write the numbers to this file")
    a = sub.add_parser("apply", help="time lowering a plan into the distributed graph on a fake process group")
    for action in p._actions[1:]:
        a._add_action(action)
    args = parser.parse_args(argv)
    result = run_plan(args) if args.cmd == "plan" else run_apply(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
