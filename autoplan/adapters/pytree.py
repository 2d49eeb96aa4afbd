"""Adapter over ``torch.utils._pytree``, so a torch upgrade touches one module.

Graph arguments and model calls are nested lists, tuples and dicts; the flatten/map/unflatten
functions that walk them are private, and so is the key-path API with which ``autoplan.trace.inputs``
names every leaf of a model call by where it sits (``batch['mask']``).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

from torch.utils._pytree import (
    GetAttrKey,
    MappingKey,
    SequenceKey,
    TreeSpec,
    keystr,
    tree_flatten,
    tree_flatten_with_path,
    tree_map,
    tree_map_only,
    tree_unflatten,
)

__all__ = [
    "Spec",
    "key",
    "leaves_with_paths",
    "path_text",
    "tree_flatten",
    "tree_map",
    "tree_map_only",
    "tree_unflatten",
    "unflatten",
]

Spec = TreeSpec


def leaves_with_paths(tree: Any) -> tuple[list[tuple[tuple, Any]], Spec]:
    """Every leaf of ``tree`` with its path (a tuple of opaque keys, see ``key`` and ``path_text``),
    in ``tree_flatten``'s order, and the spec that ``unflatten`` rebuilds ``tree`` from."""
    return tree_flatten_with_path(tree)


def key(entry: Any) -> Hashable:
    """One step of a path as a plain value: a sequence index, a mapping key or an attribute name."""
    if isinstance(entry, SequenceKey):
        return entry.idx
    if isinstance(entry, MappingKey):
        return entry.key
    if isinstance(entry, GetAttrKey):
        return entry.name
    return str(entry)


def path_text(path: tuple) -> str:
    """A path as Python indexing: ``[0]['mask'].field`` (``""`` for the empty path)."""
    return keystr(path) if path else ""


def unflatten(leaves: list, spec: Spec) -> Any:
    return tree_unflatten(leaves, spec)
