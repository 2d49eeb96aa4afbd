"""Where a mesh's process groups sit on nodes, and what one collective costs on them: alpha-beta
times per link (NVLink inside a node, the network across nodes), the all-reduce algorithm NCCL
would pick for the size, and hierarchical groups that span several nodes."""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch.distributed.device_mesh import DeviceMesh

from autoplan.cost.devices import DeviceProfile, LinkKind


@dataclass(frozen=True)
class GroupSpan:
    """How one process group sits on nodes: ``per_node`` of its ranks on each of ``nodes`` nodes."""

    per_node: int
    nodes: int

    @property
    def size(self) -> int:
        return self.per_node * self.nodes


def group_span(groups: torch.Tensor, gpus_per_node: int) -> GroupSpan:
    """The span shared by every group (a row of global ranks; rank r lives on node r // gpus_per_node).

    Groups spread unevenly over nodes count as one rank per node: every step crosses the network.
    """
    size = groups.shape[1]
    counts = {n for row in (groups // gpus_per_node).tolist() for n in collections.Counter(row).values()}
    per_node = counts.pop() if len(counts) == 1 else 1
    return GroupSpan(per_node, size // per_node)


@dataclass(frozen=True)
class MeshTopology:
    """How each mesh dim's process groups, and the whole mesh as one flattened group, sit on nodes."""

    shape: tuple[int, ...]
    spans: tuple[GroupSpan, ...]  # per mesh dim
    flat: GroupSpan  # all ranks as one group: the group of a fused (flattened-mesh) all-gather

    def __post_init__(self) -> None:
        if tuple(s.size for s in self.spans) != self.shape:
            raise ValueError(f"spans {self.spans} do not cover mesh shape {self.shape}")

    @property
    def links(self) -> tuple[LinkKind, ...]:
        """Per mesh dim: NVLink iff each group sits inside one node."""
        return tuple(LinkKind.INTRA_NODE if s.nodes == 1 else LinkKind.INTER_NODE for s in self.spans)

    @classmethod
    def from_mesh(cls, mesh: DeviceMesh, gpus_per_node: int) -> MeshTopology:
        """Read the spans from the mesh's global ranks."""
        ranks = mesh.mesh
        spans = tuple(
            group_span(ranks.movedim(d, -1).reshape(-1, ranks.shape[d]), gpus_per_node) for d in range(ranks.ndim)
        )
        return cls(tuple(ranks.shape), spans, group_span(ranks.reshape(1, -1), gpus_per_node))


CollectiveKind = Literal["all_gather", "reduce_scatter", "all_reduce", "all_to_all"]


def flat_collective_seconds(
    kind: CollectiveKind, n: int, nbytes: float, bandwidth: float, latency: float, *, in_switch: bool = False
) -> float:
    """Alpha-beta time of a collective over ``n`` ranks on one kind of link (``nbytes``: the full
    logical tensor). All-reduce takes the fastest algorithm NCCL would pick for the size: ring
    (bandwidth-optimal, 2(n-1) latency steps), double binary tree (twice the bytes per rank, only
    2 log2(n) steps: wins small messages on many ranks), or, where the switch reduces in-network
    (``in_switch``, NVLS), each byte sent and received once. In-switch gathers and scatters move
    the ring's bytes but in one multicast step instead of n-1."""
    steps = n - 1
    if kind in ("all_gather", "reduce_scatter"):
        return steps / n * nbytes / bandwidth + min(steps, 2 if in_switch else steps) * latency
    if kind == "all_to_all":  # each rank ships (n-1)/n of its nbytes/n shard
        return steps / n * (nbytes / n) / bandwidth + steps * latency
    if kind == "all_reduce":
        ring = 2 * steps / n * nbytes / bandwidth + 2 * steps * latency
        tree = 2 * nbytes / bandwidth + 2 * math.ceil(math.log2(n)) * latency
        switch = nbytes / bandwidth + 2 * latency if in_switch else math.inf
        return min(ring, tree, switch)
    raise ValueError(f"not a collective: {kind}")


def collective_seconds(kind: CollectiveKind, span: GroupSpan, nbytes: float, profile: DeviceProfile) -> float:
    """Time of one collective over a group laid out as ``span``.

    Inside one node it runs on NVLink; with one rank per node, on the network. A group with
    several ranks on each of several nodes runs hierarchically, as NCCL's multi-NIC rings and trees
    effectively do: the network phase runs between ranks of equal local index, each on its own NIC
    with 1/per_node of the bytes, and the NVLink phase inside each node. Inside a node each kind
    runs at its own measured figures where the profile has them (``collective_links``).
    """
    if span.size == 1:
        return 0.0
    nvlink = (profile.link_bandwidth(LinkKind.INTRA_NODE, kind), profile.link_latency(LinkKind.INTRA_NODE, kind))
    network = (profile.link_bandwidth(LinkKind.INTER_NODE), profile.link_latency(LinkKind.INTER_NODE))
    if span.nodes == 1:
        return flat_collective_seconds(kind, span.size, nbytes, *nvlink, in_switch=profile.nvls)
    if span.per_node == 1:
        return flat_collective_seconds(kind, span.size, nbytes, *network)
    g, k = span.per_node, span.nodes
    if kind in ("all_gather", "reduce_scatter"):
        return flat_collective_seconds(kind, k, nbytes / g, *network) + flat_collective_seconds(
            kind, g, nbytes, *nvlink
        )
    if kind == "all_reduce":  # reduce-scatter in the node, all-reduce across nodes, all-gather in the node
        scatter = (
            profile.link_bandwidth(LinkKind.INTRA_NODE, "reduce_scatter"),
            profile.link_latency(LinkKind.INTRA_NODE, "reduce_scatter"),
        )
        inside = 2 * flat_collective_seconds("reduce_scatter", g, nbytes, *scatter)
        return inside + flat_collective_seconds("all_reduce", k, nbytes / g, *network)
    if kind == "all_to_all":  # of a rank's nbytes/n shard, (n-g)/n leaves the node; both streams run at once
        n, shard = span.size, nbytes / span.size
        across = (n - g) / n * shard / network[0] + (k - 1) * network[1]
        within = (g - 1) / n * shard / nvlink[0] + (g - 1) * nvlink[1]
        return max(across, within)
    raise ValueError(f"not a collective: {kind}")
