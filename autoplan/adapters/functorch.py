"""Adapter over ``torch._functorch`` joint-graph capture, so a torch upgrade touches one module."""

from __future__ import annotations

import contextlib
from typing import Any

import torch.fx as fx
from torch import nn
from torch._functorch._aot_autograd.descriptors import (
    BufferAOTInput,
    GradAOTOutput,
    InputMutationAOTOutput,
    ParamAOTInput,
    PlainAOTInput,
    PlainAOTOutput,
    TangentAOTInput,
)
from torch._functorch.aot_autograd import aot_export_joint_with_descriptors

InputLabel = tuple[str, Any]  # ("param", fqn) | ("buffer", fqn) | ("input", i) | ("tangent", i)
# ("output", i) | ("buffer_update", fqn) | ("grad_param", fqn) | ("grad_input", i)
OutputLabel = tuple[str, Any]


def _input_label(desc: Any) -> InputLabel:
    if isinstance(desc, ParamAOTInput):
        return ("param", desc.target)
    if isinstance(desc, BufferAOTInput):
        return ("buffer", desc.target)
    if isinstance(desc, PlainAOTInput):
        return ("input", desc.idx)
    if isinstance(desc, TangentAOTInput):
        out = desc.output
        return ("tangent", getattr(out, "idx", None))
    raise NotImplementedError(f"unsupported joint-graph input {desc!r}")


def _output_label(desc: Any) -> OutputLabel:
    if desc is None:  # an output slot with no gradient (e.g. an integer input)
        return ("none", None)
    if isinstance(desc, PlainAOTOutput):
        return ("output", desc.idx)
    if isinstance(desc, InputMutationAOTOutput) and isinstance(desc.mutated_input, BufferAOTInput):
        return ("buffer_update", desc.mutated_input.target)  # a buffer the forward writes: its new value
    if isinstance(desc, GradAOTOutput):
        kind, target = _input_label(desc.grad_of)
        return ("grad_" + kind, target)
    raise NotImplementedError(f"unsupported joint-graph output {desc!r}")


def export_joint(
    stack: contextlib.ExitStack, module: nn.Module, args: tuple
) -> tuple[fx.GraphModule, list[InputLabel], list[OutputLabel], Any]:
    """Capture ``module(*args)`` forward+backward as one functional ATen graph.

    Returns the graph, a label per placeholder, a label per output, and the opaque joint object
    (kept for later compilation through the same functorch entry points).
    """
    joint = aot_export_joint_with_descriptors(stack, module, args)
    gm = joint.graph_module
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    in_labels = [_input_label(n.meta["desc"]) for n in placeholders]
    out_node = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    out_labels = [_output_label(d) for d in out_node.meta["desc"]]
    return gm, in_labels, out_labels, joint
