"""The ``ExpertRows`` placement: the routed tokens of a mixture of experts, where each rank holds
only the rows of its own experts (zeros elsewhere).

A grouped matmul split over its experts (``grouped_mm.expert_block``) makes such a value: every
rank multiplies the sorted tokens of its expert block and leaves the other rows zero, so the ranks'
results sum to the whole product. That is a ``Partial("sum")``, with more known: the ranks' rows
are disjoint. Zero-preserving elementwise ops keep it without a reduction, since on disjoint rows
``f(a_0 + a_1) = f(a_0) + f(a_1)`` whenever ``f(0) = 0`` (``silu``, a product of two such values,
the backward of ``silu``), and the next grouped matmul reads its own experts' rows of it directly.
So a SwiGLU of grouped matmuls split over the experts moves nothing between its matmuls: the hidden
activations never leave their expert's rank.

``ExpertRows(dim)`` names the tensor dim that holds the tokens (0 as the grouped matmul makes
them, 1 once transposed for a weight gradient), so that ops moving or cutting that dim are told
apart from those that keep it. It redistributes as a ``Partial`` does (an all-reduce to
``Replicate``, a reduce-scatter to ``Shard``), relabels to ``Partial`` for free, and nothing turns
into it: only the ops listed here make or keep it. Values sharing it are assumed to share one
routing (one MoE block's offsets), as every value between a block's grouped matmuls does.
"""

from __future__ import annotations

import itertools

import torch
from torch.distributed.tensor import Partial, Replicate

aten = torch.ops.aten


class ExpertRows(Partial):
    """A ``Partial("sum")`` whose ranks hold disjoint rows of tensor dim ``dim``: each its experts' rows."""

    def __init__(self, dim: int = 0):
        super().__init__("sum")
        object.__setattr__(self, "dim", dim)

    def __eq__(self, other) -> bool:
        return type(other) is ExpertRows and other.dim == self.dim

    def __hash__(self) -> int:
        return hash(("ExpertRows", self.dim))

    def __repr__(self) -> str:
        return f"ExpertRows({self.dim})"

    def __str__(self) -> str:
        return f"E({self.dim})"

    def __fx_repr__(self):
        return f"ExpertRows({self.dim})", {"ExpertRows": ExpertRows}

    def __reduce__(self):
        return ExpertRows, (self.dim,)


def within(strategy) -> bool:
    """Whether a strategy places any input or output as expert rows."""
    return any(p is not None and any(type(x) is ExpertRows for x in p) for p in (*strategy.outputs, *strategy.inputs))


def as_partial(placements: tuple) -> tuple:
    """``placements`` with each ``ExpertRows`` relabelled to the ``Partial("sum")`` it also is."""
    return tuple(Partial() if type(p) is ExpertRows else p for p in placements)


R = Replicate()
E0, E1 = ExpertRows(0), ExpertRows(1)

# Elementwise ops with f(0) = 0 in each input that may hold expert rows (single-mesh-dim rows built
# by ``elementwise_rows``): which inputs may, and whether a Replicate may stand beside them.
_ZERO_KEEPING = {
    **dict.fromkeys(
        (aten.silu.default, aten.relu.default, aten.gelu.default, aten.neg.default, aten.tanh.default),
        "unary",
    ),
    **dict.fromkeys((aten.clone.default, aten._to_copy.default), "unary"),
    # a sum of two values on the same rows
    aten.add.Tensor: "both",
    aten.sub.Tensor: "both",
    # a product is zero wherever one factor is
    aten.mul.Tensor: "either",
    aten.div.Tensor: "first",
    # the backward of an activation: zero where the incoming gradient is
    aten.silu_backward.default: "first",
    aten.gelu_backward.default: "first",
    aten.threshold_backward.default: "first",
}


def elementwise_rows(node) -> list[tuple]:
    """Single-mesh-dim rows (out, in...) in which an elementwise op keeps expert rows: each expert-rows
    input spans the 2-D output whole (no broadcast along its rows), in the output's orientation."""
    kind = _ZERO_KEEPING.get(node.target)
    out = node.meta.get("val")
    if kind is None or not isinstance(out, torch.Tensor) or out.dim() != 2:
        return []
    tensors = [a for a in node.args if isinstance(a, torch.fx.Node)]
    if len(tensors) != len([a for a in (*node.args, *node.kwargs.values()) if isinstance(a, torch.fx.Node)]):
        return []
    if kind == "both" and (len(tensors) != 2 or node.kwargs.get("alpha", 1) != 1):
        return []
    whole = [a.meta["val"].shape == out.shape for a in tensors]
    if kind in ("unary", "both"):
        masks = [(True,) * len(tensors)]
    elif kind == "either":
        masks = [m for m in itertools.product((True, False), repeat=len(tensors)) if any(m)]
    else:  # "first"
        masks = [(True,) + m for m in itertools.product((True, False), repeat=len(tensors) - 1)]
    rows = []
    for e in (E0, E1):
        for mask in masks:
            if all(whole[i] for i, m in enumerate(mask) if m):
                rows.append((e, *(e if m else R for m in mask)))
    return rows


def _norm(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


def _view_outputs(node, dim: int) -> int | None:
    """The token dim of a view-like op's outputs when its tensor inputs hold tokens on ``dim``;
    ``None`` where the op moves or cuts that dim (or is no such op)."""
    op, val = node.target, node.meta.get("val")
    first = node.args[0]
    ndim = (first[0] if isinstance(first, (list, tuple)) else first).meta["val"].dim()
    if ndim != 2:
        return None
    if op in (aten.alias.default, aten.detach.default):
        return dim
    if op is aten.t.default:
        return 1 - dim
    if op is aten.transpose.int:
        return dim if _norm(node.args[1], 2) == _norm(node.args[2], 2) else 1 - dim
    if op in (aten.split.Tensor, aten.split_with_sizes.default, aten.cat.default):
        at = 1 if op is aten.cat.default else 2  # the dim argument's position
        cut = node.args[at] if len(node.args) > at else node.kwargs.get("dim", 0)
        return dim if _norm(cut, 2) != dim and isinstance(val, (torch.Tensor, list, tuple)) else None
    return None


def promoted(node, strategies) -> list:
    """Expert-rows variants of DTensor's strategies for a view-like op (aliases, transposes, splits
    and concatenations off the token dim): where a mesh dim places every tensor input and output
    ``Partial("sum")``, the same with expert rows (in the orientation the op leaves them), the
    mesh dims so promoted taken in every combination."""
    out = []
    for s in strategies:
        placed = [p for p in (*s.outputs, *s.inputs) if p is not None]
        if not placed:
            continue
        partial = [i for i in range(len(placed[0])) if all(_summed(p[i]) for p in placed)]
        for dim in (0, 1):
            after = _view_outputs(node, dim)
            if after is None:
                continue
            for k in range(1, len(partial) + 1):
                for dims in itertools.combinations(partial, k):
                    outs = tuple(_swap(p, dims, ExpertRows(after)) for p in s.outputs)
                    ins = tuple(_swap(p, dims, ExpertRows(dim)) for p in s.inputs)
                    out.append(type(s)(outs, ins))
    return out


def _summed(p) -> bool:
    return type(p) is Partial and p.reduce_op == "sum"


def _swap(placements, dims, rows: ExpertRows):
    return None if placements is None else tuple(rows if i in dims else x for i, x in enumerate(placements))


VIEWS = frozenset(
    {
        aten.alias.default,
        aten.detach.default,
        aten.t.default,
        aten.transpose.int,
        aten.split.Tensor,
        aten.split_with_sizes.default,
        aten.cat.default,
    }
)
