"""``python -m autoplan.bench validate``: plans run for real, the cost model's prediction beside the
measured step.

Every rank of the current process group (gloo processes on CPU, NCCL under ``torchrun`` on GPUs; a
single process when started plainly) plans the model on the real mesh, the ILP's plan and the hand
plans asked for, then runs each for a few training steps. The plans take turns step by step, so
whatever drifts on the machine (its clock, other work) hits all of them alike; a step's time is
the slowest rank's, and a plan's is the median of its steps. Each plan also runs with its
collectives made free (``collective_free``): what is left is the rank's own compute, so the error
splits into compute (predicted compute against the collective-free step) and communication with
overlap (the rest). A step is timed from its forward to the end of its backward, as plans are
priced; the optimizer step runs outside the timing.

Where a collective blocks the host (gloo), one more profiled step per plan splits the
communication further (``split_waits``): each wait on a collective is what is left of the
collective when the host reaches the wait (none of it, when compute between issue and wait hid
it) plus however long that rank waited for the last one to join it. The last rank to join waits
only for the first part, the collective's exposed time; the others' extra wait is what a step
pays for its slowest rank, which the cost model prices as the profile's ``rank_skew``.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.fx as fx
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from autoplan.api import AutoParallel
from autoplan.bench.collective_free import collective_free_executor
from autoplan.bench.handplans import hand_plan, hand_plans
from autoplan.bench.steps import backward_step, kept_bytes
from autoplan.bench.workloads import MESH_DIM_NAMES, load_factory, model_config, named_model, parse_mesh
from autoplan.cost.costs import roofline_seconds
from autoplan.cost.memory import TORCH_ADAMW
from autoplan.cost.network import MeshTopology, collective_seconds
from autoplan.errors import AutoplanError
from autoplan.lower.collectives import c10d, collective_kind
from autoplan.run.group import join_group


@dataclass
class _Run:
    """One plan made runnable: its parallel module, both executors and what it predicted."""

    name: str
    plan: object
    pmod: torch.nn.Module
    real: object
    free: object
    opt: torch.optim.Optimizer
    steps: list[float]
    free_steps: list[float]
    lowered: object  # its per-rank program (``LoweredGraph``)


def priced_waits(lowered, mesh, profile) -> list[tuple[str, float]]:
    """Each wait on a collective the eager program meets, in order (its forward graph, then its
    backward), as ``collective_waits`` reports them: (the waited tensor's shape, the collective's
    price alone, ``network.collective_seconds`` on the group it runs on)."""
    topology = MeshTopology.from_mesh(mesh, profile.gpus_per_node)
    spans = {mesh.get_group(d).group_name: span for d, span in enumerate(topology.spans)}
    out = []
    for gm in (lowered.forward, lowered.backward):
        for n in gm.graph.find_nodes(op="call_function", target=c10d.wait_tensor.default):
            made = n.args[0]
            kind = collective_kind(made) if isinstance(made, fx.Node) else None
            val = made.meta.get("val") if kind else None
            if not isinstance(val, torch.Tensor):
                out.append(("?", 0.0))
                continue
            span = spans.get(made.args[-1], topology.flat)  # a fused gather runs on the whole mesh
            first = made.args[0].meta["val"]
            nbytes = {
                "all_gather": val.numel() * val.element_size(),
                "all_to_all": first.numel() * first.element_size() * span.size,
            }.get(kind, first.numel() * first.element_size())
            out.append((str(tuple(val.shape)), collective_seconds(kind, span, nbytes, profile)))
    return out


def split_waits(
    per_rank: list[list[tuple[str, float]]], largest: int = 3, priced: list[tuple[str, float]] | None = None
) -> dict | None:
    """How one step's waits on collectives (``collective_waits`` of each rank, in order) split,
    in ms: ``exposed``, the sum over collectives of the shortest rank's wait, the part of the
    collective nothing hid (the last rank to join waits for nothing else); ``straggler``, the sum of the mean wait
    less that, what the step paid for its slowest rank at each collective (a step held to its
    slowest rank's segment, against the ranks' mean); and the ``largest`` collectives by exposed
    time, by shape, each with its price alone where ``priced`` (``priced_waits``) pairs up with the
    waits. None when the ranks met different collectives (then nothing pairs up)."""
    counts = {len(w) for w in per_rank}
    if len(counts) != 1 or any([s for s, _ in w] != [s for s, _ in per_rank[0]] for w in per_rank):
        return None
    exposed = straggler = 0.0
    by_shape: dict[str, list[float]] = {}
    for waits in zip(*per_rank):
        times = [t for _, t in waits]
        own = min(times)
        exposed += own
        straggler += statistics.fmean(times) - own
        by_shape.setdefault(waits[0][0], []).append(own)
    top = sorted(by_shape.items(), key=lambda kv: -sum(kv[1]))[:largest]
    paired = priced is not None and [s for s, _ in priced] == [s for s, _ in per_rank[0]]
    price: dict[str, list[float]] = {}
    for shape, seconds in priced if paired else ():
        price.setdefault(shape, []).append(seconds)
    rows = [{"shape": k, "calls": len(v), "ms_per_call": statistics.fmean(v) * 1e3} for k, v in top]
    for row in rows if paired else ():
        row["priced_ms_per_call"] = statistics.fmean(price[row["shape"]]) * 1e3
    return {
        "collectives": counts.pop(),
        "exposed_ms": exposed * 1e3,
        "straggler_ms": straggler * 1e3,
        "priced_alone_ms": sum(t for _, t in priced) * 1e3 if paired else None,
        "largest": rows,
    }


def kendall_tau(a: list[float], b: list[float]) -> float:
    """Kendall's tau-b between two orderings of the same items: 1 when every pair agrees. A pair
    tied in one order (two names for one plan, predicted alike) neither agrees nor disagrees, and
    leaves that order's count of pairs: tau-a would divide by every pair, and score such a plan
    list at most 5/6 (four plans, one tie), where tau-b gives 0.91."""
    n = len(a)
    pairs = [(i, j) for i in range(n) for j in range(i + 1, n)]
    untied_a = sum(a[i] != a[j] for i, j in pairs)
    untied_b = sum(b[i] != b[j] for i, j in pairs)
    if not untied_a or not untied_b:
        return 1.0 if untied_a == untied_b else 0.0
    score = sum(
        1 if (a[i] - a[j]) * (b[i] - b[j]) > 0 else -1 if (a[i] - a[j]) * (b[i] - b[j]) < 0 else 0 for i, j in pairs
    )
    return score / math.sqrt(untied_a * untied_b)


PEAK_REPEATS = 3  # profiled steps whose least memory rise is a CPU rank's measured peak
REFERENCE_SIDE = 512  # the square fp32 matmul the host's speed is read from: one calibrate times


def reference_probe(device: str) -> Callable[[], float]:
    """Seconds one (``REFERENCE_SIDE``)^3 fp32 matmul takes on this host now (the mean of a few
    calls): timed between the plans' steps, it shows how far the host's speed moved from the
    profile's (``host_speed``)."""
    a = torch.randn(REFERENCE_SIDE, REFERENCE_SIDE, device=device)
    calls = 4

    def timed() -> float:
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            torch.mm(a, a)
        if device == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - t0) / calls

    return timed


def host_speed(profile, seconds: float) -> float:
    """How many times faster than ``profile`` prices it the reference matmul ran (``seconds``):
    above 1 the host computes faster now than when it was calibrated."""
    flops, nbytes = 2.0 * REFERENCE_SIDE**3, 3 * 4 * REFERENCE_SIDE**2
    return roofline_seconds(flops, nbytes, torch.float32, profile) / seconds


def _model(args: argparse.Namespace, ndim: int, dp: int) -> tuple[Callable, Callable]:
    """(a builder of the model on the meta device, ``input_fn``) for a named model or a factory."""
    if ":" in args.model:
        kwargs = {"batch": args.batch} if args.batch else {}
        made = load_factory(args.model, **kwargs)
        return (lambda: load_factory(args.model, **kwargs)[0]), made[1]
    cfg = model_config(args.model, args.layers, ndim)
    batch, seq = args.batch or max(2 * dp, 2), args.seq or min(256, cfg.max_seq_len)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    return (lambda: named_model(args.model, getattr(torch, args.dtype), args.layers, ndim)[0]), (lambda: tokens)


def _prepare(name: str, ap, device: str, prefetch: bool) -> _Run:
    """Plan ``name`` (the ILP's, or a hand plan's pins) on ``ap``'s trace and materialise it (its
    parameter gathers issued a layer ahead with ``prefetch``)."""
    plan = ap.optimize_placement() if name == "autoplan" else hand_plan(ap, name, ap.mesh.ndim)
    pmod = ap.apply_placement(plan, prefetch=prefetch)
    lowered = ap.lowered
    pmod.to_empty(device=device)
    torch.manual_seed(0)
    if hasattr(pmod, "init_weights"):
        pmod.init_weights()
    else:
        with torch.no_grad():
            for p in pmod.parameters():
                p.normal_(0.0, 0.02)
    real = pmod._autoplan.executor
    collective_free_executor(pmod, lowered, None)
    free = pmod._autoplan.executor
    pmod._autoplan.executor = real
    opt = torch.optim.AdamW(pmod.parameters(), lr=1e-4)
    return _Run(name, plan, pmod, real, free, opt, [], [], lowered)


def _step(run: _Run, local: torch.Tensor, device: str, free: bool) -> float:
    """One forward and backward of ``run`` on this rank's ``local`` batch, timed between barriers:
    what the plan's cost prices (the optimizer step is not priced, so it runs untimed). A
    collective-free step's gradients are whatever its uninitialised gathers give: they are dropped,
    never applied, so the real steps keep training the same weights."""
    run.pmod._autoplan.executor = run.free if free else run.real
    try:
        dist.barrier()
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        backward_step(run.pmod, local)
        if device == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
    finally:
        run.pmod._autoplan.executor = run.real
    if not free:
        run.opt.step()
    run.opt.zero_grad()
    return seconds


def _measured_peak(run: _Run, local: torch.Tensor, device: str) -> float:
    """This rank's peak bytes over a real step: what it keeps between steps (local parameters,
    buffers, optimizer states, its input) plus the allocator's rise during the forward and
    backward, as ``bench memory`` measures it; the plan's estimate counts the same parts.

    On CPU the rise is the least of ``PEAK_REPEATS`` profiled steps: the timeline holds gloo's
    threads' allocations too, freed when that thread gets a core, so a loaded host only ever adds
    to a step's rise (FSDP on LLaMA debug: 1.5 MiB here, 1.8 MiB once in a CI run)."""
    from autoplan.adapters.profiling import profile_step

    rises = []
    for _ in range(PEAK_REPEATS if device == "cpu" else 1):
        run.opt.zero_grad()
        dist.barrier()
        rises.append(profile_step(lambda: backward_step(run.pmod, local), device).memory_rise)
    rise = min(rises)
    run.opt.zero_grad()
    states = [v for s in run.opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return float(kept_bytes([*run.pmod.parameters(), *run.pmod.buffers(), *states, local]) + rise)


def _waits(run: _Run, local: torch.Tensor) -> tuple[float, list[tuple[str, float]]]:
    """(seconds, this rank's waits on collectives) of one real step of ``run`` under the profiler
    (``collective_waits``): the profiler slows a step, so its length says how far it stands from
    the timed ones."""
    from autoplan.adapters.profiling import collective_waits

    run.opt.zero_grad()
    dist.barrier()
    t0 = time.perf_counter()
    waits = collective_waits(lambda: backward_step(run.pmod, local))
    seconds = time.perf_counter() - t0
    run.opt.zero_grad()
    return seconds, waits


def run_validate(args: argparse.Namespace) -> dict | None:
    """Plan, run and compare (see the module's docstring); rank 0 prints and returns the numbers
    (written by ``--json``), the other ranks ``None``. A process group this call makes is torn down
    before it returns (a caller's, a test's, outlives it): left to the interpreter's exit, one
    rank's gloo threads may still be running when a faster rank has gone, and abort the process."""
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    owns_group = join_group(device, single=True)
    try:
        return _validate(args, device)
    finally:
        if owns_group:
            dist.destroy_process_group()


def _validate(args: argparse.Namespace, device: str) -> dict | None:
    world, rank = dist.get_world_size(), dist.get_rank()
    shape = parse_mesh(args.mesh) if args.mesh else (world,)
    if torch.Size(shape).numel() != world:
        raise SystemExit(f"validate: mesh {args.mesh} has {torch.Size(shape).numel()} ranks; the process group {world}")
    mesh = init_device_mesh(device, shape, mesh_dim_names=MESH_DIM_NAMES[: len(shape)])
    build, input_fn = _model(args, len(shape), shape[0])
    names = args.plans.split(",") if args.plans else ["autoplan", *hand_plans(len(shape))]
    unknown = [n for n in names if n != "autoplan" and n not in hand_plans(len(shape), moe=True)]
    if unknown or args.steps < 1:
        raise SystemExit(
            f"validate: unknown plans {unknown} (choose autoplan or {', '.join(hand_plans(len(shape), True))})"
            if unknown
            else "validate: --steps must be at least 1"
        )
    torch.set_flush_denormal(True)  # a CPU's denormal floats would time arithmetic, not the plan
    runs, refused = [], {}
    io = (Shard(0),) + (Replicate(),) * (len(shape) - 1)  # the batch split over the first mesh dim
    profile = args.profile or ("h100" if device == "cuda" else "cpu")
    with AutoParallel(build(), mesh, input_fn, device_profile=profile, optimizer=TORCH_ADAMW) as ap:
        ap.add_input_constraints([io])
        ap.add_output_constraints([io])
        for name in names:  # every plan from the one trace
            try:
                runs.append(_prepare(name, ap, device, args.prefetch))
            except AutoplanError as e:  # a hand plan the shapes cannot take: reported, not fatal
                refused[name] = str(e).splitlines()[0]
    local = distribute_tensor(input_fn().to(device), mesh, io).to_local()
    probe, probed = reference_probe(device), []
    for run in runs:  # warm-up: first calls allocate and build caches
        for free in (False, True):
            _step(run, local, device, free)
    for k in range(args.steps):
        order = runs[k % len(runs) :] + runs[: k % len(runs)]  # each plan goes first in turn
        probed.append(probe())
        for run in order:
            run.steps.append(_step(run, local, device, False))
            run.free_steps.append(_step(run, local, device, True))
    peaks = [_measured_peak(run, local, device) for run in runs]
    splits: list[dict | None] = [None] * len(runs)
    if device == "cpu" and world > 1:  # gloo blocks the host in a wait; NCCL only queues it
        gathered: list = [None] * world
        dist.all_gather_object(gathered, [_waits(run, local) for run in runs])
        for i in range(len(runs)):
            priced = priced_waits(runs[i].lowered, ap.mesh, ap.device_profile)
            splits[i] = split_waits([g[i][1] for g in gathered], priced=priced)
            if splits[i] is not None:
                splits[i]["step_ms"] = max(g[i][0] for g in gathered) * 1e3
    skew = ap.device_profile.rank_skew if world > 1 else 0.0
    times = torch.tensor(
        [[*r.steps, *r.free_steps, p] for r, p in zip(runs, peaks)] + [[*probed, *probed, 0.0]],
        dtype=torch.float64,
        device=device,
    )
    # a step lasts as long as its slowest rank; the peak is the fullest rank's
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    *per_plan, (*reference, _) = times.tolist()
    speeds = [host_speed(ap.device_profile, s) for s in reference[: args.steps]]
    speed = statistics.median(speeds)
    rows = []
    for run, t, waits in zip(runs, per_plan, splits):
        c = run.plan.cost
        measured, compute = statistics.median(t[: args.steps]), statistics.median(t[args.steps : 2 * args.steps])
        predicted, predicted_compute = c.total, c.compute_forward + c.compute_backward
        rows.append(
            {
                "plan": run.name,
                "predicted_ms": predicted * 1e3,
                "measured_ms": measured * 1e3,
                "error": (predicted - measured) / measured,
                # the compute re-priced at the speed the host showed during the run: what is left
                # of the error when the host's drift since calibration is taken out
                "error_at_host_speed": (predicted - predicted_compute + predicted_compute / speed - measured)
                / measured,
                "predicted_compute_ms": predicted_compute * 1e3,
                "measured_compute_ms": compute * 1e3,
                "predicted_comm_ms": c.comm * 1e3,
                "predicted_exposed_comm_ms": c.exposed_comm * 1e3,
                "measured_comm_ms": max(measured - compute, 0.0) * 1e3,
                # what the predicted compute holds for waiting on the slowest rank, beside
                # what one profiled step's waits show (``split_waits``)
                "predicted_straggler_ms": predicted_compute * skew / (1 + skew) * 1e3,
                "waits": waits,
                "steps_ms": [x * 1e3 for x in t[: args.steps]],
                "estimated_peak_mib": run.plan.memory.peak_bytes / 2**20,
                "measured_peak_mib": t[-1] / 2**20,
            }
        )
    tau = kendall_tau([r["predicted_ms"] for r in rows], [r["measured_ms"] for r in rows])
    result = {
        "model": args.model,
        "mesh": list(shape),
        "device": device,
        "profile": runs[0].plan.device if runs else None,
        "steps": args.steps,
        "plans": rows,
        "refused": refused,
        "kendall_tau": tau,
        "host_speed": {"median": speed, "min": min(speeds), "max": max(speeds)},
    }
    if rank != 0:
        return None
    _print(result)
    return result


def _print(result: dict) -> None:
    print(f"{result['model']} on mesh {result['mesh']} ({result['device']}), priced for {result['profile']}")
    print(f"{'plan':<9} {'predicted':>10} {'measured':>10} {'error':>7} {'at host speed':>13}", end="")
    print(f"   {'compute pred/meas':>19}   {'comm pred/meas':>17}   {'peak est/meas':>19}")
    for r in result["plans"]:
        print(
            f"{r['plan']:<9} {r['predicted_ms']:>8.2f}ms {r['measured_ms']:>8.2f}ms {r['error']:>+7.0%}"
            f" {r['error_at_host_speed']:>+13.0%}"
            f"   {r['predicted_compute_ms']:>8.2f}/{r['measured_compute_ms']:<8.2f}ms"
            f"   {r['predicted_exposed_comm_ms']:>7.2f}/{r['measured_comm_ms']:<7.2f}ms"
            f"   {r['estimated_peak_mib']:>8.1f}/{r['measured_peak_mib']:<8.1f}MiB"
        )
    for r in result["plans"]:
        w = r["waits"]
        if w is None:
            continue
        largest = ", ".join(
            f"{x['shape']} {x['calls']}x {x['ms_per_call']:.1f}ms"
            + (f" (priced {x['priced_ms_per_call']:.1f}ms alone)" if "priced_ms_per_call" in x else "")
            for x in w["largest"]
        )
        print(
            f"{r['plan']:<9} a profiled step of {w['step_ms']:.0f}ms has {w['collectives']} waits on collectives:"
            f" exposed {w['exposed_ms']:.1f}ms"
            + (f" (all priced {w['priced_alone_ms']:.1f}ms alone)," if w["priced_alone_ms"] is not None else ",")
            + f" waiting for the slowest rank {w['straggler_ms']:.1f}ms (priced {r['predicted_straggler_ms']:.1f}ms"
            f" as rank skew); most exposed: {largest or 'none'}"
        )
    for name, why in result["refused"].items():
        print(f"{name:<9} not run: {why}")
    print(f"rank agreement of predicted and measured order: Kendall tau {result['kendall_tau']:+.2f}")
    speed = result["host_speed"]
    print(
        f"host speed: a {REFERENCE_SIDE}^3 fp32 matmul ran {speed['median']:.2f}x as fast as the profile prices it"
        f" (median over rounds; {speed['min']:.2f}x to {speed['max']:.2f}x); 'at host speed' re-prices the"
        " compute at that speed"
    )


def add_parser(sub) -> None:
    v = sub.add_parser("validate", help="run plans for real on this process group: predicted beside measured")
    v.add_argument("--model", default="llama3-debug", help="a named model or module:factory")
    v.add_argument("--mesh", default=None, help="mesh shape over the process group (default: one dim of all ranks)")
    v.add_argument("--plans", default=None, help="comma-separated: autoplan and hand plans (default: all that fit)")
    v.add_argument(
        "--profile", default=None, help="device profile name or profile JSON (autoplan calibrate); default cpu or h100"
    )
    v.add_argument("--layers", type=int, default=None)
    v.add_argument(
        "--batch", type=int, default=None, help="global batch of a named model (or a factory's batch= argument)"
    )
    v.add_argument("--seq", type=int, default=None)
    v.add_argument("--dtype", default="float32")
    v.add_argument("--steps", type=int, default=5, help="measured steps per plan (median)")
    v.add_argument("--device", choices=("cpu", "cuda"), default=None)
    v.add_argument("--json", default=None, help="write the numbers to this file")
    v.add_argument("--prefetch", action="store_true", help="issue parameter gathers a layer ahead of their use")
    v.set_defaults(run=run_validate)
