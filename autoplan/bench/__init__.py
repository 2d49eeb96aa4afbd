"""Benchmarks: ``python -m autoplan.bench plan|apply|overhead|memory|compare --model llama3-8b --mesh 16x8``.

``plan`` plans on a fake process group (no GPUs, no peers), prints wall time per phase, ILP size,
objective, gap and peak RSS, then applies the plan (post-solve passes + lowering, timed as its own
phase) to report what the passes did and the collectives before and after them. ``apply`` times
lowering alone. ``overhead`` runs rank 0's planned program for real (collectives made free) next
to the plain model on the same local batch: step time, kernels and peak memory, and their ratios.
``memory`` runs rank 0's planned step and prints its measured peak beside the plan's estimate.
``compare`` prices the ILP's plan next to DDP, FSDP, HSDP and FSDP+TP written as pins. Each takes
``--json out.json``.
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import json
import math
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import torch

from autoplan.adapters.inductor import profile_cpp_kernels
from autoplan.bench import gpu, validate
from autoplan.bench.collective_free import collective_free_executor
from autoplan.bench.steps import backward_step, kept_bytes
from autoplan.bench.workloads import (
    MP_CHOICES,
    MP_HELP,
    fake_mesh,
    model_batch,
    model_config,
    mp_policy,
    named_model,
    parse_mesh,
    resolve_dtype,
)
from autoplan.lower.passes.bucketing import DEFAULT_BUCKET_BYTES


def _peak_rss_gib() -> float:
    """This process's peak resident memory since it started its program. On Linux that is the
    ``VmHWM`` of ``/proc/self/status``: ``getrusage``'s ``ru_maxrss`` survives ``exec`` and so also
    holds the peak of the process it was forked from (a test runner's worker, say)."""
    try:
        with open("/proc/self/status") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return kib / 2**20


def _planned(args: argparse.Namespace):
    """Plan the benchmark model on a fake mesh: batch-sharded I/O, parameters split over every rank."""
    from torch.distributed.tensor import Replicate, Shard

    from autoplan import AutoParallel

    shape = parse_mesh(args.mesh)
    mesh = fake_mesh(shape, getattr(args, "device", "cpu"))
    model, cfg = named_model(args.model, getattr(torch, args.dtype), getattr(args, "layers", None), len(shape))
    batch, seq = model_batch(cfg, args.batch, args.seq, shape[0])
    vocab = cfg.vocab_size
    ap = AutoParallel(
        model,
        mesh,
        input_fn=lambda: torch.randint(0, vocab, (batch, seq)),
        device_profile=_profile(args),
        prefetch=getattr(args, "prefetch", False),
        mp_policy=mp_policy(getattr(args, "mp", None)),
    )
    with ap:
        batch_pl = (Shard(0),) + (Replicate(),) * (len(shape) - 1)
        ap.add_input_constraints([batch_pl])
        ap.add_output_constraints([batch_pl])
        ap.add_memory_constraint(param_fraction=1 / math.prod(shape))
        if getattr(args, "cap", None):
            ap.add_memory_constraint(bytes_per_device=args.cap * 2**30)
        if getattr(args, "recompute", None):
            ap.add_recompute_constraint("layers.*", args.recompute)
        plan = ap.optimize_placement()
    return ap, plan, shape, batch, seq


def _profile(args: argparse.Namespace, default: str = "h100") -> str:
    """The profile a plan is priced for: ``--device-profile`` where the benchmark takes one and it is
    given, else ``default`` (the H100, which every figure of a cluster not at hand is priced for)."""
    return getattr(args, "device_profile", None) or default


def _bucket_bytes(args: argparse.Namespace) -> int:
    """``--bucket-mib`` in bytes (0: one collective per move)."""
    return int(getattr(args, "bucket_mib", DEFAULT_BUCKET_BYTES / 2**20) * 2**20)


def _applied(ap, plan, args: argparse.Namespace) -> dict:
    """Run the post-solve passes and lowering on the plan (fake process group) and report what they did."""
    t0 = time.perf_counter()
    ap.apply_placement(plan, bucket_bytes=_bucket_bytes(args))
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
    applied = _applied(ap, plan, args)
    result = {
        "model": args.model,
        "mesh": list(shape),
        "batch": batch,
        "seq": seq,
        "dtype": args.dtype,
        "mp": getattr(args, "mp", None),
        "wall_s": wall,
        "phases_s": plan.timings | {"apply": applied["apply_s"]},
        "layers_stamped": ap.traced.stamped,
        "ilp": plan.ilp.to_dict(),
        "objective_s": plan.cost.total,
        "bucket_latency_s": plan.cost.bucket_latency,
        "cap_gib": getattr(args, "cap", None),
        "estimated_peak_bytes": plan.memory.peak_bytes,
        "recompute": plan.recompute,
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
    print(f"layers stamped rather than traced: {ap.traced.stamped}")
    print(
        f"ILP: {plan.ilp['n_vars']} variables ({plan.ilp['n_edge_vars']} edge), {plan.ilp['n_rows']} rows,"
        f" {plan.ilp['n_units']} units for {plan.ilp['n_nodes']} graph nodes"
    )
    print(
        f"objective {plan.cost.total * 1e3:.2f} ms/step ({ap.applied_plan.cost.total * 1e3:.2f} after round-trip"
        f" removal), gap {plan.solver.get('gap')}"
    )
    chosen = sorted({f"{o}: {sum(v == o for v in plan.recompute.values())} layers" for o in plan.recompute.values()})
    cap = f" (cap {args.cap:g} GiB)" if getattr(args, "cap", None) else ""
    print(f"estimated peak {plan.memory.peak_bytes / 2**30:.2f} GiB per device{cap}, recompute {chosen or 'none'}")
    if mp_policy(getattr(args, "mp", None)) is not None:
        result["precisions"] = _precision_contrast(args, plan)
    return result


def _moved_mib(plan, kinds: tuple[str, ...]) -> float:
    """MiB one rank sends into the plan's collectives of ``kinds`` in a step (its shard of each
    moved tensor, in the dtype moved; the backward's regathers included)."""
    return sum(r.nbytes for r in plan.redistributions if any(k in kinds for k, _ in r.collectives)) / 2**20


def _precision_contrast(args: argparse.Namespace, plan) -> dict:
    """The mixed-precision plan beside the same model planned in pure bf16 and in pure fp32: what
    each costs, the bytes its gathers and reductions move, and how many parameters are placed
    otherwise than the mixed plan places them."""
    rows = {"mixed": plan}
    for dtype in ("bfloat16", "float32"):
        rows[dtype] = _planned(argparse.Namespace(**vars(args) | {"mp": "none", "dtype": dtype}))[1]
    print(
        f"\n{'precision':<10} {'step ms':>9} {'compute':>9} {'comm':>9} {'peak GiB':>9} {'gather MiB':>11}"
        f" {'reduce MiB':>11}  parameters placed otherwise"
    )
    out = {}
    for name, p in rows.items():
        c = p.cost
        out[name] = {
            "step_ms": c.total * 1e3,
            "compute_ms": (c.compute_forward + c.compute_backward) * 1e3,
            "comm_ms": c.comm * 1e3,
            "peak_gib": p.memory.peak_bytes / 2**30,
            "gather_mib": _moved_mib(p, ("all_gather",)),
            "reduce_mib": _moved_mib(p, ("reduce_scatter", "all_reduce")),
            "params_placed_otherwise": 0 if p is plan else sum(plan.diff(p).params.values()),
        }
        r = out[name]
        print(
            f"{name:<10} {r['step_ms']:>9.2f} {r['compute_ms']:>9.2f} {r['comm_ms']:>9.2f} {r['peak_gib']:>9.2f}"
            f" {r['gather_mib']:>11.1f} {r['reduce_mib']:>11.1f}  {r['params_placed_otherwise']}"
        )
    return out


def run_apply(args: argparse.Namespace) -> dict:
    """Plan, then time lowering the plan into the per-rank distributed graph (fake process group)."""
    ap, plan, shape, _, _ = _planned(args)
    result = {"model": args.model, "mesh": list(shape), "phases_s": ap.timings, **_applied(ap, plan, args)}
    result["peak_rss_gib"] = _peak_rss_gib()
    print(f"passes: {result['passes']}")
    print(f"apply (passes + lowering + partition + module): {result['apply_s']:.2f} s")
    print(f"peak RSS {result['peak_rss_gib']:.2f} GiB")
    print(f"lowered graph nodes: {result['lowered_nodes']}")
    print(f"collectives: {result['collectives']}")
    return result


# ---------------------------------------------------------------------------------------------- overhead


@dataclasses.dataclass
class _Program:
    """One program under test: the module, what runs it (compiled or not) and its input."""

    name: str
    module: torch.nn.Module
    run: Callable
    tokens: torch.Tensor
    compiled: bool
    times: list[float] = dataclasses.field(default_factory=list)
    cpu_times: list[float] = dataclasses.field(default_factory=list)  # process CPU seconds, all threads
    first_s: float = 0.0

    def zero_grad(self) -> None:
        for p in self.module.parameters():
            p.grad = None

    def step(self) -> None:
        """Forward and backward of the same loss for both programs (see ``steps.DenseSum``)."""
        backward_step(self.run, self.tokens)

    def resident_bytes(self) -> int:
        """Bytes this program keeps between steps: its (local) parameters and buffers, and its input."""
        return kept_bytes([*self.module.parameters(), *self.module.buffers(), self.tokens])


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _timed(prog: _Program, device: str) -> tuple[float, float]:
    """Wall and process CPU seconds of one step from no gradients to gradients; the gradients are
    freed again, so that only one program's step-time memory is alive at a time."""
    prog.zero_grad()
    _sync(device)
    t0, c0 = time.perf_counter(), time.process_time()
    prog.step()
    _sync(device)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    prog.zero_grad()
    return seconds, cpu


def _probe(prog: _Program, device: str) -> dict:
    """Untimed steps: ATen ops by name (eager programs), then kernels and peak memory."""
    from autoplan.adapters.profiling import count_ops, launches_kernel, profile_step

    result: dict = {}
    if not prog.compiled:
        ops = count_ops(prog.step)
        prog.zero_grad()
        result["ops"] = dict(ops.most_common())
        result["dispatched_kernels"] = sum(c for name, c in ops.items() if launches_kernel(name))
    prof = profile_step(prog.step, device)
    prog.zero_grad()
    result["kernels"] = prof.host_kernels
    if device == "cuda":
        result["gpu_kernels"] = prof.device_kernels
    result["resident_bytes"] = prog.resident_bytes()
    result["peak_bytes"] = result["resident_bytes"] + prof.memory_rise
    return result


def _peak_method(device: str) -> str:
    """How ``_probe`` measures a step's peak, for the saved results."""
    rise = "torch.cuda.max_memory_allocated" if device == "cuda" else "torch.profiler memory timeline"
    return f"resident bytes (own parameters, buffers, input) + the allocator's peak rise during one step ({rise})"


def _compile_regions(gm: torch.fx.GraphModule) -> Callable:
    """What ``apply_placement(compile=True)`` does to each lowered graph: regional Inductor compilation."""
    from autoplan.run.compile import compile_regions

    return compile_regions(gm)[0]


def _log(message: str) -> None:
    print(f"[bench overhead] {message}", file=sys.stderr, flush=True)


def _programs(args: argparse.Namespace, keep_plan: bool = False) -> tuple[list[_Program], dict]:
    """Rank 0's planned program and (unless ``--planned-only``) the plain model on the same local
    batch, materialised on the device (and the plan itself under ``"plan"`` with ``keep_plan``)."""
    shape = parse_mesh(args.mesh)
    plan_args = argparse.Namespace(**vars(args) | {"batch": args.batch * shape[0]})
    _log(f"planning on a fake {args.device} mesh {shape}")
    t0 = time.perf_counter()
    ap, plan, shape, _, seq = _planned(plan_args)
    plan_s = time.perf_counter() - t0
    pmod = ap.apply_placement(plan, bucket_bytes=_bucket_bytes(args))
    collectives = collective_free_executor(pmod, ap.lowered, _compile_regions if args.compile else None)
    device, dtype = args.device, getattr(torch, args.dtype)
    _log("materialising both programs")
    torch.manual_seed(0)
    pmod.to_empty(device=device)
    pmod.init_weights()
    cfg = model_config(args.model, args.layers)
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, seq), device=device)
    if args.compile and device == "cpu":
        profile_cpp_kernels()
    programs = [_Program("planned", pmod, pmod, tokens, args.compile)]
    if not args.planned_only:
        policy = mp_policy(getattr(args, "mp", None))  # the plain model computes in the compute dtype
        model, _ = named_model(args.model, dtype if policy is None else policy.param_dtype, args.layers)
        model.to_empty(device=device)
        model.init_weights()
        plain_run = torch.compile(model) if args.compile else model
        programs.append(_Program("plain", model, plain_run, tokens, args.compile))
    info = {
        "plan_s": plan_s,
        "seq": seq,
        "global_batch": args.batch * shape[0],
        "mesh": list(shape),
        "collectives_made_free": collectives,
        "param_placements": {k: str(v) for k, v in plan.param_placements.items()},
        "planned_cost_s": plan.cost.total,
        "device_profile": plan.device,
        "passes": plan.passes,
    }
    if keep_plan:
        info["plan"] = plan
    return programs, info


def _summary(times: list[float]) -> dict:
    return {"median": statistics.median(times), "min": min(times), "max": max(times), "all": times}


def _op_diff(planned: dict[str, int], plain: dict[str, int]) -> dict[str, int]:
    """Per-step op count differences (planned minus plain), largest first."""
    diff = {k: planned.get(k, 0) - plain.get(k, 0) for k in {*planned, *plain}}
    return dict(sorted(((k, v) for k, v in diff.items() if v), key=lambda kv: (-abs(kv[1]), kv[0])))


def _warm_compiler(device: str) -> None:
    """Pay the compiler's once-per-process set-up (toolchain checks, pattern tables) before timing
    either program, so neither program's compile time includes it."""
    _log("warming up the compiler")
    x = torch.ones(8, device=device, requires_grad=True)
    torch.compile(lambda t: (t * 2).sin().sum())(x).backward()


def run_overhead(args: argparse.Namespace) -> dict:
    """Time rank 0's planned program against the plain model on the same local batch, collectives free."""
    if args.steps < 1:
        raise SystemExit(f"--steps must be at least 1, got {args.steps}")
    if args.batch < 1:
        raise SystemExit(f"--batch must be at least 1, got {args.batch}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda needs a GPU (torch.cuda.is_available() is False)")
    torch.set_flush_denormal(True)  # uninitialised "gathered" values must not hit slow denormal paths
    # timed on this device, so priced for it: a plan priced for an H100 but run on a CPU would be
    # judged by costs it was not made for (relayout copies nearly free at HBM speed, say)
    args.device_profile = _profile(args, "cpu" if args.device == "cpu" else "h100")
    if args.compile:  # compile times from a cold cache: nothing reused from earlier runs on this machine
        cache = os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="autoplan-bench-inductor-")
        atexit.register(shutil.rmtree, cache, True)
    programs, info = _programs(args)
    if args.compile:
        _warm_compiler(args.device)
    for prog in programs:  # the first call compiles (with --compile); one more warm-up step
        _log(f"warming up {prog.name}")
        prog.first_s = _timed(prog, args.device)[0]
        _timed(prog, args.device)
    for k in range(args.steps):  # interleaved, alternating order, so machine noise hits both
        for prog in programs if k % 2 == 0 else programs[::-1]:
            _log(f"timing {prog.name} (step {k + 1}/{args.steps})")
            seconds, cpu = _timed(prog, args.device)
            prog.times.append(seconds)
            prog.cpu_times.append(cpu)
    result: dict = {
        "model": args.model,
        "layers": model_config(args.model, args.layers).n_layers,
        "device": args.device,
        "dtype": args.dtype,
        "compile": args.compile,
        "local_batch": args.batch,
        "steps": args.steps,
        **info,
    }
    for prog in programs:
        _log(f"counting kernels and memory of {prog.name}")
        step = _summary(prog.times)
        result[prog.name] = {
            "step_s": step,
            "step_cpu_s": _summary(prog.cpu_times),  # steadier than wall time on a shared host
            "first_step_s": prog.first_s,
            **_probe(prog, args.device),
        }
        if args.compile:
            result[prog.name]["compile_s"] = prog.first_s - step["median"]
    result["kernels_method"] = (
        "outermost kernel-launching ATen ops"
        + (" and Inductor C++ kernels" if args.compile and args.device == "cpu" else "")
        + " recorded by torch.profiler in one step"
        + ("; gpu_kernels: CUDA kernel events" if args.device == "cuda" else "")
    )
    result["peak_method"] = _peak_method(args.device)
    if args.planned_only:
        _print_overhead(result)
        return result
    p, q = result["planned"], result["plain"]
    result["ratios"] = {
        "step_time": p["step_s"]["median"] / q["step_s"]["median"],
        "step_cpu_time": p["step_cpu_s"]["median"] / q["step_cpu_s"]["median"],
        "kernels": p["kernels"] / q["kernels"],
        "peak_memory": p["peak_bytes"] / q["peak_bytes"],
    }
    if "gpu_kernels" in p:
        result["ratios"]["gpu_kernels"] = p["gpu_kernels"] / q["gpu_kernels"]
    if "ops" in p:
        result["op_diff"] = _op_diff(p["ops"], q["ops"])
    _print_overhead(result)
    return result


def _print_overhead(r: dict) -> None:
    compiled = " compiled (planned: regional Inductor, plain: torch.compile)" if r["compile"] else ""
    print(
        f"{r['model']} x{r['layers']} layers, mesh {r['mesh']}, local batch {r['local_batch']}x{r['seq']},"
        f" {r['dtype']} on {r['device']}{compiled}, planned for {r['device_profile']}"
    )
    print(f"collectives made free: {r['collectives_made_free']}")
    for name in ("planned", "plain")[: 2 if "plain" in r else 1]:
        p, s = r[name], r[name]["step_s"]
        line = f"{name:>8}: step {s['median'] * 1e3:.1f} ms (min {s['min'] * 1e3:.1f}, max {s['max'] * 1e3:.1f})"
        line += f"  cpu {p['step_cpu_s']['median'] * 1e3:.1f} ms"
        line += f"  kernels {p['kernels']}  peak {p['peak_bytes'] / 2**30:.2f} GiB"
        if "compile_s" in p:
            line += f"  compile {p['compile_s']:.1f} s"
        print(line)
    if "ratios" in r:
        print("ratios planned/plain: " + "  ".join(f"{k} {v:.3f}" for k, v in r["ratios"].items()))
    if r.get("op_diff"):
        top = list(r["op_diff"].items())[:20]
        print("ATen ops per step, planned minus plain: " + ", ".join(f"{k} {v:+d}" for k, v in top))


# ---------------------------------------------------------------------------------------------- memory


def run_memory(args: argparse.Namespace) -> dict:
    """Rank 0's planned step run for real (collectives free) next to the plan's memory estimate.

    The measured peak is resident bytes (local parameters, buffers, input) plus the allocator's rise
    during one forward+backward (``torch.cuda.max_memory_allocated`` on a GPU, the profiler's memory
    timeline elsewhere). No optimizer runs, so it is compared with the estimated peak less the
    optimizer states.
    """
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda needs a GPU (torch.cuda.is_available() is False)")
    torch.set_flush_denormal(True)
    run_args = argparse.Namespace(**vars(args) | {"compile": False, "planned_only": True})
    (prog,), info = _programs(run_args, keep_plan=True)
    plan = info.pop("plan")
    _timed(prog, args.device)  # a warm-up step: lazy initialisation is not the step's memory
    measured = _probe(prog, args.device)["peak_bytes"]
    m = plan.memory
    estimated = m.peak_bytes - m.optimizer_bytes
    result = {
        "model": args.model,
        "layers": model_config(args.model, args.layers).n_layers,
        "recompute": plan.recompute,
        "cap_gib": getattr(args, "cap", None),
        "device": args.device,
        "dtype": args.dtype,
        "local_batch": args.batch,
        **{k: v for k, v in info.items() if k != "param_placements"},
        "measured_peak_bytes": measured,
        "estimated_step_peak_bytes": estimated,
        "estimate_over_measured": estimated / measured,
        "estimate": dataclasses.asdict(m) | {"per_param": None},
        "measured_method": _peak_method(args.device) + "; no optimizer step",
    }
    print(
        f"{args.model} x{result['layers']} layers, mesh {result['mesh']}, local batch {args.batch}x{result['seq']},"
        f" {args.dtype} on {args.device}, recompute {sorted(set(plan.recompute.values())) or 'none'}"
    )
    print(
        f"peak per device: measured {measured / 2**20:.1f} MiB, estimated {estimated / 2**20:.1f} MiB"
        f" ({(estimated / measured - 1) * 100:+.1f}%), at {m.peak_at} ({m.peak_phase})"
    )
    print("estimated peak parts: " + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in m.peak_parts.items()))
    return result


def run_compare(args: argparse.Namespace) -> dict:
    """Price the ILP's plan against the hand-written plans users run, under one cost model."""
    from torch.distributed.tensor import Replicate, Shard

    from autoplan import AutoParallel
    from autoplan.bench.handplans import compare_plans

    shape = parse_mesh(args.mesh)
    model, cfg = named_model(args.model, getattr(torch, args.dtype), getattr(args, "layers", None), len(shape))
    batch, seq = model_batch(cfg, args.batch, args.seq, shape[0])
    vocab = cfg.vocab_size
    ap = AutoParallel(
        model,
        fake_mesh(shape),
        lambda: torch.randint(0, vocab, (batch, seq)),
        device_profile=args.device_profile,
        prefetch=args.prefetch,
        mp_policy=mp_policy(args.mp),
    )
    with ap:
        batch_pl = (Shard(0),) + (Replicate(),) * (len(shape) - 1)
        ap.add_input_constraints([batch_pl])
        ap.add_output_constraints([batch_pl])
        if args.cap:
            ap.add_memory_constraint(bytes_per_device=args.cap * 2**30)
        rows = compare_plans(ap, len(shape))
    cap = f", every plan capped at {args.cap:g} GiB per device" if args.cap else ""
    cap += ", parameter gathers prefetched" if args.prefetch else ""
    print(f"{args.model} on mesh {args.mesh} ({ap.device_profile.name}), global batch {batch} x {seq}{cap}")
    print(f"{'plan':<10} {'step ms':>9} {'compute':>9} {'comm':>9} {'exposed':>9} {'peak GiB':>9} {'MFU':>6}  fits")
    for r in rows:
        if "error" in r:
            print(f"{r['plan']:<10} {r['error']}")
            continue
        print(
            f"{r['plan']:<10} {r['step_ms']:>9.2f} {r['compute_ms']:>9.2f} {r['comm_ms']:>9.2f}"
            f" {max(r['exposed_comm_ms'], 0.0):>9.2f} {r['peak_gib']:>9.2f} {r['mfu']:>6.1%}"
            f"  {'yes' if r['fits'] else 'no'}"
        )
    out = {"model": args.model, "mesh": list(shape), "batch": batch, "seq": seq, "cap_gib": args.cap}
    return out | {"prefetch": args.prefetch, "plans": rows}


BUCKET_HELP = "the largest bucket of a layer's collectives run as one, in MiB (0: one collective per move)"


def build_parser() -> argparse.ArgumentParser:
    """The benchmarks' arguments (also what the README's commands are checked against)."""
    parser = argparse.ArgumentParser(prog="python -m autoplan.bench", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("plan", help="time model -> Plan on a fake process group")
    p.add_argument("--model", default="llama3-8b")
    p.add_argument("--mesh", default="16x8")
    p.add_argument("--batch", type=int, default=None, help="global batch (default: max(32, dp size))")
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--dtype", default=None, help="the parameters' dtype (default bfloat16; float32 with --mp)")
    p.add_argument("--mp", choices=MP_CHOICES, default="none", help=MP_HELP)
    p.add_argument("--json", default=None, help="write the numbers to this file")
    p.add_argument("--cap", type=float, default=None, help="cap the estimated peak per device (GiB)")
    p.add_argument(
        "--prefetch", action="store_true", help="plan for a program that gathers each layer's parameters a layer ahead"
    )
    p.add_argument("--bucket-mib", type=float, default=DEFAULT_BUCKET_BYTES / 2**20, help=BUCKET_HELP)
    a = sub.add_parser("apply", help="time lowering a plan into the distributed graph on a fake process group")
    for action in p._actions[1:]:
        a._add_action(action)
    o = sub.add_parser("overhead", help="rank 0's planned program vs the plain model on the same local batch")
    o.add_argument("--model", default="llama3-8b")
    o.add_argument("--layers", type=int, default=None, help="override the config's number of layers")
    o.add_argument("--mesh", default="128")
    o.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    o.add_argument("--compile", action="store_true", help="Inductor for both programs")
    o.add_argument("--batch", type=int, default=1, help="local (per-rank) batch; the global one is it x mesh dim 0")
    o.add_argument("--seq", type=int, default=None)
    o.add_argument("--dtype", default=None, help="the parameters' dtype (default bfloat16; float32 with --mp)")
    o.add_argument("--mp", choices=MP_CHOICES, default="none", help=MP_HELP)
    o.add_argument("--steps", type=int, default=3, help="timed steps per program, after two warm-up steps")
    o.add_argument("--json", default=None, help="write the numbers to this file")
    o.add_argument(
        "--device-profile",
        default=None,
        help="price the plan for this profile (name or JSON); default: the device it runs on (cpu or h100)",
    )
    o.add_argument(
        "--planned-only", action="store_true", help="skip the plain model (when a full copy does not fit this host)"
    )
    o.add_argument("--bucket-mib", type=float, default=DEFAULT_BUCKET_BYTES / 2**20, help=BUCKET_HELP)
    m = sub.add_parser("memory", help="rank 0's measured peak memory beside the plan's estimate")
    for action in o._actions[1:]:
        if action.dest not in ("compile", "steps", "planned_only", "device_profile"):
            m._add_action(action)
    m.add_argument(
        "--recompute", choices=("none", "selective", "full"), default=None, help="pin every layer's recompute option"
    )
    m.add_argument("--cap", type=float, default=None, help="cap the estimated peak per device (GiB)")
    m.add_argument("--prefetch", action="store_true", help="gather each layer's parameters a layer ahead")
    c = sub.add_parser("compare", help="the ILP's plan against DDP, FSDP, HSDP and FSDP+TP under one cost model")
    for action in p._actions[1:]:
        c._add_action(action)
    c.add_argument("--layers", type=int, default=None, help="override the config's number of layers")
    c.add_argument("--device-profile", default="h100", help="a built-in profile name or a profile JSON")
    validate.add_parser(sub)
    gpu.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        resolve_dtype(args)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    runners = {
        "plan": run_plan,
        "apply": run_apply,
        "overhead": run_overhead,
        "memory": run_memory,
        "compare": run_compare,
        "validate": validate.run_validate,
        "gpu": gpu.run_gpu,
    }
    try:  # a bad model, mesh or layer count: say so up front, not in a traceback
        if args.mesh is not None:
            parse_mesh(args.mesh)
        if ":" not in args.model:
            model_config(args.model, getattr(args, "layers", None))
    except ValueError as e:
        raise SystemExit(f"autoplan.bench: {e}") from None
    result = runners[args.cmd](args)
    if args.json and result is not None:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.json}")
    return 0
