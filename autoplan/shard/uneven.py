"""Uneven shards: where the parameters whose split dims do not divide by their mesh dims keep their rows.

A parameter is stored as DTensor stores ``Shard(d)``: each mesh dim splitting ``d`` chunks the piece
before it the way ``torch.chunk`` does (ceil(n/m) rows per rank, the last ranks fewer, possibly
none), so ``distribute_tensor``, ``full_tensor`` and state dicts work as usual. The per-rank graph is
one graph for every rank, so its shapes cannot differ by rank: there every uneven shard is padded at
its end to the largest shard's size (FSDP2's layout), the size costs and memory are priced on.

Only parameters (and their gradients, moved into the parameter's placement) are ever uneven: every
op computes on even shards, so a parameter read unevenly stored is gathered first (``gather_runs``
drops the padding of the gathered blocks), and a gradient is padded (``pad_segments``) before it is
reduce-scattered or chunked into an uneven placement.

Pure arithmetic on shapes and placements: the lowering (``adapters.dtensor``) and the cost model
(``costs``) both read it, so what is priced is what runs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

_PLAIN = (Shard, Replicate, Partial)


def split_dims(placements: Sequence[Placement]) -> dict[int, tuple[int, ...]]:
    """Tensor dim -> the mesh dims that ``Shard`` it, in mesh order (DTensor's default nesting order)."""
    out: dict[int, tuple[int, ...]] = {}
    for i, p in enumerate(placements):
        if type(p) is Shard:
            out[p.dim] = (*out.get(p.dim, ()), i)
    return out


def uneven_dims(
    shape: Sequence[int], placements: Sequence[Placement], mesh_shape: Sequence[int]
) -> dict[int, tuple[int, ...]]:
    """The tensor dims ``placements`` split unevenly (their size is no multiple of the ways they are
    split), each with its mesh dims; empty for an even placement, and for placements with a strided
    shard (DTensor's own layout, which plans never hold)."""
    if any(type(p) not in _PLAIN for p in placements):
        return {}
    return {d: dims for d, dims in split_dims(placements).items() if shape[d] % math.prod(mesh_shape[i] for i in dims)}


def is_uneven(shape: Sequence[int], placements: Sequence[Placement], mesh_shape: Sequence[int]) -> bool:
    return bool(uneven_dims(shape, placements, mesh_shape))


def shrinks(size: int, ways: Sequence[int]) -> bool:
    """Whether every mesh dim (of more than one rank) splitting a dim of ``size`` makes its largest
    piece smaller: a split that does not (1 row over 2 ranks) only adds moves."""
    for m in ways:
        if m > 1:
            smaller = -(-size // m)
            if smaller == size:
                return False
            size = smaller
    return True


def pieces(size: int, ways: Sequence[int]) -> list[tuple[int, int]]:
    """(global offset, rows) of every rank's piece of a dim of ``size`` split ``ways`` (mesh dims in
    order, each chunking the piece before it as ``torch.chunk`` does), ranks in row-major order of
    their coordinates on those mesh dims. An empty piece's offset is where it would start."""
    out = [(0, size)]
    for m in ways:
        split = []
        for offset, rows in out:
            chunk = -(-rows // m)
            for r in range(m):
                start = min(r * chunk, rows)
                split.append((offset + start, min(chunk, rows - start)))
        out = split
    return out


def largest(size: int, ways: Sequence[int]) -> int:
    """The largest piece's rows (rank 0's), which every padded piece has: ceil(size / prod(ways))."""
    return -(-size // math.prod(ways))


def gather_runs(size: int, ways: Sequence[int]) -> list[tuple[int, int, int]]:
    """Where the rows of a dim of ``size`` lie once its padded pieces are gathered (blocks of
    ``largest`` rows in row-major rank order): (padded offset, global offset, rows) runs in global
    order, each as long as possible. One run starting at 0 means the padding is all at the end."""
    block = largest(size, ways)
    runs: list[tuple[int, int, int]] = []
    for b, (offset, rows) in enumerate(pieces(size, ways)):
        if not rows:
            continue
        at = b * block
        if runs and runs[-1][0] + runs[-1][2] == at and runs[-1][1] + runs[-1][2] == offset:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + rows)
        else:
            runs.append((at, offset, rows))
    return runs


def pad_segments(size: int, ways: Sequence[int]) -> list[tuple[int | None, int]]:
    """The padded layout of a whole dim of ``size`` (every piece padded to ``largest``, pieces in
    row-major rank order) as segments in order: (global offset, rows) of data, or (None, rows) of
    zeros. Chunking the result evenly gives each rank its padded piece."""
    segments: list[tuple[int | None, int]] = []
    at = 0
    for padded, offset, rows in gather_runs(size, ways):
        if padded > at:
            segments.append((None, padded - at))
        segments.append((offset, rows))
        at = padded + rows
    total = largest(size, ways) * math.prod(ways)
    if total > at:
        segments.append((None, total - at))
    return segments


def local_shape_at(
    shape: Sequence[int], placements: Sequence[Placement], mesh_shape: Sequence[int], coordinate: Sequence[int]
) -> tuple[int, ...]:
    """The rows a rank at ``coordinate`` holds of each dim (its unpadded piece, as DTensor stores it)."""
    out = list(shape)
    for d, mesh_dims in split_dims(placements).items():
        index = 0
        for i in mesh_dims:
            index = index * mesh_shape[i] + coordinate[i]
        out[d] = pieces(shape[d], [mesh_shape[i] for i in mesh_dims])[index][1]
    return tuple(out)


def fsdp_bytes(shape: Sequence[int], itemsize: int, ways: int) -> int:
    """Bytes of a parameter's largest shard when it is split ``ways`` ways on its best dim (ceil
    rows per rank, as FSDP stores it padded); a 0-dim parameter is held whole."""
    if not shape:
        return itemsize
    full = math.prod(shape)
    return min(full // s * -(-s // ways) if s else 0 for s in shape) * itemsize
