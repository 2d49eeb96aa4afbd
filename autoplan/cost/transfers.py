"""What one redistribution runs: its primitives (``Transfer``) per mesh dim, the copies a collective
makes around itself, the bytes each holds and the seconds each takes (collectives priced by
``autoplan.cost.network``). ``autoplan.cost.costs.CostModel`` plans moves out of these.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from autoplan.adapters.dtensor import Placements, shard_dim
from autoplan.cost.devices import DeviceProfile
from autoplan.cost.network import GroupSpan, MeshTopology, collective_seconds
from autoplan.shard.expert_rows import ExpertRows

TransferKind = Literal["all_gather", "reduce_scatter", "all_reduce", "all_to_all", "local", "relayout"]


@dataclass(frozen=True)
class Transfer:
    """One primitive of a redistribution on one mesh dim.

    ``local`` is a step of its own (take a chunk, scale a replica); ``relayout`` is a copy that a
    collective makes around itself to run on the leading dim, so it is priced but not listed as a
    primitive of the redistribution.
    """

    kind: TransferKind
    mesh_dim: int
    nbytes: int  # collectives: the full logical tensor at this step; local/relayout: the bytes each rank copies
    made: int = 0  # local bytes of the buffer it writes on each rank (its input dies once it is made)


def _leading_block(shape: Sequence[int], dim: int) -> bool:
    """Whether the chunks of a contiguous ``shape`` along ``dim`` are contiguous blocks (every dim
    before ``dim`` has size 1): then splitting or stacking along ``dim`` needs no copy."""
    return math.prod(shape[:dim]) == 1


def is_contiguous(shape: Sequence[int], stride: Sequence[int]) -> bool:
    """Row-major without gaps (size-1 dims may have any stride)."""
    expected = 1
    for size, step in zip(reversed(shape), reversed(stride)):
        if size != 1 and step != expected:
            return False
        expected *= size
    return True


def relayout_copies(
    kind: TransferKind, src_dim: int | None, dst_dim: int | None, before: Sequence[int], after: Sequence[int]
) -> tuple[Sequence[int], ...]:
    """Local shapes of the copies a collective on a non-leading tensor dim makes (as DTensor runs it
    on a GPU mesh); ``src_dim``/``dst_dim``: the tensor dim the step's mesh dim splits before and
    after (``None``: not split); ``before``/``after``: the rank's local shape before and after it.

    NCCL gathers and scatters along dim 0 only, so: an all-gather on dim d returns its chunks
    stacked on dim 0 and one copy moves them to dim d (a view when the gathered blocks are already
    contiguous); a reduce-scatter on dim d first moves its chunks onto dim 0 (likewise); an
    all-to-all moves the new shard dim to the front before the exchange and the gathered dim
    back after it (each a copy unless the move is a view).
    """
    if kind == "all_gather" and src_dim and not _leading_block(before, src_dim):
        return (after,)
    if kind == "reduce_scatter" and dst_dim and not _leading_block(before, dst_dim):
        return (before,)
    if kind == "all_to_all":
        moves = ((before, dst_dim), (after, src_dim))
        return tuple(shape for shape, dim in moves if not _leading_block(shape, dim))
    return ()


def step_kinds(src: Placement, dst: Placement) -> tuple[TransferKind, ...] | None:
    """The primitives DTensor runs for one per-mesh-dim transition; ``None`` where DTensor raises at runtime."""
    src_dim, dst_dim = shard_dim(src), shard_dim(dst)
    plain_shards = isinstance(src, Shard) and isinstance(dst, Shard)
    if src == dst:
        return ()
    if type(dst) is ExpertRows:  # only ops make expert rows
        return None
    if type(src) is ExpertRows and type(dst) is Partial and dst.reduce_op == "sum":
        return ()  # a relabel: expert rows are a partial sum
    if isinstance(src, Partial):
        if isinstance(dst, Replicate):
            return ("all_reduce",)
        if isinstance(dst, Shard):
            return ("reduce_scatter",)
        if dst_dim is not None:  # strided shard: reduce fully, then slice
            return ("all_reduce", "local")
        return None  # mixing Partial reduce ops is unsupported
    if src_dim is not None:
        if isinstance(dst, Replicate):
            return ("all_gather",)
        if plain_shards:
            return ("all_to_all",)
        if dst_dim is not None:  # strided on either side goes through Replicate
            return ("all_gather", "local")
        return None  # Shard -> Partial is unsupported
    if isinstance(src, Replicate) and (dst_dim is not None or isinstance(dst, Partial)):
        return ("local",)
    return None


def made_bytes(kind: TransferKind, size: int, n: int, after: int) -> int:
    """Local bytes a primitive writes, from the ``size`` it reads over ``n`` ranks (``after``: the
    step's local result, what a ``local`` step leaves)."""
    if kind == "all_gather":
        return size * n
    if kind == "reduce_scatter":
        return size // n
    return after if kind == "local" else size


def step_bytes(kind: TransferKind, size: int, n: int, made: int) -> int:
    """A primitive's ``Transfer.nbytes`` from the local bytes it reads (``size``) and writes
    (``made``): a collective moves the tensor its group holds *now*, so shards that other mesh dims
    keep (an FSDP gather of a TP-sharded weight) shrink it, as do steps the same move ran before."""
    if kind in ("all_gather", "all_to_all"):
        return size * n
    return made if kind == "local" else size


def relayout_transfer(mesh_dim: int, shape: Sequence[int], itemsize: int) -> Transfer:
    """The copy of a local ``shape`` that a collective makes around itself."""
    nbytes = math.prod(shape) * itemsize
    return Transfer("relayout", mesh_dim, nbytes, nbytes)


def peak_buffer_bytes(transfers: Sequence[Transfer], source: int = 0) -> int:
    """The most bytes a redistribution's own buffers hold at once: each primitive's output is made
    while its input (the previous output) is still alive. The source is not the move's, but for
    ``source``: the bytes of a source freed once the first primitive has read it, held beside that
    primitive's output."""
    peak, previous = 0, source
    for t in transfers:
        peak, previous = max(peak, previous + t.made), t.made
    return peak


_NOT_PARTIAL = frozenset({Shard, Replicate})


def mixed_partials(placements: Placements) -> bool:
    """DTensor refuses placements that mix Partial reduce ops (their order would matter)."""
    return len({p.reduce_op for p in placements if type(p) not in _NOT_PARTIAL and isinstance(p, Partial)}) > 1


_COPIES = frozenset({"local", "relayout"})  # kinds that are one memory-bound copy kernel, no communication


def communicates(transfers: Sequence[Transfer]) -> bool:
    """Whether a move runs a collective, not only local copies: for a parameter's gathered view the
    backward reads, the lowering runs such a move again there instead of keeping its result
    (``passes.fsdp_recompute`` tags a parameter's first collective and everything after it)."""
    return any(t.kind not in _COPIES for t in transfers)


def transfer_seconds(transfer: Transfer, topology: MeshTopology, profile: DeviceProfile) -> float:
    if transfer.kind in _COPIES:  # reads and writes its bytes
        return 2 * transfer.nbytes / (profile.hbm_bandwidth * profile.bandwidth_efficiency) + profile.kernel_launch
    return collective_seconds(transfer.kind, topology.spans[transfer.mesh_dim], transfer.nbytes, profile)


_FUSED_KINDS = ("all_gather", "reduce_scatter", "all_reduce")


def fused_gather_pairs(transfers: Sequence[Transfer], ndim: int) -> set[int]:
    """Indices ``i`` where transfers i and i+1 are all-gathers (reduce-scatters, all-reduces) on
    the two dims of a 2-D mesh with nothing between them: the fusion pass
    (``passes.gather_fusion``) runs them as one collective over the whole mesh."""
    if ndim != 2:
        return set()
    return {
        i
        for i, (a, b) in enumerate(itertools.pairwise(transfers))
        if a.kind == b.kind and a.kind in _FUSED_KINDS and a.mesh_dim != b.mesh_dim
    }


def plan_seconds(
    transfers: Sequence[Transfer],
    topology: MeshTopology,
    profile: DeviceProfile,
    memo: dict,
    latency_share: float = 1.0,
) -> tuple[float, float]:
    """A redistribution's time, and the part of it that can run beside compute. Chained pairs that
    the fusion passes merge are priced as the one collective that runs (over the flattened mesh),
    plus the local chunk transpose it needs when the mesh dims ran in column-major order.
    ``memo``: each primitive's seconds by (kind, mesh dim, bytes), kept by the caller for this
    topology, profile and ``latency_share`` (a 3-D mesh's moves price ~300 K primitives, a few
    thousand distinct).

    Only the collectives can run beside compute (on their own stream, or gloo's threads), and only
    the ``comm_overlap`` fraction of their time: gloo's threads need the cores the compute holds for
    much of theirs. The copies (re-layouts, chunk picks) are kernels of the rank's own program, in
    line with its compute, so they never hide (``autoplan.cost.overlap``).

    Each collective pays ``latency_share`` of the seconds of an empty one (its launch and the
    link's latency): a move whose collectives run in a bucket shares them with the bucket's other
    moves (``CostModel.sharing``)."""

    def collective(kind: str, span: GroupSpan, nbytes: int) -> float:
        found = collective_seconds(kind, span, nbytes, profile)
        if latency_share == 1.0:
            return found
        return found - (1.0 - latency_share) * collective_seconds(kind, span, 0.0, profile)

    def seconds(t: Transfer) -> float:
        key = (t.kind, t.mesh_dim, t.nbytes)
        found = memo.get(key)
        if found is None:
            if t.kind in _COPIES:
                found = transfer_seconds(t, topology, profile)
            else:
                found = collective(t.kind, topology.spans[t.mesh_dim], t.nbytes)
            memo[key] = found
        return found

    fused = fused_gather_pairs(transfers, len(topology.shape))
    copies = collectives = 0.0
    skip = False
    for i, t in enumerate(transfers):
        following = transfers[i + 1] if i + 1 < len(transfers) else None
        if skip:
            skip = False
        elif i in fused and t.kind == "all_gather":  # dp gathered first: chunks transposed after
            collectives += collective(t.kind, topology.flat, following.nbytes)
            if t.mesh_dim < following.mesh_dim:
                copies += seconds(Transfer("relayout", 0, following.made))
            skip = True
        elif i in fused:  # a reduce-scatter of tp first: the input's chunks transposed before
            collectives += collective(t.kind, topology.flat, t.nbytes)
            if t.kind == "reduce_scatter" and t.mesh_dim > following.mesh_dim:
                copies += seconds(Transfer("relayout", 0, t.nbytes))
            skip = True
        elif t.kind in _COPIES:
            copies += seconds(t)
        else:
            collectives += seconds(t)
    return copies + collectives, collectives * profile.comm_overlap
