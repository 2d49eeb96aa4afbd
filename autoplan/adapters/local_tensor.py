"""Adapter over ``torch.distributed._local_tensor`` (all ranks simulated in one process).

The runtime asks for per-rank values (the mesh coordinate) through here, so the same code serves
one real rank per process and ``LocalTensorMode``'s simulated ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import torch
import torch.distributed as dist
from torch.distributed._local_tensor import LocalTensor, LocalTensorMode, enabled_local_tensor_mode
from torch.distributed.device_mesh import DeviceMesh


def simulated_world(ranks: int) -> LocalTensorMode:
    """A context in which ``ranks`` ranks run in this process, each tensor holding every rank's value."""
    return LocalTensorMode(ranks)


def rank_value(t: torch.Tensor, rank: int = 0) -> torch.Tensor:
    """``rank``'s value of a simulated-rank tensor; any other tensor as it is."""
    return t._local_tensors[rank] if isinstance(t, LocalTensor) else t


def world_key() -> Hashable:
    """What per-rank values depend on besides the process: the simulated ranks, if any."""
    mode = enabled_local_tensor_mode()
    return None if mode is None else frozenset(mode.ranks)


def mesh_coordinate(mesh: DeviceMesh) -> torch.Tensor:
    """This rank's coordinate in ``mesh`` as an int64 tensor on the mesh's device type (one value
    per simulated rank under ``LocalTensorMode``)."""
    ranks = mesh.mesh

    def coordinate(rank: int) -> torch.Tensor:
        found = (ranks == rank).nonzero()
        if len(found) != 1:
            raise ValueError(f"rank {rank} is not in the mesh {ranks.tolist()}")
        return found[0].to(dtype=torch.int64, device=mesh.device_type)

    return _rank_map(coordinate)


def _rank_map(make: Callable[[int], torch.Tensor]) -> torch.Tensor:
    """``make(rank)`` for this process's rank, or for every simulated rank under ``LocalTensorMode``.
    (torch 2.13 has this as ``_local_tensor.rank_map``; 2.11 only has the mode's method.)"""
    mode = enabled_local_tensor_mode()
    return make(dist.get_rank()) if mode is None else mode.rank_map(make)


def per_rank_empty(t: torch.Tensor, mesh: DeviceMesh, shape_at: Callable[[list[int]], tuple[int, ...]]) -> torch.Tensor:
    """A new uninitialised tensor like ``t`` whose shape is ``shape_at(coordinate)`` for this rank's
    mesh coordinate, with each simulated rank's own shape under ``LocalTensorMode`` (an uneven
    shard's rows differ by rank)."""

    def make(rank: int) -> torch.Tensor:
        found = (mesh.mesh == rank).nonzero()
        if len(found) != 1:
            raise ValueError(f"rank {rank} is not in the mesh {mesh.mesh.tolist()}")
        return t.new_empty(shape_at(found[0].tolist()))

    return _rank_map(make)


def per_rank(t: torch.Tensor) -> torch.Tensor:
    """``t`` with its own storage on every simulated rank. Under ``LocalTensorMode`` a plain tensor is
    one storage read by all ranks, so an in-place update (an optimizer step) would land once per rank."""
    mode = enabled_local_tensor_mode()
    if mode is None or isinstance(t, LocalTensor):
        return t
    return mode.rank_map(lambda _: t.clone())


def write_state(t: torch.Tensor) -> tuple:
    """What tells whether a tensor was written since: its in-place write counts and a copy of its
    bytes, per simulated rank for a simulated-rank tensor (whose in-place ops under the simulation
    may leave every count alone, so the bytes decide)."""
    parts = [v for _, v in sorted(t._local_tensors.items())] if isinstance(t, LocalTensor) else [t]
    return tuple((v._version, v.detach().reshape(-1).view(torch.uint8).clone()) for v in parts)


def same_state(a: tuple, b: tuple) -> bool:
    return len(a) == len(b) and all(va == vb and torch.equal(ba, bb) for (va, ba), (vb, bb) in zip(a, b))
