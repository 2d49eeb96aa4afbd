"""Does a plan belong to this model and mesh? A plan saved as JSON may be loaded against anything.

Applying a plan made for another model would at best fail deep inside lowering and at worst run a
wrong split, so what a plan was made for is recorded in it (``Plan.signature``: the global shape
and dtype of every parameter, buffer and input, and the mesh) and compared before any use.
"""

from __future__ import annotations

from autoplan.cost.devices import dtype_name
from autoplan.errors import PlanMismatchError
from autoplan.plan import Plan
from autoplan.solve.evaluate import op_name
from autoplan.trace.tracing import TracedGraph

_SHOWN = 5  # differences listed in the message


def signature(tg: TracedGraph) -> dict[str, str]:
    """``{"param:<fqn>": "float32[8, 16]", "input:0": ..., "buffer:<fqn>": ...}`` of a traced graph."""
    out = {}
    for kind in ("param", "buffer", "input"):
        for key, n in tg.placeholder_for(kind).items():
            val = n.meta["val"]
            out[f"{kind}:{key}"] = f"{dtype_name(val.dtype)}{list(val.shape)}"
    return out


def differences(plan: Plan, tg: TracedGraph, mesh_shape: tuple[int, ...]) -> list[str]:
    """What differs between what ``plan`` was made for and this graph on this mesh, first things first."""
    found = []
    if tuple(plan.mesh_shape) != tuple(mesh_shape):
        found.append(f"mesh {tuple(plan.mesh_shape)} in the plan, {tuple(mesh_shape)} here")
    ours = signature(tg)
    theirs = plan.signature or ours  # a plan saved before signatures: its nodes alone are compared
    for key in sorted(theirs.keys() | ours.keys()):
        if key not in ours:
            found.append(f"{key} {theirs[key]} is in the plan but not in this model")
        elif key not in theirs:
            found.append(f"{key} {ours[key]} is in this model but not in the plan")
        elif ours[key] != theirs[key]:
            found.append(f"{key} is {theirs[key]} in the plan, {ours[key]} here")
    if not found:  # same shapes, another program: compare the ops node by node
        for n in tg.gm.graph.nodes:
            node = plan.nodes.get(n.name)
            if n.op in ("placeholder", "call_function") and (node is None or node.op != op_name(n)):
                said = "missing from the plan" if node is None else f"{node.op} in the plan"
                found.append(f"node {n.name} ({op_name(n)}) is {said}")
    return found


def check(plan: Plan, tg: TracedGraph, mesh_shape: tuple[int, ...]) -> None:
    """Raise ``PlanMismatchError`` listing the first differences if ``plan`` is not for this graph and mesh."""
    refuse(differences(plan, tg, mesh_shape))


def refuse(found: list[str]) -> None:
    """Raise ``PlanMismatchError`` listing the first of ``found``, if there are any."""
    if found:
        more = f"\n  ... and {len(found) - _SHOWN} more" if len(found) > _SHOWN else ""
        lines = "\n  ".join(found[:_SHOWN])
        raise PlanMismatchError(
            found,
            f"the plan was made for another model or mesh:\n  {lines}{more}\n"
            "Plan this model on this mesh (optimize_placement), or load the plan it was saved from.",
        )
