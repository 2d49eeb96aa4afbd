"""Strategy enumeration: ops that ask alike are enumerated once, and each node still owns its tuple."""

import dataclasses

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
