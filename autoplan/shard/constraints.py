"""User constraints on a placement plan, as plain data (the ILP turns them into rows)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from autoplan.cost.devices import dtype_name
from autoplan.shard.expert_rows import ExpertRows
from autoplan.shard.uneven import shrinks

Placements = tuple[Placement, ...]


@dataclass(frozen=True)
class Pin:
    """Fix the output placements of a node (by name), a parameter (by FQN) or a module's forward output.

    ``target`` may be a glob (``layers.*.attention.wq.weight``).
    """

    target: str
    placements: Placements


def placement_error(
    placements: Sequence, val: torch.Tensor, mesh_shape: Sequence[int], whole: bool, uneven: bool = False
) -> str | None:
    """Why ``placements`` cannot place ``val`` on a mesh of ``mesh_shape``, or ``None`` if they can.

    ``whole``: ``val`` is a model input or a parameter, a value every rank group holds in full, never
    a pending sum (``Partial``). ``uneven``: ``val`` is a parameter, which may be split unevenly
    (``autoplan.shard.uneven``) as long as every mesh dim splitting a dim shrinks its largest piece."""
    if len(placements) != len(mesh_shape):
        return f"{len(placements)} placements given for a {len(mesh_shape)}-D mesh"
    factor: dict[int, list[int]] = {}
    for i, p in enumerate(placements):
        if type(p) not in (Replicate, Shard, Partial, ExpertRows):
            return f"{p!r} (mesh dim {i}) is not a placement: use Replicate(), Shard(d) or Partial()"
        if isinstance(p, Shard):
            d = p.dim + val.ndim if p.dim < 0 else p.dim
            if not 0 <= d < val.ndim:
                return f"Shard({p.dim}) on mesh dim {i} names a dim the {val.ndim}-D tensor {_desc(val)} lacks"
            factor.setdefault(d, []).append(i)
        elif isinstance(p, Partial):
            if not (val.dtype.is_floating_point or val.dtype.is_complex):
                return (
                    f"Partial() on mesh dim {i} of the {dtype_name(val.dtype)} tensor {_desc(val)}:"
                    " a pending sum of integers (indices, masks) is not a value; use Replicate() or Shard(d)"
                )
            if whole:
                return (
                    f"Partial() on mesh dim {i}: a model input or parameter is held whole, never as a pending"
                    " sum; use Replicate() or Shard(d)"
                )
    for d, dims in factor.items():
        ways = math.prod(mesh_shape[i] for i in dims)
        if val.shape[d] % ways and uneven:
            if not shrinks(val.shape[d], [mesh_shape[i] for i in dims]):
                return (
                    f"dim {d} {_desc(val)} (size {val.shape[d]}) split over mesh dims {', '.join(map(str, dims))}:"
                    " some of them leave the largest shard as big as before; Replicate() on them stores the same"
                )
        elif val.shape[d] % ways:
            return (
                f"dim {d} {_desc(val)} (size {val.shape[d]}) cannot be split {ways} ways evenly (mesh dims"
                f" {', '.join(map(str, dims))}); pick a size divisible by {ways}, or another placement"
            )
    return None


def _desc(val: torch.Tensor) -> str:
    return f"of shape {tuple(val.shape)}"
