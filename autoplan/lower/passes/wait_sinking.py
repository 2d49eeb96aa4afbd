"""Wait for an all-reduce where its result is first needed, not where it was issued.

The lowering emits every collective with its ``wait_tensor`` right after it, so the rank blocks
until the collective is done even when nothing reads its result for a while. A replicated
parameter's gradient (DDP, or a norm's weight in tensor parallelism) is all-reduced as soon as
the backward produces it and read only when the step returns: with the wait at once, the rank sits
out every reduction, while the backend could run it beside the compute that follows (NCCL on its
own stream, gloo on its worker thread). This pass moves each all-reduce's wait down to just before
its first reader, and no further than the end of the stretch of nodes after its own (a stretch is
a layer instance, ``REGION_KEY``, in one phase): a gradient the backward produces late in a layer
still has the next layer's whole backward to run under, as the overlap model (``cost.overlap``)
prices it, while the reductions in flight stay a layer's worth.

A wait that lands in the next stretch takes that stretch's tag, so regional compilation cuts the
graph where it did: the layer's compiled region hands its un-waited reductions to the next one, as
a prefetched gather is handed. Only all-reduces move: the functional all-reduce reduces a copy of
its input (or, run eagerly, the input it alone reads, ``passes.reinplace``), so delaying its wait
holds no memory the plan did not count (its result is alive anyway). A reduce-scatter or
all-to-all keeps its larger input alive until waited; bounding those in flight belongs with
bucketing them.
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
    """Move each all-reduce's wait to just before its first reader, past the rest of its stretch
    (``region_key`` value and phase) and at most the whole stretch that directly follows it."""
    sunk = 0
    for wait in list(graph.nodes):
        if wait.target is not c10d.wait_tensor.default:
            continue
        issued = wait.args[0]
        if not isinstance(issued, fx.Node) or issued.target is not c10d.all_reduce.default:
            continue
        phase, own = wait.meta.get(PHASE_KEY), wait.meta.get(region_key)
        readers = set(wait.users)
        last, crossed = wait, False
        for n in _after(wait):
            if n in readers or n.op != "call_function" or n.meta.get(PHASE_KEY) != phase:
                break
            tag = n.meta.get(region_key)
            if tag != own:
                if crossed:
                    break
                crossed, own = True, tag
            last = n
        if last is not wait:
            last.append(wait)
            wait.meta[region_key] = last.meta.get(region_key)
            sunk += 1
    return WaitStats(sunk)


def _after(node: fx.Node):
    n = node.next
    while n.op != "root":
        yield n
        n = n.next
