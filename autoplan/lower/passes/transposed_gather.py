"""Gather the tensor under a transpose, not the transpose: no relayout copies.

A weight split on its rows (``Shard(0)``) is read by ``mm`` through ``t(w)``; when the plan gathers the
transposed view along its dim 1, the lowering makes ``t`` of the local rows contiguous (a copy), gathers
the copies stacked on dim 0 and moves each block to its columns (``view`` to ``[n, A, B]``, ``permute``,
``clone``: a strided copy of the whole gathered weight, several times slower than a streaming one).
Gathering the rows themselves along dim 0 stacks them in place, and ``t`` of the result is the same
matrix, column block ``r`` being ``t`` of rank ``r``'s rows: no copy at all. Only values whose users
read any layout (``mm`` and views that keep working on strided inputs) are rewritten.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

c10d = torch.ops._c10d_functional
aten = torch.ops.aten

_IDENTITY_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.alias.default)
# users that accept a transposed operand as it is
_STRIDE_AGNOSTIC = (aten.mm.default, aten.t.default, aten.alias.default, aten.detach.default)


@dataclass(frozen=True)
class TransposedGatherStats:
    rewritten: int  # gathers of a transposed view turned into gathers of its base


def _is(node: object, op) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target is op


def _base_of_transpose(node: fx.Node) -> fx.Node | None:
    """``x`` where ``node`` is ``t(x)`` of a 2-D ``x``, through identity views."""
    while any(_is(node, op) for op in _IDENTITY_VIEWS) and tuple(node.args[0].meta["val"].shape) == tuple(
        node.meta["val"].shape
    ):
        node = node.args[0]
    if _is(node, aten.t.default) and node.args[0].meta["val"].dim() == 2:
        return node.args[0]
    return None


def _single(node: fx.Node, op) -> fx.Node | None:
    users = list(node.users)
    return users[0] if len(users) == 1 and _is(users[0], op) else None


def _relayout_tail(wait: fx.Node, n: int) -> fx.Node | None:
    """The node ending ``view [n, A, B] -> permute [1, 0, 2] -> clone -> view [A, n * B]`` after ``wait``."""
    view = _single(wait, aten.view.default)
    if view is None or len(view.args[1]) != 3 or view.args[1][0] != n:
        return None
    permute = _single(view, aten.permute.default)
    if permute is None or list(permute.args[1]) != [1, 0, 2]:
        return None
    clone = _single(permute, aten.clone.default)
    if clone is None:
        return None
    users = list(clone.users)
    if len(users) != 1 or not any(_is(users[0], op) for op in _IDENTITY_VIEWS[:2]):
        return None
    end = users[0]
    _, a, b = view.args[1]
    return end if list(end.args[1]) == [a, n * b] else None


def gather_under_transposes(graph: fx.Graph) -> TransposedGatherStats:
    """Rewrite ``all_gather(t(x)) -> relayout`` into ``t(all_gather(x))`` (see the module docstring)."""
    rewritten = 0
    for gather in list(graph.nodes):
        if not _is(gather, c10d.all_gather_into_tensor.default):
            continue
        base = _base_of_transpose(gather.args[0])
        wait = _single(gather, c10d.wait_tensor.default)
        if base is None or wait is None:
            continue
        end = _relayout_tail(wait, gather.args[1])
        if end is None or not all(any(_is(u, op) for op in _STRIDE_AGNOSTIC) for u in end.users):
            continue
        with graph.inserting_after(gather):
            new_gather = graph.call_function(c10d.all_gather_into_tensor.default, (base, *gather.args[1:]))
        with graph.inserting_after(wait):
            new_wait = graph.call_function(c10d.wait_tensor.default, (new_gather,))
        with graph.inserting_after(new_wait):
            new_t = graph.call_function(aten.t.default, (new_wait,))
        for new, like in ((new_gather, gather), (new_wait, wait), (new_t, end)):
            new.meta.update({k: v for k, v in like.meta.items() if k != "val"})
        val = base.meta["val"]
        n = gather.args[1]
        new_gather.meta["val"] = val.new_empty((val.shape[0] * n, val.shape[1]))
        new_wait.meta["val"] = new_gather.meta["val"]
        new_t.meta["val"] = new_wait.meta["val"].t()
        end.replace_all_uses_with(new_t)
        for dead in reversed(_chain(gather, end)):
            graph.erase_node(dead)
        rewritten += 1
    return TransposedGatherStats(rewritten)


def _chain(start: fx.Node, end: fx.Node) -> list[fx.Node]:
    """``start`` and its single-user successors up to ``end``."""
    chain, node = [start], start
    while node is not end:
        (node,) = node.users
        chain.append(node)
    return chain
