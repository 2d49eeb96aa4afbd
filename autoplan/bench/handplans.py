"""The plans users write by hand today, as pins on a LLaMA-style model (``autoplan.bench.models.llama3``
parameter and module names), so the ILP's plan can be priced against them under one cost model.

- ``ddp``: every parameter replicated; gradients all-reduced.
- ``fsdp``: ZeRO-3, every parameter's dim 0 split over the whole mesh.
- ``hsdp``: split inside the last mesh dim (a node), replicated across the others.
- ``tp``: on a 1-D mesh, tensor parallelism alone (``fsdp+tp`` with no FSDP dims): Megatron's plan.
- ``fsdp+tp``: torchtitan's 2-D plan: the last mesh dim is tensor parallel (column-wise wq/wk/wv/w1/w3
  and output, row-wise wo/w2 and the embedding), the others FSDP. Where the norms run (sequence
  parallel or replicated) is left to the ILP: a norm's output is not a pinnable module output here.
  A mixture of experts' routed experts are split inside each expert on the last dim too.

A mixture of experts (``autoplan.bench.models.moe``: expert weights ``feed_forward.w1/w2/w3`` of
``[experts, in, out]``, run as batched matmuls) gets its experts pinned too, and two plans more:

- ``fsdp+ep``: torchtitan's default for MoEs: the experts split over the first mesh dim (expert
  parallel: their matmuls run split on the experts there) and stored split on dim 1 over the others;
  every other parameter FSDP.
- ``ep+tp``: the experts split over the first mesh dim and inside each expert over the last one
  (w1/w3 column-wise, w2 row-wise); every other parameter FSDP over all but the last dim.

A model with only some of those parts gets the pins of the parts it has: on a stack of SwiGLU
blocks (``autoplan.bench.models.mlp``), ``tp`` is Megatron's MLP split, w1/w3 column-wise, w2 row-wise.

Pins fix what the hand plan fixes: the parameters' placements and, for tensor parallelism, the
layouts of its column-wise outputs. Every other value is left to the ILP, which can only help
the hand plan.
"""

from __future__ import annotations

import fnmatch
import re
import time

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from autoplan.errors import AutoplanError
from autoplan.shard.constraints import placement_error
from autoplan.trace.tracing import PATH_KEY

R = Replicate()
COLUMNWISE = ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3")
ROWWISE = ("attention.wo", "feed_forward.w2")
EVERY_PARAMETER = "*.weight"  # node names hold no dot: this glob matches parameter FQNs only
EXPERTS = "layers.*.feed_forward.w[123]"  # a mixture of experts' weights, [experts, in, out]
# the first MoE layer's expert matmuls (w1, w3, w2): pinning one layer's node pins its copies
EXPERT_MATMULS = ("bmm", "bmm_1", "bmm_2")


def hand_plans(ndim: int, moe: bool = False) -> tuple[str, ...]:
    """The hand plans a mesh of ``ndim`` dims can express (HSDP and FSDP with TP need a second dim),
    with the expert-parallel ones for a mixture of experts."""
    plans = ("ddp", "fsdp", "tp") if ndim == 1 else ("ddp", "fsdp", "hsdp", "fsdp+tp")
    if moe:
        plans += ("fsdp+ep",) if ndim == 1 else ("fsdp+ep", "ep+tp")
    return plans


def hand_plan_pins(name: str, ndim: int, moe: bool = False) -> list[tuple[str, tuple[Placement, ...]]]:
    """(parameter FQN or module glob, placements) pins of the hand plan ``name`` on an ``ndim``-D mesh."""
    if name not in hand_plans(ndim, moe):
        raise ValueError(f"no hand plan {name!r} on a {ndim}-D mesh: use one of {', '.join(hand_plans(ndim, moe))}")
    if name in ("fsdp+ep", "ep+tp"):
        return _expert_parallel(ndim, tp=name == "ep+tp")
    if name == "ddp":
        pins = [(EVERY_PARAMETER, (R,) * ndim)]
    elif name == "fsdp":
        pins = [(EVERY_PARAMETER, (Shard(0),) * ndim)]
    elif name == "hsdp":
        pins = [(EVERY_PARAMETER, (R,) * (ndim - 1) + (Shard(0),))]
    else:
        return _fsdp_tp(ndim, moe)
    return pins + [(EXPERTS, pins[0][1])] if moe else pins


def _expert_parallel(ndim: int, tp: bool) -> list[tuple[str, tuple[Placement, ...]]]:
    """The experts split over the first mesh dim, their matmuls too; with ``tp`` split inside each
    expert over the last dim, else stored split on dim 1 over the others. Every other parameter FSDP
    (over all but the last dim with ``tp``)."""
    rest = ndim - 1 - tp
    ep = (Shard(0),) + (Shard(1),) * rest
    if not tp:
        pins = [(EVERY_PARAMETER, (Shard(0),) * ndim), (EXPERTS, ep)]
        return pins + [(m, (Shard(0),) + (R,) * (ndim - 1)) for m in EXPERT_MATMULS]
    pins = [(EVERY_PARAMETER, (Shard(0),) * (ndim - 1) + (R,))]
    pins += [(f"layers.*.feed_forward.{w}", ep + (Shard(2),)) for w in ("w1", "w3")]
    pins += [("layers.*.feed_forward.w2", ep + (Shard(1),))]
    matmul_ep = (Shard(0),) + (R,) * rest
    return pins + [(m, matmul_ep + (Shard(2),)) for m in EXPERT_MATMULS[:2]]


def _fsdp_tp(ndim: int, moe: bool) -> list[tuple[str, tuple[Placement, ...]]]:
    """FSDP on every dim but the last, TP on the last; an activation (batch, [seq,] features) is
    batch-split on the FSDP dims and split on ``d`` over TP. A mixture of experts' dense layers and shared
    experts are split the same way, and each routed expert column- (w1, w3) or row-wise (w2), its
    expert dim FSDP."""
    dp = (Shard(0),) * (ndim - 1)

    def act(d: int) -> tuple[Placement, ...]:
        return dp + (Shard(d),)

    blocks = [("layers.*", "feed_forward")]
    if moe:
        blocks = [("dense_layers.*", "feed_forward"), ("layers.*", "feed_forward.shared")]
    pins = []
    for block, ffn in blocks:
        columnwise = [m.replace("feed_forward", ffn) for m in COLUMNWISE]
        rowwise = [m.replace("feed_forward", ffn) for m in ROWWISE]
        pins += [(f"{block}.{norm}.weight", dp + (R,)) for norm in ("attention_norm", "ffn_norm")]  # FSDP only
        pins += [(f"{block}.{m}.weight", dp + (Shard(0),)) for m in columnwise]  # (out, in): split outputs
        pins += [(f"{block}.{m}.weight", dp + (Shard(1),)) for m in rowwise]  # split inputs
        pins += [(f"{block}.{m}", act(-1)) for m in columnwise]  # column-wise outputs: split features
    if moe:
        pins += [(f"layers.*.feed_forward.{w}", dp + (Shard(2),)) for w in ("w1", "w3")]
        pins += [("layers.*.feed_forward.w2", dp + (Shard(1),))]
    pins += [("norm.weight", dp + (R,)), ("tok_embeddings.weight", dp + (Shard(0),))]
    pins += [("output.weight", dp + (Shard(0),)), ("output", act(-1))]  # vocab-split logits
    return pins


def _present(pins: list, params: dict, modules: set[str]) -> list:
    """The pins of ``pins`` whose target this model has: a LLaMA-style model may lack parts (a stack
    of SwiGLU blocks has no attention, norms or embedding; Qwen3-MoE no dense layer or shared
    expert), and the hand plan then covers the parts it has. A model with none of them keeps every
    pin, so that adding the first says what the model lacks."""
    names = (*params, *modules)
    present = [(t, p) for t, p in pins if any(fnmatch.fnmatchcase(name, t) for name in names)]
    return present or pins


def fit_to_shapes(pins: list, params: dict[str, torch.Tensor], mesh_shape: tuple[int, ...]) -> list:
    """``pins`` with each parameter glob split by layer pattern where the mesh cannot split some of
    its parameters' dim 0 evenly; those split dim 1 on the outer mesh dims instead, which moves the
    same bytes without padding (LLaMA-3's 128256-row embedding over 1024 ranks). Where no dim splits
    evenly the pin stays as it is: the parameter is then split unevenly (``autoplan.shard.uneven``), as
    FSDP pads it."""
    out = []
    for target, placements in pins:
        matched = [fqn for fqn in params if fnmatch.fnmatchcase(fqn, target)]
        if all(placement_error(placements, params[f], mesh_shape, whole=True) is None for f in matched):
            out.append((target, placements))
            continue
        # the outer (FSDP) mesh dims move to dim 1 first, as few as fit: the inner (TP) one keeps its split
        moved = [
            tuple(Shard(1) if i < k and p == Shard(0) else p for i, p in enumerate(placements))
            for k in range(1, len(placements) + 1)
        ]
        for pattern in dict.fromkeys(re.sub(r"\.\d+\.", ".*.", f) for f in matched):
            val = params[next(f for f in matched if fnmatch.fnmatchcase(f, pattern))]
            fitting = [pl for pl in (placements, *moved) if placement_error(pl, val, mesh_shape, whole=True) is None]
            out.append((pattern, fitting[0] if fitting else placements))  # none: the pin says why
    return out


def hand_plan(ap, name: str, ndim: int):
    """``ap``'s plan under the pins of hand plan ``name`` (those its model has parts for, see
    ``_present``, fitted to its shapes), removed again afterwards; ``AutoplanError`` when the shapes cannot take it."""
    params = {fqn: n.meta["val"] for fqn, n in ap.traced.placeholder_for("param").items()}
    moe = any(fnmatch.fnmatchcase(fqn, EXPERTS) and params[fqn].dim() == 3 for fqn in params)
    modules = {n.meta.get(PATH_KEY) or "" for n in ap.traced.gm.graph.nodes}
    added = []
    try:
        pins = _present(hand_plan_pins(name, ndim, moe), params, modules)
        for target, placements in fit_to_shapes(pins, params, tuple(ap.mesh.shape)):
            ap.add_node_constraint(target, placements)
            added.append(target)
        return ap.optimize_placement()
    finally:
        for target in added:
            ap.remove_node_constraint(target)


def compare_plans(ap, ndim: int) -> list[dict]:
    """The ILP's plan and each hand plan that ``ap``'s mesh can express, under ``ap``'s other
    constraints and one cost model: one row each, the ILP's first (``python -m autoplan.bench
    compare`` prints them). The ILP starts from the cheapest hand plan, so within any MIP gap it
    is never worse than one."""
    rows, plans = [], {}
    params = {fqn: n.meta["val"] for fqn, n in ap.traced.placeholder_for("param").items()}
    moe = any(fnmatch.fnmatchcase(fqn, EXPERTS) and params[fqn].dim() == 3 for fqn in params)
    for name in hand_plans(ndim, moe):
        t0 = time.perf_counter()
        try:
            plans[name] = hand_plan(ap, name, ndim)
        except AutoplanError as e:  # a hand plan the shapes cannot take: reported, not fatal
            rows.append({"plan": name, "error": str(e).splitlines()[0]})
        else:
            rows.append(_row(name, plans[name], ap, time.perf_counter() - t0))
    t0 = time.perf_counter()
    best = min(plans.values(), key=lambda p: p.cost.total, default=None)
    return [_row("autoplan", ap.optimize_placement(start=best), ap, time.perf_counter() - t0), *rows]


def _row(name: str, plan, ap, seconds: float) -> dict:
    c = plan.cost
    return {
        "plan": name,
        "step_ms": c.total * 1e3,
        "compute_ms": (c.compute_forward + c.compute_backward) * 1e3,
        "comm_ms": c.comm * 1e3,
        "exposed_comm_ms": c.exposed_comm * 1e3,
        "peak_gib": plan.memory.peak_bytes / 2**30,
        "param_bytes": plan.memory.param_bytes,
        "fits": plan.memory.peak_bytes <= ap.device_profile.memory_bytes,
        "mfu": c.mfu,
        "gap": plan.solver.get("gap"),
        "plan_s": seconds,
    }
