"""Adapter over ``torch.fx``'s private lazy graph modules, so a torch upgrade touches one module."""

from __future__ import annotations

import contextlib

import torch.fx as fx
from torch.fx._lazy_graph_module import _make_graph_module, _use_lazy_graph_module


def lazy_graph_modules() -> contextlib.AbstractContextManager:
    """Graph modules made inside generate their Python code when first run or read, not at every
    ``recompile``: planning never runs the joint graph, and generating the code of 80 layers'
    25,000 nodes takes about a second each time."""
    return _use_lazy_graph_module(True)


def graph_module(root: fx.GraphModule, graph: fx.Graph) -> fx.GraphModule:
    """A graph module over ``graph`` (taking ``root``'s attributes), lazy as inside ``lazy_graph_modules``."""
    with lazy_graph_modules():
        return _make_graph_module(root, graph)
