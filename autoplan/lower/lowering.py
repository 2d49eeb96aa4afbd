"""Lower a planned joint graph to the per-rank graph every rank runs: local shapes, explicit collectives.

The traced joint graph is re-executed on DTensors whose placements follow the plan: before each op
every input is redistributed to the placement the plan expects, so DTensor computes exactly the
chosen strategy. Tracing that execution with ``make_fx`` on fake local tensors records local ATen
ops (shape arguments already localised by DTensor) and the plan's redistributions as functional
collectives (``_c10d_functional.*`` + ``wait_tensor``) on the mesh's process groups.

The graph is rank-generic: where a rank keeps its own chunk of a tensor, the chunk is indexed by the
graph's first input, the rank's mesh coordinate, so the same graph runs on every rank (and on all of
``LocalTensorMode``'s simulated ranks in one process).
"""

from __future__ import annotations

import operator
from collections import Counter
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.fx as fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.fx.experimental.proxy_tensor import make_fx

from autoplan.adapters.dtensor import redistribute
from autoplan.adapters.fake import FakeTensor
from autoplan.adapters.modules import buffer_slots
from autoplan.adapters.pytree import tree_flatten, tree_unflatten
from autoplan.cost.costs import largest_shard_shape as padded_shape
from autoplan.lower.collectives import collective_kind, is_c10d
from autoplan.lower.local_ops import in_layout_of, local_convolution, run_local
from autoplan.lower.passes.bucketing import DEFAULT_BUCKET_BYTES, BucketStats, bucket_collectives
from autoplan.lower.passes.contiguity import ContiguityStats, make_collective_inputs_contiguous
from autoplan.lower.passes.fsdp_recompute import RECOMPUTE_KEY, RecomputeStats, tag_parameter_gathers
from autoplan.lower.passes.gather_fusion import (
    FusionStats,
    fuse_all_reduce_chains,
    fuse_gather_chains,
    fuse_reduce_scatter_chains,
)
from autoplan.lower.passes.prefetch import PrefetchStats, prefetch_parameter_gathers
from autoplan.lower.passes.wait_sinking import WaitStats, sink_all_reduce_waits
from autoplan.lower.validate import GraphCheckError, LoweringError, check_lowered
from autoplan.plan import Plan, placements_str
from autoplan.progress import progress
from autoplan.shard import expert_rows
from autoplan.shard.strategies import Placements, aliases_input
from autoplan.trace.recompute import closure, just_in_time, layer_of
from autoplan.trace.tracing import PATH_KEY, PHASE_KEY, TracedGraph, forward_nodes

aten = torch.ops.aten


REGION_KEY = "autoplan_region"  # the repeated-layer instance a lowered node belongs to ("" outside any)
SOURCE_KEY = "autoplan_source"  # the traced node a lowered node computes (with its input moves)


@dataclass
class LoweredGraph:
    """Per-rank joint graph plus what the runtime needs to feed and read it."""

    joint: fx.GraphModule
    forward: fx.GraphModule
    backward: fx.GraphModule
    input_labels: list  # per placeholder: the mesh coordinate (``COORDINATE``), then the traced inputs
    output_labels: list
    input_placements: list[Placements | None]  # per placeholder
    output_placements: list[Placements | None]  # per graph output
    n_outputs: int  # model outputs (forward graph's first outputs)
    local_shapes: list[tuple[tuple[int, ...], tuple[int, ...]]]  # per placeholder: (local, global)
    n_segments: int = 0  # distinct node lowerings traced (the rest were copies)
    recompute: RecomputeStats = RecomputeStats(0, 0)
    activation_recompute: int = 0  # lowered forward nodes the plan's recompute choice runs again
    gather_fusion: FusionStats = FusionStats(0, 0)
    scatter_fusion: FusionStats = FusionStats(0, 0)
    reduce_fusion: FusionStats = FusionStats(0, 0)
    contiguity: ContiguityStats = ContiguityStats(0, 0)
    waits: WaitStats = WaitStats(0)
    prefetch: PrefetchStats = PrefetchStats(0, 0)
    buckets: BucketStats = BucketStats()
    # per phase: a typical layer's collectives before bucketing (``collectives_per_layer``)
    unbucketed_per_layer: dict[str, dict[str, int]] | None = None

    def collective_counts(self, graph: fx.GraphModule | None = None) -> dict[str, int]:
        return count_collectives(graph or self.joint)


def count_collectives(gm: fx.GraphModule) -> dict[str, int]:
    """Data-moving collectives per kind."""
    return dict(sorted(Counter(k for n in gm.graph.nodes if (k := collective_kind(n))).items()))


def collectives_per_layer(graph: fx.Graph | fx.GraphModule) -> dict[str, int]:
    """Data-moving collectives per kind in a typical repeated-layer instance of ``graph`` (the
    counts most instances run; a boundary layer planned on its own may differ): what bucketing a
    layer's collectives shrinks."""
    per: dict[str, Counter] = {}
    graph = graph.graph if isinstance(graph, fx.GraphModule) else graph
    for n in graph.nodes:
        if (kind := collective_kind(n)) and (layer := n.meta.get(REGION_KEY)):
            per.setdefault(layer, Counter())[kind] += 1
    typical = Counter(tuple(sorted(c.items())) for c in per.values()).most_common(1)
    return dict(typical[0][0]) if typical else {}


def output_targets(tg: TracedGraph, plan: Plan, fixed_outputs: dict[int, Placements]) -> list[Placements | None]:
    """Where each graph output must end up: constrained outputs, gradients in their parameter's placement."""
    params = tg.placeholder_for("param")
    inputs = tg.placeholder_for("input")
    sinks = {s.index: s for s in tg.output_sinks(fixed_outputs)}
    targets: list[Placements | None] = []
    for kind, target in tg.output_labels:
        if kind == "output":
            s = sinks.get(target)
            if s is None:
                targets.append(None)
            elif s.fixed is not None:
                targets.append(s.fixed)
            else:
                targets.append(plan.nodes[s.tangent.name].outputs[0])
        elif kind == "grad_param":
            targets.append(plan.nodes[params[target].name].outputs[0])
        elif kind == "grad_input":
            targets.append(plan.nodes[inputs[target].name].outputs[0])
        else:
            targets.append(None)
    return targets


def _to(value, placements: Placements | None, coordinate: torch.Tensor):
    if placements is None or not isinstance(value, DTensor):
        return value
    return value if value.placements == tuple(placements) else redistribute(value, placements, coordinate)


def _moved_for_view(value: DTensor, moved: DTensor, traced: torch.Tensor) -> DTensor:
    """A view's moved input in the dim order of the value it was traced on. A move's result is
    contiguous; a value the model had transposed (a transpose's result, moved before the view that
    reads it) must keep that order, since the views after it were traced on it (a transpose back,
    then a merge of dims)."""
    if moved is value or not isinstance(moved, DTensor) or not isinstance(traced, torch.Tensor):
        return moved
    if traced.is_contiguous():
        return moved
    local = in_layout_of(moved.to_local(), traced)
    return DTensor.from_local(
        local, moved.device_mesh, moved.placements, run_check=False, shape=moved.shape, stride=moved.stride()
    )


def _run_node(node: fx.Node, plan: Plan, mesh: DeviceMesh, env: dict, coordinate: torch.Tensor):
    chosen = plan.nodes[node.name]
    wanted = iter(chosen.inputs)
    flat, spec = tree_flatten((node.args, node.kwargs))
    view = aliases_input(node)

    def take(a: fx.Node):
        moved = _to(env[a], next(wanted), coordinate)
        return _moved_for_view(env[a], moved, a.meta.get("val")) if view else moved

    flat = [take(a) if isinstance(a, fx.Node) else a for a in flat]
    args, kwargs = tree_unflatten(flat, spec)
    if chosen.rule in LOCAL_RULES or expert_rows.within(chosen) or local_convolution(node, chosen):
        return run_local(node, args, kwargs, mesh, chosen, coordinate)
    result = node.target(*args, **kwargs)
    results = result if isinstance(result, (tuple, list)) else (result,)
    for i, (r, pl) in enumerate(zip(results, chosen.outputs)):
        if isinstance(r, DTensor) and pl is not None and r.placements != tuple(pl):
            raise LoweringError(
                f"{node.name} ({node.target}) output {i}: plan says {placements_str(pl)}, DTensor computed "
                f"{placements_str(r.placements)} from inputs {[placements_str(p) for p in chosen.inputs]}"
            )
        if not isinstance(r, DTensor) and isinstance(r, torch.Tensor) and pl is not None:
            if any(p != Replicate() for p in pl):
                raise LoweringError(f"{node.name} ({node.target}) made a plain tensor but the plan shards it")
    if not isinstance(result, torch.Tensor) or isinstance(result, DTensor):
        return result
    return DTensor.from_local(result, mesh, chosen.outputs[0], run_check=False)


@dataclass(frozen=True)
class Partitioned:
    """The per-rank forward and backward graphs, and what the passes that run on them did."""

    forward: fx.GraphModule
    backward: fx.GraphModule
    prefetch: PrefetchStats
    buckets: BucketStats
    unbucketed_per_layer: dict[str, dict[str, int]]


def partition(
    joint: fx.GraphModule,
    n_outputs: int,
    prefetch: frozenset[str] = frozenset(),
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> Partitioned:
    """Split the per-rank joint graph at the forward/backward boundary.

    The backward reads saved forward values, except chains tagged must-recompute (FSDP parameter
    gathers, and the ops of layers the plan recomputes), which it runs again from their saved
    inputs. Nothing else is recomputed, so every other collective runs exactly once. Each graph's
    collectives issued together then run in buckets of at most ``bucket_bytes`` (``passes.bucketing``,
    0: none), and the gathers of the parameters named in ``prefetch`` are issued a layer ahead in
    both graphs (``passes.prefetch``).

    Forward: primals -> (model outputs..., saved...). Backward: (saved..., tangents...) -> gradients.
    """
    nodes = list(joint.graph.nodes)
    outputs = list(nodes[-1].args[0])
    tangents = [n for n in nodes if n.op == "placeholder" and n.name.startswith("tangents")]
    constants = [n for n in nodes if n.op == "get_attr"]
    is_fwd = {n for n in nodes if n.meta.get("partitioner_tag") == "is_forward"}
    # a forward op's tuple is never saved whole: its element reads stay in the forward graph
    is_fwd |= {n for n in nodes if n.target is operator.getitem and n.args[0] in is_fwd}
    primals = {n for n in nodes if n.op == "placeholder"} - set(tangents)
    forward = [n for n in nodes if n in is_fwd or n in primals]
    backward = [n for n in nodes if n.op == "call_function" and n not in is_fwd]
    in_backward = set(backward)
    read = [a for n in backward for a in n.all_input_nodes] + [g for g in outputs[n_outputs:] if isinstance(g, fx.Node)]
    recompute = closure(forward, read, lambda n: bool(n.meta.get(RECOMPUTE_KEY)))
    rerun, in_forward = set(recompute), set(forward)
    readers = in_backward | rerun
    saved = [n for n in forward if n not in rerun and any(u in readers for u in n.users)]
    saved += [o for o in outputs[n_outputs:] if isinstance(o, fx.Node) and o in in_forward and o not in rerun]
    saved = list(dict.fromkeys(saved))

    fwd = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in constants + forward:
        env[n] = fwd.node_copy(n, lambda a: env[a])
    fwd.output([env[o] if isinstance(o, fx.Node) else o for o in outputs[:n_outputs]] + [env[n] for n in saved])

    bwd = fx.Graph()
    benv: dict[fx.Node, fx.Node] = {}
    for n in saved:
        benv[n] = bwd.placeholder(n.name)
        benv[n].meta = dict(n.meta)
    for n in tangents + constants + just_in_time(recompute, backward):
        benv[n] = bwd.node_copy(n, lambda a: benv[a])
    bwd.output([benv[o] if isinstance(o, fx.Node) else o for o in outputs[n_outputs:]])
    fwd.eliminate_dead_code()
    bwd.eliminate_dead_code()
    before = {"forward": collectives_per_layer(fwd), "backward": collectives_per_layer(bwd)}
    buckets = BucketStats()
    if bucket_bytes:
        buckets = bucket_collectives(fwd, REGION_KEY, bucket_bytes) + bucket_collectives(bwd, REGION_KEY, bucket_bytes)
    a, b = (prefetch_parameter_gathers(g, REGION_KEY, prefetch) for g in (fwd, bwd))
    moved = PrefetchStats(a.gathers + b.gathers, a.nodes + b.nodes)
    return Partitioned(fx.GraphModule(joint, fwd), fx.GraphModule(joint, bwd), moved, buckets, before)


def _local_fake(val: torch.Tensor, placements: Placements, mesh: DeviceMesh, fake_mode) -> torch.Tensor:
    """A rank's local value: its shard, padded to the largest where the split is uneven
    (``autoplan.shard.uneven``), so that every rank runs a graph of the same shapes."""
    shape = padded_shape(val.shape, placements, mesh.shape)
    with fake_mode:
        return torch.empty(shape, dtype=val.dtype, device=mesh.device_type)


def _mark_phases(graph: fx.Graph, n_outputs: int) -> None:
    """Tag nodes the way functorch's partitioner expects: forward = what the model outputs need."""
    forward = forward_nodes(graph, n_outputs)
    anchor = next(n for n in reversed(graph.nodes) if n.op == "placeholder")
    for n in list(graph.nodes):
        if n.op == "call_function":
            n.meta["partitioner_tag"] = "is_forward" if n in forward else "is_backward"
            n.meta[PHASE_KEY] = "forward" if n in forward else "backward"
            if n in forward:  # the partitioner splits by position: forward ops must all come first
                anchor.append(n)
                anchor = n


LOCAL_RULES = ("autoplan", "fallback", "local_map")
COORDINATE = ("coordinate", "mesh")  # input label of the rank's mesh coordinate


class _Stitcher:
    """Builds the per-rank joint graph from traced segments, one segment per distinct node signature.

    Identical layers produce identical segments (same op, shapes, placements), so each is traced
    through DTensor once and then copied: lowering cost grows with distinct nodes, not with depth.
    Every segment also reads the rank's mesh coordinate (a graph input), so chunk choices are
    indexed by it and the graph is the same on every rank.
    """

    def __init__(self, tg: TracedGraph, plan: Plan, mesh: DeviceMesh):
        self.tg, self.plan, self.mesh = tg, plan, mesh
        self.graph = fx.Graph()
        self.root = torch.nn.Module()
        self.templates: dict[tuple, fx.GraphModule] = {}
        self.n_traced = 0
        with tg.fake_mode:
            self.coordinate_fake = torch.zeros(mesh.ndim, dtype=torch.int64, device=mesh.device_type)
        self.coordinate = self.graph.placeholder("mesh_coordinate")
        self.coordinate.meta["val"] = self.coordinate_fake

    def placement(self, node: fx.Node) -> Placements:
        return self.plan.nodes[node.name].outputs[0]

    def local_fake(self, node: fx.Node) -> torch.Tensor:
        return _local_fake(node.meta["val"], self.placement(node), self.mesh, self.tg.fake_mode)

    def wrap(self, node: fx.Node, local: torch.Tensor) -> DTensor:
        val = node.meta["val"]
        return DTensor.from_local(
            local, self.mesh, self.placement(node), run_check=False, shape=val.shape, stride=val.stride()
        )

    def segment(self, key: tuple, fn, inputs: list[fx.Node]) -> fx.GraphModule:
        if key not in self.templates:
            fakes = [self.local_fake(a) for a in inputs]
            with self.tg.fake_mode:
                template = make_fx(fn, tracing_mode="real")(*fakes, self.coordinate_fake)
            # DTensor's propagation may run ops while tracing (torch 2.11 on a cold cache): drop what
            # the segment does not return, but keep collectives (every rank must run the same ones)
            template.graph.eliminate_dead_code(lambda n: n.is_impure() or is_c10d(n))
            self.templates[key] = template
            self.n_traced += 1
        return self.templates[key]

    def constant(self, node: fx.Node) -> fx.Node:
        """A tensor the model built in ``forward`` (``torch.tensor(...)``): replicated, so every rank
        gets the traced value as a buffer of the lowered graph."""
        value = getattr(self.tg.gm, node.target)
        if isinstance(value, FakeTensor):
            value = value.constant
        if not isinstance(value, torch.Tensor):
            raise LoweringError(f"constant {node.target} (module {node.meta.get(PATH_KEY, '')!r}) has no traced value")
        return self.buffer(value.to(self.mesh.device_type), {"val": node.meta.get("val")})

    def buffer(self, value: torch.Tensor, meta: dict) -> fx.Node:
        """``value`` as a new buffer of the lowered module, read by a ``get_attr`` node."""
        name = f"_const{buffer_slots(self.root) + len(self.root.__dict__)}"
        self.root.register_buffer(name, value)
        attr = self.graph.get_attr(name)
        attr.meta = meta
        return attr

    def inline(self, template: fx.GraphModule, args: list[fx.Node], region: str = "", source: str = "") -> list:
        """Copy a segment into the graph; every copied node is tagged with ``region`` (its layer
        instance), which regional compilation cuts the per-rank graphs by, and with ``source``, the
        traced node it lowers (recompute tags are chosen by traced node)."""
        env: dict[fx.Node, fx.Node] = {}
        it = iter([*args, self.coordinate])
        for n in template.graph.nodes:
            if n.op == "placeholder":
                env[n] = next(it)
            elif n.op == "get_attr":
                env[n] = self.buffer(getattr(template, n.target), {**n.meta, REGION_KEY: region})
            elif n.op == "output":
                flat, _ = tree_flatten(n.args[0])
                return [env[a] if isinstance(a, fx.Node) else a for a in flat]
            else:
                env[n] = self.graph.node_copy(n, lambda a: env[a])
                env[n].meta[REGION_KEY] = region
                env[n].meta[SOURCE_KEY] = source
        raise LoweringError("segment without output")

    def node_key(self, node: fx.Node, inputs: list[fx.Node]) -> tuple:
        chosen = self.plan.nodes[node.name]
        flat, spec = tree_flatten((node.args, node.kwargs))
        leaves = tuple(("T", inputs.index(a)) if isinstance(a, fx.Node) else ("C", repr(a)) for a in flat)
        metas = tuple(
            (tuple(a.meta["val"].shape), tuple(a.meta["val"].stride()), a.meta["val"].dtype, self.placement(a))
            for a in inputs
        )
        return ("op", node.target, str(spec), leaves, metas, chosen.inputs, chosen.outputs, chosen.rule)

    def lower_node(self, node: fx.Node, env: dict) -> list:
        inputs = list(dict.fromkeys(a for a in tree_flatten((node.args, node.kwargs))[0] if isinstance(a, fx.Node)))

        def seg(*locals_):
            *locals_, coordinate = locals_
            values = {a: self.wrap(a, t) for a, t in zip(inputs, locals_)}
            result = _run_node(node, self.plan, self.mesh, values, coordinate)
            flat, _ = tree_flatten(result)
            return [r.to_local() if isinstance(r, DTensor) else r for r in flat]

        template = self.segment(self.node_key(node, inputs), seg, inputs)
        return self.inline(template, [env[a] for a in inputs], layer_of(node), node.name)

    def lower_output(self, node: fx.Node, env: dict, target: Placements | None, region: str = ""):
        if target is None or self.placement(node) == tuple(target):
            return env[node]
        val = node.meta["val"]
        key = ("move", tuple(val.shape), tuple(val.stride()), val.dtype, self.placement(node), tuple(target))

        def seg(local, coordinate):
            return [redistribute(self.wrap(node, local), target, coordinate).to_local()]

        return self.inline(self.segment(key, seg, [node]), [env[node]], region)[0]

    def run(self, targets: list, local: list[torch.Tensor]) -> fx.Graph:
        """Lower every node in order. A gradient is moved into its parameter's placement (reduced,
        usually) right where it is produced, as FSDP does, so the unreduced copy dies there instead
        of living to the end of the backward."""
        env: dict[fx.Node, object] = {}
        locals_ = iter(local)
        nodes = self.tg.gm.graph.nodes
        outs, kinds = self.tg.output_node.args[0], [kind for kind, _ in self.tg.output_labels]
        early = {o: t for o, t, k in zip(outs, targets, kinds) if k.startswith("grad_") and isinstance(o, fx.Node)}
        moved: dict[fx.Node, object] = {}

        def final(o, target):
            if not isinstance(o, fx.Node):
                return o
            return moved[o] if o in moved and target == early[o] else self.lower_output(o, env, target)

        for node in progress(nodes, "lowering", len(nodes)):
            if node.op == "placeholder":
                ph = self.graph.placeholder(node.name)
                ph.meta["val"] = next(locals_)
                env[node] = ph
            elif node.op == "get_attr":
                env[node] = self.constant(node)
            elif node.op == "call_function" and node.target is operator.getitem:
                env[node] = env[node.args[0]][node.args[1]]
            elif node.op == "call_function":
                lowered = self.lower_node(node, env)
                env[node] = lowered if isinstance(node.meta["val"], (tuple, list)) else lowered[0]
            elif node.op == "output":
                self.graph.output([final(o, t) for o, t in zip(node.args[0], targets)])
            if node.op == "call_function" and node in early:
                moved[node] = self.lower_output(node, env, early[node], layer_of(node))
        return self.graph


_RENAMES = (aten.view.default, aten._unsafe_view.default, aten.alias.default, aten.detach.default)


def _drop_identity_views(graph: fx.Graph) -> int:
    """Remove views that keep the shape (left by wrapping and unwrapping DTensors at segment
    borders, and by the traced program's own no-op reshapes): a view to its input's own shape has
    its input's strides too, whatever they are at run time, so in a functional graph run without
    autograd (as the plan's function runs it) it is a pure rename, and so is a ``t`` of a ``t``.
    Each one dropped is an op call less per step (~470 per step of a 4-layer LLaMA). The recorded
    strides are not compared: a segment traced from fresh contiguous fakes may record a transposed
    input as contiguous."""
    dropped = 0
    for n in list(graph.nodes):
        if n.op != "call_function":
            continue
        if n.target is aten.t.default and getattr(n.args[0], "target", None) is aten.t.default:
            n.replace_all_uses_with(n.args[0].args[0])  # a transpose transposed back: the tensor itself
            graph.erase_node(n)
            dropped += 1
        elif n.target in _RENAMES:
            src = n.args[0]
            a, b = src.meta.get("val"), n.meta.get("val")
            if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape:
                n.replace_all_uses_with(src)
                graph.erase_node(n)
                dropped += 1
    return dropped


def _tag_recomputed(graph: fx.Graph, recomputed: frozenset[str]) -> int:
    """Tag the lowered forward nodes of the recomputed traced ops (their input moves included)."""
    hits = [
        n for n in graph.nodes if n.meta.get(SOURCE_KEY) in recomputed and n.meta.get("partitioner_tag") == "is_forward"
    ]
    for n in hits:
        n.meta[RECOMPUTE_KEY] = True
    return len(hits)


@dataclass(frozen=True)
class LoweringOptions:
    """How the per-rank program is built (``AutoParallel.apply_placement`` documents each)."""

    reshard_after_forward: bool = True  # backward re-gathers sharded parameters (FSDP)
    fuse_gathers: bool = True  # chained per-mesh-dim all-gathers (reduce-scatters, all-reduces) become one
    prefetch: bool = False  # parameter gathers issued a layer ahead of their use (see passes.prefetch)
    bucket_bytes: int = DEFAULT_BUCKET_BYTES  # collectives issued together run as one (passes.bucketing; 0: off)

    def check(self, mesh: DeviceMesh) -> None:
        """Refuse what the mesh's backend cannot run. Gloo (torch 2.13) corrupts its heap when
        several all-gathers are in flight while another collective is issued (measured: nine
        parameter-sized gathers then an all-reduce, an all-to-all or another gather, repeated,
        abort within 100 steps in most runs; all-reduces in flight beside others never did), and
        prefetching does exactly that."""
        if self.prefetch and dist.is_initialized() and dist.get_backend(mesh.get_group(0)) == "gloo":
            raise LoweringError(
                "prefetch=True keeps a layer's parameter all-gathers in flight while other collectives "
                "run, which gloo does not survive (heap corruption); prefetch on NCCL meshes, or apply "
                "the plan without it on gloo"
            )


def lower(
    tg: TracedGraph,
    plan: Plan,
    mesh: DeviceMesh,
    fixed_outputs: dict[int, Placements],
    options: LoweringOptions = LoweringOptions(),
    recomputed: frozenset[str] = frozenset(),
) -> LoweredGraph:
    """The per-rank forward and backward graphs of ``plan``; ``recomputed`` names the traced forward
    ops the backward runs again instead of reading saved (``autoplan.trace.recompute``)."""
    options.check(mesh)
    targets = output_targets(tg, plan, fixed_outputs)
    placeholders = tg.placeholders
    in_pl = [plan.nodes[p.name].outputs[0] for p in placeholders]
    local = [_local_fake(p.meta["val"], pl, mesh, tg.fake_mode) for p, pl in zip(placeholders, in_pl)]
    stitcher = _Stitcher(tg, plan, mesh)
    graph = stitcher.run(targets, local)
    _drop_identity_views(graph)
    n_outputs = sum(1 for lab in tg.output_labels if lab[0] == "output")
    _mark_phases(graph, n_outputs)
    fusion = fuse_gather_chains(graph, mesh) if options.fuse_gathers else FusionStats(0, 0)
    scatters = fuse_reduce_scatter_chains(graph, mesh) if options.fuse_gathers else FusionStats(0, 0)
    reduces = fuse_all_reduce_chains(graph, mesh) if options.fuse_gathers else FusionStats(0, 0)
    labels = [COORDINATE, *tg.input_labels]
    params = {n for n, (kind, _) in zip(graph.find_nodes(op="placeholder"), labels) if kind == "param"}
    recompute = tag_parameter_gathers(graph, params) if options.reshard_after_forward else RecomputeStats(0, 0)
    activations = _tag_recomputed(graph, recomputed)
    # last rewrite: the passes above match collective chains this would interrupt
    contiguity = make_collective_inputs_contiguous(graph)
    waits = sink_all_reduce_waits(graph, REGION_KEY)  # moves waits only: no chain above is cut
    try:
        check_lowered(graph, mesh, stitcher.root)
    except GraphCheckError as e:
        raise LoweringError(str(e)) from e
    gm = fx.GraphModule(stitcher.root, graph)  # generated once, after every rewrite (codegen is slow on 8B)
    ahead = frozenset(p.name for p in params) if options.prefetch else frozenset()
    parts = partition(gm, n_outputs, ahead, options.bucket_bytes)
    return LoweredGraph(
        joint=gm,
        forward=parts.forward,
        backward=parts.backward,
        input_labels=labels,
        output_labels=list(tg.output_labels),
        input_placements=[None, *in_pl],
        output_placements=targets,
        n_outputs=n_outputs,
        local_shapes=[((mesh.ndim,), (mesh.ndim,))]
        + [(tuple(t.shape), tuple(p.meta["val"].shape)) for t, p in zip(local, placeholders)],
        n_segments=stitcher.n_traced,
        recompute=recompute,
        activation_recompute=activations,
        gather_fusion=fusion,
        scatter_fusion=scatters,
        reduce_fusion=reduces,
        contiguity=contiguity,
        waits=waits,
        prefetch=parts.prefetch,
        buckets=parts.buckets,
        unbucketed_per_layer=parts.unbucketed_per_layer,
    )
