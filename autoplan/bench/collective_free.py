"""Rank 0's lowered program with its collectives made free, for measuring one rank on one machine.

The benchmarks (``autoplan.bench overhead|memory``) run rank 0's step for real on a fake process
group: what is left once every collective costs nothing is the rank's own compute, local work and
memory, which is what they compare with the plain model and with the plan's estimates.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from autoplan.adapters.ops import base_name

# Ops whose output is their input; every collective becomes a new tensor of its output's shape, as
# the functional ones make (an all-reduce too: its result is a new tensor beside its input).
_PASS_THROUGH = ("wait_tensor", "broadcast")


def _free_shard_dim_alltoall(t: torch.Tensor, gather_dim: int, shard_dim: int, n: int) -> torch.Tensor:
    """DTensor's GPU all-to-all (``_dtensor.shard_dim_alltoall``) with the exchange made free: the
    local copies around it (the new shard dim to the front, the gathered dim back) still run."""
    from autoplan.adapters.dtensor import chunks_from_front, chunks_to_front

    send = chunks_to_front(t, shard_dim, n).contiguous()
    return chunks_from_front(send.new_empty(send.shape), gather_dim)


def collective_free(gm: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, dict[str, int]]:
    """A copy of a lowered graph with every collective made free.

    On a fake process group a collective returns at once but may still copy (the coalesced
    all-gather copies its input once per rank), which no real rank does. Here a wait returns its
    input and every functional collective a new tensor of its output's shape, as it allocates one
    (an all-reduce too): uninitialised for floating point, zeros otherwise (gathered token ids must
    stay valid indices). DTensor's GPU all-to-all keeps its local copies. What remains is the rank's compute
    and local work. Returns the copy and the collectives replaced, by op name.
    """
    from autoplan.lower.collectives import communicates

    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    replaced: dict[str, int] = {}
    for n in list(graph.nodes):
        if not communicates(n):
            continue
        name, val = base_name(n.target), n.meta.get("val")
        if not isinstance(val, torch.Tensor):
            raise NotImplementedError(f"collective-free rewrite: {n.target} ({n.name}) does not return one tensor")
        if name in _PASS_THROUGH:
            new = n.args[0]
        elif name == "shard_dim_alltoall":
            source, gather_dim, shard_dim = n.args[:3]
            ranks = val.shape[gather_dim] // source.meta["val"].shape[gather_dim]
            with graph.inserting_before(n):
                new = graph.call_function(_free_shard_dim_alltoall, (source, gather_dim, shard_dim, ranks))
        else:
            make = torch.ops.aten.new_empty if val.dtype.is_floating_point else torch.ops.aten.new_zeros
            with graph.inserting_before(n):
                new = graph.call_function(make.default, (n.args[0], list(val.shape)), {"dtype": val.dtype})
        if new is not n.args[0]:
            new.meta = dict(n.meta)
        n.replace_all_uses_with(new)
        graph.erase_node(n)
        replaced[name] = replaced.get(name, 0) + 1
    return torch.fx.GraphModule(gm, graph), dict(sorted(replaced.items()))


def collective_free_executor(pmod: torch.nn.Module, lowered, compile_graph: Callable | None) -> dict:
    """Point the parallel module at collective-free copies of its lowered graphs (compiled the way
    ``apply_placement(compile=True)`` compiles them, when asked); returns what was replaced."""
    from autoplan.run.runtime import make_executor

    forward, in_forward = collective_free(lowered.forward)
    backward, in_backward = collective_free(lowered.backward)
    free = dataclasses.replace(lowered, forward=forward, backward=backward)
    pmod._autoplan.executor = make_executor(free, compile_graph)
    return {"forward": in_forward, "backward": in_backward}
