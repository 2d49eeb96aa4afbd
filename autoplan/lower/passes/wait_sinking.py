"""Wait for an all-reduce where its result is first needed, not where it was issued.

The lowering emits every collective with its ``wait_tensor`` right after it, so the rank blocks
until the collective is done even when nothing reads its result for a while. A replicated
parameter's gradient (DDP, or a norm's weight in tensor parallelism) is all-reduced as soon as
the backward produces it and read only when the step returns: with the wait at once, the rank sits
out every reduction, while the backend could run it beside the compute that follows (NCCL on its
own stream, gloo on its worker thread). This pass moves each all-reduce's wait down to just before
its first reader, which is what the overlap model (``cost.overlap``) assumes of gradient reductions.

The wait stays inside the stretch of nodes of its own layer instance (``REGION_KEY``) and phase,
so regional compilation still cuts the graph where it did and a compiled region never hands an
unfinished collective to another. Only all-reduces move: the functional all-reduce reduces a copy
of its input, so delaying its wait holds no memory the plan did not count (its result is alive
anyway). A reduce-scatter or all-to-all keeps its larger input alive until waited; bounding those in
flight belongs with bucketing them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx

from autoplan.lower.collectives import c10d
from autoplan.trace.tracing import PHASE_KEY


@dataclass(frozen=True)
class WaitStats:
    sunk: int  # all-reduce waits moved past ops that do not read their result


def sink_all_reduce_waits(graph: fx.Graph, region_key: str) -> WaitStats:
    """Move each all-reduce's wait to just before its first reader, no further than the last node
    of the same ``region_key`` value and phase that directly follows it."""
    sunk = 0
    for wait in list(graph.nodes):
        if wait.target is not c10d.wait_tensor.default:
            continue
        issued = wait.args[0]
        if not isinstance(issued, fx.Node) or issued.target is not c10d.all_reduce.default:
            continue
        stretch = (wait.meta.get(region_key), wait.meta.get(PHASE_KEY))
        readers = set(wait.users)
        last = wait
        for n in _after(wait):
            if n in readers or n.op != "call_function" or (n.meta.get(region_key), n.meta.get(PHASE_KEY)) != stretch:
                break
            last = n
        if last is not wait:
            last.append(wait)
            sunk += 1
    return WaitStats(sunk)


def _after(node: fx.Node):
    n = node.next
    while n.op != "root":
        yield n
        n = n.next
