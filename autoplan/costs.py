"""Analytic GPU cost model: roofline compute time and alpha-beta collective time for DTensor redistributions.

The planning host is a CPU; every number here describes the *target* GPUs, so nothing reads local devices.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement
from torch.utils.flop_counter import flop_registry

from autoplan import attention
from autoplan.adapters.dtensor import Placements, TensorMeta, redistribute_steps, shard_dim

aten = torch.ops.aten
# a price of moving a tensor between placements: (made in, read in, tensor meta) -> seconds or bytes
Price = Callable[[Placements, Placements, Any], float]


class LinkKind(enum.Enum):
    INTRA_NODE = "nvlink"
    INTER_NODE = "network"


@dataclass(frozen=True)
class DeviceProfile:
    """Performance facts of one target GPU model and its interconnect (all rates per GPU)."""

    name: str
    peak_flops: tuple[tuple[str, float], ...]  # (dtype name, dense FLOP/s); a tuple so the profile stays hashable
    hbm_bandwidth: float  # bytes/s
    intra_node_bandwidth: float  # bytes/s per GPU per direction (NVLink/NVSwitch)
    inter_node_bandwidth: float  # bytes/s per GPU (network)
    intra_node_latency: float  # s per collective step
    inter_node_latency: float  # s per collective step
    gpus_per_node: int
    memory_bytes: int
    compute_efficiency: float  # achievable fraction of peak FLOPs
    bandwidth_efficiency: float  # achievable fraction of HBM / link bandwidth
    kernel_launch: float  # floor per launched kernel, s

    def flops_for(self, dtype: torch.dtype) -> float:
        """Peak FLOP/s for ``dtype``; unlisted dtypes (ints, bool, complex) get the slowest listed rate, to be safe."""
        rates = dict(self.peak_flops)
        return rates.get(dtype_name(dtype), min(rates.values()))

    def link_bandwidth(self, link: LinkKind) -> float:
        """Achievable bytes/s per GPU on ``link``."""
        raw = self.intra_node_bandwidth if link is LinkKind.INTRA_NODE else self.inter_node_bandwidth
        return raw * self.bandwidth_efficiency

    def link_latency(self, link: LinkKind) -> float:
        return self.intra_node_latency if link is LinkKind.INTRA_NODE else self.inter_node_latency


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# H100 SXM5 (dense, no sparsity). float32 is the CUDA-core rate, not TF32: PyTorch's default
# float32_matmul_precision="highest" keeps fp32 matmuls off TF32 tensor cores (494e12).
# Efficiencies: large bf16 GEMMs reach ~60% of peak in practice, HBM/NVLink/network streams ~80%.
# Latencies: ~5 us per NCCL ring step over NVSwitch, ~15 us over InfiniBand/RoCE; ~4 us per kernel launch.
H100_SXM = DeviceProfile(
    name="H100-SXM5-80GB",
    peak_flops=(
        ("float8_e4m3fn", 1979e12),
        ("float8_e5m2", 1979e12),
        ("bfloat16", 989e12),
        ("float16", 989e12),
        ("float32", 67e12),
        ("float64", 67e12),
    ),
    hbm_bandwidth=3.35e12,
    intra_node_bandwidth=450e9,
    inter_node_bandwidth=50e9,  # 400 Gb/s NIC per GPU
    intra_node_latency=5e-6,
    inter_node_latency=15e-6,
    gpus_per_node=8,
    memory_bytes=80 * 2**30,
    compute_efficiency=0.6,
    bandwidth_efficiency=0.8,
    kernel_launch=4e-6,
)
# H200 SXM: the H100's compute with 141 GB of faster HBM3e (4.8 TB/s).
H200_SXM = dataclasses.replace(H100_SXM, name="H200-SXM-141GB", hbm_bandwidth=4.8e12, memory_bytes=141 * 10**9)
# A100 SXM4 80GB: no fp8; NVLink 3 (600 GB/s both directions), a 200 Gb/s HDR NIC per GPU.
A100_SXM = dataclasses.replace(
    H100_SXM,
    name="A100-SXM4-80GB",
    peak_flops=(("bfloat16", 312e12), ("float16", 312e12), ("float32", 19.5e12), ("float64", 19.5e12)),
    hbm_bandwidth=2.039e12,
    intra_node_bandwidth=300e9,
    inter_node_bandwidth=25e9,
)
DEVICE_PROFILES = {"h100": H100_SXM, "h200": H200_SXM, "a100": A100_SXM}


@dataclass(frozen=True)
class MeshTopology:
    """Which physical link each mesh dim's collectives run over."""

    shape: tuple[int, ...]
    links: tuple[LinkKind, ...]  # per mesh dim

    def __post_init__(self) -> None:
        if len(self.shape) != len(self.links):
            raise ValueError(f"shape {self.shape} and links {self.links} disagree on the number of mesh dims")

    @classmethod
    def from_mesh(cls, mesh: DeviceMesh, gpus_per_node: int) -> MeshTopology:
        """Classify each dim from the mesh's global ranks (rank r lives on node r // gpus_per_node)."""
        ranks = mesh.mesh
        return cls(tuple(ranks.shape), tuple(link_kind(ranks, d, gpus_per_node) for d in range(ranks.ndim)))


def link_kind(ranks: torch.Tensor, dim: int, gpus_per_node: int) -> LinkKind:
    """NVLink iff every process group along ``dim`` sits inside one node.

    One hop off-node makes the whole ring network-bound.
    """
    nodes = ranks.movedim(dim, -1).reshape(-1, ranks.shape[dim]) // gpus_per_node
    return LinkKind.INTRA_NODE if bool((nodes == nodes[:, :1]).all()) else LinkKind.INTER_NODE


# ---------------------------------------------------------------------------------------------- sizes


def local_shape(shape: Sequence[int], placements: Placements, mesh_shape: Sequence[int]) -> tuple[int, ...]:
    """The largest local shard's shape: DTensor chunks with ceil, so rank 0 holds the biggest piece."""
    sizes = list(shape)
    for placement, n in zip(placements, mesh_shape, strict=True):
        dim = shard_dim(placement)
        if dim is not None:
            sizes[dim] = -(-sizes[dim] // n)
    return tuple(sizes)


def local_bytes(meta: TensorMeta, placements: Placements, mesh_shape: Sequence[int]) -> int:
    """Bytes of the largest local shard; Replicate and Partial keep the full tensor on every rank."""
    return math.prod(local_shape(meta.shape, placements, mesh_shape)) * meta.dtype.itemsize


def work_split(
    inputs: Sequence[tuple[TensorMeta, Placements]],
    outputs: Sequence[tuple[TensorMeta, Placements]],
    mesh_shape: Sequence[int],
) -> int:
    """How many ways an op's FLOPs are divided: mesh dims where all placements are Replicate do the full work."""

    def splits(d: int) -> bool:
        return any(shard_dim(p[d]) is not None or isinstance(p[d], Partial) for _, p in outputs) or any(
            shard_dim(p[d]) is not None for _, p in inputs
        )

    return math.prod(n for d, n in enumerate(mesh_shape) if splits(d))


def compute_dtype(tensors: Sequence[TensorMeta]) -> torch.dtype:
    """The dtype the math runs in: the first floating one (indices and masks do not pick the tensor-core rate)."""
    fallback = tensors[0].dtype if tensors else torch.float32
    return next((m.dtype for m in tensors if m.dtype.is_floating_point), fallback)


def roofline_seconds(flops: float, nbytes: float, dtype: torch.dtype, profile: DeviceProfile) -> float:
    """One kernel: bound by compute or HBM traffic, whichever is slower, never faster than a launch."""
    compute = flops / (profile.flops_for(dtype) * profile.compute_efficiency)
    memory = nbytes / (profile.hbm_bandwidth * profile.bandwidth_efficiency)
    return max(compute, memory) + profile.kernel_launch


# ---------------------------------------------------------------------------------------------- collectives

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
    kind: TransferKind, src: Placement, dst: Placement, before: Sequence[int], after: Sequence[int]
) -> tuple[Sequence[int], ...]:
    """Local shapes of the copies a collective on a non-leading tensor dim makes (as DTensor runs it
    on a GPU mesh); ``before``/``after``: the rank's local shape before and after the step.

    NCCL gathers and scatters along dim 0 only, so: an all-gather on dim d returns its chunks
    stacked on dim 0 and one copy moves them to dim d (a view when the gathered blocks are already
    contiguous); a reduce-scatter on dim d first moves its chunks onto dim 0 (likewise); an
    all-to-all moves the new shard dim to the front before the exchange and the gathered dim
    back after it (each a copy unless the move is a view).
    """
    src_dim, dst_dim = shard_dim(src), shard_dim(dst)
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


def _made_bytes(kind: TransferKind, size: int, n: int, after: int) -> int:
    """Local bytes a primitive writes, from the ``size`` it reads over ``n`` ranks (``after``: the
    step's local result, what a ``local`` step leaves)."""
    if kind == "all_gather":
        return size * n
    if kind == "reduce_scatter":
        return size // n
    return after if kind == "local" else size


def peak_buffer_bytes(transfers: Sequence[Transfer]) -> int:
    """The most bytes a redistribution's own buffers hold at once: each primitive's output is made
    while its input (the previous output; the source is not the move's) is still alive."""
    peak = previous = 0
    for t in transfers:
        peak, previous = max(peak, previous + t.made), t.made
    return peak


def mixed_partials(placements: Placements) -> bool:
    """DTensor refuses placements that mix Partial reduce ops (their order would matter)."""
    return len({p.reduce_op for p in placements if isinstance(p, Partial)}) > 1


def collective_seconds(kind: TransferKind, n: int, nbytes: float, bandwidth: float, latency: float) -> float:
    """Ring alpha-beta time of a collective over ``n`` ranks on a link with achievable ``bandwidth``."""
    steps = n - 1
    if kind in ("all_gather", "reduce_scatter"):
        return steps / n * nbytes / bandwidth + steps * latency
    if kind == "all_reduce":  # reduce-scatter + all-gather
        return 2 * steps / n * nbytes / bandwidth + 2 * steps * latency
    if kind == "all_to_all":  # each rank ships (n-1)/n of its nbytes/n shard
        return steps / n * (nbytes / n) / bandwidth + steps * latency
    raise ValueError(f"not a collective: {kind}")


def transfer_seconds(transfer: Transfer, topology: MeshTopology, profile: DeviceProfile) -> float:
    if transfer.kind in ("local", "relayout"):  # one memory-bound copy kernel: reads and writes its bytes
        return 2 * transfer.nbytes / (profile.hbm_bandwidth * profile.bandwidth_efficiency) + profile.kernel_launch
    link = topology.links[transfer.mesh_dim]
    return collective_seconds(
        transfer.kind,
        topology.shape[transfer.mesh_dim],
        transfer.nbytes,
        profile.link_bandwidth(link),
        profile.link_latency(link),
    )


# ---------------------------------------------------------------------------------------------- FLOPs


def _sdpa_flops(q_shape: Sequence[int], k_shape: Sequence[int], v_shape: Sequence[int], is_causal: bool) -> float:
    """QK^T plus PV (2*b*h*s_q*s_kv*(d_qk + d_v)); a causal mask skips about half the blocks.

    ``h`` is the query heads: with grouped-query attention every query head still multiplies
    against a full key/value sequence, whatever the number of key/value heads.
    """
    b, h, s_q, d_qk = q_shape
    s_kv, d_v = k_shape[-2], v_shape[-1]
    flops = 2 * b * h * s_q * s_kv * (d_qk + d_v)
    return flops / 2 if is_causal else flops


def _sdpa_kernel_flops(op: torch._ops.OpOverload, args: Sequence[Any], kwargs: Mapping[str, Any]) -> float:
    """Forward: 2 GEMMs. Backward (flash-style) recomputes the scores and runs four more: 2.5x the forward."""
    spec = attention.SDPA_OPS[op]
    q, k, v = (spec.arg(args, kwargs, role) for role in ("query", "key", "value"))
    flops = _sdpa_flops(q.shape, k.shape, v.shape, attention.is_causal(spec, args, kwargs))
    return 2.5 * flops if spec.backward else flops


def node_flops(op: torch._ops.OpOverload, args: Sequence[Any], kwargs: Mapping[str, Any], out: Any) -> float:
    """Global FLOPs of one aten call; works on fake/meta tensors since only shapes are read; 0 without a formula.

    Attention kernels use autoplan's formula even where torch's flop counter has one: that one
    ignores the causal mask, which halves the work.
    """
    if op in attention.SDPA_OPS:
        return float(_sdpa_kernel_flops(op, args, kwargs))
    packet = op.overloadpacket
    if packet in flop_registry:
        return float(flop_registry[packet](*args, **kwargs, out_val=out))
    return 0.0


# ---------------------------------------------------------------------------------------------- model


def redistribute_key(src: Placements, dst: Placements, meta: TensorMeta) -> tuple:
    """Everything a redistribution's cost depends on besides the (per-instance) mesh and profile."""
    return (tuple(src), tuple(dst), tuple(meta.shape), tuple(meta.stride), meta.dtype)


class UnsupportedRedistribution(ValueError):
    """DTensor has no way to perform this placement change."""


class CostModel:
    """Costs of compute and redistribution for one (mesh, topology, profile); caches keyed accordingly."""

    def __init__(self, mesh: DeviceMesh, profile: DeviceProfile = H100_SXM) -> None:
        self.mesh = mesh
        self.profile = profile
        self.topology = MeshTopology.from_mesh(mesh, profile.gpus_per_node)
        # Keyed by redistribute_key; mesh and profile are fixed per instance.
        self._plans: dict[tuple, tuple[Transfer, ...] | None] = {}
        self._costs: dict[tuple, float] = {}

    def _plan(self, src: Placements, dst: Placements, meta: TensorMeta) -> tuple[Transfer, ...] | None:
        key = redistribute_key(src, dst, meta)
        if key not in self._plans:
            self._plans[key] = self._build_plan(key[0], key[1], meta)
        return self._plans[key]

    def _build_plan(self, src: Placements, dst: Placements, meta: TensorMeta) -> tuple[Transfer, ...] | None:
        """Map DTensor's own steps to primitives, with the re-layout copies collectives make (on
        non-leading dims, of non-contiguous inputs); size-1 mesh dims are skipped, as DTensor does."""
        if mixed_partials(src) or mixed_partials(dst):
            return None
        transfers: list[Transfer] = []
        mesh_shape, itemsize = self.topology.shape, meta.dtype.itemsize
        current = list(src)
        contiguous = is_contiguous(meta.shape, meta.stride)  # every step's output is a fresh contiguous tensor
        for step in redistribute_steps(self.mesh, src, dst, meta):
            n = mesh_shape[step.mesh_dim]
            if n == 1:  # DTensor short-cuts these before checking the transition is supported
                continue
            kinds = step_kinds(step.src, step.dst)
            if kinds is None:
                return None
            before = local_shape(meta.shape, current, mesh_shape)
            current[step.mesh_dim] = step.dst
            after = local_shape(meta.shape, current, mesh_shape)
            full = math.prod(step.logical_shape) * itemsize
            written = -(-full // n) if shard_dim(step.dst) is not None else full
            size = math.prod(before) * itemsize  # the local bytes the next primitive reads
            for k in kinds:
                copies = list(relayout_copies(k, step.src, step.dst, before, after))
                # NCCL needs a contiguous input (a transposed view is not); an all-to-all's own copy may do
                if k != "local" and not contiguous and not (copies and copies[0] is before):
                    copies.insert(0, before)
                sizes = [math.prod(c) * itemsize for c in copies]
                relayouts = [Transfer("relayout", step.mesh_dim, b, b) for b in sizes]
                made = _made_bytes(k, size, n, math.prod(after) * itemsize)
                # in the order they run: copies of the input before the collective, of its output after
                transfers.extend(r for c, r in zip(copies, relayouts) if c is before)
                transfers.append(Transfer(k, step.mesh_dim, written if k == "local" else full, made))
                transfers.extend(r for c, r in zip(copies, relayouts) if c is not before)
                size, contiguous = made, True
        return tuple(transfers)

    def redistribute_cost(self, src: Placements, dst: Placements, meta: TensorMeta) -> float:
        """Seconds to move ``meta`` from ``src`` to ``dst`` placements; ``math.inf`` if DTensor cannot."""
        key = redistribute_key(src, dst, meta)
        if key not in self._costs:
            plan = self._plan(src, dst, meta)
            self._costs[key] = (
                math.inf if plan is None else sum(transfer_seconds(t, self.topology, self.profile) for t in plan)
            )
        return self._costs[key]

    def redistribute_peak_bytes(self, src: Placements, dst: Placements, meta: TensorMeta) -> int:
        """The most bytes the move from ``src`` to ``dst`` holds at once on a rank, its result
        included (a gather on a non-leading dim holds the gathered chunks and their re-laid copy):
        what the memory model counts while the reading op runs. At least the result's bytes."""
        if tuple(src) == tuple(dst):
            return 0
        plan = self._plan(src, dst, meta)
        final = local_bytes(meta, dst, self.topology.shape)
        return final if plan is None else max(final, peak_buffer_bytes(plan))

    def redistribute_collectives(
        self, src: Placements, dst: Placements, meta: TensorMeta
    ) -> tuple[tuple[str, int], ...]:
        """The (kind, mesh_dim) primitives of a redistribution in execution order; raises if DTensor cannot."""
        plan = self._plan(src, dst, meta)
        if plan is None:
            raise UnsupportedRedistribution(f"DTensor cannot redistribute {tuple(src)} -> {tuple(dst)}")
        return tuple((t.kind, t.mesh_dim) for t in plan if t.kind != "relayout")

    def compute_cost(
        self,
        flops: float,
        inputs: Sequence[tuple[TensorMeta, Placements]],
        outputs: Sequence[tuple[TensorMeta, Placements]],
        *,
        is_view: bool = False,
    ) -> float:
        """Per-rank seconds of one op: roofline over its local shards, 0 for views/aliases (no kernel runs)."""
        if is_view:
            return 0.0
        shape = self.topology.shape
        nbytes = sum(local_bytes(meta, placements, shape) for meta, placements in (*inputs, *outputs))
        dtype = compute_dtype([meta for meta, _ in (*inputs, *outputs)])
        return roofline_seconds(flops / work_split(inputs, outputs, shape), nbytes, dtype, self.profile)
