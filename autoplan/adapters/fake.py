"""Adapter over torch's private fakes: ``torch._subclasses.fake_tensor`` (tensors with shapes and no
data, which tracing runs the model on) and ``torch.testing._internal``'s fake process group store
(a world of any size whose collectives do nothing, which planning sets meshes up on), so a torch
upgrade touches one module.
"""

from __future__ import annotations

import contextlib
import logging

import torch.distributed as dist
from torch._subclasses import fake_tensor
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

__all__ = ["FakeTensor", "FakeTensorMode", "data_dependent_fake_mode", "fake_store", "fake_tensor_log"]


def fake_tensor_log() -> logging.Logger:
    """The logger fake-tensor mode reports failing meta kernels to (with their full stack)."""
    return logging.getLogger(fake_tensor.__name__)


def fake_store() -> dist.Store:
    """A store for ``init_process_group("fake", ...)``: no peers to meet."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


@contextlib.contextmanager
def data_dependent_fake_mode():
    """A fresh fake mode, outside every mode active now (a trace's proxy and fake modes), whose
    shape environment lets ops of data-dependent shape (nonzero, boolean masks, ``.tolist()``) run:
    their sizes are unknown symbols. Code run in it must not branch on them."""
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes(), FakeTensorMode(shape_env=ShapeEnv()) as mode:
        yield mode
