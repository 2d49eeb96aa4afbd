"""Adapter over the autograd graph's private sequence numbers, so a torch upgrade touches one module.

A forward op records the sequence number of the autograd node it creates; the backward ops that
node runs can be tagged with the same number, which ties them to the forward op's module.
"""

from __future__ import annotations

import torch


def sequence_number(fn: torch.autograd.graph.Node) -> int:
    """The sequence number of an autograd node (a tensor's ``grad_fn`` or one of its inputs)."""
    return fn._sequence_nr()
