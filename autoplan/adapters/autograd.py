"""Adapter over autograd's private parts (the graph's sequence numbers, the dispatcher's thread-local
key sets), so a torch upgrade touches one module.

A forward op records the sequence number of the autograd node it creates; the backward ops that
node runs can be tagged with the same number, which ties them to the forward op's module.
"""

from __future__ import annotations

import contextlib

import torch


def sequence_number(fn: torch.autograd.graph.Node) -> int:
    """The sequence number of an autograd node (a tensor's ``grad_fn`` or one of its inputs)."""
    return fn._sequence_nr()


@contextlib.contextmanager
def autograd_within_op():
    """Autograd recording again inside a custom op's kernel, which the dispatcher runs with the
    autograd keys excluded: a kernel that differentiates the code it runs (an untraced region's
    backward) needs it."""
    keys = torch._C.DispatchKey
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for name in ("AutogradFunctionality", "AutogradOther", "AutogradNestedTensor", "ADInplaceOrView"):
        exclude = exclude.remove(getattr(keys, name))
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude), torch.enable_grad():
        yield
