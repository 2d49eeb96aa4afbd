"""Lowering on a fake 2x4 mesh: the per-rank graphs carry exactly the plan's collectives."""

import dataclasses

import pytest
import torch
from conftest import expected_on_cpu, fake_mesh
from parallel_run import rerun_collectives
from torch.distributed.tensor import Replicate, Shard

from autoplan import AutoParallel
from autoplan.bench.models.llama3 import LLAMA3_CONFIGS, Transformer
from autoplan.lower.lowering import count_collectives
from autoplan.lower.passes.reinplace import reinplace_all_reduces

R, S0 = Replicate(), Shard(0)
c10d = torch.ops._c10d_functional
aten = torch.ops.aten


@pytest.fixture(scope="module")
def lowered_llama():
    mesh = fake_mesh((2, 4), ("dp", "tp"))
    cfg = LLAMA3_CONFIGS["debug"]
    with torch.device("meta"):
        model = Transformer(cfg)
    with AutoParallel(model, mesh, input_fn=lambda: torch.randint(0, cfg.vocab_size, (8, 16))) as ap:
        ap.add_input_constraints([(S0, R)])
        ap.add_output_constraints([(S0, R)])
        ap.add_memory_constraint(param_fraction=1 / 8)
        plan = ap.optimize_placement()
        pmod = ap.apply_placement(plan)
    return plan, ap.lowered, pmod, ap


def test_lowered_collectives_are_exactly_the_planned_ones(lowered_llama):
    _, lowered, _, ap = lowered_llama
    plan = ap.applied_plan  # what was lowered: the plan after round-trip removal
    first = dataclasses.replace(plan, redistributions=[r for r in plan.redistributions if not r.again])
    planned = expected_on_cpu(first.collective_counts())
    planned["all_gather"] -= lowered.gather_fusion.fused  # each fused chain: two gathers became one
    planned["reduce_scatter"] -= lowered.scatter_fusion.fused
    if lowered.reduce_fusion.fused:
        planned["all_reduce"] -= lowered.reduce_fusion.fused
    assert lowered.collective_counts() == planned
    fwd, bwd = count_collectives(lowered.forward), count_collectives(lowered.backward)
    # partitioning drops nothing and re-runs only the parameter gathers tagged for recompute: one
    # (fused) gather for each regather the plan priced
    reruns = rerun_collectives(lowered.backward)
    regathers = [r for r in plan.redistributions if r.again and r.collectives]
    assert regathers and all({k for k, _ in r.collectives} == {"all_gather"} for r in regathers)
    assert reruns == {"all_gather": len(regathers)}
    joint, bucketed = lowered.collective_counts(), dict(lowered.buckets.saved)
    expected = {k: v + reruns.get(k, 0) - bucketed.get(k, 0) for k, v in joint.items()}
    assert {k: fwd.get(k, 0) + bwd.get(k, 0) for k in joint} == expected
    # every gradient arrives in its parameter's (sharded) placement through reduce-scatters: the
    # plan has no all-reduce of a gradient, so the graph has no extra one either
    grad_moves = [r for r in plan.redistributions if r.consumer.startswith("grad:")]
    assert grad_moves and all("all_reduce" not in [k for k, _ in r.collectives] for r in grad_moves)
    assert lowered.collective_counts().get("all_reduce", 0) == plan.collective_counts().get("all_reduce", 0)


def test_graphs_have_local_shapes(lowered_llama):
    plan, lowered, _, _ = lowered_llama
    params = {n.name: n for n in lowered.joint.graph.nodes if n.op == "placeholder"}
    wq = next(p for p in params.values() if tuple(p.meta["val"].shape) != (64, 64) and p.meta["val"].ndim == 2)
    assert wq.meta["val"].numel() < 64 * 64  # a sharded parameter arrives as its shard
    for (local, glob), pl in zip(lowered.local_shapes, lowered.input_placements):
        if pl is not None and any(isinstance(p, Shard) for p in pl):
            assert torch.Size(local).numel() < torch.Size(glob).numel()


def test_lowered_graphs_call_no_op_that_only_renames(lowered_llama):
    # each op the per-rank program calls costs a dispatch: a view to its input's own shape, a detach
    # and a transpose transposed back change nothing and are not called
    _, lowered, _, _ = lowered_llama
    renames = (aten.view.default, aten._unsafe_view.default, aten.alias.default, aten.detach.default)
    for gm in (lowered.forward, lowered.backward):
        calls = [n for n in gm.graph.nodes if n.op == "call_function"]
        assert not [n.name for n in calls if n.target in renames and n.meta["val"].shape == n.args[0].meta["val"].shape]
        assert not [n.name for n in calls if n.target is aten.t.default and n.args[0].target is aten.t.default]
        assert any(n.target is aten.t.default for n in calls)


def test_parallel_module_keeps_fqns_and_dtensor_params(lowered_llama):
    plan, _, pmod, _ = lowered_llama
    from torch.distributed.tensor import DTensor

    names = dict(pmod.named_parameters())
    assert set(names) == set(plan.param_placements)
    for fqn, p in names.items():
        assert isinstance(p, DTensor) and tuple(p.placements) == plan.param_placements[fqn]
    assert all(isinstance(v, DTensor) for v in pmod.state_dict().values())


def test_wrong_input_shape_names_the_input_and_shapes(lowered_llama):
    _, _, pmod, _ = lowered_llama
    with pytest.raises(
        ValueError, match=r"input 0 has shape \(8, 16\).*local shard of shape \(4, 16\).*global.*plan again.*drop_last"
    ):
        pmod(torch.zeros(8, 16, dtype=torch.long))


def _unsharded_parameter(node, params) -> bool:
    """Is ``node`` a gathered parameter: a parameter through gathers, waits and layout ops only?"""
    layout = (
        *("view", "_unsafe_view", "t", "transpose", "permute", "split", "getitem", "cat"),
        *("clone", "contiguous", "_to_copy", "index_select", "slice"),
    )
    seen_gather = False
    stack, visited = [node], set()
    while stack:
        n = stack.pop()
        if n in visited:
            continue
        visited.add(n)
        if n in params:
            continue
        name = getattr(n.target, "_opname", getattr(n.target, "__name__", ""))
        if name in ("all_gather_into_tensor", "wait_tensor"):
            seen_gather |= name == "all_gather_into_tensor"
        elif n.op != "call_function" or name not in layout:
            return False
        stack.extend(n.all_input_nodes)
    return seen_gather


def _saved_gathered_params(lowered) -> list:
    """The forward's saved values that are gathered parameters (bucketed gathers included)."""
    names = {
        n.name
        for n, (kind, _) in zip(lowered.joint.graph.find_nodes(op="placeholder"), lowered.input_labels)
        if kind == "param"
    }
    params = {n for n in lowered.forward.graph.find_nodes(op="placeholder") if n.name in names}
    out = next(n for n in lowered.forward.graph.nodes if n.op == "output")
    saved = [a for a in out.args[0][lowered.n_outputs :] if isinstance(a, torch.fx.Node)]
    return [a.name for a in saved if _unsharded_parameter(a, params)]


def test_fsdp_plan_saves_no_gathered_parameter_for_backward(lowered_llama):
    plan, lowered, _, _ = lowered_llama
    assert lowered.recompute.chains > 0
    assert _saved_gathered_params(lowered) == []
    # the backward re-gathers them instead: it has more all-gathers than the plan's backward moves
    # alone, the regathers the plan prices beside them (``Redistribution.again``)
    first_runs = [r for r in plan.redistributions if r.phase == "backward" and not r.again]
    assert count_collectives(lowered.backward)["all_gather"] > sum(
        1 for r in first_runs for k, _ in r.collectives if k == "all_gather"
    )
    assert any(r.again for r in plan.redistributions)


def test_keeping_gathered_parameters_saves_them(lowered_llama):
    plan, _, _, ap = lowered_llama
    # same plan, reshard_after_forward=False: the gathered weights are saved (so the check above can fail)
    ap.apply_placement(plan, reshard_after_forward=False)
    kept = ap.lowered
    assert kept.recompute.chains == 0
    assert _saved_gathered_params(kept)


def test_pass_counts_reach_the_plan_report(lowered_llama):
    plan, _, _, ap = lowered_llama
    ap.apply_placement(plan)  # other tests re-apply with passes off; report the default run
    assert plan.passes["recompute_chains_tagged"] == ap.lowered.recompute.chains > 0
    assert plan.passes["gather_chains_fused"] == ap.lowered.gather_fusion.fused
    assert plan.passes["aliases_dropped"] > 0  # placed like their producers: they do nothing
    summary = plan.summary()
    assert f"passes: round trips removed {plan.passes['round_trips_removed']}" in summary
    assert "recompute chains tagged" in summary
    assert "collectives before passes: all_gather" in summary and "collectives after passes: all_gather" in summary
    assert type(plan).from_json(plan.to_json()).passes == plan.passes


def test_a_nested_shards_chunk_of_a_gathered_weight_is_re_gathered():
    """(S0, S0) -> (R, S0) gathers the whole weight and picks this rank's chunk by index (a copy):
    the chunk is re-made in the backward from a new gather, not saved (FSDP's reshard after
    forward, which the memory model assumes); only the small index is saved."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from autoplan.lower.collectives import c10d
    from autoplan.lower.lowering import partition
    from autoplan.lower.passes.fsdp_recompute import RECOMPUTE_KEY, tag_parameter_gathers

    group = fake_mesh((2,)).get_group().group_name

    def joint(w, coord, x, tangent):
        full = c10d.wait_tensor.default(c10d.all_gather_into_tensor.default(w, 2, group))
        chunk = torch.index_select(full.view(2, 4, 8), 0, coord[:1]).view(4, 8)
        y = x @ chunk
        return y, tangent @ chunk.t()

    args = (torch.randn(4, 8), torch.zeros(2, dtype=torch.long), torch.randn(3, 4), torch.randn(3, 8))
    gm = make_fx(joint, tracing_mode="fake")(*args)
    w = next(iter(gm.graph.find_nodes(op="placeholder")))
    out = next(n for n in gm.graph.nodes if n.op == "output")
    grad = out.args[0][1]  # tangent @ chunk.t(): the backward, reading the chunk
    in_backward = {grad, *grad.all_input_nodes[1:]}
    for n in gm.graph.nodes:
        if n.op == "call_function":
            n.meta["partitioner_tag"] = "is_backward" if n in in_backward else "is_forward"
    stats = tag_parameter_gathers(gm.graph, {w})
    picked = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.index_select.default)
    assert stats.chains == 1 and picked.meta.get(RECOMPUTE_KEY)
    backward_gm = partition(gm, 1).backward
    saved = [n for n in backward_gm.graph.nodes if n.op == "placeholder" and not n.name.startswith("tangent")]
    inputs = {n.name for n in gm.graph.find_nodes(op="placeholder")}
    assert [n.name for n in saved if n.name not in inputs and n.meta["val"].numel() > 2] == []
    assert any(n.name == w.name for n in saved)  # the shard, from which the backward gathers again
    assert count_collectives(backward_gm)["all_gather"] == 1


def _relayouts_of_gathers(gm) -> list:
    """Permutes of an all-gather's result (through views): the copies that lay gathered chunks out
    on a non-leading dim."""
    views = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default)
    found = []
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is torch.ops.aten.permute.default:
            source = n.args[0]
            while source.op == "call_function" and source.target in views:
                source = source.args[0]
            if source.op == "call_function" and source.target is c10d.wait_tensor.default:
                if source.args[0].target is c10d.all_gather_into_tensor.default:
                    found.append(n.name)
    return found


def test_weights_are_gathered_before_their_transpose_with_no_relayout_copy():
    # FSDP on 8 CPU ranks: a weight's forward reads its transpose (mm(x, w.t())). Gathered after the
    # ``t``, a weight split on dim 0 is gathered on dim 1 of the view, and its chunks are copied into
    # place; gathered before it, nothing is copied. The planner must see both places.
    mesh = fake_mesh((8,))
    cfg = LLAMA3_CONFIGS["small"]
    with torch.device("meta"):
        model = Transformer(cfg)
    tokens = lambda: torch.randint(0, cfg.vocab_size, (8, 256))  # noqa: E731
    with AutoParallel(model, mesh, tokens, device_profile="cpu") as ap:
        ap.add_input_constraints([(S0,)])
        ap.add_output_constraints([(S0,)])
        ap.add_memory_constraint(param_fraction=1 / 8)
        plan = ap.optimize_placement()
        ap.apply_placement(plan)
    weights = [p for f, p in plan.param_placements.items() if f.endswith(("wq.weight", "w1.weight", "w2.weight"))]
    assert weights and all(p != (R,) for p in weights)  # split, as FSDP splits them
    assert _relayouts_of_gathers(ap.lowered.forward) == []


def test_gradient_all_reduces_are_waited_for_where_read_and_keep_the_numerics():
    """DDP on 8 simulated ranks: each weight's gradient is all-reduced as the backward produces it.
    Its wait moves to just before its first reader (or the end of its layer's stretch), so the rank
    computes on while the reduction runs; the eager program reduces it in place, with no copy on
    the computing thread; and three AdamW steps still match one device."""
    from parallel_run import check_run, graph_report, one_value, parallel_run, plan_and_apply, reference_run
    from torch.distributed._local_tensor import LocalTensorMode

    mesh = fake_mesh((2, 4), ("dp", "tp"))
    ref = reference_run("llama", batch_rows=8)
    # each reduction on its own, to see each wait move (``test_bucketing`` covers buckets' waits)
    plan, lowered, pmod = plan_and_apply(mesh, "llama", [("*weight", (R, R))], batch_rows=8, bucket_bytes=0)
    backward = list(lowered.backward.graph.nodes)
    at = {n: i for i, n in enumerate(backward)}
    reduces = [n for n in backward if n.target is c10d.all_reduce.default]
    assert len(reduces) >= len(plan.param_placements)  # every gradient, and the loss's pieces
    waits = [next(iter(r.users)) for r in reduces]
    assert all(w.target is c10d.wait_tensor.default and len(r.users) == 1 for r, w in zip(reduces, waits))
    assert all(at[w] < min(at[u] for u in w.users) for w in waits)  # still before every reader
    # most reductions now have compute issued between them and their wait
    overlapped = [w for r, w in zip(reduces, waits) if at[w] > at[r] + 1]
    assert lowered.waits.sunk == len(overlapped) and len(overlapped) >= len(reduces) // 2
    assert plan.passes["all_reduce_waits_sunk"] == lowered.waits.sunk
    # a gradient the backward produces last in its layer still runs under the next layer's
    # backward: each of the seven weights and two norms of layers.1 (the backward's first of two
    # layers) has a matmul after its reduction before its wait, some in layers.0's stretch
    from autoplan.lower.lowering import REGION_KEY

    mms = [at[n] for n in backward if n.target is torch.ops.aten.mm.default]
    handed = [(r, w) for r, w in zip(reduces, waits) if r.meta[REGION_KEY].startswith("layers.1")]
    assert len(handed) == 9 and all(any(at[r] < m < at[w] for m in mms) for r, w in handed)
    assert any(w.meta[REGION_KEY] != r.meta[REGION_KEY] for r, w in handed)
    # the eager program reduces each weight's gradient in its own buffer (nothing else reads it);
    # the lowered graph, which compiled regions and counts read, keeps the functional all-reduce
    eager, in_place = reinplace_all_reduces(lowered.backward)
    mutating = [n for n in eager.graph.nodes if n.target is c10d.all_reduce_.default]
    assert in_place == len(mutating) == len(reduces)
    assert all(len(n.args[0].users) == 1 and n.args[0].op == "call_function" for n in mutating)
    assert sum(n.target is c10d.all_reduce.default for n in lowered.backward.graph.nodes) == len(reduces)
    with LocalTensorMode(8):
        r = parallel_run(mesh, pmod, ref, False, plain=one_value)
    check_run(r | {"ref_losses": ref.losses} | graph_report(plan, lowered))


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["eager", "inductor"])
def test_parameter_gathers_are_issued_a_layer_ahead_and_keep_the_numerics(compiled):
    """FSDP on 8 simulated ranks: each layer's weight gathers are issued before the previous layer
    (in the order each graph runs them) does its first matmul, their waits stay in their own layer,
    the collectives are those of the unprefetched program, and three AdamW steps
    still match one device, eager and with regions compiled (a prefetched gather's region hands
    its un-waited result to the next layer's)."""
    from parallel_run import check_run, graph_report, one_value, parallel_run, plan_and_apply, reference_run
    from torch.distributed._local_tensor import LocalTensorMode

    from autoplan.lower.lowering import REGION_KEY

    mesh = fake_mesh((2, 4), ("dp", "tp"))
    ref = reference_run("llama", batch_rows=8)
    pins, prefetched = [("*weight", (S0, R))], {"prefetch": True}  # planned for the prefetching program
    each = {"bucket_bytes": 0}  # each weight's gather on its own (``test_bucketing`` prefetches buckets)
    _, plain, _ = plan_and_apply(mesh, "llama", pins, batch_rows=8, settings=prefetched, prefetch=False, **each)
    plan, lowered, pmod = plan_and_apply(
        mesh, "llama", pins, batch_rows=8, settings=prefetched, compile=compiled, **each
    )
    assert plain.prefetch.gathers == 0 and lowered.prefetch.gathers == plan.passes["gathers_prefetched"]
    # one gather per weight of a layer each way (seven matmul weights, two norms), one reduction back
    per_layer = {k: v for k, v in plan.passes.items() if "_per_layer_" in k and "bucketing" not in k}
    assert per_layer == {
        "all_gather_per_layer_forward": 9,
        "all_gather_per_layer_backward": 9,
        "reduce_scatter_per_layer_backward": 9,
    }
    assert "collectives per layer backward: all_gather 9, reduce_scatter 9" in plan.summary()
    for graph, order in ((lowered.forward.graph, 1), (lowered.backward.graph, -1)):
        nodes = list(graph.nodes)
        at = {n: i for i, n in enumerate(nodes)}
        layers = sorted({t for n in nodes if (t := n.meta.get(REGION_KEY, "")).startswith("layers.")})[::order]
        assert len(layers) == 2
        mms = [n for n in nodes if n.target is aten.mm.default]
        first_mm = {t: min(at[n] for n in mms if n.meta.get(REGION_KEY) == t) for t in layers}
        gathers = [n for n in nodes if n.target is c10d.all_gather_into_tensor.default]
        weights = [g for g in gathers if g.meta.get(REGION_KEY) == layers[1] and _feeds_matmul(g)]
        assert len(weights) == 7  # the attention's four projections, the feed-forward's three
        for g in weights:  # issued before the previous layer computes, waited for in its own
            (wait,) = g.users
            assert at[g] < first_mm[layers[0]] < at[wait] and wait.meta.get(REGION_KEY) == layers[1]
    assert lowered.collective_counts(lowered.forward) == plain.collective_counts(plain.forward)
    assert lowered.collective_counts(lowered.backward) == plain.collective_counts(plain.backward)
    with LocalTensorMode(8):
        r = parallel_run(mesh, pmod, ref, False, plain=one_value)
    check_run(r | {"ref_losses": ref.losses} | graph_report(plan, lowered))


def _feeds_matmul(gather) -> bool:
    """A gathered weight read by a matmul through views."""
    frontier, seen = [gather], set()
    while frontier:
        n = frontier.pop()
        if n.target is aten.mm.default:
            return True
        if n not in seen and (n is gather or n.target in (c10d.wait_tensor.default, aten.t.default, aten.view.default)):
            seen.add(n)
            frontier.extend(n.users)
    return False


def test_only_an_all_reduce_that_alone_reads_a_fresh_tensor_reduces_it_in_place():
    """Reducing in place writes the input: a graph input, a value something else reads, or a view
    of such a value must keep the functional (copying) all-reduce."""
    aten = torch.ops.aten
    graph = torch.fx.Graph()
    a, b = graph.placeholder("a"), graph.placeholder("b")
    for n, shape in ((a, (4, 4)), (b, (4, 4))):
        n.meta["val"] = torch.empty(shape, device="meta")
    group = "0"

    def reduce(x):
        return graph.call_function(
            c10d.wait_tensor.default, (graph.call_function(c10d.all_reduce.default, (x, "sum", group)),)
        )

    alone = graph.call_function(aten.mm.default, (a, b))  # read by its all-reduce only: in place
    shared = graph.call_function(aten.mm.default, (a, b))  # read again below: copied
    viewed = graph.call_function(aten.view.default, (graph.call_function(aten.mm.default, (a, b)), [16]))
    base = graph.call_function(aten.mm.default, (a, b))
    view_of_shared = graph.call_function(aten.view.default, (base, [16]))  # its base is read again
    outs = [reduce(alone), reduce(shared), reduce(viewed), reduce(a), reduce(view_of_shared)]
    graph.output((*outs, graph.call_function(aten.add.Tensor, (shared, base))))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    eager, count = reinplace_all_reduces(gm)
    reduced = [n.args[0].name for n in eager.graph.nodes if n.target is c10d.all_reduce_.default]
    assert count == 2 and reduced == [alone.name, viewed.name]
    assert sum(n.target is c10d.all_reduce.default for n in gm.graph.nodes) == 5  # the original stays


@pytest.mark.parametrize("placement", [Replicate(), Shard(0)], ids=["replicated", "sharded"])
def test_the_parallel_module_never_shares_storage_with_what_it_was_given(placement):
    """A real model's parameters, and a state dict loaded into the parallel module, stay as they
    were while the parallel module trains: its shards and replicas are copies (a replica made by
    ``distribute_tensor`` is otherwise the given tensor itself, and a dim-0 shard a view of it)."""
    from models import MLP

    mesh = fake_mesh((8,))
    torch.manual_seed(0)
    model = MLP(32, 64, 32)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with AutoParallel(model, mesh, lambda: torch.randn(16, 32)) as ap:
        ap.add_input_constraints([(Shard(0),)])
        ap.add_output_constraints([(Shard(0),)])
        ap.add_node_constraint("*weight", (placement,))
        pmod = ap.apply_placement(ap.optimize_placement())
    loaded = {k: v + 1 for k, v in before.items()}
    kept = {k: v.clone() for k, v in loaded.items()}
    for source in (None, loaded):
        if source is not None:
            pmod.load_state_dict(source)
        with torch.no_grad():
            for p in pmod.parameters():
                p.to_local().mul_(0.5)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    assert all(torch.equal(loaded[k], v) for k, v in kept.items())
