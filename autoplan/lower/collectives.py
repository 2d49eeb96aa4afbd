"""Collectives as they appear in lowered graphs: c10d's functional collectives (with their waits)
and DTensor's own GPU all-to-all. One definition for every pass, count and rewrite that looks for
them, so a collective added here is seen by all of them."""

from __future__ import annotations

import torch
import torch.fx as fx

from autoplan.adapters.ops import base_name

c10d = torch.ops._c10d_functional

# Namespaces whose ops communicate (or wait on communication): never compute to compile or count.
NAMESPACES = frozenset({"_c10d_functional", "_dtensor"})
# c10d's data-moving collectives (not the waits), by the kind plans count them as.
C10D_KINDS = {
    c10d.all_gather_into_tensor.default: "all_gather",
    c10d.reduce_scatter_tensor.default: "reduce_scatter",
    c10d.all_reduce.default: "all_reduce",
    c10d.all_to_all_single.default: "all_to_all",
}


def _call_namespace(n: fx.Node) -> str | None:
    return getattr(n.target, "namespace", None) if n.op == "call_function" else None


def is_c10d(n: fx.Node) -> bool:
    """A functional c10d op, waits included: every rank must run it, so it is never dead code."""
    return _call_namespace(n) == "_c10d_functional"


def is_c10d_collective(n: fx.Node) -> bool:
    """A c10d collective that moves data: it reads a contiguous input and allocates its result."""
    return n.op == "call_function" and n.target in C10D_KINDS


def communicates(n: fx.Node) -> bool:
    """Any op of the communicating namespaces (collectives, waits, DTensor's all-to-all)."""
    return _call_namespace(n) in NAMESPACES


def collective_kind(n: fx.Node) -> str | None:
    """The kind a data-moving collective counts as; on GPU meshes DTensor moves Shard -> Shard with
    its own synchronous ``_dtensor.shard_dim_alltoall`` (CPU meshes: ``all_to_all_single``)."""
    if is_c10d_collective(n):
        return C10D_KINDS[n.target]
    if _call_namespace(n) == "_dtensor" and base_name(n.target) == "shard_dim_alltoall":
        return "all_to_all"
    return None
