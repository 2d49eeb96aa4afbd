"""Measure the machine at hand and write a device profile the cost model prices plans with.

The built-in profiles (``autoplan.cost.devices``) are datasheet figures for clusters that are not
at hand. ``calibrate`` times this host's device instead:

- matmuls of several sizes per dtype, each square and thin (an eighth and a thirty-second of the
  rows): the fastest is the dtype's peak, and each size's fraction of it makes the dtype's matmul
  curves in the profile's ``kernel_efficiency``, one per shape (small matmuls reach less of the
  peak, and how much less depends on the dtype: bf16 on tensor cores needs far larger products
  than fp32 to fill the device; a thin one reaches less than a square one of the same FLOPs,
  ``devices.thinness``);
- causal attention (SDPA, forward and backward) at several sequence lengths per dtype, counted
  with the cost model's own FLOP formula: its fraction of the dtype's matmul peak is the
  dtype's attention curve;
- a large elementwise product: the memory bandwidth that memory-bound ops stream at;
- a one-element op: the launch and dispatch floor every kernel pays;
- with a process group of more than one rank, all-gather, reduce-scatter, all-reduce and
  all-to-all at several sizes up to a step's largest moves, on the real backend and through the
  functional ops the lowered program issues (on gloo each after a burst of compute, as a
  training step issues them), on the groups of every dim of a mesh (``CalibrateOptions.mesh``;
  by default one dim per link class: the hosts, and the ranks of one host) and on the whole
  mesh. Each group sits on one class of link, NVLink inside a node or the network with one rank
  per node (``network.MeshTopology``), and the rows of each class are fitted to the cost model's
  own alpha-beta formulas (``network.flat_collective_seconds``) as one latency and one bandwidth
  for the link, and inside a node each kind's own latency and bandwidth, where the backend runs
  it otherwise than the model (``collective_links``: gloo's reduce-scatter reduces the whole
  tensor, no ring). Every group's own fit, and how far the profile prices its rows, are reported.
  Then how much of an all-reduce's time runs under a matmul loop it is issued beside
  (``comm_overlap``), and how long a collective after a layer's compute waits for the last rank
  (``rank_skew``).
Dtypes not measured keep their datasheet rate scaled like the first measured one; links not measured
keep theirs.

Every rank measures; rank 0's numbers are written (``devices.profile_to_json``) with the raw tables, and
``devices.resolve_profile`` loads the file back wherever a profile name is accepted.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from autoplan.cost.devices import CPU_GLOO, H100_SXM, DeviceProfile, dtype_name, profile_to_json, thinness
from autoplan.cost.flops import sdpa_flops
from autoplan.cost.links import (
    GroupRows,
    check_mesh,
    collective_burst,
    default_mesh,
    fit_groups,
    group_report,
    measure_collectives,
    measure_overlap,
    measure_skew,
    mesh_groups,
    ranks_per_host,
)
from autoplan.cost.measure import CalibrateOptions, seconds_per_call, sync


def matmul_shapes(n: int) -> tuple[tuple[int, int, int], ...]:
    """The (m, k, n) matmuls measured at size ``n``: a square one, and thin ones of an eighth and a
    thirty-second of the rows (few tokens against a wide weight: a small local batch, a weight's
    gradient over them), which reach less of the peak (``devices.thinness``: 5/3 and about 3.6)."""
    return ((n, n, n), (max(n // 8, 1), n, n), (max(n // 32, 1), n, n))


def _too_slow(fn: Callable[[], object], device: torch.device, opts: CalibrateOptions, what: str, say) -> bool:
    """Whether one call of ``fn`` takes longer than ``CalibrateOptions.call_seconds``; says so. Not
    warmed up first: the kernels of a smaller size of the same kind have run."""
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    t = time.perf_counter() - t0
    if t > opts.call_seconds:
        say(f"{what}: {t:.2f} s a call, over {opts.call_seconds} s: larger sizes left out")
    return t > opts.call_seconds


def measure_matmuls(device: torch.device, opts: CalibrateOptions, say: Callable[[str], None]) -> dict:
    """Per dtype name: ``[(size, FLOPs of one matmul, FLOP/s, thinness)]`` for each of
    ``matmul_shapes`` at each size, up to the first size whose square matmul is ``_too_slow``
    (always the smallest)."""
    table = {}
    for dtype in opts.dtypes:
        rows = []
        for i, size in enumerate(opts.matmul_sizes(device)):
            square = torch.randn(size, size, device=device).to(dtype)
            if i and _too_slow(
                lambda a=square: torch.mm(a, a), device, opts, f"matmul {dtype_name(dtype)} {size}", say
            ):
                break
            for m, k, n in matmul_shapes(size):
                a = torch.randn(m, k, device=device).to(dtype)
                b = torch.randn(k, n, device=device).to(dtype)
                flops = 2.0 * m * k * n
                s = seconds_per_call(lambda a=a, b=b: torch.mm(a, b), device, opts.repeats, inner=None)
                nbytes = a.element_size() * (m * k + k * n + m * n)
                rows.append((size, flops, flops / s, thinness(flops, nbytes, a.element_size())))
                say(f"matmul {dtype_name(dtype)} {m}x{k}x{n}: {flops / s / 1e9:.1f} GFLOP/s")
        table[dtype_name(dtype)] = rows
    return table


def measure_attention(device: torch.device, opts: CalibrateOptions, say: Callable[[str], None]) -> dict:
    """Per dtype name: ``[(sequence length, FLOPs of a forward and backward, FLOP/s)]``, the FLOPs
    by the cost model's own formula (``flops.sdpa_flops``: causal halves the work; the backward is
    2.5 forwards), so the fractions apply to the FLOPs the cost model counts; up to the first
    length whose step is ``_too_slow`` (always the shortest)."""
    table = {}
    for dtype in opts.dtypes:
        rows = []
        for i, (heads, seq, dim) in enumerate(opts.attention_shapes(device)):
            q, k, v = (torch.randn(1, heads, seq, dim, device=device, dtype=dtype, requires_grad=True) for _ in "qkv")
            grad = torch.randn(1, heads, seq, dim, device=device, dtype=dtype)
            flops = 3.5 * sdpa_flops(q.shape, k.shape, v.shape, is_causal=True)

            def step(q=q, k=k, v=v, grad=grad):
                out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
                return torch.autograd.grad(out, (q, k, v), grad)

            if i and _too_slow(step, device, opts, f"attention {dtype_name(dtype)} seq {seq}", say):
                break
            s = seconds_per_call(step, device, opts.repeats, inner=None)
            rows.append((seq, flops, flops / s))
            say(f"attention {dtype_name(dtype)} seq {seq}: {flops / s / 1e9:.1f} GFLOP/s")
        table[dtype_name(dtype)] = rows
    return table


def measure_memory(device: torch.device, opts: CalibrateOptions, say: Callable[[str], None]) -> tuple[float, float]:
    """(bytes/s an elementwise op streams at, counting what it reads and writes; seconds of a
    one-element op called as the lowered program calls ops, through its ``OpOverload``)."""
    a = torch.rand(opts.stream_bytes // 4, device=device)
    b, out = torch.rand_like(a), torch.empty_like(a)
    s = seconds_per_call(lambda: torch.mul(a, b, out=out), device, opts.repeats, inner=4)
    bandwidth = 3 * opts.stream_bytes / s
    one, add = torch.ones(1, device=device), torch.ops.aten.add.Tensor
    launch = seconds_per_call(lambda: add(one, one), device, opts.repeats, inner=200)
    say(f"elementwise: {bandwidth / 1e9:.1f} GB/s; one-element op: {launch * 1e6:.1f} us")
    return bandwidth, launch


def efficiency_curve(rows: list, peak: float | None = None) -> tuple[float, tuple[tuple[float, float], ...]]:
    """(peak FLOP/s: ``peak``, or the fastest size, ``[(FLOPs, fraction of the peak)]`` per size,
    in increasing FLOPs; a fraction over the peak counts as the peak)."""
    peak = peak or max(row[2] for row in rows)
    return peak, tuple(sorted((row[1], min(row[2] / peak, 1.0)) for row in rows))


def matmul_curves(rows: list) -> tuple[float, list[tuple]]:
    """(peak FLOP/s: the fastest matmul, ``kernel_efficiency`` rows of each measured shape: (FLOPs,
    fraction of the peak, thinness)); ``rows`` as ``measure_matmuls`` gives them."""
    peak = max(rate for _, _, rate, _ in rows)
    out = []
    shapes = len(matmul_shapes(1))
    for shape in range(shapes):
        family = rows[shape::shapes]
        _, curve = efficiency_curve(family, peak)
        thin = round(statistics.median(t for *_, t in family), 3)  # one value at every size, to rounding
        out += [(f, e, thin) for f, e in curve]
    return peak, out


def calibrate(
    device: torch.device | str = "cpu",
    group=None,
    opts: CalibrateOptions | None = None,
    say: Callable[[str], None] = lambda line: None,
) -> tuple[DeviceProfile, dict]:
    """Measure ``device`` (and ``group``'s collectives when it has several ranks) and return the
    profile and the raw measurements. Starts from the built-in profile of the device's kind (the
    ``cpu`` or ``h100`` one) and replaces what was measured; the links of a single process stay
    the built-in ones (there is nothing to measure them on)."""
    opts = opts or CalibrateOptions()
    device = torch.device(device)
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    local = ranks_per_host(world)
    shape = opts.mesh or default_mesh(world, local)
    check_mesh(shape, world)  # before measuring anything
    base = CPU_GLOO if device.type == "cpu" else H100_SXM
    dtypes = tuple(d for d in opts.dtypes if device.type == "cuda" or d in (torch.float32, torch.bfloat16))
    opts = dataclasses.replace(opts, dtypes=dtypes)
    matmuls = measure_matmuls(device, opts, say)
    attentions = measure_attention(device, opts, say)
    bandwidth, launch = measure_memory(device, opts, say)
    measured_peaks, efficiency = {}, []
    for name, rows in matmuls.items():
        measured_peaks[name], curves = matmul_curves(rows)
        _, attention = efficiency_curve(attentions[name], measured_peaks[name])
        efficiency += [("matmul", name, *row) for row in curves] + [("attention", name, f, e) for f, e in attention]
    reference = dtype_name(opts.dtypes[0])
    # a dtype not measured keeps the datasheet rate, scaled as the reference dtype's measured peak is
    scale = measured_peaks[reference] / base.flops_for(opts.dtypes[0])
    rates = {name: rate * scale for name, rate in base.peak_flops} | measured_peaks
    keep = base.bandwidth_efficiency  # what the links not measured here still achieve of their datasheet rate
    profile = dataclasses.replace(
        base,
        name=opts.name or _device_name(device),
        peak_flops=tuple(rates.items()),
        kernel_efficiency=tuple(efficiency),
        compute_efficiency=1.0,
        hbm_bandwidth=bandwidth,
        bandwidth_efficiency=1.0,
        intra_node_bandwidth=base.intra_node_bandwidth * keep,
        inter_node_bandwidth=base.inter_node_bandwidth * keep,
        kernel_launch=launch,
        memory_bytes=_memory_bytes(device),
    )
    measured: dict = {
        "matmul": matmuls,
        "attention": attentions,
        "elementwise_bytes_per_s": bandwidth,
        "launch_s": launch,
    }
    if world > 1 and dist.get_backend(group) != "fake":  # a planning host's fake group moves nothing
        burst = collective_burst(group, device, opts)
        groups = [
            GroupRows(
                name, span, tuple(measure_collectives(g, device, opts, lambda line, n=name: say(f"{n}: {line}"), burst))
            )
            for name, g, span in mesh_groups(shape, group, device, local)
        ]
        overlap = measure_overlap(group, device, opts, say)
        skew = measure_skew(group, device, opts, say, burst)
        if local < world:
            per_node = local  # the hosts' ranks, as collective_seconds places groups
        else:
            per_node = max(world, profile.gpus_per_node) if device.type == "cpu" else profile.gpus_per_node
        profile = fit_groups(
            dataclasses.replace(profile, gpus_per_node=per_node, nvls=False, comm_overlap=overlap, rank_skew=skew),
            groups,
        )
        say(
            f"links: inside a node latency {profile.intra_node_latency * 1e6:.1f} us, bandwidth"
            f" {profile.intra_node_bandwidth / 1e9:.2f} GB/s; across nodes latency"
            f" {profile.inter_node_latency * 1e6:.1f} us, bandwidth {profile.inter_node_bandwidth / 1e9:.2f} GB/s;"
            " per kind inside a node:"
        )
        for kind, lat, bw in profile.collective_links:
            say(f"  {kind}: latency {lat * 1e6:.1f} us, bandwidth {bw / 1e9:.2f} GB/s")
        reports = [group_report(profile, g) for g in groups]
        for r in reports:
            say(
                f"{r['name']} ({r['ranks']} ranks on {r['nodes']} node(s), {r['link']}): its own fit latency"
                f" {r['latency_s'] * 1e6:.1f} us, bandwidth {r['bandwidth_bytes_per_s'] / 1e9:.2f} GB/s; the profile"
                f" prices its collectives within a median {r['priced_median_error']:.0%}"
            )
        measured["collectives"] = [row for g in groups for row in g.rows]
        measured["groups"] = reports
        measured["comm_overlap"] = overlap
        measured["rank_skew"] = skew
        measured["link_fit"] = {
            "latency_s": profile.intra_node_latency,
            "bandwidth_bytes_per_s": profile.intra_node_bandwidth,
            "inter_node_latency_s": profile.inter_node_latency,
            "inter_node_bandwidth_bytes_per_s": profile.inter_node_bandwidth,
            "per_kind": {
                kind: {"latency_s": lat, "bandwidth_bytes_per_s": bw} for kind, lat, bw in profile.collective_links
            },
        }
    return profile, measured


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"calibrated {torch.cuda.get_device_name(device)}"
    return f"calibrated cpu ({torch.get_num_threads()} threads)"


def _memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    try:
        with open("/proc/meminfo") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemTotal:"))
        return kib * 1024
    except (OSError, StopIteration):
        return CPU_GLOO.memory_bytes


def write_profile(path: str | Path, profile: DeviceProfile, measured: dict | None = None) -> None:
    Path(path).write_text(profile_to_json(profile, measured))
