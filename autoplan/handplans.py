"""The plans users write by hand today, as pins on a LLaMA-style model (``autoplan.models.llama3``
parameter and module names), so the ILP's plan can be priced against them under one cost model.

- ``ddp``: every parameter replicated; gradients all-reduced.
- ``fsdp``: ZeRO-3, every parameter's dim 0 split over the whole mesh.
- ``hsdp``: split inside the last mesh dim (a node), replicated across the others.
- ``fsdp+tp``: torchtitan's 2-D plan: the last mesh dim is tensor parallel (column-wise wq/wk/wv/w1/w3
  and output, row-wise wo/w2 and the embedding), the others FSDP. Where the norms run (sequence
  parallel or replicated) is left to the ILP: a norm's output is not a pinnable module output here.

Pins fix what the hand plan fixes: the parameters' placements and, for tensor parallelism, the
layouts of its column-wise outputs. Every other value is left to the ILP, which can only help
the hand plan.
"""

from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

R = Replicate()
COLUMNWISE = ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3")
ROWWISE = ("attention.wo", "feed_forward.w2")
EVERY_PARAMETER = "*.weight"  # node names hold no dot: this glob matches parameter FQNs only


def hand_plans(ndim: int) -> tuple[str, ...]:
    """The hand plans a mesh of ``ndim`` dims can express (HSDP and TP need a second dim)."""
    return ("ddp", "fsdp") if ndim == 1 else ("ddp", "fsdp", "hsdp", "fsdp+tp")


def hand_plan_pins(name: str, ndim: int) -> list[tuple[str, tuple[Placement, ...]]]:
    """(parameter FQN or module glob, placements) pins of the hand plan ``name`` on an ``ndim``-D mesh."""
    if name not in hand_plans(ndim):
        raise ValueError(f"no hand plan {name!r} on a {ndim}-D mesh: use one of {', '.join(hand_plans(ndim))}")
    if name == "ddp":
        return [(EVERY_PARAMETER, (R,) * ndim)]
    if name == "fsdp":
        return [(EVERY_PARAMETER, (Shard(0),) * ndim)]
    if name == "hsdp":
        return [(EVERY_PARAMETER, (R,) * (ndim - 1) + (Shard(0),))]
    return _fsdp_tp(ndim)


def _fsdp_tp(ndim: int) -> list[tuple[str, tuple[Placement, ...]]]:
    """FSDP on every dim but the last, TP on the last; a (batch, seq, ...) activation is batch-split
    on the FSDP dims and split on ``d`` over TP."""
    dp = (Shard(0),) * (ndim - 1)

    def act(d: int) -> tuple[Placement, ...]:
        return dp + (Shard(d),)

    norms = ("layers.*.attention_norm.weight", "layers.*.ffn_norm.weight", "norm.weight")
    pins = [(fqn, dp + (R,)) for fqn in norms]  # FSDP only
    pins += [(f"layers.*.{m}.weight", dp + (Shard(0),)) for m in COLUMNWISE]  # (out, in): split outputs
    pins += [(f"layers.*.{m}.weight", dp + (Shard(1),)) for m in ROWWISE]  # split inputs
    pins += [("tok_embeddings.weight", dp + (Shard(0),)), ("output.weight", dp + (Shard(0),))]
    pins += [(f"layers.*.{m}", act(2)) for m in COLUMNWISE]  # column-wise outputs: split features
    pins += [("output", act(2))]  # vocab-split logits
    return pins
