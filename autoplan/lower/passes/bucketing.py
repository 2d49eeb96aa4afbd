"""Bucketing: the collectives a stretch issues together run as one collective on a flat buffer.

The lowering emits one collective per moved value, so an FSDP layer gathers each of its weights on
its own and reduce-scatters each gradient on its own: ~24 all-gathers and ~9 reduce-scatters per
LLaMA layer, each paying a launch and the link's latency. FSDP2 runs one all-gather per layer on a
flat buffer (its parameters' shards packed one after another) and one reduce-scatter of the
layer's gradients. This pass does the same for whatever the plan moves, on the partitioned forward
and backward graphs (so the backward's re-gathers bucket too).

Collectives join one bucket when they share a kind, a process group (and its size), a reduce op, a
dtype and a layer instance (outside layers, a stretch: ``prefetch.stretches``), and their
inputs are all ready before any of their results is read; moves of values made from parameters
alone and moves of values the step computes never share one. A member's input counts as ready
anywhere when it is made from parameters (placeholders) by cheap ops (views, casts, chunk picks:
``fsdp_recompute.CHEAP``) and collectives only; those move up with the bucket (a weight gathered on
one mesh dim and then on the other: its first bucket moves up with its second). The bucket is issued no
earlier than its first member was, and right after its last member's input is made: a layer's
weight gathers all go out where its first weight was gathered, its gradient reductions once its
last gradient is made. Its wait stays where its first member's wait was (at least after the issue),
so a wait moved down (``wait_sinking``) stays down. A bucket holds at most ``bucket_bytes`` of
full-size (gathered, or unreduced) values, so one bucket does not hold a whole model's memory.

The flat layouts, per member ``x`` of ``n`` elements per rank on a group of ``W`` ranks:

- all-gather: the members' shards are packed end to end, the gather returns ``[W, sum n]`` rank by
  rank, and each member's ``[W, n]`` column block is copied out to its own gathered tensor, all in
  one ``split_with_sizes_copy`` (as FSDP2's copy-out does: rank-major chunks of one member are not
  one view of the flat result);
- reduce-scatter: each member's ``[W * n]`` input is viewed ``[W, n]`` and the blocks are packed
  column by column, so rank ``r``'s row holds every member's ``r``-th chunk; the result is
  ``[sum n]`` and each member's output is a view of its slice;
- all-reduce: the members are packed end to end, each output a view of its slice.

Every element meets the same values in the same reduction as before: only the packing changes. How
a backend orders the sum of more than two ranks' values inside one large collective is its own.
"""

from __future__ import annotations

import operator
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.fx as fx

from autoplan.lower.collectives import C10D_KINDS, c10d, communicates, is_c10d
from autoplan.lower.passes.fsdp_recompute import CHEAP
from autoplan.lower.passes.prefetch import stretches

aten = torch.ops.aten

DEFAULT_BUCKET_BYTES = 512 * 2**20  # a LLaMA-3 8B layer's weights in bf16 fit one bucket
_KINDS = ("all_gather", "reduce_scatter", "all_reduce")


BUCKET_KEY = "autoplan_bucket"  # on a bucket's collective: how many collectives it runs as one


@dataclass(frozen=True)
class BucketStats:
    merged: int = 0  # collectives that now run inside a bucket of two or more
    buckets: int = 0  # the collectives that run instead of them
    saved: tuple[tuple[str, int], ...] = ()  # per kind: collectives fewer than before

    def __add__(self, other: BucketStats) -> BucketStats:
        saved = dict(self.saved)
        for k, v in other.saved:
            saved[k] = saved.get(k, 0) + v
        return BucketStats(self.merged + other.merged, self.buckets + other.buckets, tuple(sorted(saved.items())))


def members(n: fx.Node) -> int:
    """The collectives ``n`` runs as one: its bucket's size, else 1."""
    return n.meta.get(BUCKET_KEY, 1)


@dataclass
class _Member:
    node: fx.Node
    wait: fx.Node
    ready: int  # index of the latest node its input needs (-1: made from parameters by cheap ops)
    need: int  # index of the first node that reads its result
    nbytes: int  # full-size bytes: gathered output, or unreduced input


def _made_from_placeholders(graph: fx.Graph) -> set[fx.Node]:
    """Nodes made from placeholders and buffers by cheap ops and collectives alone (a weight's
    shard cast, gathered on one mesh dim, then viewed): movable anywhere earlier, as every rank
    moves them alike."""
    found: set[fx.Node] = set()
    for n in graph.nodes:
        if n.op in ("placeholder", "get_attr"):
            found.add(n)
        elif n.op == "call_function" and (n.target in CHEAP and not communicates(n) or is_c10d(n)):
            if all(a in found for a in n.all_input_nodes):
                found.add(n)
    return found


def _ancestors(n: fx.Node, within: set[fx.Node]) -> set[fx.Node]:
    """``n`` and the nodes of ``within`` it is made from."""
    seen, todo = set(), [n]
    while todo:
        m = todo.pop()
        if m in seen or m not in within:
            continue
        seen.add(m)
        todo.extend(m.all_input_nodes)
    return seen


def _key(n: fx.Node, region_key: str, stretch: dict[fx.Node, int]) -> tuple:
    """What members of one bucket share: kind, the collective's non-tensor arguments (reduce op,
    group size, group name), dtype, and layer instance (outside layers: the stretch, so the
    embedding's and the output's moves stay apart). The graph is one phase's (a re-gather copied
    into the backward keeps its forward tag)."""
    where = n.meta.get(region_key) or stretch.get(n)
    return (C10D_KINDS[n.target], n.args[1:], n.args[0].meta["val"].dtype, where)


def _full_bytes(n: fx.Node) -> int:
    val = n.meta["val"] if C10D_KINDS[n.target] == "all_gather" else n.args[0].meta["val"]
    return val.numel() * val.element_size()


def plan_buckets(graph: fx.Graph, region_key: str, bucket_bytes: int) -> tuple[list[list[_Member]], set[fx.Node]]:
    """The buckets of two or more members, each in graph order, and the cheap parameter-made nodes
    they may move up."""
    index = {n: i for i, n in enumerate(graph.nodes)}
    movable = _made_from_placeholders(graph)
    stretch = stretches(graph, region_key)
    groups: dict[tuple, list[_Member]] = defaultdict(list)
    for n in graph.nodes:
        if n.op != "call_function" or C10D_KINDS.get(n.target) not in _KINDS:
            continue
        waits = list(n.users)
        if len(waits) != 1 or waits[0].target is not c10d.wait_tensor.default or not waits[0].users:
            continue
        src = n.args[0]
        ready = -1 if src in movable else index[src]
        need = min(index[u] for u in waits[0].users)
        # parameters' moves and the step's own never share a bucket: a weight's gather would wait
        # for an activation's, and a gather of it on another mesh dim for both
        key = (*_key(n, region_key, stretch), ready < 0)
        groups[key].append(_Member(n, waits[0], ready, need, _full_bytes(n)))

    buckets: list[list[_Member]] = []
    for members in groups.values():
        open_: list[_Member] = []
        for m in members:
            if open_ and _fits(open_ + [m], index, bucket_bytes):
                open_.append(m)
                continue
            if len(open_) > 1:
                buckets.append(open_)
            open_ = [m]
        if len(open_) > 1:
            buckets.append(open_)
    buckets.sort(key=lambda b: index[b[0].node])
    return buckets, movable


def _fits(members: list[_Member], index: dict[fx.Node, int], bucket_bytes: int) -> bool:
    at = max(index[members[0].node], max(m.ready for m in members) + 1)
    return at <= min(m.need for m in members) and sum(m.nbytes for m in members) <= bucket_bytes


def bucket_collectives(graph: fx.Graph, region_key: str, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> BucketStats:
    """Replace each group of collectives issued together (see the module doc) by one collective on
    a flat buffer; rewrites ``graph`` in place."""
    buckets, movable = plan_buckets(graph, region_key, bucket_bytes)
    if not buckets:
        return BucketStats()
    nodes = list(graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    ups = [{a for m in b for a in _ancestors(m.node.args[0], movable) if a.op != "placeholder"} for b in buckets]
    position = {n: float(i) for n, i in index.items()}  # where each node is now
    moved: set[fx.Node] = set()  # nodes moved up by a bucket before them
    done = []
    order, needs = _dependencies_first(buckets, ups)
    for i in order:
        members = buckets[i]
        # issued where planned: before the first node there that has not moved up since
        at = max(index[members[0].node], max(m.ready for m in members) + 1)
        need = min(m.need for m in members)
        issue = next((n for n in nodes[at : need + 1] if n not in moved), None)
        if issue is None:
            continue
        first_wait = min(index[m.wait] for m in members)
        wait_at = issue if first_wait <= index[issue] else nodes[first_wait]
        if needs[i]:
            # it reads another bucket's result (a gather of a gather on another mesh dim): that
            # bucket's packing, collective and copies move up with it, as they now are, unless
            # that bucket waits for something the step computes (then the member stays out)
            movable = _made_from_placeholders(graph)
            position = {n: float(k) for k, n in enumerate(graph.nodes)}
            src = [m.node.args[0] for m in members]
            members = [m for m, x in zip(members, src) if x in movable or position[x] < position[issue]]
            if len(members) < 2:
                continue
            ups[i] = {a for m in members for a in _ancestors(m.node.args[0], movable) if a.op != "placeholder"}
        for n in sorted((a for a in ups[i] if position[a] > position[issue]), key=position.__getitem__):
            issue.prepend(n)
            position[n] = position[issue] - 0.5
            moved.add(n)
        _rewrite(graph, members, issue, wait_at)
        done.append(members)
    for m in (m for b in done for m in b):
        graph.erase_node(m.wait)
        graph.erase_node(m.node)
    saved: dict[str, int] = {}
    for b in done:
        kind = C10D_KINDS[b[0].node.target]
        saved[kind] = saved.get(kind, 0) + len(b) - 1
    return BucketStats(sum(len(b) for b in done), len(done), tuple(sorted(saved.items())))


def _dependencies_first(buckets: list[list[_Member]], ups: list[set[fx.Node]]) -> tuple[list[int], list[set[int]]]:
    """Bucket indices, each after the buckets whose members it is made from (in graph order
    otherwise; buckets on a cycle of such dependencies are left out: run unbucketed), and per
    bucket those it is made from."""
    owner = {m.node: i for i, b in enumerate(buckets) for m in b}
    needs = [{owner[a] for a in u if a in owner} - {i} for i, u in enumerate(ups)]
    order: list[int] = []
    placed: set[int] = set()
    progress = True
    while progress:
        progress = False
        for i in range(len(buckets)):
            if i not in placed and needs[i] <= placed:
                order.append(i)
                placed.add(i)
                progress = True
    return order, needs


def _fake(like: torch.Tensor, shape: list[int]) -> torch.Tensor:
    return like.new_empty(shape)


def _call(graph: fx.Graph, meta: dict, target, args: tuple, val: torch.Tensor, kwargs: dict | None = None) -> fx.Node:
    n = graph.call_function(target, args, kwargs or {})
    n.meta = {**meta, "val": val}
    return n


def _view(graph: fx.Graph, meta: dict, x: fx.Node, shape: list[int], like: torch.Tensor) -> fx.Node:
    """``x`` viewed as ``shape``; ``x`` itself where it has that shape already."""
    if list(x.meta["val"].shape) == shape:
        return x
    return _call(graph, meta, aten.view.default, (x, shape), _fake(like, shape))


def _rewrite(graph: fx.Graph, members: list[_Member], issue: fx.Node, wait_at: fx.Node) -> None:
    first = members[0].node
    kind = C10D_KINDS[first.target]
    meta = {k: v for k, v in first.meta.items() if k != "val"}
    like = first.args[0].meta["val"]
    sizes = [m.node.args[0].meta["val"].numel() for m in members]
    if kind == "all_gather":
        world = first.args[1]
    elif kind == "reduce_scatter":
        world = first.args[2]
        sizes = [s // world for s in sizes]
    total = sum(sizes)
    with graph.inserting_before(issue):
        if kind == "reduce_scatter":  # rank r's row: every member's r-th chunk
            blocks = [_view(graph, meta, m.node.args[0], [world, s], like) for m, s in zip(members, sizes)]
            packed = _call(graph, meta, aten.cat.default, (blocks, 1), _fake(like, [world, total]))
            flat = _view(graph, meta, packed, [world * total], like)
            out_val = _fake(like, [total])
        else:
            pieces = [_view(graph, meta, m.node.args[0], [s], like) for m, s in zip(members, sizes)]
            flat = _call(graph, meta, aten.cat.default, (pieces,), _fake(like, [total]))
            out_val = _fake(like, [world * total] if kind == "all_gather" else [total])
        issued = _call(graph, meta, first.target, (flat, *first.args[1:]), out_val)
        issued.meta[BUCKET_KEY] = len(members)
    with graph.inserting_before(wait_at):
        done = _call(graph, {**members[0].wait.meta}, c10d.wait_tensor.default, (issued,), out_val)
        if kind == "all_gather":  # each member's column block, copied out rank-major in one kernel
            rows = _view(graph, meta, done, [world, total], like)
            blocks = [_fake(like, [world, s]) for s in sizes]
            split = _call(graph, meta, aten.split_with_sizes_copy.default, (rows, sizes, 1), blocks)
            parts = [_call(graph, meta, operator.getitem, (split, j), b) for j, b in enumerate(blocks)]
        else:  # each member's slice, a view
            parts, offset = [], 0
            for s in sizes:
                parts.append(_call(graph, meta, aten.slice.Tensor, (done, 0, offset, offset + s), _fake(like, [s])))
                offset += s
        for m, part in zip(members, parts):
            m.wait.replace_all_uses_with(_view(graph, meta, part, list(m.wait.meta["val"].shape), like))
