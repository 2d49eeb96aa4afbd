"""The links ``calibrate`` measures: collectives on each mesh dim's process groups, timed as the
lowered program issues them, fitted per class of link to the cost model's alpha-beta formulas;
how much of a collective runs beside compute; and how long a collective waits for the last rank."""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from autoplan.cost.devices import DeviceProfile, LinkKind
from autoplan.cost.measure import CalibrateOptions, matmul_loop, seconds_per_call, sync
from autoplan.cost.network import CollectiveKind, GroupSpan, MeshTopology, collective_seconds, flat_collective_seconds
from autoplan.errors import ConstraintError

COLLECTIVES: tuple[CollectiveKind, ...] = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")
c10d = torch.ops._c10d_functional


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
    sync(device)
    times = []
    for _ in range(repeats):
        total = 0.0
        for _ in range(inner):
            burst()
            sync(device)
            t0 = time.perf_counter()
            fn()
            sync(device)
            total += time.perf_counter() - t0
        times.append(total / inner)
    return statistics.median(times)


def collective_burst(group, device: torch.device, opts: CalibrateOptions) -> Callable[[], None]:
    """The compute each timed collective follows (``CalibrateOptions.collective_gap``): matmuls, the
    same count on every rank, or nothing on GPUs."""
    gap = opts.collective_gap(device)
    return matmul_loop(gap, 128, device, group, opts)[0] if gap else (lambda: None)


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

    t_comm = seconds_per_call(comm, device, opts.repeats)
    # compute about twice the all-reduce: all of it could hide
    compute, loops = matmul_loop(2.0 * t_comm, 128 if opts.fast else 256, device, group, opts)

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
        timed = (seconds_per_call(fn, device, 1, inner=3) for fn in (compute, one_then_other, both))
        t_compute, t_serial, t_both = timed
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
    long, loops = matmul_loop(opts.skew_gap, 128, device, group, opts)
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
