"""Strategy enumeration: ops that ask alike are enumerated once, and each node still owns its tuple."""

import dataclasses
import operator

import torch
from conftest import fake_mesh

import autoplan.shard.strategies as strategies_module
from autoplan import AutoParallel
from autoplan.bench.models.llama3 import LLAMA3_CONFIGS, Transformer
from autoplan.shard.strategies import StrategyBuilder, enumerate_strategies


def test_ops_that_ask_alike_are_enumerated_once_each_node_keeping_its_own_tuple(monkeypatch):
    """A layer's two norms, its gate and up projections (and their backward ops) have the same op,
    arguments and input choices: the builder enumerates them once. Every node gets what
    enumerating it on its own gives, in a tuple no other node shares (per-tuple caches count on it)."""
    mesh = fake_mesh((2, 2, 2), ("a", "b", "c"))
    with torch.device("meta"):
        model = Transformer(dataclasses.replace(LLAMA3_CONFIGS["debug"], n_layers=1))
    with AutoParallel(model, mesh, input_fn=lambda: torch.randint(0, 256, (8, 16))) as ap:
        graph, rep = ap.traced.gm.graph, ap.clustering.rep
    asked = []
    real = StrategyBuilder._for_op
    monkeypatch.setattr(StrategyBuilder, "_for_op", lambda self, n, c: asked.append(n) or real(self, n, c))
    shared = enumerate_strategies(graph, rep, StrategyBuilder(mesh))
    n_ops, n_asked = sum(1 for _ in shared if _.op == "call_function"), len(asked)
    monkeypatch.setattr(strategies_module, "_op_key", lambda node, choices: None)
    alone = enumerate_strategies(graph, rep, StrategyBuilder(mesh))
    assert shared.keys() == alone.keys()
    for n in shared:
        assert shared[n] == alone[n], n.name
    assert n_asked < n_ops - 10
    tuples = [id(s.strategies) for s in shared.values()]
    assert len(set(tuples)) == len(tuples)


def test_an_op_reading_one_node_twice_is_not_taken_for_one_reading_two():
    """``stack([x, x])`` and ``stack([x, y])`` (same shapes, same choices) ask DTensor differently:
    each gets what it gets alone, whichever comes first."""
    import torch.fx as fx

    from autoplan.shard.strategies import all_placements

    mesh = fake_mesh((2, 2), ("a", "b"))
    stack = torch.ops.aten.stack.default
    for order in (("same", "apart"), ("apart", "same")):
        g = fx.Graph()
        x, y = g.placeholder("x"), g.placeholder("y")
        for n in (x, y):
            n.meta["val"] = torch.empty(4, 8, device="meta")
        builder = StrategyBuilder(mesh)
        for kind in order:
            n = g.call_function(stack, ([x, x if kind == "same" else y],))
            n.meta["val"] = torch.empty(2, 4, 8, device="meta")
            choices = {a: all_placements(a.meta["val"], (2, 2)) for a in (x, y)}
            assert builder.for_op(n, choices) == StrategyBuilder(mesh)._for_op(n, choices), (order, kind)


def test_routing_elementwise_ops_and_factories_have_rules_not_the_replicated_fallback():
    """``floor_divide`` (a routed row's token: row // top_k) splits its tokens like its input and
    takes no ``Partial``; a broadcast divisor stays whole. ``arange`` is made whole on every rank.
    Neither warns that it falls back to running replicated."""
    import warnings

    import torch.fx as fx
    from torch.distributed.tensor import Partial, Replicate, Shard

    from autoplan.shard.strategies import all_placements

    mesh = fake_mesh((2, 2), ("a", "b"))
    g = fx.Graph()
    rows, k = g.placeholder("rows"), g.placeholder("k")
    rows.meta["val"] = torch.empty(16, 4, dtype=torch.long, device="meta")
    k.meta["val"] = torch.empty(4, dtype=torch.long, device="meta")
    div = g.call_function(torch.ops.aten.floor_divide.default, (rows, k))
    div.meta["val"] = torch.empty(16, 4, dtype=torch.long, device="meta")
    ar = g.call_function(torch.ops.aten.arange.default, (16,), {"device": torch.device("meta")})
    ar.meta["val"] = torch.empty(16, dtype=torch.long, device="meta")
    choices = {a: all_placements(a.meta["val"], (2, 2)) for a in (rows, k)}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        found = StrategyBuilder(mesh).for_op(div, choices)
        made = StrategyBuilder(mesh).for_op(ar, {})
    assert found.source == "autoplan" and made.source == "autoplan"
    split = {s.outputs[0]: s.inputs for s in found.strategies}
    assert split[(Shard(0), Shard(1))] == ((Shard(0), Shard(1)), (Replicate(), Shard(0)))
    assert all(not isinstance(p, Partial) for s in found.strategies for pl in (*s.outputs, *s.inputs) for p in pl)
    assert [s.outputs[0] for s in made.strategies] == [(Replicate(), Replicate())]


def test_expert_rows_pass_views_that_keep_the_token_dim_and_follow_a_transpose():
    """A view keeps expert rows only where it leaves their token dim alone: a split or concatenation
    across the features (SwiGLU's gate and up halves) keeps them, one across the tokens does not,
    and a transpose (a weight gradient's operand) moves them to the other dim."""
    from torch.distributed.tensor import Partial
    from torch.fx.experimental.proxy_tensor import make_fx

    from autoplan.shard.expert_rows import ExpertRows, promoted
    from autoplan.shard.strategies import Strategy

    def views(x):
        return torch.split(x, 4, 1), torch.split(x, 4, 0), torch.cat([x, x], 1), torch.cat([x, x], 0), x.t()

    gm = make_fx(views, tracing_mode="fake")(torch.randn(8, 8))
    ops = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is not operator.getitem]
    P, E0, E1 = (Partial(),), (ExpertRows(0),), (ExpertRows(1),)

    def kept(node):
        n_in = 2 if node.target is torch.ops.aten.cat.default else 1
        n_out = 2 if node.target is torch.ops.aten.split.Tensor else 1
        return {(s.inputs[0], s.outputs[0]) for s in promoted(node, [Strategy((P,) * n_out, (P,) * n_in)])}

    split_features, split_tokens, cat_features, cat_tokens, transpose = ops
    assert kept(split_features) == {(E0, E0)} and kept(cat_features) == {(E0, E0)}
    assert kept(split_tokens) == {(E1, E1)} and kept(cat_tokens) == {(E1, E1)}  # only a transposed value's
    assert kept(transpose) == {(E0, E1), (E1, E0)}
