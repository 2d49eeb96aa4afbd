"""User constraints on a placement plan, as plain data (the ILP turns them into rows)."""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.tensor.placement_types import Placement

Placements = tuple[Placement, ...]


@dataclass(frozen=True)
class Pin:
    """Fix the output placements of a node (by name), a parameter (by FQN) or a module's forward output.

    ``target`` may be a glob (``layers.*.attention.wq.weight``).
    """

    target: str
    placements: Placements
