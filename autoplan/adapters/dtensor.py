"""Adapter over the private parts of ``torch.distributed.tensor`` (sharding rules, specs, redistribute plans).

Everything autoplan needs from ``torch.distributed.tensor._*`` goes through here, so that a torch
upgrade touches one module.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, _tp_conv
from torch.distributed.tensor import _redistribute as _dtensor_redistribute
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import OpSchema, OpSpec, OpStrategy, TupleStrategy
from torch.distributed.tensor._ops import utils as _dtensor_op_utils
from torch.distributed.tensor._ops.single_dim_strategy import _ShardingPlaceholder
from torch.distributed.tensor._redistribute import (
    _gen_transform_infos,
    disable_redistribute_transform_optimization,
    redistribute_local_tensor,
)
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard, _StridedShard

from autoplan.shard.expert_rows import ExpertRows
from autoplan.shard.uneven import gather_runs, is_uneven, pad_segments, uneven_dims

Placements = tuple[Placement, ...]
_PLAIN = frozenset({Shard, Replicate, Partial})

# torch 2.13 names these ``*_single``; 2.11 has only the ``*_tensor`` names (deprecated in 2.13)
_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
_reduce_scatter = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor


def tensor_meta(t: torch.Tensor) -> TensorMeta:
    return TensorMeta(t.shape, t.stride(), t.dtype)


def tensor_key(v) -> tuple:
    """What a cost or a strategy reads of a tensor (a tensor or its ``TensorMeta``): its shape,
    stride and dtype; any other value as its ``repr``."""
    if isinstance(v, TensorMeta):
        return (tuple(v.shape), tuple(v.stride), v.dtype)
    if isinstance(v, torch.Tensor):
        return (tuple(v.shape), tuple(v.stride()), v.dtype)
    return (repr(v),)


def make_spec(mesh: DeviceMesh, placements: Placements, meta: TensorMeta) -> DTensorSpec:
    return DTensorSpec(mesh, tuple(placements), tensor_meta=meta)


@dataclass(frozen=True)
class RedistributeStep:
    """One per-mesh-dim transition of a redistribution, as DTensor itself would perform it."""

    mesh_dim: int
    src: Placement
    dst: Placement
    logical_shape: tuple[int, ...]  # the tensor's shape on this mesh dim before the step


def redistribute_steps(
    mesh: DeviceMesh, src: Placements, dst: Placements, meta: TensorMeta
) -> tuple[RedistributeStep, ...]:
    """The ordered per-mesh-dim steps DTensor's redistribute uses to go from ``src`` to ``dst``,
    with each step's logical shape as the rank holding the largest shards sees it (DTensor records
    this rank's, which differs on uneven splits: every rank must price a move alike to plan alike)."""
    transitions = redistribute_transitions(mesh, src, dst, meta)
    shapes = logical_shapes(mesh, tuple(src), meta) if transitions else []
    return tuple(RedistributeStep(d, a, b, shapes[d]) for d, a, b in transitions)


def redistribute_transitions(
    mesh: DeviceMesh, src: Placements, dst: Placements, meta: TensorMeta
) -> tuple[tuple[int, Placement, Placement], ...]:
    """``redistribute_steps`` without the shapes: (mesh dim, source, target placement) per step.

    Where DTensor takes its greedy search (``shape_free``), the steps are worked out here from the
    placements alone (``_greedy``): asking DTensor builds two specs and their logical shapes per
    pair, and a 3-D mesh prices tens of thousands of pairs. Elsewhere DTensor is asked."""
    src, dst = tuple(src), tuple(dst)
    if src == dst:
        return ()
    if shape_free(src, dst):
        return _greedy(tuple(mesh.shape), src, dst)
    infos = _gen_transform_infos(make_spec(mesh, src, meta), make_spec(mesh, dst, meta))
    return tuple((i.mesh_dim, *i.src_dst_placements) for i in infos)


def _greedy(
    mesh_shape: tuple[int, ...], src: Placements, dst: Placements
) -> tuple[tuple[int, Placement, Placement], ...]:
    """DTensor's greedy redistribute search over plain placements (default shard order): when the
    source is split at all, inner to outer mesh dims, a mesh dim whose target shards a tensor dim
    that the outer mesh dims split differently before and after is first replicated (a nested
    shard cannot move in place); then outer to inner, each mesh dim goes to its target."""
    current, steps = list(src), []
    # plain placements (``shape_free``): a type test and a dim stand for isinstance and ``is_shard``
    if any(n > 1 and type(p) is Shard for n, p in zip(mesh_shape, src)):
        for m in reversed(range(len(src))):
            target = dst[m]
            if type(target) is Shard:
                d = target.dim
                before = [i for i in range(m) if type(current[i]) is Shard and current[i].dim == d]
                after = [i for i in range(m) if type(dst[i]) is Shard and dst[i].dim == d]
                if before != after:
                    target = Replicate()
            if current[m] != target:
                steps.append((m, current[m], target))
                current[m] = target
    for m, target in enumerate(dst):
        if current[m] != target:
            steps.append((m, current[m], target))
            current[m] = target
    return tuple(steps)


def shape_free(src: Placements, dst: Placements) -> bool:
    """Whether DTensor plans this move with its greedy search, whose transitions ignore the shape
    (its graph search, taken for strided shards or when forced, weighs bytes), over placements
    ``_greedy`` reads as DTensor does: no subclass of ``Shard`` (a strided shard is one)."""
    forced = getattr(_dtensor_redistribute, "_FORCE_MIN_COST_REDISTRIBUTION_PLAN", None)
    # a failing isinstance on a placement runs in Python (~0.7 us): the plain types are let by first
    return not forced and not any(type(p) not in _PLAIN and isinstance(p, Shard) for p in (*src, *dst))


def logical_shapes(mesh: DeviceMesh, src: Placements, meta: TensorMeta) -> list[tuple[int, ...]]:
    """The tensor's shape as each mesh dim's step sees it: split by ``src``'s shards on the mesh
    dims before it (the first, largest shard: DTensor's rule at coordinate 0)."""
    shapes = [tuple(meta.shape)]
    for i, p in enumerate(src[:-1]):
        shape = shapes[-1]
        if isinstance(p, Shard):
            size, _ = p._local_shard_size_and_offset(shape[p.dim], mesh.size(i), 0)
            shape = (*shape[: p.dim], size, *shape[p.dim + 1 :])
        shapes.append(shape)
    return shapes


def local_tensor(t: DTensor) -> torch.Tensor:
    """The tensor holding this rank's shard itself (``to_local`` gives a view of it under autograd)."""
    return t._local_tensor


def dtensor_spec(t: DTensor) -> DTensorSpec:
    """``t``'s placements, mesh and global shape and strides, as one value."""
    return t._spec


def with_spec(local: torch.Tensor, spec: DTensorSpec) -> DTensor:
    """``local`` as the shard of a DTensor of ``spec`` (a gradient handed back for a DTensor input),
    made without the autograd node ``DTensor.from_local`` adds, which a backward does not need."""
    return DTensor(local, spec, requires_grad=False)


def set_local_tensor(t: DTensor, local: torch.Tensor) -> None:
    """Make ``local`` the tensor holding this rank's shard of ``t`` (same shape, dtype and device)."""
    t._local_tensor = local


def sharding_propagator():
    return DTensor._op_dispatcher.sharding_propagator


def n_tensor_outputs(op: torch._ops.OpOverload) -> int:
    return sum(1 for r in op._schema.returns if "Tensor" in str(r.type))


def single_dim_rules(op: torch._ops.OpOverload, args_meta: tuple, kwargs_meta: dict) -> list[tuple] | None:
    """DTensor's single-mesh-dim rules for ``op`` as rows ``(out..., in...)``; ``None`` if it has none.

    Sharding placeholders become plain ``Shard`` (autoplan never plans strided shards). The
    all-replicate rule is implied and not included.
    """
    info = sharding_propagator().op_single_dim_strategy_funcs.get(op)
    if info is None:
        return None
    rows = info.func(op, args_meta, kwargs_meta)
    return [tuple(Shard(p.dim) if isinstance(p, _ShardingPlaceholder) else p for p in row) for row in rows]


def share_rule(op: torch._ops.OpOverload, like: torch._ops.OpOverload) -> None:
    """Make DTensor split ``op`` as it splits ``like`` (an op of ours computing the same product)."""
    propagator = sharding_propagator()
    propagator.register_op_strategy(op, propagator.op_strategy_funcs[like])


def has_full_rule(op: torch._ops.OpOverload) -> bool:
    return op in sharding_propagator().op_strategy_funcs


def runs_nested_splits(op: torch._ops.OpOverload) -> bool:
    """Whether DTensor runs ``op`` with a tensor dim split over several mesh dims: it dispatches
    convolutions to its own handler (``_tp_conv``), which reads the output spec's ``dim_map``, and
    that raises on such a split (torch 2.13) though the op's strategy offers it."""
    return DTensor._op_dispatcher._custom_op_handlers.get(op) not in (
        _tp_conv.convolution_handler,
        _tp_conv.convolution_backward_handler,
    )


def input_choices(mesh: DeviceMesh, placements: Sequence[Placements], meta: TensorMeta) -> OpStrategy:
    """The candidate placements of one tensor argument, in the form DTensor strategy functions consume."""
    return OpStrategy([OpSpec(make_spec(mesh, p, meta)) for p in placements])


def tuple_choices(children: Sequence[OpStrategy]) -> TupleStrategy:
    return TupleStrategy(tuple(children))


@contextlib.contextmanager
def _no_redistribute_costs():
    """DTensor's rules price every (input choice, expected spec) pair with a path search that
    dominates enumeration time; autoplan prices redistributions itself, so skip it while enumerating.
    """
    saved = _dtensor_op_utils.redistribute_cost
    _dtensor_op_utils.redistribute_cost = lambda src, dst: 0.0
    try:
        yield
    finally:
        _dtensor_op_utils.redistribute_cost = saved


def full_rule_strategies(op: torch._ops.OpOverload, args_schema: tuple, kwargs_schema: dict) -> list[tuple]:
    """Run DTensor's N-D strategy function; return ``(output placements, input placements)`` pairs.

    Output placements is a tuple (one entry per tensor output, ``None`` for absent ones); input
    placements has one entry per tensor argument in flattened argument order.
    """
    with _no_redistribute_costs():
        schema = OpSchema(op, _copy_lists(args_schema), _copy_lists(kwargs_schema))
        strategy = sharding_propagator().op_strategy_funcs[op](schema)
    if isinstance(strategy, TupleStrategy):
        raise NotImplementedError(f"{op} returns a per-output tuple strategy")
    pairs = []
    for spec in strategy.strategies:
        outs = spec.output_specs
        out_pl = (
            (outs.placements,)
            if isinstance(outs, DTensorSpec)
            else tuple(o.placements if o is not None else None for o in outs)
        )
        ins = spec.input_specs
        in_pl = tuple(i.placements for i in ins) if ins is not None else None
        pairs.append((out_pl, in_pl))
    return pairs


def _copy_lists(tree):
    if isinstance(tree, list):
        return [_copy_lists(x) for x in tree]
    if isinstance(tree, tuple):
        return tuple(_copy_lists(x) for x in tree)
    if isinstance(tree, dict):
        return {k: _copy_lists(v) for k, v in tree.items()}
    return tree


def propagate_output_placements(
    op: torch._ops.OpOverload, args_schema: tuple, kwargs_schema: dict
) -> tuple[Placements | None, ...]:
    """What DTensor's own propagation gives for given input specs (used to validate plans)."""
    # DTensor rewrites shape arguments to local sizes; never let it touch the caller's (graph's) lists
    schema = OpSchema(op, _copy_lists(args_schema), _copy_lists(kwargs_schema))
    # uncached: the cached entry point returned another view's output spec for an equal-looking schema
    out = sharding_propagator().propagate_op_sharding_non_cached(schema)
    # view ops report needs_redistribute only to pass local shapes; compare placements instead
    if out.needs_redistribute and out.redistribute_schema is not None:
        wanted = [s.placements for s in out.redistribute_schema.args_spec]
        given = [s.placements for s in schema.args_spec]
        if wanted != given:
            raise ValueError(f"DTensor would redistribute the inputs of {op}: {given} -> {wanted}")
    specs = out.output_spec
    if isinstance(specs, DTensorSpec):
        return (specs.placements,)
    return tuple(s.placements if s is not None else None for s in specs)


_SPLITTING = (Shard, _StridedShard)
_UNSPLIT = frozenset({Replicate, Partial})


def shard_dim(placement: Placement) -> int | None:
    """The tensor dim a placement splits, counting DTensor's private ``_StridedShard`` too; ``None`` if unsplit."""
    if type(placement) in _UNSPLIT:  # a failing isinstance on placements costs ~0.5 us: millions of calls
        return None
    return placement.dim if isinstance(placement, _SPLITTING) else None


def redistribute(value: DTensor, placements: Placements, coordinate: torch.Tensor | None = None) -> DTensor:
    """Move a DTensor to ``placements`` step by step, as priced: Partial targets allowed (the public
    API forbids them), and no merging of steps across mesh dims (a later pass fuses explicitly).

    With ``coordinate`` (this rank's mesh coordinate as an int64 tensor) the steps that pick a
    rank's chunk index it with that tensor instead of a Python int, so a graph traced on one rank
    runs on every rank (and on all of ``LocalTensorMode``'s simulated ranks at once).
    """
    mesh = value.device_mesh
    src = value._spec
    if any(type(p) is ExpertRows for p in src.placements):  # a Partial to DTensor, relabelled for free
        relabelled = tuple(
            Partial() if type(p) is ExpertRows and p != q else p for p, q in zip(src.placements, placements)
        )
        src = make_spec(mesh, relabelled, src.tensor_meta)
    dst = make_spec(mesh, placements, src.tensor_meta)
    shape, mesh_shape = tuple(value.shape), tuple(mesh.shape)
    with disable_redistribute_transform_optimization():
        if is_uneven(shape, src.placements, mesh_shape) or is_uneven(shape, dst.placements, mesh_shape):
            if coordinate is None:
                raise ValueError("a move from or to an uneven split is lowered with the rank's mesh coordinate")
            local = _redistribute_uneven(value._local_tensor, src, dst, coordinate)
        elif coordinate is None:
            local = redistribute_local_tensor(value._local_tensor, src, dst)
        else:
            local = _redistribute_rank_generic(value._local_tensor, src, dst, coordinate)
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=value.shape, stride=value.stride())


def _redistribute_rank_generic(
    local: torch.Tensor, src: DTensorSpec, dst: DTensorSpec, coordinate: torch.Tensor
) -> torch.Tensor:
    """DTensor's own steps, except where it bakes the rank in or re-lays chunks one by one.

    Replicate -> Shard takes the rank's chunk by its coordinate tensor. Gathers and reduce-scatters
    on a non-leading tensor dim run on dim 0 with one re-layout copy (DTensor splits into one chunk
    per rank and concatenates them: ``n`` small kernels, and a quadratic fusion search when compiled).
    On CPU groups Shard -> Shard is a real all-to-all (DTensor's CPU fallback all-gathers). A step
    on a mesh dim of one rank runs nothing, as it is priced (DTensor's own steps skip those too).
    """
    mesh, meta = src.mesh, src.tensor_meta
    current = list(src.placements)
    for info in _gen_transform_infos(src, dst):
        i = info.mesh_dim
        before, after = info.src_dst_placements
        target = [*current]
        target[i] = after
        n = mesh.size(i)
        if n == 1:  # one rank holds the whole tensor, whatever the placement says: nothing runs
            current = target
            continue
        index = coordinate[i : i + 1]
        if type(after) is Shard and before.is_replicate():
            local = _take_chunk(local, after.dim, n, index)
        elif type(after) is Shard and type(before) is Shard and before.dim != after.dim and mesh.device_type == "cpu":
            local = _all_to_all(local, before.dim, after.dim, n, (mesh, i))
        elif type(before) is Shard and before.dim and after.is_replicate() and info.logical_shape[before.dim] % n == 0:
            local = _gather_on(local, before.dim, n, (mesh, i))
        elif type(before) is Partial and type(after) is Shard and after.dim and local.shape[after.dim] % n == 0:
            local = _reduce_scatter_on(local, after.dim, n, before.reduce_op, (mesh, i))
        else:
            local = redistribute_local_tensor(local, make_spec(mesh, current, meta), make_spec(mesh, target, meta))
        current = target
    return local


def _redistribute_uneven(
    local: torch.Tensor, src: DTensorSpec, dst: DTensorSpec, coordinate: torch.Tensor
) -> torch.Tensor:
    """A move from or to an uneven split on padded shards (``autoplan.shard.uneven``), as
    ``CostModel._uneven_plan`` prices it: the graph is the same on every rank, so every rank's piece
    of an uneven split is padded at its end to the largest piece's rows.

    From an uneven split: each such dim is all-gathered innermost mesh dim first (the padded
    pieces then lie in rank order), its rows picked out of the padded blocks, and DTensor's even
    move does the rest. To one: DTensor's even move to the target with those mesh dims left
    partial or replicated, then each dim padded to every rank's piece and reduce-scattered (or
    chunked by the rank's coordinate) over its mesh dims, outermost first."""
    mesh, meta = src.mesh, src.tensor_meta
    shape, mesh_shape = tuple(meta.shape), tuple(mesh.shape)
    srcp, dstp = tuple(src.placements), tuple(dst.placements)
    src_uneven, dst_uneven = uneven_dims(shape, srcp, mesh_shape), uneven_dims(shape, dstp, mesh_shape)
    if src_uneven and dst_uneven:
        raise ValueError(f"no move between two uneven splits {srcp} -> {dstp} of shape {shape}")
    if src_uneven:
        gathered = {i for dims in src_uneven.values() for i in dims}
        for d, mesh_dims in sorted(src_uneven.items()):
            for i in reversed(mesh_dims):
                local = _gather_padded(local, d, mesh_shape[i], (mesh, i))
            local = _unpad(local, d, shape[d], [mesh_shape[i] for i in mesh_dims])
        mid = tuple(Replicate() if i in gathered else p for i, p in enumerate(srcp))
        return _redistribute_rank_generic(local, make_spec(mesh, mid, meta), dst, coordinate)
    on = {i for dims in dst_uneven.values() for i in dims}
    mid = tuple(
        dstp[i] if i not in on else srcp[i] if isinstance(srcp[i], (Partial, Replicate)) else Replicate()
        for i in range(len(dstp))
    )
    local = _redistribute_rank_generic(local, src, make_spec(mesh, mid, meta), coordinate)
    for d, mesh_dims in sorted(dst_uneven.items()):
        local = _pad(local, d, shape[d], [mesh_shape[i] for i in mesh_dims])
        for i in mesh_dims:
            n = mesh_shape[i]
            if isinstance(mid[i], Partial):
                local = _reduce_scatter_padded(local, d, n, mid[i].reduce_op, (mesh, i))
            else:
                local = _take_chunk(local, d, n, coordinate[i : i + 1])
    return local


def _gather_padded(t: torch.Tensor, dim: int, n: int, group) -> torch.Tensor:
    """All-gather equal (padded) pieces along ``dim``, in rank order."""
    if dim == 0:
        return _waited(_all_gather(t.contiguous(), 0, group))
    return _gather_on(t, dim, n, group)


def _reduce_scatter_padded(t: torch.Tensor, dim: int, n: int, op: str, group) -> torch.Tensor:
    """Reduce-scatter a dim laid out as ``n`` equal (padded) pieces."""
    if dim == 0:
        return _waited(_reduce_scatter(t.contiguous(), op, 0, group))
    return _reduce_scatter_on(t, dim, n, op, group)


def _unpad(t: torch.Tensor, dim: int, size: int, ways: Sequence[int]) -> torch.Tensor:
    """The ``size`` rows of a gathered padded dim, in order: a view when the padding is a tail."""
    runs = gather_runs(size, ways)
    if len(runs) == 1 and runs[0][0] == 0:
        return t.narrow(dim, 0, size)
    return torch.cat([t.narrow(dim, at, rows) for at, _, rows in runs], dim)


def _pad(t: torch.Tensor, dim: int, size: int, ways: Sequence[int]) -> torch.Tensor:
    """A whole dim of ``size`` rows laid out as every rank's piece padded to the largest (zeros)."""
    parts = []
    for offset, rows in pad_segments(size, ways):
        if offset is None:
            parts.append(t.new_zeros((*t.shape[:dim], rows, *t.shape[dim + 1 :])))
        else:
            parts.append(t.narrow(dim, offset, rows))
    return torch.cat(parts, dim)


def _waited(t: torch.Tensor) -> torch.Tensor:
    return t.wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t


def chunks_to_front(t: torch.Tensor, dim: int, n: int) -> torch.Tensor:
    """``t``'s ``n`` even chunks along ``dim`` stacked on a new leading dim (a view), the layout a
    collective that only works on dim 0 sends."""
    if t.shape[dim] % n:
        raise ValueError(f"dim {dim} of shape {tuple(t.shape)} does not split evenly {n} ways")
    return t.unflatten(dim, (n, t.shape[dim] // n)).movedim(dim, 0)


def chunks_from_front(t: torch.Tensor, dim: int) -> torch.Tensor:
    """The inverse of ``chunks_to_front``: the leading dim's blocks laid side by side along ``dim``
    (a copy unless the blocks already are contiguous there)."""
    return t.movedim(0, dim).flatten(dim, dim + 1)


def _gather_on(t: torch.Tensor, dim: int, n: int, group) -> torch.Tensor:
    """All-gather even shards along ``dim``: gathered on dim 0 (the only dim NCCL gathers on), the
    rank blocks then moved next to ``dim`` by one copy."""
    gathered = _waited(_all_gather(t.contiguous(), 0, group))
    return chunks_from_front(gathered.unflatten(0, (n, t.shape[0])), dim)


def _reduce_scatter_on(t: torch.Tensor, dim: int, n: int, op: str, group) -> torch.Tensor:
    """Reduce-scatter along ``dim`` (evenly split): the ``n`` chunks moved to the front by one copy,
    then reduce-scattered on dim 0."""
    chunks = chunks_to_front(t, dim, n).flatten(0, 1)
    return _waited(_reduce_scatter(chunks.contiguous(), op, 0, group))


def _all_to_all(t: torch.Tensor, gather_dim: int, shard_dim: int, n: int, group) -> torch.Tensor:
    """Shard(gather_dim) -> Shard(shard_dim) over ``n`` ranks the way DTensor's GPU kernel does it:
    the new shard dim's chunks to the front, one exchange, the received chunks back onto the
    gathered dim (each move a copy only when it is not a view). Built from functional collectives,
    which every process group runs; DTensor's CPU path all-gathers the whole tensor instead."""
    send = chunks_to_front(t, shard_dim, n).contiguous()
    return chunks_from_front(_waited(funcol.all_to_all_single(send, None, None, group)), gather_dim)


def _take_chunk(t: torch.Tensor, dim: int, n: int, index: torch.Tensor) -> torch.Tensor:
    """Chunk ``index`` (a one-element tensor) of ``n`` even chunks along ``dim``, as a new tensor."""
    if t.shape[dim] % n:
        raise ValueError(f"dim {dim} of shape {tuple(t.shape)} does not split evenly {n} ways")
    return t.unflatten(dim, (n, t.shape[dim] // n)).index_select(dim, index).flatten(dim, dim + 1)


def local_shape(shape: Sequence[int], mesh: DeviceMesh, placements: Placements) -> tuple[int, ...]:
    """This rank's shard shape of a tensor of global ``shape`` placed as ``placements``."""
    return tuple(compute_local_shape_and_global_offset(shape, mesh, placements)[0])


_FLAT_GROUPS: weakref.WeakKeyDictionary[DeviceMesh, str] = weakref.WeakKeyDictionary()


def flattened_group_name(mesh: DeviceMesh) -> str:
    """Process group over all of ``mesh``'s ranks in row-major order (created on first use per
    mesh, on every rank).

    A plain group, not a flattened ``DeviceMesh`` (``mesh._flatten()``): once that exists, DTensor
    (torch 2.13) merges the per-mesh-dim gathers of a nested shard into one gather over it, which
    misplaces the rows of an uneven one (``full_tensor()`` of a parameter split 10 rows over 2x4
    returns rows 5-7 as zeros), since its flat chunks are not the nested ones."""
    name = _FLAT_GROUPS.get(mesh)
    if name is None:
        name = _FLAT_GROUPS[mesh] = dist.new_group(ranks=mesh.mesh.flatten().tolist()).group_name
    return name
