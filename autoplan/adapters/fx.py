"""Adapter over ``torch.fx``'s private lazy graph modules, so a torch upgrade touches one module."""

from __future__ import annotations

import contextlib

import torch.fx as fx
from torch.fx._lazy_graph_module import _make_graph_module, _use_lazy_graph_module
from torch.fx.graph import _BoxedCodeGen


def lazy_graph_modules() -> contextlib.AbstractContextManager:
    """Graph modules made inside generate their Python code when first run or read, not at every
    ``recompile``: planning never runs the joint graph, and generating the code of 80 layers'
    25,000 nodes takes about a second each time."""
    return _use_lazy_graph_module(True)


def graph_module(root: fx.GraphModule, graph: fx.Graph) -> fx.GraphModule:
    """A graph module over ``graph`` (taking ``root``'s attributes), lazy as inside ``lazy_graph_modules``."""
    with lazy_graph_modules():
        return _make_graph_module(root, graph)


def boxed(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` called with one list of its arguments, which it empties before running:
    FX code drops each value after its last use, so no caller's reference keeps an argument alive
    to the end (the convention AOTAutograd uses for its backward graphs)."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    graph.set_codegen(_BoxedCodeGen())
    return graph_module(gm, graph)
