"""How the lowering runs an op on the rank's own shards, where DTensor has no rule to run it by.

Our own op rules, replicate-only fallbacks, a convolution split as DTensor's handler refuses, a
grouped matmul split over its experts, and GPU attention kernels on a CPU mesh (through their host
twin, with the kernel's outputs rebuilt around it): each unwraps its DTensor arguments, runs the op
on the local tensors and wraps the results in the placements the plan chose. Ops whose arguments
name global shapes or positions (``empty``'s size, an ``as_strided`` view's, an embedding bag's
offsets and table rows) get the local shard's (``LOCAL_CALLS``).
"""

from __future__ import annotations

import math

import torch
import torch.fx as fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from autoplan.adapters import dtensor as dt
from autoplan.adapters.ops import schema
from autoplan.adapters.pytree import tree_flatten, tree_map, tree_unflatten
from autoplan.cost.costs import largest_shard_shape as padded_shape
from autoplan.lower.validate import LoweringError
from autoplan.shard.strategies import as_strided_offset, bag_length, op_arg
from autoplan.trace import attention, grouped_mm, regions
from autoplan.trace.tracing import PATH_KEY

aten = torch.ops.aten


def _local_lengths(spec: attention.SdpaOp, args, kwargs) -> tuple[list, dict]:
    """A kernel call with the sequence lengths (``max_q``/``max_k``) of the local shards: the
    traced call baked in the global ones."""
    args, kwargs = list(args), dict(kwargs)
    q, k = spec.arg(args, kwargs, "query"), spec.arg(args, kwargs, "key")
    for role, length in (("max_q", q.shape[2]), ("max_k", k.shape[2])):
        i = spec.position(role)
        if i is not None and i < len(args):
            args[i] = length
        elif i is not None:
            kwargs[spec.arg_names[role]] = length
    return args, kwargs


def _kernel_lse(lse: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """The host's logsumexp (b, h, s) in a GPU kernel's layout: padded along the sequence
    (efficient: to a multiple of 32) or with a trailing unit dim (cuDNN)."""
    if lse.shape[2] != shape[2]:
        lse = torch.nn.functional.pad(lse, (0, shape[2] - lse.shape[2]))
    return lse.reshape(shape)


def _host_lse(lse: torch.Tensor, seq: int) -> torch.Tensor:
    """A GPU kernel's logsumexp back to the host's (b, h, s) layout."""
    return lse.reshape(*lse.shape[:3])[..., :seq].contiguous()


def in_layout_of(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``t`` copied into the dim order of ``like`` (the traced value it stands for: a GPU kernel's
    output, a transposed view's): the planned graph's later views were traced against that layout,
    while ``t`` has another (the host kernel's, a move's contiguous result)."""
    order = sorted(range(like.ndim), key=lambda d: -like.stride(d))
    inverse = sorted(range(like.ndim), key=order.__getitem__)
    return t.permute(order).clone(memory_format=torch.contiguous_format).permute(inverse)


def _bias_grad(values: dict, lse: torch.Tensor) -> torch.Tensor:
    """The gradient of an additive attention bias: the scores' gradient, from the probabilities
    the forward's logsumexp gives back (``dS = P * (dO V^T - rowsum(dO * O))``), summed to the
    bias's shape where it broadcasts. On dense copies (a clone, which the trace records where a
    no-op ``contiguous`` would not): the matmuls trace to views of their inputs, which must hold for
    whatever strides the shards have when the program runs."""
    q, k, v, grad_out = (
        values[r].float().clone(memory_format=torch.contiguous_format) for r in ("query", "key", "value", "grad_out")
    )
    scale = values.get("scale") or q.shape[-1] ** -0.5
    scores = q @ k.transpose(-2, -1) * scale + values["bias"].float()  # SDPA takes a bias or is_causal
    probs = torch.exp(scores - lse.float().unsqueeze(-1))
    delta = (grad_out * values["out"].float()).sum(-1, keepdim=True)
    grad = probs * (grad_out @ v.transpose(-2, -1) - delta)
    return grad.sum_to_size(values["bias"].shape).to(values["bias"].dtype)


def _pad_head(t: torch.Tensor, head: int) -> torch.Tensor:
    """``t`` with its last (head) dim zero-padded to ``head``. The CPU kernel takes one head size
    for query, key and value; GPU kernels take a narrower value (MLA's). Zero columns of the value
    give zero columns of the output and of the value's gradient, and add nothing to the others."""
    return t if t.shape[-1] == head else torch.nn.functional.pad(t, (0, head - t.shape[-1]))


def _run_host_twin(node: fx.Node, spec: attention.SdpaOp, values: dict, mesh: DeviceMesh, outputs: tuple) -> tuple:
    """A GPU attention kernel computed by its CPU twin on the local shards, in the GPU kernel's output
    layout. The values only a GPU makes (RNG state, seeds, debug masks) are zeros that nothing reads:
    without dropout the backward needs none of them."""
    where = f"{node.name} ({node.target}, module {node.meta.get(PATH_KEY) or '<top level>'})"
    if values.get("dropout_p"):
        raise LoweringError(f"{where}: attention dropout draws GPU random numbers; it cannot run on a CPU mesh")
    twin = attention.HOST_TWIN[spec.op]
    common = {r: values[r] for r in ("query", "key", "value", "is_causal", "scale")}
    common |= {"bias": values.get("bias"), "dropout_p": 0.0}
    head, v_head = values["query"].shape[-1], values["value"].shape[-1]
    common["value"] = _pad_head(values["value"], head)
    if spec.backward:
        lse = _host_lse(values["lse"], values["query"].shape[2])
        padded = {r: _pad_head(values[r], head) for r in ("grad_out", "out")}
        grads = list(twin.call({**common, **padded, "lse": lse}))
        grads[2] = grads[2][..., :v_head]
        mask = values.get("grad_input_mask")
        if mask is not None and mask[3]:  # the CPU kernel has no gradient for a bias
            grads.append(_bias_grad(values, lse))
        grads = [in_layout_of(g, like) for g, like in zip(grads, node.meta["val"])]
        return (*grads, *(None for _ in spec.output_roles[len(grads) :]))
    vals = node.meta["val"]
    out, lse = twin.call(common)
    out = in_layout_of(out[..., :v_head], vals[spec.output("out")])
    made = {"out": out, "max_q": values["query"].shape[2], "max_k": values["key"].shape[2]}
    result = []
    for i, role in enumerate(spec.output_roles):
        val = vals[i]
        shape = padded_shape(val.shape, outputs[i], mesh.shape) if isinstance(val, torch.Tensor) else None
        if role == "lse":
            result.append(_kernel_lse(lse, shape))
        elif role in made:
            result.append(made[role])
        elif isinstance(val, torch.Tensor):
            result.append(torch.zeros(shape, dtype=val.dtype, device=out.device))
        else:
            result.append(val)
    return tuple(result)


def _run_experts(node: fx.Node, args, kwargs, mesh: DeviceMesh, dims: list[int], coordinate: torch.Tensor):
    """A grouped matmul split over its experts on mesh ``dims``: this rank's expert block
    (``grouped_mm.expert_block``), the block numbered across ``dims`` in mesh order."""
    a, b, offs = (*args, *kwargs.values())[:3]
    block = coordinate[dims[0]]
    for d in dims[1:]:
        block = block * mesh.shape[d] + coordinate[d]
    n_local = offs.shape[0] // math.prod(mesh.shape[d] for d in dims)
    return grouped_mm.expert_block(node.target, a, b, offs, block, n_local)


def _local_empty(node: fx.Node, args, kwargs, mesh: DeviceMesh, chosen, coordinate: torch.Tensor):
    """``empty`` of the rank's shard of the traced shape."""
    shape = padded_shape(node.meta["val"].shape, chosen.outputs[0], mesh.shape)
    return node.target(list(shape), *args[1:], **kwargs)


def _local_as_strided(node: fx.Node, args, kwargs, mesh: DeviceMesh, chosen, coordinate: torch.Tensor):
    """An ``as_strided`` view (or ``as_strided_scatter``) of the rank's rows: its base in the traced
    layout (a move's result is contiguous), the view's rows as many as the shard's, its offset from
    the local base's first element. Its strides hold locally: within a row of the base nothing
    changes, and the rows of a view that keeps them step by the traced stride
    (``strategies.as_strided_offset``). Any other view runs as traced, on a whole base."""
    op, rel = node.target, as_strided_offset(node)
    if rel is None:
        return op(*args, **kwargs)
    traced = node.args[0].meta["val"]
    base = op_arg(op, args, kwargs, "self")
    if tuple(base.stride()) != tuple(traced.stride()):
        base = in_layout_of(base, traced)
    size, stride = list(op_arg(op, args, kwargs, "size")), op_arg(op, args, kwargs, "stride")
    if op is aten.as_strided_scatter.default:
        src = op_arg(op, args, kwargs, "src")
        return op(base, src, [src.shape[0], *size[1:]], stride, rel)
    size[0] = padded_shape(node.meta["val"].shape, chosen.outputs[0], mesh.shape)[0]
    return op(base, size, stride, base.storage_offset() + rel)


def _local_random(node: fx.Node, args, kwargs, mesh: DeviceMesh, chosen, coordinate: torch.Tensor):
    """A random op drawn whole, as one device draws it, and the rank's shard of it kept (each split
    mesh dim in mesh order, the rank's chunk picked by its coordinate)."""
    drawn = node.target(*args, **kwargs)
    for i, p in enumerate(chosen.outputs[0]):
        d, n = dt.shard_dim(p), mesh.shape[i]
        if d is not None and n > 1:
            chunks = drawn.unflatten(d, (n, drawn.shape[d] // n))
            drawn = chunks.index_select(d, coordinate[i : i + 1]).flatten(d, d + 1)
    return drawn


def _block(mesh: DeviceMesh, placements, coordinate: torch.Tensor) -> tuple[torch.Tensor | None, int]:
    """This rank's block of a tensor split on dim 0 (numbered over the splitting mesh dims in mesh
    order, as DTensor nests them) and how many blocks there are; ``None`` where dim 0 is whole."""
    dims = [i for i, p in enumerate(placements) if dt.shard_dim(p) == 0]
    if not dims:
        return None, 1
    block = coordinate[dims[0]]
    for d in dims[1:]:
        block = block * mesh.shape[d] + coordinate[d]
    return block, math.prod(mesh.shape[d] for d in dims)


def _local_embedding_bag(node: fx.Node, args, kwargs, mesh: DeviceMesh, chosen, coordinate: torch.Tensor):
    """An embedding bag op on the rank's bags and table rows (``strategies._embedding_bag_rows``).

    Split over the bags, the local offsets start at the local indices (the first one subtracted),
    and the bag of each index (``offset2bag``) is numbered as on one device wherever it travels:
    the forward adds the rank's first bag, the backward takes it off. Split over the table's rows,
    the indices of other ranks' rows read an extra zero row past the local ones: the forward looks
    them up in the table with that row added, the backward makes its gradient and drops it."""
    op = node.target
    args, kwargs = list(args), dict(kwargs)
    positions = {a.name: i for i, a in enumerate(schema(op).arguments)}
    names = [a.name for a in schema(op).arguments if isinstance(op_arg(op, node.args, node.kwargs, a.name), fx.Node)]
    placed = dict(zip(names, chosen.inputs))

    def get(name: str):
        return op_arg(op, args, kwargs, name)

    def put(name: str, value) -> None:
        if positions[name] < len(args):
            args[positions[name]] = value
        else:
            kwargs[name] = value

    first_bag = None
    if any(dt.shard_dim(p) == 0 for p in placed["indices"]):
        offsets = get("offsets")
        start = offsets[0]
        put("offsets", offsets - start)
        first_bag = start // bag_length(node)
        if "offset2bag" in placed and get("offset2bag").numel():
            put("offset2bag", get("offset2bag") - first_bag)
    backward = op is aten._embedding_bag_backward.default
    block, ways = _block(mesh, chosen.outputs[0] if backward else placed["weight"], coordinate)
    if block is not None:
        n_rows = get("num_weights") // ways if backward else get("weight").shape[0]
        indices = get("indices")
        local = indices - block * n_rows
        put("indices", torch.where((local >= 0) & (local < n_rows), local, n_rows).to(indices.dtype))
        if backward:
            put("num_weights", n_rows + 1)
        else:
            weight = get("weight")
            put("weight", torch.cat([weight, weight.new_zeros(1, *weight.shape[1:])]))
    result = op(*args, **kwargs)
    if block is not None and backward:
        result = result.narrow(0, 0, n_rows)
    if first_bag is not None and op is aten._embedding_bag.default and result[1].numel():
        result = (result[0], result[1] + first_bag, *result[2:])
    return result


# ops of our rules that run with arguments of their own for the local shards
LOCAL_CALLS = {
    aten.empty.memory_format: _local_empty,
    aten.bernoulli.p: _local_random,
    aten.as_strided.default: _local_as_strided,
    aten.as_strided_scatter.default: _local_as_strided,
    aten._embedding_bag.default: _local_embedding_bag,
    aten._embedding_bag_backward.default: _local_embedding_bag,
    aten._embedding_bag_per_sample_weights_backward.default: _local_embedding_bag,
}


def run_local(node: fx.Node, args, kwargs, mesh: DeviceMesh, chosen, coordinate: torch.Tensor):
    """Ops DTensor has no rule for (ours, or replicate-only fallbacks): run on the local shards.

    GPU attention kernels run as themselves on a GPU mesh and through their CPU twin on a CPU mesh;
    a grouped matmul split over its experts runs the rank's block of experts.
    """
    outputs = chosen.outputs
    unwrap = lambda v: v.to_local() if isinstance(v, DTensor) else v  # noqa: E731
    args, kwargs = tree_map(unwrap, args), tree_map(unwrap, kwargs)
    spec = attention.spec_of(node.target)
    experts = grouped_mm.expert_mesh_dims(node, chosen.inputs, outputs)
    if node.target in (regions.ENTER, regions.EXIT):  # a region's boundary: the shard as it is
        result = args[0]
    elif experts:
        result = _run_experts(node, args, kwargs, mesh, experts, coordinate)
    elif node.target in LOCAL_CALLS:
        result = LOCAL_CALLS[node.target](node, args, kwargs, mesh, chosen, coordinate)
    elif spec is None or spec.backend == "cpu":
        result = node.target(*args, **kwargs)
    elif mesh.device_type == "cpu":
        values = {role: spec.arg(args, kwargs, role) for role in spec.arg_names}
        result = _run_host_twin(node, spec, values, mesh, outputs)
    else:
        args, kwargs = _local_lengths(spec, args, kwargs)
        result = node.target(*args, **kwargs)
    flat, spec = tree_flatten(result)
    vals = node.meta["val"] if isinstance(node.meta["val"], (tuple, list)) else (node.meta["val"],)
    wrapped = [
        DTensor.from_local(r, mesh, pl, run_check=False, shape=v.shape, stride=v.stride())
        if isinstance(r, torch.Tensor) and pl is not None
        else r
        for r, pl, v in zip(flat, outputs, vals)
    ]
    return tree_unflatten(wrapped, spec)


def local_convolution(node: fx.Node, chosen) -> bool:
    """A convolution DTensor's own handler cannot run (it refuses a tensor dim split over several
    mesh dims: the batch over both dims of a 2-D mesh) that needs no halo exchange (no spatial dim
    is split): each rank convolves its own shards, as the strategy's per-mesh-dim rules say."""
    if dt.runs_nested_splits(node.target):
        return False
    placements = [p for p in (*chosen.inputs, *chosen.outputs) if p is not None]
    dims = [[d for d in map(dt.shard_dim, p) if d is not None] for p in placements]
    nested = any(len(d) != len(set(d)) for d in dims)
    return nested and all(d < 2 for ds in dims for d in ds)
