"""Analytic GPU cost model: roofline compute time and the time of DTensor redistributions, each
planned as the primitives of ``autoplan.cost.transfers`` (collectives priced by ``autoplan.cost.network``).

The planning host is a CPU; every number here describes the *target* GPUs, so nothing reads local devices.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.fx as fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Replicate, Shard

from autoplan.adapters.dtensor import (
    Placements,
    TensorMeta,
    redistribute_transitions,
    shape_free,
    shard_dim,
    tensor_key,
    tensor_meta,
)
from autoplan.cost.compute import compute_dtype, flops_of, is_free, kernel_kind
from autoplan.cost.devices import H100_SXM, DeviceProfile, thinness
from autoplan.cost.network import MeshTopology, collective_seconds
from autoplan.cost.transfers import (
    Transfer,
    TransferKind,
    communicates,
    is_contiguous,
    made_bytes,
    mixed_partials,
    peak_buffer_bytes,
    plan_seconds,
    relayout_copies,
    relayout_transfer,
    step_bytes,
    step_kinds,
)
from autoplan.shard.strategies import Strategy, output_vals, tensor_inputs
from autoplan.shard.uneven import gather_runs, largest, uneven_dims
from autoplan.trace import grouped_mm

# a price of moving a tensor between placements: (made in, read in, tensor meta) -> seconds or bytes
Price = Callable[[Placements, Placements, Any], float]
# a price over every (source, destination) pair of two placement lists: one row per source
Matrix = Callable[[Sequence[Placements], Sequence[Placements], Any], np.ndarray]


def pairwise(price: Price) -> Matrix:
    """``price`` as a ``Matrix``."""

    def matrix(srcs: Sequence[Placements], dsts: Sequence[Placements], meta) -> np.ndarray:
        return np.array([[price(o, q, meta) for q in dsts] for o in srcs], dtype=float).reshape(len(srcs), len(dsts))

    return matrix


# ---------------------------------------------------------------------------------------------- sizes


def largest_shard_shape(shape: Sequence[int], placements: Placements, mesh_shape: Sequence[int]) -> tuple[int, ...]:
    """The largest local shard's shape: DTensor chunks with ceil, so rank 0 holds the biggest piece."""
    return split_shape(shape, [shard_dim(p) for p in placements], mesh_shape)


def split_shape(shape: Sequence[int], dims: Sequence[int | None], mesh_shape: Sequence[int]) -> tuple[int, ...]:
    """``largest_shard_shape`` from the tensor dim each mesh dim splits (``None``: not split)."""
    sizes = list(shape)
    for dim, n in zip(dims, mesh_shape, strict=True):
        if dim is not None:
            sizes[dim] = -(-sizes[dim] // n)
    return tuple(sizes)


def local_bytes(meta: TensorMeta, placements: Placements, mesh_shape: Sequence[int]) -> int:
    """Bytes of the largest local shard; Replicate and Partial keep the full tensor on every rank."""
    return math.prod(largest_shard_shape(meta.shape, placements, mesh_shape)) * meta.dtype.itemsize


def work_split(
    inputs: Sequence[tuple[TensorMeta, Placements]],
    outputs: Sequence[tuple[TensorMeta, Placements]],
    mesh_shape: Sequence[int],
) -> int:
    """How many ways an op's FLOPs are divided: mesh dims where all placements are Replicate do the
    full work. Expert rows do not divide it: each rank's tensor is whole, zeros included (the grouped
    matmul that makes them divides its work by its expert-split weight)."""

    def splits(d: int) -> bool:
        return any(shard_dim(p[d]) is not None or type(p[d]) is Partial for _, p in outputs) or any(
            shard_dim(p[d]) is not None for _, p in inputs
        )

    return math.prod(n for d, n in enumerate(mesh_shape) if splits(d))


def roofline_seconds(
    flops: float, nbytes: float, dtype: torch.dtype, profile: DeviceProfile, kind: str = "matmul"
) -> float:
    """One kernel: bound by compute (at the efficiency the profile gives a ``kind`` kernel of its
    size and ``thinness``) or HBM traffic, whichever is slower, never faster than a launch."""
    thin = thinness(flops, nbytes, dtype.itemsize)
    compute = flops / (profile.flops_for(dtype) * profile.efficiency_at(flops, dtype, kind, thin))
    memory = nbytes / (profile.hbm_bandwidth * profile.bandwidth_efficiency)
    return max(compute, memory) + profile.kernel_launch


_PLAIN_TYPES = frozenset({Shard, Replicate, Partial})  # a failing isinstance on a placement runs in Python


@dataclass(frozen=True)
class _Step:
    """One mesh dim's transition of a move, as the primitives that run it (sizes aside)."""

    mesh_dim: int
    kinds: tuple[TransferKind, ...]
    src_dim: int | None  # the tensor dim this mesh dim splits before the step (``None``: none)
    dst_dim: int | None  # and after it


@dataclass(frozen=True)
class _UnevenMove:
    """A move from or to an unevenly split placement (``autoplan.shard.uneven``), whose primitives
    ``CostModel._uneven_plan`` works out on the padded shards the lowering moves."""

    src: Placements
    dst: Placements


_UNKNOWN = object()
_CANNOT = (math.inf, math.inf)  # a move DTensor cannot run: its seconds and their hideable part


class UnsupportedRedistribution(ValueError):
    """DTensor has no way to perform this placement change."""


class CostModel:
    """Costs of compute and redistribution for one (mesh, topology, profile); caches keyed accordingly."""

    def __init__(
        self,
        mesh: DeviceMesh,
        profile: DeviceProfile = H100_SXM,
        expert_imbalance: float = 1.0,
        *,
        latency_share: float = 1.0,
    ) -> None:
        self.mesh = mesh
        self.profile = profile
        self.latency_share = latency_share  # of each collective's launch and latency (``sharing``)
        self._sharing: dict[float, CostModel] = {}
        self.expert_imbalance = expert_imbalance  # the busiest expert-parallel rank's tokens over the mean
        self.topology = MeshTopology.from_mesh(mesh, profile.gpus_per_node)
        # a step of several ranks waits for the slowest at each blocking collective
        self.skew = 1.0 + profile.rank_skew if math.prod(self.topology.shape) > 1 else 1.0
        # Keyed by ``_key``; mesh and profile are fixed per instance.
        self._ids: dict[Placements, int] = {}
        self._by_object: dict[int, tuple[Placements, int]] = {}  # by ``id``: a tuple already numbered
        self._dims: list[tuple[int | None, ...]] = []  # per id: the tensor dim each mesh dim splits
        self._splits: dict[tuple[int | None, ...], int] = {}  # a number per distinct ``_dims`` entry
        self._split_of: list[int] = []  # per id: its ``_dims`` entry's number
        self._costs: dict[tuple, tuple[float, float]] = {}  # by ``_key``: seconds, their hideable part
        self._plans: dict[tuple, tuple[Transfer, ...] | None] = {}  # by ``_move``
        self._seconds: dict[tuple, tuple[float, float]] = {}  # by ``_move``: as ``_costs``
        self._step_plans: dict[tuple, tuple[Transfer, ...]] = {}  # by (step, local shapes, contiguous, itemsize)
        self._matrices: dict[tuple, np.ndarray] = {}
        self._local_shapes: dict[tuple, tuple[int, ...]] = {}  # by (shape, tensor dim each mesh dim splits)
        self._transfer_s: dict[tuple, float] = {}  # by (kind, mesh dim, bytes)
        self._templates: dict[tuple, tuple[int, tuple[_Step, ...] | None]] = {}  # per placement pair (``_steps``)
        self._template_ids: dict[tuple[_Step, ...] | None, int] = {}  # a number per distinct steps
        self._strategy_seconds: dict[int, tuple[tuple[Strategy, ...], np.ndarray]] = {}  # see ``strategy_seconds``
        self._flops: dict[fx.Node, float] = {}  # per traced op
        self._kinds: dict[tuple, tuple | None] = {}  # per (source, target) placement: ``step_kinds`` and both dims
        self._uneven: dict[tuple, bool] = {}  # per (``_dims`` entry's number, shape): split unevenly

    def _id(self, placements: Placements) -> int:
        """A number per distinct placement tuple: cache keys made of them hash in C, where a
        placement's own hash runs in Python (millions of lookups on a 3-D mesh). A tuple seen
        before is found by identity (strategies hold the same tuples through every build and the
        plan's pricing), kept alive beside its number so that its id cannot be reused."""
        seen = self._by_object.get(id(placements))
        if seen is not None and seen[0] is placements:
            return seen[1]
        key = tuple(placements)
        found = self._ids.get(key)
        if found is None:
            dims = tuple(shard_dim(p) for p in key)
            self._dims.append(dims)
            self._split_of.append(self._splits.setdefault(dims, len(self._splits)))
            found = self._ids[key] = len(self._dims) - 1
        if key is placements:  # a tuple, immutable: a list could change under its id
            self._by_object[id(placements)] = (placements, found)
        return found

    def numbers(self, placements: Sequence[Placements]) -> np.ndarray:
        """A number per placement tuple, equal exactly where the tuples are (stable for this model)."""
        return np.array([self._id(p) for p in placements], dtype=np.int64)

    def _key(self, src: Placements, dst: Placements, meta: TensorMeta) -> tuple:
        """Everything a redistribution's cost depends on besides the (per-instance) mesh and profile."""
        return (self._id(src), self._id(dst), *tensor_key(meta))

    def _move(self, src: Placements, dst: Placements, meta: TensorMeta, key: tuple) -> tuple:
        """What a move's primitives depend on: its steps (numbered), the tensor dims its source
        splits and the tensor (``_key``'s tensor part). Pairs that take the same steps from sources
        split alike (e.g. differing only in a Partial or Replicate on a mesh dim no step touches)
        move alike, and on a 3-D mesh many of its (pair, tensor) moves repeat another's. Also the
        steps themselves."""
        number, steps = self._steps(src, dst, meta, key)
        return (number, self._split_of[key[0]], *key[2:]), steps

    def _plan(
        self, src: Placements, dst: Placements, meta: TensorMeta, key: tuple | None = None
    ) -> tuple[Transfer, ...] | None:
        """The move's primitives (``None`` where DTensor cannot run it); ``key``: its ``_key``."""
        key = self._key(src, dst, meta) if key is None else key
        return self._plan_of(*self._move(src, dst, meta, key), meta, key[0])

    def _plan_of(
        self, move: tuple, steps: tuple[_Step, ...] | None, meta: TensorMeta, src: int
    ) -> tuple[Transfer, ...] | None:
        found = self._plans.get(move, _UNKNOWN)
        if found is _UNKNOWN:
            found = self._plans[move] = self._build_plan(steps, meta, src)
        return found

    def _steps(
        self, src: Placements, dst: Placements, meta: TensorMeta, key: tuple
    ) -> tuple[int, tuple[_Step, ...] | None]:
        """DTensor's per-mesh-dim steps as primitives, without sizes (``None`` where DTensor cannot
        run the move), and a number per distinct steps. Kept per placement pair where its steps
        ignore the shape (a 3-D mesh prices ~126 K (pair, shape) moves but only ~27 K pairs)."""
        pair = (key[0], key[1])
        uneven = self._is_uneven(key[0], key[2]) or self._is_uneven(key[1], key[2])
        if uneven and all(type(p) in _PLAIN_TYPES for p in (*src, *dst)):  # else DTensor's own steps
            steps = _UnevenMove(tuple(src), tuple(dst))  # its steps depend on the shape
            return self._template_ids.setdefault(steps, len(self._template_ids)), steps
        found = self._templates.get(pair)
        if found is None:
            steps = self._make_steps(src, dst, meta)
            found = (self._template_ids.setdefault(steps, len(self._template_ids)), steps)
            if shape_free(src, dst):
                self._templates[pair] = found
        return found

    def _is_uneven(self, number: int, shape: tuple[int, ...]) -> bool:
        """Whether the placements numbered ``number`` split ``shape`` unevenly (kept per split and shape)."""
        key = (self._split_of[number], shape)
        found = self._uneven.get(key)
        if found is None:
            ways: dict[int, int] = {}
            for n, d in zip(self.topology.shape, self._dims[number]):
                if d is not None:
                    ways[d] = ways.get(d, 1) * n
            found = self._uneven[key] = any(shape[d] % w for d, w in ways.items())
        return found

    def _make_steps(self, src: Placements, dst: Placements, meta: TensorMeta) -> tuple[_Step, ...] | None:
        if mixed_partials(src) or mixed_partials(dst):
            return None
        steps = []
        for mesh_dim, a, b in redistribute_transitions(self.mesh, src, dst, meta):
            if self.topology.shape[mesh_dim] == 1:  # DTensor short-cuts these before checking the transition
                continue
            found = self._kinds.get((a, b), _UNKNOWN)
            if found is _UNKNOWN:
                kinds = step_kinds(a, b)
                found = self._kinds[(a, b)] = None if kinds is None else (kinds, shard_dim(a), shard_dim(b))
            if found is None:
                return None
            steps.append(_Step(mesh_dim, *found))
        return tuple(steps)

    def _build_plan(
        self, steps: tuple[_Step, ...] | _UnevenMove | None, meta: TensorMeta, src: int
    ) -> tuple[Transfer, ...] | None:
        """Map DTensor's own steps (from the placements numbered ``src``) to primitives, with the
        re-layout copies collectives make (on non-leading dims, of non-contiguous inputs); size-1
        mesh dims are skipped, as DTensor does."""
        if isinstance(steps, _UnevenMove):
            return self._uneven_plan(steps.src, steps.dst, meta)
        if not steps:
            return steps
        transfers: list[Transfer] = []
        itemsize = meta.dtype.itemsize
        current = list(self._dims[src])  # the tensor dim each mesh dim splits, as the steps go
        contiguous = is_contiguous(meta.shape, meta.stride)  # every step's output is a fresh contiguous tensor
        after = self._local_shape(meta.shape, current)
        for step in steps:
            before = after
            current[step.mesh_dim] = step.dst_dim
            after = self._local_shape(meta.shape, current)
            key = (step, before, after, contiguous, itemsize)
            found = self._step_plans.get(key)
            if found is None:
                found = self._step_plans[key] = self._step_plan(step, before, after, contiguous, itemsize)
            transfers += found
            contiguous = contiguous or bool(step.kinds)
        return tuple(transfers)

    def _step_plan(
        self, step: _Step, before: tuple[int, ...], after: tuple[int, ...], contiguous: bool, itemsize: int
    ) -> tuple[Transfer, ...]:
        """One step's primitives, from local shape ``before`` to ``after``, with the re-layout copies
        its collectives make; kept per step and shapes (moves from many sources share their steps)."""
        transfers: list[Transfer] = []
        n = self.topology.shape[step.mesh_dim]
        size = math.prod(before) * itemsize  # the local bytes the next primitive reads
        for k in step.kinds:
            copies = relayout_copies(k, step.src_dim, step.dst_dim, before, after)
            # NCCL needs a contiguous input (a transposed view is not); an all-to-all's own copy may do
            if k != "local" and not contiguous and not (copies and copies[0] is before):
                copies = (before, *copies)
            made = made_bytes(k, size, n, math.prod(after) * itemsize)
            primitive = Transfer(k, step.mesh_dim, step_bytes(k, size, n, made), made)
            if copies:  # in the order they run: copies of the input before the collective, of its output after
                transfers += [relayout_transfer(step.mesh_dim, c, itemsize) for c in copies if c is before]
                transfers.append(primitive)
                transfers += [relayout_transfer(step.mesh_dim, c, itemsize) for c in copies if c is not before]
            else:
                transfers.append(primitive)
            size, contiguous = made, True
        return tuple(transfers)

    def _uneven_plan(self, src: Placements, dst: Placements, meta: TensorMeta) -> tuple[Transfer, ...] | None:
        """The primitives of a move from or to an uneven split, as ``adapters.dtensor`` lowers it on
        padded shards (every rank's piece padded to the largest, ``autoplan.shard.uneven``).

        From one: each unevenly split dim is all-gathered over its mesh dims, innermost first (the
        padded pieces then lie in rank order), its padding dropped (a view when it is all at the
        end, else a copy), and the rest of the move is DTensor's from there. To one (a gradient into
        its parameter's placement): DTensor's move to the target with those mesh dims left partial
        or replicated, then each dim padded (a copy) and reduce-scattered or chunked over its mesh
        dims, outermost first. Between two uneven splits: ``None`` (nothing needs it)."""
        src, dst = tuple(src), tuple(dst)
        if src == dst:
            return ()
        mesh, shape, itemsize = self.topology.shape, tuple(meta.shape), meta.dtype.itemsize
        src_uneven, dst_uneven = uneven_dims(shape, src, mesh), uneven_dims(shape, dst, mesh)
        if (src_uneven and dst_uneven) or mixed_partials(src) or mixed_partials(dst):
            return None
        nbytes = lambda s: math.prod(s) * itemsize  # noqa: E731
        transfers: list[Transfer] = []
        if src_uneven:
            mid = tuple(Replicate() if any(i in m for m in src_uneven.values()) else p for i, p in enumerate(src))
            current = list(self._local_shape(shape, [shard_dim(p) for p in src]))
            for d, mesh_dims in sorted(src_uneven.items()):
                for i in reversed(mesh_dims):
                    before = tuple(current)
                    current[d] *= mesh[i]
                    after = tuple(current)
                    transfers.append(Transfer("all_gather", i, nbytes(before) * mesh[i], nbytes(after)))
                    copies = relayout_copies("all_gather", d, None, before, after)
                    transfers += [relayout_transfer(i, c, itemsize) for c in copies]
                current[d] = shape[d]
                runs = gather_runs(shape[d], [mesh[i] for i in mesh_dims])
                if len(runs) > 1 or runs[0][0]:  # else the padding is a tail the view leaves out
                    transfers.append(relayout_transfer(mesh_dims[0], current, itemsize))
            rest = self._plan(mid, dst, meta)
            return None if rest is None else (*transfers, *rest)
        on = {i: d for d, mesh_dims in dst_uneven.items() for i in mesh_dims}
        mid = tuple(
            dst[i] if i not in on else src[i] if isinstance(src[i], (Partial, Replicate)) else Replicate()
            for i in range(len(dst))
        )
        first = self._plan(src, mid, meta)
        if first is None:
            return None
        transfers += first
        current = list(self._local_shape(shape, [shard_dim(p) for p in mid]))
        for d, mesh_dims in sorted(dst_uneven.items()):
            current[d] = largest(shape[d], [mesh[i] for i in mesh_dims]) * math.prod(mesh[i] for i in mesh_dims)
            transfers.append(relayout_transfer(mesh_dims[0], current, itemsize))
            for i in mesh_dims:
                before = tuple(current)
                current[d] //= mesh[i]
                after = tuple(current)
                if isinstance(mid[i], Partial):
                    copies = relayout_copies("reduce_scatter", None, d, before, after)
                    transfers += [relayout_transfer(i, c, itemsize) for c in copies]
                    transfers.append(Transfer("reduce_scatter", i, nbytes(before), nbytes(after)))
                else:
                    transfers.append(Transfer("local", i, nbytes(after), nbytes(after)))
        return tuple(transfers)

    def _local_shape(self, shape: tuple[int, ...], dims: list[int | None]) -> tuple[int, ...]:
        """``split_shape`` on this mesh, kept: a 3-D mesh's moves ask ~300 K times for ~2 K shapes."""
        key = (shape, *dims)
        found = self._local_shapes.get(key)
        if found is None:
            found = self._local_shapes[key] = split_shape(shape, dims, self.topology.shape)
        return found

    def sharing(self, share: float) -> CostModel:
        """This model for a move whose collectives run in a bucket (``passes.bucketing``) it shares
        with others: each collective priced at the seconds its bytes add, plus ``share`` of the
        launch and latency the bucket pays once (``bucket_latency``). ``Move.share``: one over the
        moves of its layer that may share the bucket, so that a plan moving all of them pays one
        latency, as the bucketed program does."""
        if share == self.latency_share:
            return self
        found = self._sharing.get(share)
        if found is None:
            found = self._sharing[share] = CostModel(
                self.mesh, self.profile, self.expert_imbalance, latency_share=share
            )
        return found

    def bucket_latency(self, kind: str, mesh_dim: int) -> float:
        """What one bucket's collective of ``kind`` over ``mesh_dim`` costs beyond its bytes: a
        collective of none."""
        return collective_seconds(kind, self.topology.spans[mesh_dim], 0.0, self.profile)

    def redistribute_cost(self, src: Placements, dst: Placements, meta: TensorMeta) -> float:
        """Seconds to move ``meta`` from ``src`` to ``dst`` placements; ``math.inf`` if DTensor cannot."""
        return self._cost(src, dst, meta, self._key(src, dst, meta))[0]

    def hideable_cost(self, src: Placements, dst: Placements, meta: TensorMeta) -> float:
        """The part of ``redistribute_cost`` that can run under compute: the profile's
        ``comm_overlap`` share of its collectives' seconds (its copies run in line with the rank's
        compute; ``plan_seconds``)."""
        return self._cost(src, dst, meta, self._key(src, dst, meta))[1]

    def _cost(self, src: Placements, dst: Placements, meta: TensorMeta, key: tuple) -> tuple[float, float]:
        found = self._costs.get(key)
        if found is None:
            move, steps = self._move(src, dst, meta, key)
            found = self._seconds.get(move)
            if found is None:
                found = self._move_seconds(move, steps, meta, key[0])
            self._costs[key] = found
        return found

    def _move_seconds(
        self, move: tuple, steps: tuple[_Step, ...] | None, meta: TensorMeta, src: int
    ) -> tuple[float, float]:
        """A move's seconds and their hideable part (``math.inf`` where DTensor cannot run it),
        kept by ``_move``."""
        plan = self._plan_of(move, steps, meta, src)
        found = (
            _CANNOT
            if plan is None
            else plan_seconds(plan, self.topology, self.profile, self._transfer_s, self.latency_share)
        )
        self._seconds[move] = found
        return found

    def redistribute_costs(
        self, srcs: Sequence[Placements], dsts: Sequence[Placements], meta: TensorMeta
    ) -> np.ndarray:
        """``redistribute_cost`` over every pair (a ``Matrix``), cached whole: the same edge groups
        come back in every re-solve, and on a 3-D mesh one holds ~1,500 pairs."""
        return self._costs_matrix(srcs, dsts, meta, 0)

    def hideable_costs(self, srcs: Sequence[Placements], dsts: Sequence[Placements], meta: TensorMeta) -> np.ndarray:
        """``hideable_cost`` over every pair, as ``redistribute_costs``."""
        return self._costs_matrix(srcs, dsts, meta, 1)

    def reruns(self, srcs: Sequence[Placements], dsts: Sequence[Placements], meta: TensorMeta) -> np.ndarray:
        """Per pair, 1 where the backward runs the move again when it feeds a parameter's gathered
        view (``Move.again``): one that runs a collective, which the lowering re-runs rather than
        keep its result; 0 for a move of local copies only, whose result the backward keeps."""
        key = (tuple(self._id(o) for o in srcs), tuple(self._id(q) for q in dsts), "reruns", *tensor_key(meta))
        found = self._matrices.get(key)
        if found is None:
            found = np.array(
                [[float(s != d and communicates(self._plan(s, d, meta) or ())) for d in dsts] for s in srcs]
            ).reshape(len(srcs), len(dsts))
            found.setflags(write=False)
            self._matrices[key] = found
        return found

    def _costs_matrix(
        self, srcs: Sequence[Placements], dsts: Sequence[Placements], meta: TensorMeta, part: int
    ) -> np.ndarray:
        src_ids, dst_ids = [self._id(o) for o in srcs], [self._id(q) for q in dsts]
        tensor = tensor_key(meta)  # each pair's ``_key`` is (src id, dst id, *tensor)
        key = (tuple(src_ids), tuple(dst_ids), part, *tensor)
        found = self._matrices.get(key)
        if found is None:
            found = self._matrices[key] = self._matrix(srcs, dsts, src_ids, dst_ids, meta, tensor, part)
            found.setflags(write=False)  # shared by every edge with this key
        return found

    def _matrix(
        self, srcs, dsts, src_ids: list[int], dst_ids: list[int], meta: TensorMeta, tensor: tuple, part: int
    ) -> np.ndarray:
        """``_cost`` of every pair, with what depends on one side only worked out once per side: a
        3-D mesh prices ~650 K pairs. Pairs of evenly split sides whose steps are known already
        (``_steps``' shape-free templates) go straight to their move; the rest take ``_cost``."""
        shape = tensor[0]
        even_dst = [not self._is_uneven(b, shape) for b in dst_ids]
        templates, seconds = self._templates, self._seconds
        rows = []
        for o, a in zip(srcs, src_ids):
            even_src, split, row = not self._is_uneven(a, shape), self._split_of[a], []
            for q, b, even in zip(dsts, dst_ids, even_dst):
                template = templates.get((a, b)) if even_src and even else None
                if template is None:
                    row.append(self._cost(o, q, meta, (a, b, *tensor))[part])
                    continue
                move = (template[0], split, *tensor)
                found = seconds.get(move)
                row.append((self._move_seconds(move, template[1], meta, a) if found is None else found)[part])
            rows.append(row)
        return np.array(rows, dtype=float).reshape(len(srcs), len(dsts))

    def redistribute_peak_bytes(
        self, src: Placements, dst: Placements, meta: TensorMeta, consumed: bool = False
    ) -> int:
        """The most bytes the move from ``src`` to ``dst`` holds at once on a rank, its result
        included (a gather on a non-leading dim holds the gathered chunks and their re-laid copy):
        what the memory model counts while the reading op runs. At least the result's bytes.

        ``consumed``: the move is its source's last reader, so the source is freed once the first
        primitive has read it: the move's peak with the source counted beside that primitive's
        output, less the source's bytes (counted where the source is stored): less than the
        result's bytes where the source's moment is the highest, none where no primitive runs
        (the result is the source)."""
        if tuple(src) == tuple(dst):
            return 0
        plan = self._plan(src, dst, meta)
        final = local_bytes(meta, dst, self.topology.shape)
        if plan is None:
            return final
        if not consumed:
            return max(final, peak_buffer_bytes(plan))
        source = local_bytes(meta, src, self.topology.shape)
        return max(0, peak_buffer_bytes(plan, source) - source)

    def redistribute_collectives(
        self, src: Placements, dst: Placements, meta: TensorMeta
    ) -> tuple[tuple[str, int], ...]:
        """The (kind, mesh_dim) primitives of a redistribution in execution order; raises if DTensor cannot."""
        plan = self._plan(src, dst, meta)
        if plan is None:
            raise UnsupportedRedistribution(f"DTensor cannot redistribute {tuple(src)} -> {tuple(dst)}")
        return tuple((t.kind, t.mesh_dim) for t in plan if t.kind != "relayout")

    def strategy_seconds(self, node: fx.Node, strategies: tuple[Strategy, ...]) -> np.ndarray:
        """Per-rank compute seconds of each of ``node``'s ``strategies``, worked out once per tuple.

        The tuple is matched by identity, and kept alive beside its result so that its id cannot be
        reused: hashing its strategies would cost as much as pricing them. A tuple names one op's
        strategies (``StrategyBuilder.for_op`` gives each node its own), which the copies of a layer
        share with their representative and cost alike, so re-solves and the plan's explanation
        find it again."""
        found = self._strategy_seconds.get(id(strategies))
        if found is None or found[0] is not strategies:
            found = self._strategy_seconds[id(strategies)] = (strategies, self._op_seconds(node, strategies))
        return found[1]

    def op_seconds(self, node: fx.Node, strategy: Strategy) -> float:
        """Per-rank compute seconds of ``node`` under one strategy (not kept)."""
        return float(self._op_seconds(node, (strategy,))[0])

    def _op_seconds(self, node: fx.Node, strategies: Sequence[Strategy]) -> np.ndarray:
        if is_free(node):
            return np.zeros(len(strategies))
        ins = [tensor_meta(a.meta["val"]) for a in tensor_inputs(node)]
        outs = [(i, tensor_meta(v)) for i, v in enumerate(output_vals(node)) if isinstance(v, torch.Tensor)]
        flops = self._flops.get(node)
        if flops is None:
            flops = self._flops[node] = flops_of(node)
        kind = kernel_kind(node)
        return np.array(
            [
                self.compute_cost(
                    flops,
                    list(zip(ins, s.inputs)),
                    [(m, s.outputs[i]) for i, m in outs if s.outputs[i] is not None],
                    kind=kind,
                )
                * self._load(node, s)
                for s in strategies
            ]
        )

    def _load(self, node: fx.Node, strategy: Strategy) -> float:
        """The slowest rank's compute over one rank's: a step of several ranks waits for the last
        at each blocking collective (the profile's ``rank_skew``), and a grouped matmul split over
        its experts waits for the rank whose experts got the most tokens (``expert_imbalance``, from
        the data: 1 prices the balanced case); any other split divides the work evenly."""
        if self.expert_imbalance == 1.0 or not grouped_mm.expert_mesh_dims(node, strategy.inputs, strategy.outputs):
            return self.skew
        return self.skew * self.expert_imbalance

    def ideal_op_seconds(self, node: fx.Node) -> float:
        """``node``'s FLOPs at the devices' peak rate, spread evenly over all of them (for MFU)."""
        if is_free(node):
            return 0.0
        metas = [tensor_meta(a.meta["val"]) for a in tensor_inputs(node)]
        metas += [tensor_meta(v) for v in output_vals(node) if isinstance(v, torch.Tensor)]
        return self.ideal_seconds(flops_of(node), compute_dtype(metas))

    def ideal_seconds(self, flops: float, dtype: torch.dtype) -> float:
        """``flops`` at the peak rate of ``dtype`` on every device of the mesh at once."""
        return flops / (self.profile.flops_for(dtype) * math.prod(self.topology.shape))

    def compute_cost(
        self,
        flops: float,
        inputs: Sequence[tuple[TensorMeta, Placements]],
        outputs: Sequence[tuple[TensorMeta, Placements]],
        *,
        is_view: bool = False,
        kind: str = "matmul",
    ) -> float:
        """Per-rank seconds of one op: roofline over its local shards, 0 for views/aliases (no kernel runs)."""
        if is_view:
            return 0.0
        shape = self.topology.shape
        nbytes = sum(local_bytes(meta, placements, shape) for meta, placements in (*inputs, *outputs))
        dtype = compute_dtype([meta for meta, _ in (*inputs, *outputs)])
        return roofline_seconds(flops / work_split(inputs, outputs, shape), nbytes, dtype, self.profile, kind)
