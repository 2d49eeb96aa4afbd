"""Alias insertion (before planning) and round-trip removal (after) on hand-built graphs and plans."""

import dataclasses

import torch
import torch.fx as fx
from conftest import fake_mesh
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor import Replicate, Shard

from autoplan.bench.models.llama3 import LLAMA3_CONFIGS, Transformer
from autoplan.cost.costs import H100_SXM, CostModel
from autoplan.lower.passes.alias_roundtrip import ALIAS, ALIAS_KEY, insert_aliases, remove_round_trips, rewire_aliases
from autoplan.plan import CostBreakdown, MemoryReport, NodePlan, Plan
from autoplan.solve.evaluate import reprice
from autoplan.trace.clustering import find_repeats
from autoplan.trace.tracing import PHASE_KEY, TracedGraph, trace_joint

aten = torch.ops.aten
R, S0, S1 = Replicate(), Shard(0), Shard(1)
A, B, C = (S0, R), (R, R), (S1, R)  # producer's placement, alias's, a third one


def traced(build) -> TracedGraph:
    """A TracedGraph around ``build(graph, x)``: one input ``x`` (8x8), the returned nodes as outputs."""
    g = fx.Graph()
    fake = FakeTensorMode()
    x = g.placeholder("x")
    with fake:
        x.meta["val"] = torch.empty(8, 8)
    x.meta[PHASE_KEY] = "forward"

    def op(target, *args, phase="forward"):
        node = g.create_node("call_function", target, args, name=target.__name__.split(".")[0])
        with fake:
            node.meta["val"] = target(*(a.meta["val"] for a in args))
        node.meta[PHASE_KEY] = phase
        return node

    outs = build(op, x)
    g.output(outs)
    return TracedGraph(
        gm=fx.GraphModule(torch.nn.Module(), g),
        input_labels=[("input", 0)],
        output_labels=[("output", i) for i in range(len(outs))],
        joint=None,
        fake_mode=fake,
    )


def planned(tg: TracedGraph, placements: dict[str, tuple]) -> Plan:
    """A hand-written plan: ``name -> (output, *inputs)`` placements, priced with ``reprice``."""
    nodes = {}
    for n in tg.gm.graph.nodes:
        if n.op != "output":
            out, *ins = placements[n.name]
            nodes[n.name] = NodePlan(n.name, str(n.target), "", "forward", (out,), tuple(ins), 0.0)
    plan = Plan(
        mesh_shape=(2, 2),
        mesh_dim_names=None,
        device="test",
        nodes=nodes,
        param_placements={},
        cost=CostBreakdown(0, 0, 0, 0),
        memory=MemoryReport(0, 0, 0),
        redistributions=[],
        solver={},
        ilp={},
        timings={},
    )
    return reprice(tg, plan, cost_model(), {})


def cost_model() -> CostModel:
    return CostModel(fake_mesh((2, 2)), H100_SXM)


def with_alias(op, x):
    """y = relu(x), read through an alias by ``y * y`` (twice) and by ``neg``."""
    y = op(aten.relu.default, x)
    a = op(ALIAS, y)
    return [op(aten.mul.Tensor, a, a), op(aten.neg.default, a)]


def names(node: fx.Node) -> list[str]:
    return [a.name for a in node.all_input_nodes]


def nodes_of(tg: TracedGraph) -> dict[str, fx.Node]:
    return {n.name: n for n in tg.gm.graph.nodes}


def rewired(placements: dict[str, tuple]):
    """``with_alias`` planned as ``placements``, then rewired: (stats, nodes by name)."""
    tg = traced(with_alias)
    stats = rewire_aliases(tg.gm.graph, planned(tg, placements))
    return stats, nodes_of(tg)


def test_reads_wanting_the_producer_placement_skip_the_alias():
    tg = traced(with_alias)
    # the alias is placed B, but `mul` wants A (the producer's) for both of its reads: A -> B -> A twice
    plan = planned(tg, {"x": (A,), "relu": (A, A), "alias": (B, B), "mul": (A, A, A), "neg": (B, B)})
    assert len(plan.redistributions) == 3
    stats = rewire_aliases(tg.gm.graph, plan)
    nodes = nodes_of(tg)
    assert stats.removed == 2 and stats.aliases_dropped == 0
    assert names(nodes["mul"]) == ["relu"] and nodes["mul"].args == (nodes["relu"], nodes["relu"])
    assert names(nodes["neg"]) == ["alias"]  # it wants the alias's placement: the alias still serves it


def test_x_plus_x_moves_only_the_read_that_wants_the_producer_placement():
    stats, nodes = rewired({"x": (A,), "relu": (A, A), "alias": (B, B), "mul": (A, A, B), "neg": (B, B)})
    assert stats.removed == 1 and nodes["mul"].args == (nodes["relu"], nodes["alias"])


def test_a_consumer_wanting_a_third_placement_stays_on_the_alias():
    stats, nodes = rewired({"x": (A,), "relu": (A, A), "alias": (B, B), "mul": (A, A, A), "neg": (C, C)})
    assert stats.removed == 2 and stats.aliases_dropped == 0
    assert nodes["neg"].args == (nodes["alias"],)


def test_alias_without_readers_left_is_erased():
    stats, nodes = rewired({"x": (A,), "relu": (A, A), "alias": (B, B), "mul": (A, A, A), "neg": (A, A)})
    assert stats.removed == 3 and stats.aliases_dropped == 1
    assert "alias" not in nodes


def test_noop_alias_loses_every_reader_and_is_erased():
    # placed like its producer: no round trip, but the alias does nothing, even for the C reader
    stats, nodes = rewired({"x": (A,), "relu": (A, A), "alias": (A, A), "mul": (A, A, A), "neg": (C, C)})
    assert stats.removed == 0 and stats.aliases_dropped == 1
    assert "alias" not in nodes and nodes["neg"].args == (nodes["relu"],)


def test_remove_round_trips_works_on_a_copy_and_reprices_the_plan():
    tg = traced(with_alias)
    plan = planned(tg, {"x": (A,), "relu": (A, A), "alias": (B, B), "mul": (A, A, A), "neg": (A, A)})
    out, repriced, stats = remove_round_trips(tg, plan, cost_model(), {})
    assert stats.removed == 3 and stats.aliases_dropped == 1
    assert "alias" in nodes_of(tg) and "alias" in plan.nodes  # the planned graph and plan are untouched
    assert "alias" not in nodes_of(out) and "alias" not in repriced.nodes
    # before: A -> B into the alias, B -> A for each of the three reads; after: nothing moves
    assert [(r.consumer, r.src, r.dst) for r in plan.redistributions] == [
        ("alias", A, B),
        ("mul", B, A),
        ("mul", B, A),
        ("neg", B, A),
    ]
    assert repriced.redistributions == [] and repriced.cost.total < plan.cost.total
    assert repriced.collective_counts() == {} and plan.collective_counts()["all_gather"] == 1


def test_aliases_follow_values_read_more_than_once():
    def build(op, x):
        y = op(aten.relu.default, x)  # read by two ops: aliased
        z = op(aten.neg.default, y)  # read once by an op and once as an output: not aliased
        w = op(aten.mul.Tensor, y, z)
        g = op(aten.sin.default, w, phase="backward")  # a gradient read twice by one op: aliased
        return [z, op(aten.add.Tensor, g, g, phase="backward"), op(aten.cos.default, y)]

    tg = traced(build)
    stats = insert_aliases(tg)
    nodes = nodes_of(tg)
    aliases = {n.args[0].name: n for n in tg.gm.graph.nodes if n.target is ALIAS}
    assert stats.inserted == 2 and set(aliases) == {"relu", "sin"}
    alias, grad = aliases["relu"], aliases["sin"]
    assert alias.meta[ALIAS_KEY] and alias.meta[PHASE_KEY] == "forward" and grad.meta[PHASE_KEY] == "backward"
    assert nodes["neg"].args == (alias,) and nodes["cos"].args == (alias,) and nodes["mul"].args[0] is alias
    assert nodes["add"].args == (grad, grad)
    assert alias.meta["val"] is nodes["relu"].meta["val"]


def test_llama_layers_are_still_clustered_with_their_aliases():
    cfg = dataclasses.replace(LLAMA3_CONFIGS["debug"], n_layers=4)
    with torch.device("meta"):
        model = Transformer(cfg)
    tg = trace_joint(model, lambda: torch.randint(0, cfg.vocab_size, (4, 16)))
    stats = insert_aliases(tg)
    clustering = find_repeats(tg)
    assert clustering.classes == (("layers.0", "layers.1", "layers.2", "layers.3"),)
    # the first and last layers sit elsewhere (embedding, final norm): tied, but refined on their own
    assert clustering.boundary == (("layers.0",), ("layers.3",))
    aliases = [n for n in tg.gm.graph.nodes if n.target is ALIAS]
    in_later = [a for a in aliases if clustering.instance[a] in ("layers.1", "layers.2", "layers.3")]
    assert stats.inserted == len(aliases) > 0 and in_later
    # every alias of a later layer shares the decision of an alias of the first
    assert all(
        clustering.rep[a].target is ALIAS and clustering.instance[clustering.rep[a]] == "layers.0" for a in in_later
    )
    # gradients are aliased too (a layer's output gradient feeds the residual path and the matmul backwards)
    assert any(a.meta[PHASE_KEY] == "backward" for a in in_later)
    # a 2-layer stack has no middle layer: nothing is tied
    with torch.device("meta"):
        two = trace_joint(Transformer(LLAMA3_CONFIGS["debug"]), lambda: torch.randint(0, 256, (4, 16)))
    insert_aliases(two)
    assert find_repeats(two).classes == ()
