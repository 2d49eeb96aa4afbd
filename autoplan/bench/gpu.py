"""``python -m autoplan.bench gpu``: every check that needs a GPU, in one command and one JSON.

Meant for a machine lent for a few minutes, with torch and this checkout (``PYTHONPATH``) and no
package registry: each check runs as its own process (a fresh CUDA context and process group, a
timeout of its own), so one failing check never hides the others. Without a CUDA device the checks
that can run on the CPU still run (calibration, planning with each attention kernel, validation,
the training example on gloo) and the CUDA-only ones are skipped, each saying why.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Check:
    name: str
    argv: tuple[str, ...]  # after ``python``; ``{out}`` is the check's JSON, ``{profile}`` calibrate's
    cuda_only: bool = False
    timeout_s: int = 120
    env: tuple[tuple[str, str], ...] = ()  # set for this check's process


def checks(cuda: bool) -> list[Check]:
    """The checks, in order (calibrate first: validation prices with its profile)."""
    device = "cuda" if cuda else "cpu"
    bench = ("-m", "autoplan.bench")
    plan = ("-m", "autoplan.cli", "plan", "--model", "llama3-debug", "--mesh", "2x2", "--dtype", "bfloat16")
    # without a GPU the command only shows it runs: a fast calibration, which a loaded host still
    # finishes in its limit (a full CPU one is ``autoplan calibrate``)
    fast = () if cuda else ("--fast",)
    calibrate = ("-m", "autoplan.cli", "calibrate", "--device", device, "--out", "{profile}", *fast)
    # one intra-op thread on a CPU: beside other work on a small host, two threads spinning for each
    # other took the fast calibration from 5 s to past its limit
    threads = () if cuda else (("OMP_NUM_THREADS", "1"),)
    out = [Check("calibrate", calibrate, timeout_s=90, env=threads)]
    out += [
        Check(f"plan attention={kernel}", (*plan, "--attention", kernel, "-o", "{out}"))
        for kernel in ("flash", "efficient", "cudnn", "math")
    ]
    for layers in (2, 4):
        for compiled in (False, True):
            argv = (*bench, "overhead", "--model", "llama3-8b", "--layers", str(layers), "--mesh", "128")
            argv += ("--device", "cuda", "--batch", "1", "--seq", "4096", "--json", "{out}")
            name = f"overhead 8b x{layers} {'compiled' if compiled else 'eager'}"
            out.append(Check(name, argv + (("--compile",) if compiled else ()), cuda_only=True, timeout_s=150))
    memory = (*bench, "memory", "--model", "llama3-8b", "--layers", "2", "--mesh", "16x8", "--device", "cuda")
    out.append(Check("memory 8b x2 16x8", (*memory, "--batch", "1", "--seq", "1024", "--json", "{out}"), True, 120))
    validate = (*bench, "validate", "--plans", "autoplan", "--device", device, "--profile", "{profile}")
    out.append(Check("validate debug (one rank)", (*validate, "--model", "llama3-debug", "--json", "{out}")))
    if cuda:  # a step whose kernels, not their launches, take the time
        big = ("--model", "llama3-8b", "--layers", "2", "--dtype", "bfloat16", "--batch", "1", "--seq", "4096")
        out.append(Check("validate 8b x2 (one rank)", (*validate, *big, "--json", "{out}"), timeout_s=90))
    torchrun = (
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "1",
        str(ROOT / "examples" / "train_llama3_debug.py"),
    )
    backend = "NCCL" if torch.cuda.is_available() else "gloo"  # the example picks by what the machine has
    out.append(Check(f"train_llama3_debug.py (1 rank, {backend})", torchrun, timeout_s=90))
    return out


def _run(check: Check, folder: Path, profile: Path, limit_s: float) -> dict:
    out = folder / (check.name.replace(" ", "_").replace("/", "_").replace("=", "_") + ".json")
    # -X faulthandler: a check that hangs prints every thread's stack when it is stopped (SIGABRT)
    argv = [sys.executable, "-X", "faulthandler", *(a.format(out=out, profile=profile) for a in check.argv)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    env.update(check.env)
    t0 = time.perf_counter()
    # a session of its own: on a timeout the whole group goes (torchrun's workers, compile workers)
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=folder, env=env, start_new_session=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=limit_s)
    except subprocess.TimeoutExpired:
        os.kill(proc.pid, signal.SIGABRT)  # where it hung, on its stderr
        try:
            stdout, stderr = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            stdout, stderr = "", ""
        try:  # whatever it started (torchrun's workers, compile workers) goes too
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:  # the abort took the whole group already
            pass
        more_out, more_err = proc.communicate()
        return {
            "status": "timeout",
            "seconds": time.perf_counter() - t0,
            "limit_s": limit_s,
            "stdout_tail": (stdout + more_out)[-1500:],
            "stderr_tail": (stderr + more_err)[-4000:],
        }
    result: dict = {"status": "ok" if proc.returncode == 0 else "failed", "seconds": time.perf_counter() - t0}
    if proc.returncode != 0:
        result["stderr_tail"] = stderr[-2000:]
    result["stdout_tail"] = stdout[-1500:]
    if out.is_file():
        try:
            result["json"] = json.loads(out.read_text())
        except json.JSONDecodeError:
            result["json_error"] = f"{out.name} is not JSON"
    return result


def run_gpu(args: argparse.Namespace) -> dict:
    """Run every check (see the module docstring); prints a line per check and returns the results."""
    cuda = torch.cuda.is_available() and args.device != "cpu"
    device = torch.cuda.get_device_name(0) if cuda else "no CUDA device"
    print(f"autoplan GPU checks on {device} (torch {torch.__version__})", flush=True)
    results: dict = {"device": device, "torch": torch.__version__, "cuda": cuda, "checks": {}}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        profile = folder / "profile.json"
        chosen = [c for c in checks(cuda) if not args.only or any(c.name.startswith(o) for o in args.only.split(","))]
        for check in chosen:
            left = args.deadline - (time.perf_counter() - started)
            why = "needs a CUDA device; none here" if check.cuda_only and not cuda else None
            if why is None and left < min(check.timeout_s, 30):
                why = f"{left:.0f} s left of the {args.deadline:.0f} s deadline"
            if why is not None:
                results["checks"][check.name] = {"status": "skipped", "why": why}
                print(f"  skipped  {check.name}: {why}", flush=True)
                continue
            r = _run(check, folder, profile, min(check.timeout_s, left))
            results["checks"][check.name] = r
            print(f"  {r['status']:<8} {check.name} ({r['seconds']:.1f} s)", flush=True)
        if profile.is_file():
            results["profile"] = json.loads(profile.read_text())
    results["seconds"] = time.perf_counter() - started
    failed = [k for k, v in results["checks"].items() if v["status"] in ("failed", "timeout")]
    print(f"{len(results['checks'])} checks in {results['seconds']:.0f} s; failed: {', '.join(failed) or 'none'}")
    return results


def add_parser(sub) -> None:
    g = sub.add_parser("gpu", help="every GPU check in one command, one JSON (CUDA-only checks skipped without one)")
    g.add_argument("--device", choices=("cpu", "cuda"), default=None, help="cpu: run as if no GPU were here")
    g.add_argument("--json", default=None, help="write the results to this file")
    g.add_argument("--only", default=None, help="run only the checks whose names start so (comma-separated)")
    g.add_argument(
        "--deadline", type=float, default=540.0, help="seconds for all checks; those that would overrun are skipped"
    )
    g.set_defaults(run=run_gpu, model="llama3-debug", mesh=None, dtype="float32")
