"""Strategy enumeration: ops that ask alike are enumerated once, and each node still owns its tuple."""

import dataclasses

import torch
from conftest import fake_mesh

import autoplan.strategies as strategies_module
from autoplan import AutoParallel
from autoplan.models.llama3 import LLAMA3_CONFIGS, Transformer
from autoplan.strategies import StrategyBuilder, enumerate_strategies


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
