"""Reduce a tensor in its own buffer when the all-reduce is its only reader.

c10d's functional all-reduce reduces a copy of its input: the issuing thread allocates the result
and copies the input into it before the backend starts. When the input is a fresh tensor that
nothing else reads (a parameter's gradient, produced by the backward and handed straight to its
reduction), the copy buys nothing and costs a full pass over the bytes on the thread that
computes. On a CPU it also lands in freshly mapped pages, and then takes about as long as the
gloo all-reduce itself: a step that issues its gradient reductions asynchronously to run beside
the backward spends that time in line instead. ``all_reduce_`` reduces in place, with the same
result.

For graphs that run eagerly; Inductor reinplaces the collectives of the regions it compiles.
"""

from __future__ import annotations

import operator

import torch.fx as fx

from autoplan.adapters.ops import OpOverload, schema
from autoplan.lower.collectives import c10d
from autoplan.shard.strategies import aliases_input


def _owns_storage(n: fx.Node) -> bool:
    """Whether ``n``'s value can be written without another reader seeing it: a tensor computed by
    an op that returns no alias of its inputs (or an element of such an op's tuple), or an alias of
    one (a view, a ``contiguous`` of a contiguous value) that nothing else reads. Graph inputs never."""
    if n.op != "call_function":
        return False
    if n.target is operator.getitem:  # the elements of a tuple do not overlap
        return isinstance(n.args[0], fx.Node) and _owns_storage(n.args[0])
    op = n.target
    if not isinstance(op, OpOverload):
        return False
    if aliases_input(n) or any(r.alias_info is not None for r in schema(op).returns):
        src = n.args[0]
        return isinstance(src, fx.Node) and len(src.users) == 1 and _owns_storage(src)
    return True


def reinplace_all_reduces(gm: fx.GraphModule) -> tuple[fx.GraphModule, int]:
    """A copy of ``gm`` in which every all-reduce of a tensor it alone reads, and that owns its
    storage, reduces that tensor in place; and how many do."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    count = 0
    for n in graph.find_nodes(op="call_function", target=c10d.all_reduce.default):
        x = n.args[0]
        if isinstance(x, fx.Node) and len(x.users) == 1 and _owns_storage(x):
            n.target = c10d.all_reduce_.default
            count += 1
    return fx.GraphModule(gm, graph), count


def reduce_in_place(gm: fx.GraphModule) -> fx.GraphModule:
    """``reinplace_all_reduces``'s graph: how an eagerly run program takes its lowered graphs."""
    return reinplace_all_reduces(gm)[0]
