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
import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from autoplan.cost.devices import CPU_GLOO, H100_SXM, DeviceProfile, LinkKind, dtype_name, profile_to_json, thinness
from autoplan.cost.flops import sdpa_flops
from autoplan.cost.network import CollectiveKind, GroupSpan, MeshTopology, collective_seconds, flat_collective_seconds
from autoplan.errors import ConstraintError

COLLECTIVES: tuple[CollectiveKind, ...] = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")
c10d = torch.ops._c10d_functional


@dataclass(frozen=True)
class CalibrateOptions:
    """What to measure: ``fast`` takes smaller sizes and fewer repeats (seconds, for tests)."""

    fast: bool = False
    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)
    name: str | None = None  # the profile's name; default from the device
    # The mesh whose dims' groups the collectives are measured on, covering the process group; by
    # default (hosts, ranks per host) across hosts and one dim on one host (``default_mesh``).
    mesh: tuple[int, ...] | None = None
    # The longest one kernel call may take: a dtype's larger sizes past the first that takes longer
    # are left out (a CPU without native bf16 runs a 2048-cube bf16 matmul for ~20 s, and would
    # take minutes over the table), and its curve ends at the last size measured.
    call_seconds: float = 0.25

    def matmul_sizes(self, device: torch.device) -> tuple[int, ...]:
        """Square matmul sizes; a GPU's tensor cores fill up only past 4096."""
        if self.fast:
            return (64, 128, 256, 512)
        return (128, 256, 512, 1024, 2048) + ((4096, 8192) if device.type == "cuda" else ())

    def attention_shapes(self, device: torch.device) -> tuple[tuple[int, int, int], ...]:
        """(heads, sequence length, head dim) of one sequence's causal attention."""
        if self.fast:
            return ((4, 64, 32), (4, 128, 32))
        if device.type == "cuda":
            return ((16, 512, 128), (16, 2048, 128), (16, 8192, 128))
        return ((8, 128, 64), (8, 512, 64), (8, 1024, 64))

    @property
    def collective_bytes(self) -> tuple[int, ...]:
        """Sizes of the full tensor each collective is timed at: up to a step's largest moves (a
        LLaMA's logits, tens of MiB), which a fit of smaller ones would only extrapolate to."""
        return (2**12, 2**16, 2**20) if self.fast else (2**12, 2**15, 2**18, 2**21, 2**23, 2**25)

    @property
    def overlap_bytes(self) -> int:
        """The all-reduce ``measure_overlap`` issues beside compute: a layer's gradient."""
        return 2**20 if self.fast else 2**23

    @property
    def stream_bytes(self) -> int:
        return 2**24 if self.fast else 2**27

    @property
    def skew_gap(self) -> float:
        """Seconds of compute before the all-reduce ``measure_skew`` times: a layer's."""
        return 4e-3 if self.fast else 40e-3

    @property
    def skew_trials(self) -> int:
        """Trials of ``measure_skew`` at most: single trials on 2 gloo processes range from -13 to
        +22 ms around a mean of a few, so the mean needs ~100 (about 10 s there) to settle within 2%."""
        return 9 if self.fast else 120

    @property
    def skew_seconds(self) -> float:
        """When ``measure_skew`` stops short of ``skew_trials``: 4 processes on 2 cores take 30 s for 120."""
        return 1.0 if self.fast else 12.0

    @property
    def repeats(self) -> int:
        return 3 if self.fast else 7

    def collective_gap(self, device: torch.device) -> float:
        """Seconds of compute each timed collective follows (``measure_collectives``): a training
        step's gap between two of its collectives. 0 on GPUs, where the collective runs on its own
        stream and the host only queues the compute."""
        if device.type == "cuda":
            return 0.0
        return 1e-3 if self.fast else 5e-3


TIMED_SECONDS = 4e-3  # one timing of a kernel spans this long: launches and timer reads fade in it


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _seconds(fn: Callable[[], object], device: torch.device, repeats: int, inner: int | None = 1) -> float:
    """The median over ``repeats`` timings of ``inner`` calls of ``fn``, per call, after a warm-up;
    ``inner=None``: as many calls as fill ``TIMED_SECONDS`` (``_calls_filling``)."""
    fn()
    _sync(device)
    if inner is None:
        inner = _calls_filling(fn, device, TIMED_SECONDS)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        _sync(device)
        times.append((time.perf_counter() - t0) / inner)
    return statistics.median(times)


def _calls_filling(fn: Callable[[], object], device: torch.device, seconds: float) -> int:
    """How many calls of ``fn`` take about ``seconds`` (at least one), from one timed call (warm it
    up first). Counted from time, not FLOPs: on a GPU a small kernel costs its launch,
    microseconds whatever its FLOPs, so a count sized by FLOPs runs the thinnest matmuls for minutes."""
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return max(1, int(seconds / max(time.perf_counter() - t0, 1e-7)))


def matmul_shapes(n: int) -> tuple[tuple[int, int, int], ...]:
    """The (m, k, n) matmuls measured at size ``n``: a square one, and thin ones of an eighth and a
    thirty-second of the rows (few tokens against a wide weight: a small local batch, a weight's
    gradient over them), which reach less of the peak (``devices.thinness``: 5/3 and about 3.6)."""
    return ((n, n, n), (max(n // 8, 1), n, n), (max(n // 32, 1), n, n))


def _too_slow(fn: Callable[[], object], device: torch.device, opts: CalibrateOptions, what: str, say) -> bool:
    """Whether one call of ``fn`` takes longer than ``CalibrateOptions.call_seconds``; says so. Not
    warmed up first: the kernels of a smaller size of the same kind have run."""
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
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
                s = _seconds(lambda a=a, b=b: torch.mm(a, b), device, opts.repeats, inner=None)
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
            s = _seconds(step, device, opts.repeats, inner=None)
            rows.append((seq, flops, flops / s))
            say(f"attention {dtype_name(dtype)} seq {seq}: {flops / s / 1e9:.1f} GFLOP/s")
        table[dtype_name(dtype)] = rows
    return table


def measure_memory(device: torch.device, opts: CalibrateOptions, say: Callable[[str], None]) -> tuple[float, float]:
    """(bytes/s an elementwise op streams at, counting what it reads and writes; seconds of a
    one-element op called as the lowered program calls ops, through its ``OpOverload``)."""
    a = torch.rand(opts.stream_bytes // 4, device=device)
    b, out = torch.rand_like(a), torch.empty_like(a)
    s = _seconds(lambda: torch.mul(a, b, out=out), device, opts.repeats, inner=4)
    bandwidth = 3 * opts.stream_bytes / s
    one, add = torch.ones(1, device=device), torch.ops.aten.add.Tensor
    launch = _seconds(lambda: add(one, one), device, opts.repeats, inner=200)
    say(f"elementwise: {bandwidth / 1e9:.1f} GB/s; one-element op: {launch * 1e6:.1f} us")
    return bandwidth, launch


def _collective(kind: CollectiveKind, nbytes: int, group, device: torch.device) -> Callable[[], object]:
    """One ``kind`` collective moving a full tensor of ``nbytes`` over ``group``, issued as the lowered
    program issues it: c10d's functional op, which allocates its result on every call (on a CPU, in
    freshly mapped pages for a large one), then its wait; an all-reduce in place, as the eager
    program reduces what it alone reads (``lower.passes.reinplace``)."""
    n = dist.get_world_size(group)
    name = (group or dist.group.WORLD).group_name
    numel = max(n * n, nbytes // 4 // (n * n) * (n * n))  # each rank's shard splits into n for an all-to-all
    full = torch.ones(numel, device=device)
    shard = torch.ones(numel // n, device=device)
    if kind == "all_gather":
        return lambda: c10d.wait_tensor(c10d.all_gather_into_tensor(shard, n, name))
    if kind == "reduce_scatter":
        return lambda: c10d.wait_tensor(c10d.reduce_scatter_tensor(full, "sum", n, name))
    if kind == "all_reduce":
        return lambda: c10d.wait_tensor(c10d.all_reduce_(full, "sum", name))
    splits = [numel // n // n] * n  # each rank sends its shard of the logical tensor, as the model prices it
    return lambda: c10d.wait_tensor(c10d.all_to_all_single(shard, splits, splits, name))


def _seconds_after(
    burst: Callable[[], object], fn: Callable[[], object], device: torch.device, repeats: int, inner: int
) -> float:
    """The median over ``repeats`` of ``fn``'s own time, per call, each call timed alone right after
    a ``burst``: the burst's cold caches and sleeping threads land in ``fn``'s time, its own time
    does not (taking a separately timed burst off the pair's time leaves noise the size of the
    burst's, which swamps a small collective and can leave it at nothing)."""
    burst()
    fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        total = 0.0
        for _ in range(inner):
            burst()
            _sync(device)
            t0 = time.perf_counter()
            fn()
            _sync(device)
            total += time.perf_counter() - t0
        times.append(total / inner)
    return statistics.median(times)


def _matmul_loop(
    seconds: float, side: int, device: torch.device, group, opts: CalibrateOptions
) -> tuple[Callable[[], None], int]:
    """(a loop of (``side``, ``side``) matmuls lasting about ``seconds``, its matmul count): the
    same count on every rank, so ranks that run it meet at the next collective alike."""
    a = torch.randn(side, side, device=device)
    per_mm = _seconds(lambda: torch.mm(a, a), device, opts.repeats, inner=16)
    loops = _agreed(max(1, round(seconds / per_mm)), group)

    def loop() -> None:
        for _ in range(loops):
            torch.mm(a, a)

    return loop, loops


def collective_burst(group, device: torch.device, opts: CalibrateOptions) -> Callable[[], None]:
    """The compute each timed collective follows (``CalibrateOptions.collective_gap``): matmuls, the
    same count on every rank, or nothing on GPUs."""
    gap = opts.collective_gap(device)
    return _matmul_loop(gap, 128, device, group, opts)[0] if gap else (lambda: None)


def measure_collectives(
    group, device: torch.device, opts: CalibrateOptions, say: Callable[[str], None], burst: Callable[[], None]
) -> list:
    """``[(kind, group size, bytes of the full tensor, seconds)]`` on ``group``, every rank timing alike.

    Where the backend runs collectives on the cores that compute (gloo), each one is timed as a
    training step meets it: right after a ``burst`` of compute (``collective_burst``,
    ``_seconds_after``). Back to back, a collective finds its peer ready, its worker thread awake and
    its buffers in cache; after compute it finds none of them, and pays for it (2 gloo processes on
    2 cores: about a millisecond more per collective at every size)."""
    n = dist.get_world_size(group)
    rows = []
    for kind in COLLECTIVES:
        for nbytes in opts.collective_bytes:
            fn = _collective(kind, nbytes, group, device)
            dist.barrier(group=group)
            # a large one is timed once a repeat: it lasts tens of milliseconds on gloo
            s = _seconds_after(burst, fn, device, opts.repeats, inner=3 if nbytes < 2**24 else 1)
            rows.append((kind, n, nbytes, s))
            say(f"{kind} over {n} ranks, {nbytes / 2**10:.0f} KiB: {s * 1e6:.0f} us")
    return rows


@dataclass(frozen=True)
class GroupRows:
    """One measured process group: its name, how it sits on nodes, and its ``measure_collectives`` rows."""

    name: str
    span: GroupSpan
    rows: tuple[tuple[str, int, int, float], ...]

    @property
    def link(self) -> LinkKind | None:
        """The class of link its rows fit: NVLink inside one node, the network with one rank on each
        node; None for a group with several ranks on each of several nodes, which runs on both at once
        (reported, fitted to neither)."""
        if self.span.nodes == 1:
            return LinkKind.INTRA_NODE
        return LinkKind.INTER_NODE if self.span.per_node == 1 else None


def ranks_per_host(world: int) -> int:
    """The ranks on this host: torchrun's ``LOCAL_WORLD_SIZE``, else all of them (one host)."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if local < 1 or world % local:
        raise ConstraintError(f"calibrate: {world} ranks do not split into hosts of LOCAL_WORLD_SIZE={local}")
    return local


def default_mesh(world: int, local: int) -> tuple[int, ...]:
    """One mesh dim per class of link: (hosts, ranks per host) across hosts, one dim on one host."""
    return (world // local, local) if local < world else (world,)


def check_mesh(shape: tuple[int, ...], world: int) -> None:
    """Refuse a mesh that does not cover the ``world`` ranks, naming both."""
    if math.prod(shape) != world:
        joined = "x".join(map(str, shape))
        raise ConstraintError(
            f"calibrate --mesh {joined} takes {math.prod(shape)} ranks; the process group has {world}"
            " (start that many with torchrun --nproc-per-node, or give a mesh of this many)"
        )


def mesh_groups(shape: tuple[int, ...], group, device: torch.device, local: int) -> list[tuple[str, object, GroupSpan]]:
    """(name, this rank's process group, its span) of each dim of a ``shape`` mesh over ``group``'s
    ranks, and of the whole mesh when it has several dims (the group of a fused all-gather)."""
    from torch.distributed.device_mesh import DeviceMesh

    ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
    check_mesh(shape, len(ranks))
    mesh = DeviceMesh(device.type, torch.tensor(ranks).reshape(shape))
    topology = MeshTopology.from_mesh(mesh, local)
    dims = [(f"mesh dim {d}", mesh.get_group(d), topology.spans[d]) for d in range(len(shape)) if shape[d] > 1]
    if len(dims) > 1:
        dims.append(("whole mesh", group or dist.group.WORLD, topology.flat))
    return dims


def fit_groups(profile: DeviceProfile, groups: list[GroupRows]) -> DeviceProfile:
    """``profile`` with the links ``groups`` measured: NVLink's latency, bandwidth and per-kind
    figures from every group inside one node, the network's from every group with one rank per
    node; a class no group measured keeps its figures."""
    rows = {link: [r for g in groups if g.link is link for r in g.rows] for link in LinkKind}
    if rows[LinkKind.INTRA_NODE]:
        latency, bandwidth = fit_link(rows[LinkKind.INTRA_NODE])
        profile = dataclasses.replace(
            profile,
            intra_node_latency=latency,
            intra_node_bandwidth=bandwidth,
            collective_links=fit_kinds(rows[LinkKind.INTRA_NODE]),
        )
    if rows[LinkKind.INTER_NODE]:
        latency, bandwidth = fit_link(rows[LinkKind.INTER_NODE])
        profile = dataclasses.replace(profile, inter_node_latency=latency, inter_node_bandwidth=bandwidth)
    return profile


def group_report(profile: DeviceProfile, group: GroupRows) -> dict:
    """What ``group`` measured, its own link fit, and how far ``profile`` prices its rows (the median
    of |priced - measured| / measured): a dim whose links differ from its class's shows here."""
    latency, bandwidth = fit_link(group.rows)
    errors = [abs(collective_seconds(k, group.span, b, profile) - s) / s for k, _, b, s in group.rows]
    return {
        "name": group.name,
        "ranks": group.span.size,
        "nodes": group.span.nodes,
        "link": group.link.value if group.link else "both",
        "rows": group.rows,
        "latency_s": latency,
        "bandwidth_bytes_per_s": bandwidth,
        "priced_median_error": statistics.median(errors),
    }


def measure_overlap(group, device: torch.device, opts: CalibrateOptions, say: Callable[[str], None]) -> float:
    """The fraction of an all-reduce's time that runs under a matmul loop longer than it, when the
    all-reduce is issued asynchronously beside the loop: what ``DeviceProfile.comm_overlap`` means
    (1 where the backend has its own stream or engine; near 0 where its threads need the cores the
    compute holds, gloo on a small CPU, where only the waiting on the peer hides). Each trial times
    the compute alone, the compute then the all-reduce, and the all-reduce beside the compute, in
    turn: the saving over the serial pair, over the all-reduce's own part of it, is that trial's
    fraction, and the median trial's is the profile's (the all-reduce after compute, not alone:
    timed back to back it runs faster, and would credit overlap that is not there)."""
    buf = torch.ones(opts.overlap_bytes // 4, device=device)

    def comm():
        dist.all_reduce(buf, group=group)

    t_comm = _seconds(comm, device, opts.repeats)
    # compute about twice the all-reduce: all of it could hide
    compute, loops = _matmul_loop(2.0 * t_comm, 128 if opts.fast else 256, device, group, opts)

    def both():
        work = dist.all_reduce(buf, group=group, async_op=True)
        compute()
        work.wait()

    def one_then_other():
        compute()
        comm()

    fractions = []
    for _ in range(opts.repeats):  # timed in turn, so drift on the host hits each alike
        dist.barrier(group=group)
        t_compute, t_serial, t_both = (_seconds(fn, device, 1, inner=3) for fn in (compute, one_then_other, both))
        fractions.append(min(max((t_serial - t_both) / max(t_serial - t_compute, 1e-9), 0.0), 1.0))
    fraction = statistics.median(fractions)
    say(
        f"overlap: {loops} matmuls {t_compute * 1e3:.2f} ms, then an all-reduce after them {t_serial * 1e3:.2f} ms,"
        f" beside them {t_both * 1e3:.2f} ms (last of {opts.repeats} trials): a median"
        f" {fraction:.0%} of the all-reduce ran beside compute"
    )
    return fraction


def measure_skew(
    group, device: torch.device, opts: CalibrateOptions, say: Callable[[str], None], short: Callable[[], None]
) -> float:
    """How far apart ranks given the same compute finish it, as a fraction of it: what a blocking
    collective after a stretch of compute waits for, beyond its own time (``DeviceProfile.rank_skew``).

    Each trial times, on every rank, a fixed count of matmuls alone and then followed by a small
    all-reduce, once for a ``short`` stretch (the burst the collectives were timed after,
    ``collective_burst``) and once for a long one (``skew_gap``). The slowest rank's pair, less the
    ranks' mean matmuls alone, is what the all-reduce cost after that stretch; its growth from the
    short stretch to the long one is what the longer compute made it wait. The fraction is the sum of
    those waits over the sum of the compute's growth, over all trials: a step pays the mean wait
    at each of its many blocking collectives, and most trials wait little while a few (a rank
    descheduled) wait long, so a median would miss most of it. 0 on GPUs, whose collectives do
    not share the host's cores."""
    if device.type == "cuda":
        return 0.0
    small = torch.ones(1024, device=device)
    long, loops = _matmul_loop(opts.skew_gap, 128, device, group, opts)
    n = dist.get_world_size(group)

    def timed(fn: Callable[[], object]) -> float:
        dist.barrier(group=group)
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    waited, computed = [], []
    start = time.perf_counter()
    for _ in range(opts.skew_trials):
        t = torch.tensor(
            [timed(short), timed(lambda: (short(), dist.all_reduce(small, group=group)))]
            + [timed(long), timed(lambda: (long(), dist.all_reduce(small, group=group)))],
            dtype=torch.float64,
        )
        mean, slowest = t.clone(), torch.cat([t, torch.tensor([time.perf_counter() - start], dtype=torch.float64)])
        dist.all_reduce(mean, group=group)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
        c_short, c_long = mean[0].item() / n, mean[2].item() / n
        waited.append((slowest[3].item() - c_long) - (slowest[1].item() - c_short))
        computed.append(c_long - c_short)
        if slowest[4].item() > opts.skew_seconds:  # every rank reads the same slowest clock: all stop alike
            break
    fraction = min(max(sum(waited) / max(sum(computed), 1e-9), 0.0), 1.0)
    say(
        f"rank skew: {loops} matmuls take the ranks {statistics.mean(computed) * 1e3:.1f} ms more than the short"
        f" stretch on average; a small all-reduce after them waits {fraction:.1%} of that longer for the last rank"
        f" (over {len(waited)} trials; single trials {min(waited) * 1e3:+.1f} to {max(waited) * 1e3:+.1f} ms)"
    )
    return fraction


def _agreed(value: int, group) -> int:
    """The least of every rank's ``value``: ranks that loop alike take part in each collective alike."""
    t = torch.tensor([value], dtype=torch.int64)
    if dist.get_backend(group) == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return int(t.item())


def _terms(kind: str, n: int, nbytes: float) -> tuple[float, float]:
    """A collective's latency steps and bytes over the link in the cost model's formula
    (``network.flat_collective_seconds``, read off at unit values); an all-reduce's as a ring."""
    if kind == "all_reduce":
        return 2.0 * (n - 1), 2.0 * (n - 1) / n * nbytes
    return flat_collective_seconds(kind, n, 0.0, 1.0, 1.0), flat_collective_seconds(kind, n, nbytes, 1.0, 0.0)


def _least_squares(rows: list) -> tuple[float, float]:
    coeffs = []
    for kind, n, nbytes, s in rows:
        steps, moved = _terms(kind, n, float(nbytes))
        coeffs.append((steps / s, moved / s))
    (alpha, inv_beta), *_ = np.linalg.lstsq(np.array(coeffs), np.ones(len(coeffs)), rcond=None)
    return max(float(alpha), 1e-7), 1.0 / max(float(inv_beta), 1e-13)


def fit_link(rows: list) -> tuple[float, float]:
    """(latency s, bandwidth bytes/s) that best fit ``rows`` of (kind, n, bytes, seconds) under the
    cost model's own formulas, by least squares on relative error: each is ``latency * steps +
    moved / bandwidth``. The all-reduce takes the fastest of several algorithms in the model, so
    the gathers, scatters and all-to-alls pin the link down."""
    return _least_squares([r for r in rows if r[0] != "all_reduce"])


def fit_kinds(rows: list) -> tuple[tuple[str, float, float], ...]:
    """Per collective kind in ``rows``: the (latency, bandwidth) its own sizes fit (as ``fit_link``),
    for a backend that runs some kinds otherwise than the model's algorithm."""
    kinds = dict.fromkeys(r[0] for r in rows)
    return tuple((kind, *_least_squares([r for r in rows if r[0] == kind])) for kind in kinds)


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
