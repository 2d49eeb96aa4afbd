"""``autoplan``: plan a model from the shell, and read saved plans.

    autoplan plan --model llama3-8b --mesh 16x8 -o plan.json
    autoplan plan --model mypackage.models:build --mesh 8 --inputs "S(0)" --cap 40 -o plan.json
    autoplan show plan.json
    autoplan explain plan.json "layers.*.attention" [--all]
    autoplan diff a.json b.json
    autoplan calibrate --out profile.json        (torchrun --nproc-per-node N -m autoplan.cli calibrate: links too;
                                                 --mesh 2x2: on each mesh dim's groups)

A factory (``module:function``, found from the current folder too) returns ``(model, input_fn)``;
build the model on the meta device so that planning needs no memory. Planning runs on a fake
process group, so any mesh plans here. ``-v`` logs each phase and the solver's progress (shown
without it under ``--cap``, whose rounds may take minutes), ``-vv`` the solver's own log too.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys

import torch
from torch.distributed.tensor import Replicate

from autoplan.bench.workloads import MP_CHOICES, MP_HELP, resolve_dtype
from autoplan.plan import Plan, parse_placements_strict

log = logging.getLogger("autoplan")
# the loggers of a solve's progress (rounds, incumbent, gap, seconds), shown under --cap without -v
PROGRESS_LOGGERS = ("autoplan.solve.planner", "autoplan.solve.ilp")


def _placements(spec: str, ndim: int, what: str) -> tuple:
    """``"S(0)R"`` for a 2-D mesh; missing trailing dims are replicated."""
    try:
        parts = parse_placements_strict(spec)
    except ValueError:
        parts = ()
    if not 0 < len(parts) <= ndim:
        raise ValueError(f"{what}: expected up to {ndim} placements like 'S(0)R' (R, S(d), P(sum)), got {spec!r}")
    return parts + (Replicate(),) * (ndim - len(parts))


def _workload(args: argparse.Namespace, shape: tuple[int, ...]) -> tuple:
    """The model, its input function and default I/O placements (batch split over the first mesh dim
    for the named LLaMA models, none for a user factory)."""
    from autoplan.bench.workloads import load_factory, model_batch, named_model

    if ":" in args.model:
        model, input_fn = load_factory(args.model)
        return model, input_fn, None
    model, cfg = named_model(args.model, getattr(torch, args.dtype), args.layers, len(shape))
    batch, seq = model_batch(cfg, args.batch, args.seq, shape[0])
    return model, lambda: torch.randint(0, cfg.vocab_size, (batch, seq)), "S(0)" + "R" * (len(shape) - 1)


def cmd_plan(args: argparse.Namespace) -> int:
    from autoplan import AutoParallel
    from autoplan.bench.workloads import fake_mesh, mp_policy, parse_mesh

    try:  # every argument checked before the (long) planning starts
        if args.cap is not None and not args.cap > 0:
            raise ValueError(f"--cap is the estimated peak per device in GiB, a positive number; got {args.cap:g}")
        shape = parse_mesh(args.mesh)
        model, input_fn, io_default = _workload(args, shape)
        inputs, outputs = (
            _placements(spec, len(shape), flag) if spec else None
            for spec, flag in ((args.inputs or io_default, "--inputs"), (args.outputs or io_default, "--outputs"))
        )
        pins = [(p.partition("=")[0], _placements(p.partition("=")[2], len(shape), f"--pin {p}")) for p in args.pin]
        mesh = fake_mesh(shape)
    except ValueError as e:
        raise SystemExit(f"autoplan plan: {e}") from None
    log.info("tracing %s for mesh %s", args.model, "x".join(map(str, shape)))
    settings = {"device_profile": args.device_profile, "attention": args.attention, "mp_policy": mp_policy(args.mp)}
    with AutoParallel(model, mesh, input_fn, **settings) as ap:
        log.info("traced and enumerated strategies: %s", _seconds(ap.timings))
        if inputs:
            ap.add_input_constraints([inputs])
        if outputs:
            ap.add_output_constraints([outputs])
        for target, placements in pins:
            ap.add_node_constraint(target, placements)
        fraction = args.param_fraction if args.param_fraction is not None else 1 / math.prod(shape)
        if fraction > 0:
            ap.add_memory_constraint(param_fraction=fraction)
        if args.cap is not None:
            ap.add_memory_constraint(bytes_per_device=args.cap * 2**30)
        plan = ap.optimize_placement()
    log.info("solved: %s", _seconds(plan.timings))
    print(plan.summary())
    if args.out:
        plan.to_json(args.out)
        print(f"\nplan written to {args.out}")
    return 0


def _seconds(timings: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.2f}s" for k, v in timings.items())


def cmd_calibrate(args: argparse.Namespace) -> int:
    """Measure this host's device (and, under torchrun, its links) and write the profile on rank 0."""
    import os
    import time

    import torch.distributed as dist

    from autoplan.bench.workloads import parse_mesh
    from autoplan.cost.calibrate import calibrate, write_profile
    from autoplan.cost.measure import CalibrateOptions
    from autoplan.run.group import join_group

    try:
        mesh = parse_mesh(args.mesh) if args.mesh else None
    except ValueError as e:
        raise SystemExit(f"autoplan calibrate: --mesh: {e}") from None
    cuda = args.device == "cuda" or (args.device is None and torch.cuda.is_available())
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    owns_group = join_group(device.type, single=False)
    rank = dist.get_rank() if dist.is_initialized() else 0
    started = time.perf_counter()

    def say(line: str) -> None:
        if rank == 0:
            print(f"[{time.perf_counter() - started:5.1f} s] {line}", flush=True)

    try:
        profile, measured = calibrate(device, None, CalibrateOptions(fast=args.fast, name=args.name, mesh=mesh), say)
        if rank == 0:
            write_profile(args.out, profile, measured)
            say(
                f"wrote {args.out} ({profile.name}); plan with device_profile={args.out!r}"
                f" or --device-profile {args.out}"
            )
    finally:
        if owns_group:  # a caller's group (a test's, a notebook's) outlives the command
            dist.destroy_process_group()
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    print(Plan.from_json(args.plan).summary())
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    print(Plan.from_json(args.plan).explain(args.target, all_ops=args.all))
    return 0


def cmd_diff(args: argparse.Namespace) -> int:
    print(Plan.from_json(args.first).diff(Plan.from_json(args.second)))
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``autoplan`` command's arguments (also what the README's commands are checked against)."""
    from autoplan.cost.devices import DEVICE_PROFILES

    parser = argparse.ArgumentParser(prog="autoplan", description="Plan how to split a PyTorch training step.")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "-v",
        "--verbose",
        action="count",
        default=0,
        help="log each phase and the solver's progress (the 'autoplan' logger); -vv: the solver's own log too",
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("plan", parents=[common], help="plan a model on a mesh (any size: a fake process group)")
    p.add_argument(
        "--model",
        default="llama3-8b",
        help="llama3-{debug,8b,70b}, deepseek-v3-{16b,671b}, qwen3-30b-a3b, moe-debug or module:factory",
    )
    p.add_argument("--mesh", default="16x8", help="mesh shape, e.g. 128 or 16x8")
    p.add_argument("--layers", type=int, default=None, help="override a named model's number of layers")
    p.add_argument("--batch", type=int, default=None, help="global batch of a named model (default max(32, dp))")
    p.add_argument("--seq", type=int, default=None, help="sequence length of a named model (default ≤ 8192)")
    p.add_argument("--dtype", default=None, help="a named model's parameters' dtype (bfloat16; float32 with --mp)")
    p.add_argument("--mp", choices=MP_CHOICES, default="none", help=MP_HELP)
    p.add_argument("--inputs", default=None, help="placements of the (first) input, e.g. 'S(0)R'")
    p.add_argument("--outputs", default=None, help="placements of the (first) output")
    p.add_argument("--pin", action="append", default=[], help="TARGET=PLACEMENTS, e.g. 'layers.*.wq.weight=S(0)S(0)'")
    p.add_argument(
        "--param-fraction",
        type=float,
        default=None,
        help="per-device share of parameter bytes (default 1/ranks; 0: no cap)",
    )
    p.add_argument(
        "--cap",
        type=float,
        default=None,
        metavar="GIB",
        help="cap each device's estimated peak memory of a step at GIB GiB (parameters, gradients, optimizer"
        " states, activations)",
    )
    p.add_argument(
        "--device-profile",
        default="h100",
        help=f"{', '.join(sorted(DEVICE_PROFILES))} or a profile JSON (autoplan calibrate --out)",
    )
    p.add_argument("--attention", default="auto", help="auto, flash, efficient, cudnn or math")
    p.add_argument("-o", "--out", default=None, help="write the plan to this JSON file")
    p.set_defaults(run=cmd_plan)
    c = sub.add_parser(
        "calibrate",
        parents=[common],
        help="measure this machine's matmuls, memory, launch floor and (under torchrun) collectives into a profile",
    )
    c.add_argument("--out", default="profile.json", help="where to write the profile JSON")
    c.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when there is one")
    c.add_argument("--fast", action="store_true", help="smaller sizes and fewer repeats (a second or two)")
    c.add_argument("--name", default=None, help="the profile's name (default: the device's)")
    c.add_argument(
        "--mesh",
        default=None,
        help="measure the collectives on each dim of this mesh of the ranks, e.g. 2x2 (default: one dim per link"
        " class: hosts x ranks per host)",
    )
    c.set_defaults(run=cmd_calibrate)
    s = sub.add_parser("show", parents=[common], help="print a saved plan's summary")
    s.add_argument("plan")
    s.set_defaults(run=cmd_show)
    e = sub.add_parser("explain", parents=[common], help="why a node or module took its placements")
    e.add_argument("plan")
    e.add_argument("target", help="a node name, a module path or a pattern such as 'layers.*.attention'")
    e.add_argument("--all", action="store_true", help="a module's views and aliases too, not only its compute ops")
    e.set_defaults(run=cmd_explain)
    d = sub.add_parser("diff", parents=[common], help="what the second plan does differently, by layer pattern")
    d.add_argument("first")
    d.add_argument("second")
    d.set_defaults(run=cmd_diff)
    return parser


def main(argv: list[str] | None = None) -> int:
    from autoplan.errors import AutoplanError
    from solvers.result import InfeasibleError, SolverTimeoutError

    args = build_parser().parse_args(argv)
    logging.basicConfig(format="[%(name)s] %(message)s", level=logging.INFO if args.verbose else logging.WARNING)
    # autoplan's debug lines and the solver's log at -vv, not every library's debug output (set on
    # every call: loggers outlive it)
    log.setLevel(logging.DEBUG if args.verbose > 1 else logging.NOTSET)
    # a capped solve may run minutes: show its rounds and gap (set on every call, as loggers outlive it)
    shown = getattr(args, "cap", None) is not None and not args.verbose
    for name in PROGRESS_LOGGERS:
        logging.getLogger(name).setLevel(logging.INFO if shown else logging.NOTSET)
    try:
        resolve_dtype(args)
    except ValueError as e:
        raise SystemExit(f"autoplan: {e}") from None
    try:
        return args.run(args)
    except KeyError as e:  # explain: no such node or module (the message lists close ones)
        raise SystemExit(f"autoplan {args.cmd}: {e.args[0]}") from None
    except (FileNotFoundError, AutoplanError, InfeasibleError, SolverTimeoutError) as e:
        raise SystemExit(f"autoplan {args.cmd}: {e}") from None


if __name__ == "__main__":
    sys.exit(main())
