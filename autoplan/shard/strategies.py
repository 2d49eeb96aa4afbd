"""Per-node sharding strategies on an N-D mesh.

A strategy fixes the placements of a node's outputs and the placements it expects for each tensor
input. Sources, in order: autoplan's own rules (attention kernels, grouped matmuls, see ``_OWN_RULES``),
DTensor's single-mesh-dim rules expanded to N-D as a product over mesh dims, DTensor's full N-D
rules, and finally a replicate-only fallback that warns (or raises in strict mode).
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
import warnings
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from autoplan.adapters import dtensor as dt
from autoplan.adapters.ops import OpOverload, schema
from autoplan.adapters.pytree import tree_map
from autoplan.errors import UnsupportedOpError
from autoplan.progress import progress
from autoplan.shard import expert_rows
from autoplan.shard.constraints import placement_error
from autoplan.shard.expert_rows import ExpertRows
from autoplan.trace import attention, grouped_mm, regions
from autoplan.trace.tracing import PATH_KEY, RUNTIME_CHECKS

Placements = dt.Placements
aten = torch.ops.aten


@dataclass(frozen=True)
class Strategy:
    """Placements of a node's outputs (``None`` for non-tensor outputs) and of its tensor inputs."""

    outputs: tuple[Placements | None, ...]
    inputs: tuple[Placements, ...]

    @property
    def output(self) -> Placements:
        return self.outputs[0]


@dataclass(frozen=True)
class NodeStrategies:
    strategies: tuple[Strategy, ...]
    source: str  # "autoplan" | "dtensor-1d" | "dtensor" | "placeholder" | "fallback"


def tensor_inputs(node: fx.Node) -> list[fx.Node]:
    """A node's fx-node arguments in flattened (args, kwargs) order; duplicates kept (``x + x``)."""
    found: list[fx.Node] = []
    fx.node.map_arg((node.args, node.kwargs), found.append)  # C++ walk: this runs ~10^6 times at 70B
    return found


def value_of(node: fx.Node) -> tuple[fx.Node, int]:
    """The (producer, output index) a node's value comes from: getitems read a multi-output producer."""
    if node.op == "call_function" and node.target is operator.getitem:
        return node.args[0], node.args[1]
    return node, 0


def output_vals(node: fx.Node) -> tuple:
    val = node.meta.get("val")
    return tuple(val) if isinstance(val, (tuple, list)) else (val,)


# not marked a view (autograd does not track it as one), but it aliases its input all the same
_ALIASING = frozenset({torch.ops.aten._unsafe_view.default})


def aliases_input(node: fx.Node) -> bool:
    """Whether an op's output shares its input's storage: views, tuple elements, ``_unsafe_view``.
    No kernel runs and no bytes are allocated."""
    if node.op != "call_function":
        return False
    op = node.target
    return op is operator.getitem or op in _ALIASING or getattr(op, "is_view", False)


def is_valid(placements: Placements | None, val, mesh_shape: Sequence[int], uneven: bool = False) -> bool:
    """Reject shards the mesh cannot split evenly (unless ``uneven``: a parameter's storage, see
    ``autoplan.shard.uneven``), partial integer tensors and exotic placement types: the rules
    ``constraints.placement_error`` words for users. Ops compute on even shards only."""
    if placements is None:
        return True
    if not isinstance(val, torch.Tensor):
        return all(isinstance(p, Replicate) for p in placements)
    return placement_error(placements, val, mesh_shape, whole=False, uneven=uneven) is None


def all_placements(val, mesh_shape: Sequence[int], partial: bool = False, uneven: bool = False) -> list[Placements]:
    """Every valid Replicate/Shard (and optionally Partial) assignment over the mesh dims."""
    ndim = val.ndim if isinstance(val, torch.Tensor) else 0
    base = [Replicate(), *[Shard(d) for d in range(ndim)]] + ([Partial()] if partial else [])
    return [p for p in itertools.product(base, repeat=len(mesh_shape)) if is_valid(p, val, mesh_shape, uneven)]


def _product_rows(rows: Sequence[tuple], n_out: int, mesh_ndim: int) -> list[Strategy]:
    """Combine single-mesh-dim rows into N-D strategies: one row per mesh dim."""
    out = []
    for combo in itertools.product(rows, repeat=mesh_ndim):
        cols = list(zip(*combo))
        outs = tuple(None if any(p is None for p in c) else tuple(c) for c in cols[:n_out])
        ins = tuple(tuple(c) for c in cols[n_out:])
        out.append(Strategy(outs, ins))
    return out


def _follow(val: torch.Tensor, dim: int, size: int, broadcast: Placement) -> Placement:
    """A tensor broadcast against the 4-D attention scores (a bias, its gradient) on split dim ``dim``:
    sharded alike where it has that dim, else ``broadcast`` (Replicate for the bias, Partial for its
    gradient, which sums over the broadcast rows)."""
    d = dim - (4 - val.ndim)
    return Shard(d) if d >= 0 and val.shape[d] == size != 1 else broadcast


def _sdpa_row(
    spec: attention.SdpaOp, dim: int | None, query: torch.Tensor, outs: Sequence, ins: Sequence, roles: Sequence[str]
) -> tuple:
    """One single-mesh-dim row (out..., in...): split ``dim`` (0 batch, 1 heads, 2 query sequence) or
    replicate everything (``None``). Keys and values keep their sequence whole (only queries split),
    so their gradients are partial sums over the local query block. Small tensors with neither a
    batch nor a head dim (RNG seeds and offsets, rng_state) stay replicated."""
    rep = Replicate()

    def place(role: str, val, is_output: bool) -> Placement | None:
        if not isinstance(val, torch.Tensor):
            return None if is_output else rep
        if dim is None:
            return rep
        if role in ("query", "out", "grad_out", "lse", "grad_query"):
            return Shard(dim)
        if role in ("key", "value", "grad_key", "grad_value"):
            return Shard(dim) if dim < 2 else (Partial() if is_output else rep)
        if role in ("bias", "grad_bias"):
            return _follow(val, dim, query.shape[dim], Partial() if is_output else rep)
        return rep

    return (
        *(place(r, v, True) for r, v in zip(spec.output_roles, outs)),
        *(place(r, v, False) for r, v in zip(roles, ins)),
    )


def _sdpa_rows(node: fx.Node) -> list[tuple]:
    """Batch-, head- and (where valid) query-sequence-parallel attention, for every SDPA kernel.

    Heads: grouped-query keys/values with fewer heads split their head dim too; contiguous head
    blocks keep each query head with its key/value head whenever both head counts divide (the
    shape check in ``_filter`` drops the rest). Query sequence: not with a causal mask (a local
    query block would be masked as if it started at row 0) nor with a logsumexp whose sequence dim
    is padded (efficient attention rounds it up to 32).
    """
    spec = attention.spec_of(node.target)
    roles = [r for r, a in attention.argument_roles(spec, node.args, node.kwargs) if isinstance(a, fx.Node)]
    ins = [a.meta.get("val") for a in tensor_inputs(node)]
    outs = output_vals(node)
    query = spec.arg(node.args, node.kwargs, "query").meta["val"]
    lse = outs[spec.output("lse")] if spec.output("lse") is not None else ins[roles.index("lse")]
    dims: list[int | None] = [None, 0, 1]
    if not attention.is_causal(spec, node.args, node.kwargs) and lse.shape[2] == query.shape[2]:
        dims.append(2)
    return [_sdpa_row(spec, d, query, outs, ins, roles) for d in dims]


def _grouped_mm_rows(node: fx.Node) -> list[tuple] | None:
    """A grouped matmul (``trace.grouped_mm``) split inside each expert, as DTensor splits it, or
    over the experts, which DTensor never does where offsets group the tokens.

    Split over the experts (the expert-parallel row), every rank holds the routed tokens (sorted by
    expert) and the offsets, and multiplies only the rows of its own experts
    (``grouped_mm.expert_block``): in the forward (2-D x 3-D) its result is its experts' rows,
    zero elsewhere (``ExpertRows``: a partial sum whose reduction combines the experts' outputs);
    the weight gradient (2-D x 2-D) is the expert-split gradient itself. Either reads its tokens
    whole or as expert rows (the output of a previous expert-parallel matmul, e.g. SwiGLU's
    hidden units), so expert parallelism moves tokens in once and back once where FSDP moves
    expert weights, and the costs choose. Offsets and the grouped dim stay whole. ``None``
    (DTensor's rule) for a call with a bias or another output dtype.
    """
    extra = {**dict(zip(("offs", "bias", "out_dtype"), node.args[2:])), **node.kwargs}
    if extra.get("bias") is not None or extra.get("out_dtype") not in (None, node.meta["val"].dtype):
        return None
    a, b = (x.meta["val"] for x in node.args[:2])
    R, P, E0, E1 = Replicate(), Partial(), ExpertRows(0), ExpertRows(1)
    if a.dim() == 3 and b.dim() == 3:  # one matmul per expert: [E, M, K] x [E, K, N]
        return [
            (Shard(0), Shard(0), Shard(0)),
            (Shard(1), Shard(1), R),
            (Shard(2), R, Shard(2)),
            (P, Shard(2), Shard(1)),
        ]
    if a.dim() == 2 and b.dim() == 3:  # routed rows [T, K] x experts [E, K, N]
        return [(E0, R, Shard(0), R), (E0, E0, Shard(0), R), (Shard(1), R, Shard(2), R), (P, Shard(1), Shard(1), R)]
    if a.dim() == 2 and b.dim() == 2:  # weight gradient [K, T] x [T, N] -> [E, K, N]
        experts = [(Shard(0), x, y, R) for x in (R, E1) for y in (R, E0)]
        return [*experts, (Shard(1), Shard(0), R, R), (Shard(2), R, Shard(1), R)]
    return None


def _elementwise_rows(node: fx.Node) -> list[tuple] | None:
    """An elementwise op that is not linear (``floor_divide`` of routing's token indices, the
    functional ``copy``): each output dim split alike in every tensor input that spans it, an input
    broadcast along it (or of fewer dims) whole. No ``Partial``: a sum's parts do not divide apart."""
    out = node.meta["val"]
    if not isinstance(out, torch.Tensor):
        return None
    inputs = [a.meta["val"] for a in tensor_inputs(node)]
    rows = []
    for d in range(out.dim()):
        row = [Shard(d)]
        for x in inputs:
            own = d - (out.dim() - x.dim())
            row.append(Shard(own) if own >= 0 and x.shape[own] == out.shape[d] else Replicate())
        rows.append(tuple(row))
    return rows


def _index_add_rows(node: fx.Node) -> list[tuple]:
    """``index_add(self, dim, index, source)``, a MoE's combine (each routed row added into its
    token's row): linear in ``self`` and ``source``, so their partial sums (an expert-parallel
    matmul's rows) add into a partial sum, reduced once on the tokens rather than on the routed
    rows (top-k times as many); or split alike on any other dim, the index whole."""
    ndim = node.meta["val"].dim()
    dim = node.args[1] % ndim
    if [a.meta["val"].dim() for a in tensor_inputs(node)] != [ndim, 1, ndim]:
        return []
    R = Replicate()
    rows = [(Partial(), Partial(), R, Partial())]
    rows += [(Shard(d), Shard(d), R, Shard(d)) for d in range(ndim) if d != dim]
    return rows


def _factory_rows(node: fx.Node) -> list[tuple]:
    """A tensor made from nothing (``arange``, ``zeros``, a lifted constant): every rank makes it whole."""
    return []


def _empty_rows(node: fx.Node) -> list[tuple]:
    """``empty``: memory its readers fill (stochastic depth's ``empty(...).bernoulli_(p)``), so any rank
    can make just its shard of it, split on any dim (``local_ops`` passes the shard's shape)."""
    return [(Shard(d),) for d in range(node.meta["val"].dim())]


def _random_rows(node: fx.Node) -> list[tuple]:
    """A random op (``bernoulli``: stochastic depth's mask) draws the whole tensor on every rank, from
    the generator state one device draws it from, and keeps its own shard of it (``local_ops``),
    split on any dim: its readers split the batch with no move between. Drawn split, each rank
    would draw the first values of the stream for its own shard, and the step would no longer be
    one device's. (Priced as the shard it keeps: a mask is a few bytes per sample.)"""
    return [(Shard(d), Replicate()) for d in range(node.meta["val"].dim())]


def op_arg(op: OpOverload, args: Sequence, kwargs: dict, name: str):
    """Argument ``name`` of a call of ``op``: positional, keyword, or the schema's default."""
    for i, a in enumerate(schema(op).arguments):
        if a.name == name:
            return args[i] if i < len(args) and not a.kwarg_only else kwargs.get(name, a.default_value)
    raise KeyError(f"{op} has no argument {name!r}")


def _node_arg(node: fx.Node, name: str):
    return op_arg(node.target, node.args, node.kwargs, name)


def _dense_rows_outermost(t: torch.Tensor) -> bool:
    """Whether ``t`` fills its storage span without gaps or overlaps, dim 0 outermost: each index of
    dim 0 owns one block of ``numel / size(0)`` elements, the blocks in order (any dim order inside)."""
    if t.dim() == 0 or t.numel() == 0:
        return False
    dims = sorted((d for d in range(t.dim()) if t.shape[d] != 1), key=t.stride)
    expected = 1
    for d in dims:
        if t.stride(d) != expected:
            return False
        expected *= t.shape[d]
    return t.shape[0] == 1 or dims[-1] == 0


def as_strided_offset(node: fx.Node) -> int | None:
    """Where an ``as_strided`` view (or ``as_strided_scatter``'s) starts, counted from its base's first
    element: ``as_strided`` counts its offset in the base's storage, ``as_strided_scatter`` in the
    fresh copy of its base it writes into. ``None`` for a view the batch split cannot take: one
    whose dim 0 does not step over the base's rows block by block (each view row of ``stride[0]``
    elements, ``size[0] * stride[0]`` of them all, the base dense with its rows outermost) or that
    reaches outside its own block (``autoplan.lower.local_ops`` relies on this for local shapes)."""
    base = node.args[0].meta["val"]
    size, stride = _node_arg(node, "size"), _node_arg(node, "stride")
    offset = _node_arg(node, "storage_offset")
    if node.target is aten.as_strided.default:
        rel = 0 if offset is None else offset - base.storage_offset()
    else:
        rel = offset or 0
    if not size or not _dense_rows_outermost(base) or min(size) <= 0 or min(stride) < 0:
        return None
    reach = rel + sum((n - 1) * s for n, s in zip(size[1:], stride[1:]))
    if size[0] * stride[0] != base.numel() or rel < 0 or reach >= stride[0]:
        return None
    return rel


def _as_strided_rows(node: fx.Node) -> list[tuple]:
    """``as_strided`` (and ``as_strided_scatter``, which writes ``src`` through such a view of a copy
    of ``self``), as a view that takes some elements: a partial sum's parts view apart; and where
    the view keeps its base's rows (``as_strided_offset``; a view's gradient scatters into a flat
    buffer of its base, whose dim 0 then is every element) split on dim 0 alike, each rank viewing
    its own rows."""
    P, S0 = Partial(), Shard(0)
    n = len(tensor_inputs(node)) + 1
    rows = [(P,) * n]
    if as_strided_offset(node) is not None:
        rows.append((S0,) * n)
    return rows


def bag_length(node: fx.Node) -> int | None:
    """The length of every bag of an embedding bag op whose bags lie end to end, all of one length
    (``F.embedding_bag`` on a 2-D input makes its offsets ``arange(0, n, L)`` over the ``n``
    indices): then an even split of the indices splits the bags, each rank holding whole ones.
    ``None`` for offsets the caller gives, whose bags a split of the indices could cut through."""
    offsets, indices = _node_arg(node, "offsets"), _node_arg(node, "indices")
    while isinstance(offsets, fx.Node) and offsets.target is aten.alias.default:
        offsets = offsets.args[0]
    if not isinstance(offsets, fx.Node) or offsets.target not in (aten.arange.start, aten.arange.start_step):
        return None
    if node.target is aten._embedding_bag.default and _node_arg(node, "include_last_offset"):
        return None
    start, end, step = (*offsets.args, 1)[:3]
    n = indices.meta["val"].numel()
    ok = start == 0 and end == n > 0 and isinstance(step, int) and step > 0 and n % step == 0
    return step if ok else None


def _embedding_bag_rows(node: fx.Node) -> list[tuple] | None:
    """``_embedding_bag`` (``nn.EmbeddingBag``) and its backward ops, split over the bags where they
    lie end to end (``bag_length``): the indices, offsets, per-sample weights and every per-bag and
    per-index value alike, the table whole, its gradient a partial sum over the bags. Or, in sum
    and mean mode without a padding index, over the table's rows: each rank looks up its own rows,
    reading the others as a zero row (``local_ops``), so the bags are partial sums (a mean's over
    the whole bag's count) and the table's gradient comes out split. ``None`` (no rule) for sparse
    gradients."""
    op = node.target
    forward = op is aten._embedding_bag.default
    weights_grad = op is aten._embedding_bag_per_sample_weights_backward.default
    if not weights_grad and _node_arg(node, "sparse"):
        return None
    R, P, S0 = Replicate(), Partial(), Shard(0)
    names = [a.name for a in schema(op).arguments if isinstance(_node_arg(node, a.name), fx.Node)]
    vals = [a.meta["val"] for a in tensor_inputs(node)]
    by_bag = bag_length(node) is not None
    if op is aten._embedding_bag_backward.default and _node_arg(node, "scale_grad_by_freq"):
        by_bag = False  # frequencies count the indices of every bag
    by_row = _node_arg(node, "mode") != 2 and _node_arg(node, "padding_idx") in (None, -1)

    def per_index(v: torch.Tensor) -> Placement:  # sum mode's offset2bag is empty: it stays whole
        return S0 if v.numel() else R

    split = tuple(R if n == "weight" else per_index(v) for n, v in zip(names, vals))
    rows = []
    if by_bag:
        outs = tuple(per_index(v) for v in output_vals(node)) if forward else (S0,) if weights_grad else (P,)
        rows.append((*outs, *split))
    if by_row:
        rows.append(
            ((P, R, R, R) if forward else (P,) if weights_grad else (S0,))
            + tuple(S0 if n == "weight" else R for n in names)
        )
    return rows


def _check_rows(node: fx.Node) -> list[tuple]:
    """A runtime check a decomposition leaves (``_assert_async``, e.g. one_hot's range check on the
    class ids): it reads the whole value, so every rank checks it replicated."""
    return []


# Ops DTensor has no (usable) rule for, keyed by op, giving single-mesh-dim rows (out..., in...),
# or None where DTensor's rule serves. DTensor's GPU attention rules cannot take the RNG and
# integer values their backward reads; its grouped matmul rules never split the experts; it has
# no rule for some elementwise ops routing uses (and its combine, ``index_add``), for MobileNet's
# activations' gradients, ``fill`` with a tensor value, ``as_strided`` views, ``nn.EmbeddingBag``,
# random draws, nor for tensors made from nothing. ``autoplan.lower.local_ops.LOCAL_CALLS`` runs
# those whose arguments name global shapes or rows on the local shards (``empty``, ``bernoulli``,
# ``as_strided``, the embedding bag ops).
_OWN_RULES: dict[OpOverload, Callable[[fx.Node], list[tuple] | None]] = {
    **dict.fromkeys(attention.SDPA_OPS, _sdpa_rows),
    **dict.fromkeys(grouped_mm.GROUPED_MM, _grouped_mm_rows),
    aten.index_add.default: _index_add_rows,
    **dict.fromkeys((aten.floor_divide.default, aten.remainder.Tensor, aten.copy.default), _elementwise_rows),
    aten.hardswish.default: _elementwise_rows,
    aten.hardswish_backward.default: _elementwise_rows,
    aten.hardsigmoid_backward.default: _elementwise_rows,
    aten.fill.Tensor: _elementwise_rows,  # its value a 0-d tensor, whole on every rank
    aten.as_strided.default: _as_strided_rows,
    aten.as_strided_scatter.default: _as_strided_rows,
    aten._embedding_bag.default: _embedding_bag_rows,
    aten._embedding_bag_backward.default: _embedding_bag_rows,
    aten._embedding_bag_per_sample_weights_backward.default: _embedding_bag_rows,
    aten.bernoulli.p: _random_rows,
    **dict.fromkeys(
        (aten.arange.default, aten.arange.start, aten.arange.start_step, aten.zeros.default, aten.ones.default)
        + (aten.full.default, aten.scalar_tensor.default, aten.lift_fresh_copy.default),
        _factory_rows,
    ),
    aten.empty.memory_format: _empty_rows,
    **dict.fromkeys(RUNTIME_CHECKS, _check_rows),
}


# what a rule of ours reads beyond the op's signature: where the base of a view starts in its
# storage, whether the bags' offsets are an even ``arange`` (their producer, not their shape)
_KEY_FACTS: dict[OpOverload, Callable[[fx.Node], object]] = {
    **dict.fromkeys((aten.as_strided.default, aten.as_strided_scatter.default), as_strided_offset),
    **dict.fromkeys(
        (
            aten._embedding_bag.default,
            aten._embedding_bag_backward.default,
            aten._embedding_bag_per_sample_weights_backward.default,
        ),
        bag_length,
    ),
}


def op_signature(node: fx.Node) -> tuple:
    """What an op is besides its placements: its target, its arguments with each tensor as
    ``tensor_key``, its outputs alike (identical layers' copies of one op have one signature)."""

    def plain(a):
        if isinstance(a, fx.Node):
            return ("tensor", *dt.tensor_key(a.meta.get("val")))
        return tuple(plain(x) for x in a) if isinstance(a, (list, tuple)) else a

    return (
        node.target,
        plain(node.args),
        tuple(sorted((k, plain(v)) for k, v in node.kwargs.items())),
        tuple(dt.tensor_key(v) for v in output_vals(node)),
    )


def _op_key(node: fx.Node, choices: dict[fx.Node, list[Placements]]) -> tuple | None:
    """Everything ``StrategyBuilder._for_op`` reads of ``node``: its ``op_signature``, its tensor
    inputs' choices and which of them are the same node; ``None`` when some argument cannot be hashed."""
    inputs = tensor_inputs(node)
    key = (
        *op_signature(node),
        tuple(tuple(choices[a]) for a in inputs),
        tuple(inputs.index(a) for a in inputs),  # which inputs are one node: ``_full_rule`` asks differently
        _KEY_FACTS[node.target](node) if node.target in _KEY_FACTS else None,
    )
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _meta_args(node: fx.Node):
    to_meta = lambda a: dt.tensor_meta(a.meta["val"]) if isinstance(a, fx.Node) else a  # noqa: E731
    return tree_map(to_meta, node.args), tree_map(to_meta, node.kwargs)


def _full_rule(node: fx.Node, mesh: DeviceMesh, choices: dict[fx.Node, list[Placements]]) -> list[Strategy]:
    """DTensor's N-D rule over all input choices at once, plus one call per aligned choice.

    Rules that follow their inputs (stack, cat, views) answer a many-choice query with the single
    strategy they prefer, and some raise when *one* choice is unusable; asking again with every
    input at the same placement recovers the alternatives.
    """
    out: list[Strategy] = []
    error: Exception | None = None
    try:
        out += _full_rule_once(node, mesh, choices)
    except Exception as e:  # noqa: BLE001 - DTensor rules raise many kinds of errors for bad choices
        error = e
    nodes = list(dict.fromkeys(tensor_inputs(node)))
    if len(nodes) == 1 and error is None:
        return out
    aligned = [
        p for p in dict.fromkeys(itertools.chain(*(choices[a] for a in nodes))) if all(p in choices[a] for a in nodes)
    ]
    for p in aligned:
        try:
            out += _full_rule_once(node, mesh, {a: [p] for a in nodes})
        except Exception:  # noqa: BLE001
            continue
    if not out and error is not None:
        raise error
    return out


def _full_rule_once(node: fx.Node, mesh: DeviceMesh, choices: dict[fx.Node, list[Placements]]) -> list[Strategy]:
    def wrap(a):
        if isinstance(a, fx.Node):
            return dt.input_choices(mesh, choices[a], dt.tensor_meta(a.meta["val"]))
        if isinstance(a, (list, tuple)) and a and all(isinstance(x, fx.Node) for x in a):
            return dt.tuple_choices([wrap(x) for x in a])
        return a

    args = tuple(wrap(a) for a in node.args)
    kwargs = {k: wrap(v) for k, v in node.kwargs.items()}
    out = []
    for outs, ins in dt.full_rule_strategies(node.target, args, kwargs):
        n_in = len(tensor_inputs(node))
        out.append(Strategy(outs, ins if ins is not None else (outs[0],) * n_in))
    return out


def _producible(
    node: fx.Node, cands: list[Strategy], choices: dict[fx.Node, list[Placements]], mesh_shape: Sequence[int]
) -> list[Strategy]:
    """Keep strategies whose inputs are placements the producers offer, or fully replicated.

    Expanding single-dim rules is a full product (every Partial flavour, every shard pairing); the
    inputs no producer can offer would only ever be reached by a redistribution, which the
    replicated (gathered) variant already covers.
    """
    inputs = tensor_inputs(node)
    rep = (Replicate(),) * len(mesh_shape)
    offered = [set(choices[a]) | {rep} for a in inputs]
    # a value only ever held whole (a constant, a zero state built in ``forward``) is read as any
    # shard by a local slice: without this, an RNN's first step, fed a replicated zero state,
    # could split nothing, and so neither could any step after it
    whole = [choices[a] == [rep] for a in inputs]

    def ok(p: Placements, offers: set, held_whole: bool) -> bool:
        return p in offers or (held_whole and not any(isinstance(x, Partial) for x in p))

    return [s for s in cands if all(ok(p, o, w) for p, o, w in zip(s.inputs, offered, whole))]


def _replicate_only(node: fx.Node, mesh_ndim: int) -> list[Strategy]:
    rep = (Replicate(),) * mesh_ndim
    outs = tuple(rep if isinstance(v, torch.Tensor) else None for v in output_vals(node))
    return [Strategy(outs, (rep,) * len(tensor_inputs(node)))]


def _filter(node: fx.Node, cands: Iterable[Strategy], mesh_shape: Sequence[int]) -> tuple[Strategy, ...]:
    ins = [a.meta["val"] for a in tensor_inputs(node)]
    outs = output_vals(node)
    seen: dict[Strategy, None] = {}
    absent = [not isinstance(v, torch.Tensor) for v in outs]
    for s in cands:
        if len(s.inputs) != len(ins) or len(s.outputs) != len(outs):
            continue
        if any(absent):  # an output the call does not make (a masked-off gradient) has no placement
            s = Strategy(tuple(None if a else p for p, a in zip(s.outputs, absent)), s.inputs)
        if all(is_valid(p, v, mesh_shape) for p, v in zip(s.outputs, outs)) and all(
            is_valid(p, v, mesh_shape) for p, v in zip(s.inputs, ins)
        ):
            seen.setdefault(s)
    return tuple(seen)


def _region_strategy(node: fx.Node, mesh_ndim: int) -> Strategy:
    """A ``local_map`` region's op (``autoplan.trace.regions``): its body runs as written on each
    rank's local tensors, replicated; its boundaries take a value from, or give it, the placements
    the region declares."""
    local = (Replicate(),) * mesh_ndim
    if node.target is regions.ENTER:
        return Strategy((local,), (regions.placements_of(node.args[2]),))
    if node.target is regions.EXIT:
        return Strategy((regions.placements_of(node.args[2]),), (local,))
    return _replicate_only(node, mesh_ndim)[0]


@dataclass
class StrategyBuilder:
    """Enumerates strategies node by node; ``choices`` are the producers' candidate output placements."""

    mesh: DeviceMesh
    strict: bool = False

    def __post_init__(self):
        self.mesh_shape = tuple(self.mesh.shape)
        self._warned: set = set()
        self._done: dict[tuple, NodeStrategies] = {}  # by ``_op_key``: this builder's mesh is fixed

    def for_op(self, node: fx.Node, choices: dict[fx.Node, list[Placements]]) -> NodeStrategies:
        """``_for_op``, once per op, arguments and input choices: a layer's two norms, its gate and
        up projections and their backward ops ask alike (about a third of a LLaMA layer's ops).
        Each node gets its own tuple of the shared strategies: per-tuple
        caches (``CostModel.strategy_seconds``, ``problem.Shared.labels``) count on a tuple naming
        one layer's node."""
        if regions.in_region(node):
            return NodeStrategies((_region_strategy(node, len(self.mesh_shape)),), "local_map")
        key = _op_key(node, choices)
        if key is None:
            return self._for_op(node, choices)
        found = self._done.get(key)
        if found is None:
            found = self._done[key] = self._for_op(node, choices)
        return dataclasses.replace(found, strategies=tuple(list(found.strategies)))

    def for_placeholder(self, node: fx.Node, uneven: bool = False) -> NodeStrategies:
        """Every placement of a graph input; ``uneven``: uneven shards too (a parameter's storage)."""
        val = node.meta["val"]
        placements = all_placements(val, self.mesh_shape, uneven=uneven)
        return NodeStrategies(tuple(Strategy((p,), ()) for p in placements), "placeholder")

    def for_constant(self, node: fx.Node) -> NodeStrategies:
        """A tensor constant of the graph (a mask, a table built in ``forward``): every rank holds it."""
        return NodeStrategies((Strategy(((Replicate(),) * len(self.mesh_shape),), ()),), "constant")

    def _for_op(self, node: fx.Node, choices: dict[fx.Node, list[Placements]]) -> NodeStrategies:
        op = node.target
        n_in = len(tensor_inputs(node))
        n_out = len(output_vals(node))
        rep = (Replicate(),) * n_out + (Replicate(),) * n_in
        rows = _OWN_RULES[op](node) if op in _OWN_RULES else None
        if rows is not None:
            rows = [*rows, rep]
            return self._finish(node, _product_rows(rows, n_out, len(self.mesh_shape)), "autoplan")
        if isinstance(op, OpOverload):
            args_meta, kwargs_meta = _meta_args(node)
            rows = dt.single_dim_rules(op, args_meta, kwargs_meta)
            if rows is not None:
                rows = [r for r in rows if len(r) == n_out + n_in] + expert_rows.elementwise_rows(node) + [rep]
                cands = _product_rows(rows, n_out, len(self.mesh_shape))
                return self._finish(node, _producible(node, cands, choices, self.mesh_shape), "dtensor-1d")
            if dt.has_full_rule(op):
                # DTensor passes any Partial through as it is, expert rows too, where a transpose moves
                # their token dim: they are dropped, and made again where the op keeps them
                cands = [s for s in _full_rule(node, self.mesh, choices) if not expert_rows.within(s)]
                if op in expert_rows.VIEWS:
                    cands += expert_rows.promoted(node, cands)
                return self._finish(node, cands, "dtensor")
        return self._fallback(node)

    def _finish(self, node: fx.Node, cands: list[Strategy], source: str) -> NodeStrategies:
        strategies = _filter(node, cands, self.mesh_shape)
        if not strategies:
            return self._fallback(node)
        return NodeStrategies(strategies, source)

    def _fallback(self, node: fx.Node) -> NodeStrategies:
        path = node.meta.get(PATH_KEY) or "<top level>"
        msg = f"no sharding rule for {node.target} (node {node.name}, module {path})"
        if self.strict:
            raise UnsupportedOpError(msg + "; strict mode forbids running it replicated")
        if node.target not in self._warned:
            self._warned.add(node.target)
            warnings.warn(msg + "; it will run replicated", stacklevel=2)
        return NodeStrategies(tuple(_replicate_only(node, len(self.mesh_shape))), "fallback")


def enumerate_strategies(
    graph: fx.Graph,
    rep: dict[fx.Node, fx.Node],
    builder: StrategyBuilder,
    uneven: Collection[fx.Node] = frozenset(),
) -> dict[fx.Node, NodeStrategies]:
    """Strategies for every representative node, in graph order.

    An input's choices are the placements its producer can output. When the producer has not been
    enumerated yet (a tied layer reading a later copy's value), or is a ``local_map`` region's
    output, every placement is a choice.
    The placeholders in ``uneven`` (the parameters) may also be stored split unevenly; their
    readers still get them in even placements (``autoplan.shard.uneven``).
    """
    out: dict[fx.Node, NodeStrategies] = {}
    for n in progress(graph.nodes, "strategies", len(graph.nodes)):
        if rep[n] is not n:
            continue
        if n.op == "placeholder":
            out[n] = builder.for_placeholder(n, uneven=n in uneven)
        elif n.op == "get_attr":
            out[n] = builder.for_constant(n)
        elif n.op == "call_function" and n.target is not operator.getitem:
            choices = {}
            for a in tensor_inputs(n):
                u, k = value_of(a)
                if u.target is regions.EXIT:
                    # a region declares one placement for what it makes: its readers may want it
                    # moved (an all-to-all into another split, not only a gather)
                    choices[a] = all_placements(a.meta["val"], builder.mesh_shape)
                elif rep[u] in out:
                    made = dict.fromkeys(s.outputs[k] for s in out[rep[u]].strategies)
                    # expert rows are a Partial too, relabelled for free
                    choices[a] = list(made | dict.fromkeys(expert_rows.as_partial(p) for p in made if p is not None))
                else:
                    choices[a] = all_placements(a.meta["val"], builder.mesh_shape, partial=True)
            out[n] = builder.for_op(n, choices)
    return out
