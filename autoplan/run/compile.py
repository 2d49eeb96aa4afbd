"""Compiling parallel modules with Inductor.

Two ways. ``regional`` (what ``apply_placement(plan, compile=True)`` uses): the lowered forward and
backward graphs are cut into regions, one per repeated-layer instance and one per stretch between
them; regions with the same structure share one compiled kernel set, so compile time grows with
the number of *distinct* layers, not with depth (a 32-layer model compiles like a 3-layer one).
Regions are functional ATen graphs with static shapes, so they go to Inductor directly, without
Dynamo.
``backend()``: a ``torch.compile`` backend for the whole parallel module (one graph, slow to
compile on deep models), kept for users who compile the module themselves.

Both keep autoplan's forward/backward split (save what backward reads, never re-run a collective)
rather than Inductor's min-cut rematerialisation, so the compiled program keeps the collectives and
saved tensors the plan was costed with.
"""

from __future__ import annotations

import hashlib
import operator
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.fx.passes.split_module import split_module

from autoplan.adapters.inductor import aot_backend, compile_graph
from autoplan.adapters.ops import OpOverload, base_name
from autoplan.adapters.pytree import tree_map
from autoplan.lower.collectives import communicates
from autoplan.lower.lowering import REGION_KEY, partition


def _plan_partition(joint, _joint_inputs, *, num_fwd_outputs: int, **_unused):
    parts = partition(joint, num_fwd_outputs)
    return parts.forward, parts.backward


def backend() -> Callable:
    """A ``torch.compile`` backend for a whole parallel module (one graph: slow to compile on deep models)."""
    return aot_backend(_plan_partition)


@dataclass(frozen=True)
class RegionStats:
    regions: int  # regions the graph was cut into
    distinct: int  # regions compiled (the others reuse one of these or run eagerly)
    eager: int = 0  # regions with too little compute to be worth a compile (gathers, a lookup)


# A region with fewer compute ops than this runs eagerly: a compile costs seconds and there is
# nothing to fuse (typically a layer's parameter gathers, or an embedding lookup).
MIN_COMPUTE_OPS = 3
_ALLOCATIONS = frozenset({"empty", "empty_strided", "new_empty", "new_empty_strided", "new_zeros", "zeros", "full"})


def compute_ops(gm: fx.GraphModule) -> int:
    """ATen ops in ``gm`` that compute: not views, allocations or collectives."""
    count = 0
    for n in gm.graph.nodes:
        op = n.target
        if n.op != "call_function" or not isinstance(op, OpOverload) or communicates(n):
            continue
        if op.is_view or base_name(op) in _ALLOCATIONS:
            continue
        count += 1
    return count


def region_ids(graph: fx.Graph) -> dict[fx.Node, int]:
    """A region id per node: a new region starts wherever the layer tag changes along graph order.

    Nodes without a tag (added by later passes) stay in the region they appear in; an element read
    stays with its tuple. A node's id is never below its inputs' ids, so the cut is acyclic.
    """
    ids: dict[fx.Node, int] = {}
    current, tag = 0, None
    for n in graph.nodes:
        if n.op in ("placeholder", "output"):
            continue
        if n.target is operator.getitem:  # an element read stays with its tuple, wherever it sits
            ids[n] = ids[n.args[0]]
            continue
        t = n.meta.get(REGION_KEY)
        if t is not None and t != tag:
            current += tag is not None
            tag = t
        ids[n] = current
    return ids


def _value_key(val) -> tuple | str:
    if isinstance(val, torch.Tensor):
        return (tuple(val.shape), tuple(val.stride()), val.dtype, val.device.type)
    if isinstance(val, (tuple, list)):
        return tuple(_value_key(v) for v in val)
    return repr(val)


def _constant_key(t) -> tuple | str:
    """Constants are part of a region's code: two regions share kernels only with equal constants."""
    if not isinstance(t, torch.Tensor):
        return repr(t)
    data = t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return (_value_key(t), hashlib.sha1(data).hexdigest())


def structure_key(gm: fx.GraphModule) -> tuple:
    """What a region computes, independent of node names: ops, wiring, constants and input metadata."""
    index: dict[fx.Node, int] = {}
    items = []
    for i, n in enumerate(gm.graph.nodes):
        index[n] = i
        args = tree_map(lambda a: ("%", index[a]) if isinstance(a, fx.Node) else a, (n.args, n.kwargs))
        if n.op == "get_attr":
            target = _constant_key(getattr(gm, n.target))
        else:
            target = "" if n.op == "placeholder" else str(n.target)
        items.append((n.op, target, repr(args), _value_key(n.meta.get("val"))))
    return tuple(items)


def _lift_constants(gm: fx.GraphModule) -> tuple[fx.GraphModule, list]:
    """``gm`` with its tensor constants turned into trailing inputs (Inductor's graph entry point
    wants every tensor as an input, as Dynamo would lift them), and the constants in that order."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    anchor = next(n for n in graph.nodes if n.op not in ("placeholder", "get_attr"))
    constants = []
    for n in [n for n in graph.nodes if n.op == "get_attr"]:
        with graph.inserting_before(anchor):
            lifted = graph.placeholder(f"constant_{len(constants)}")
        lifted.meta = dict(n.meta)
        n.replace_all_uses_with(lifted)
        graph.erase_node(n)
        constants.append(getattr(gm, n.target))
    return fx.GraphModule(gm, graph), constants


def _standalone(example: object) -> object:
    """A compile-time stand-in for a tensor-subclass input (``LocalTensor``): a fresh tensor of the
    same shape, strides and dtype. The compiler fakeifies its examples and rebuilds inputs that
    alias one another (views, detached copies) with ``set_``, which such a subclass cannot take;
    plain tensors go as they are."""
    if not isinstance(example, torch.Tensor) or type(example) in (torch.Tensor, torch.nn.Parameter):
        return example
    return torch.empty_strided(example.shape, example.stride(), dtype=example.dtype, device=example.device)


class _Inductor(torch.nn.Module):
    """A region compiled by Inductor on its first call; shapes are static, so once."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__()
        self.region, self._constants = _lift_constants(gm)
        self._compiled: Callable | None = None

    def forward(self, *args):
        args = (*args, *self._constants)
        if self._compiled is None:
            self._compiled = compile_graph(self.region, [_standalone(a) for a in args])
        return self._compiled(*args)


def compile_regions(
    gm: fx.GraphModule, compile_region: Callable[[fx.GraphModule], torch.nn.Module] = _Inductor
) -> tuple[fx.GraphModule, RegionStats]:
    """``gm`` cut into regions, each structurally distinct region compiled once and shared.

    Returns a module with ``gm``'s signature whose regions run compiled (those with fewer than
    ``MIN_COMPUTE_OPS`` compute ops run eagerly); the glue between them is a handful of calls per
    layer. Compilation itself happens lazily, on the first call.
    """
    ids = region_ids(gm.graph)
    split = split_module(gm, gm, lambda n: ids[n], keep_original_order=True)
    compiled: dict[tuple, Callable] = {}
    regions = eager = 0
    for name, region in list(split.named_children()):
        if not isinstance(region, fx.GraphModule):
            continue
        regions += 1
        if compute_ops(region) < MIN_COMPUTE_OPS:
            eager += 1
            continue
        key = structure_key(region)
        if key not in compiled:
            compiled[key] = compile_region(region)
        setattr(split, name, compiled[key])
    return split, RegionStats(regions, len(compiled), eager)
