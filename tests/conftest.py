"""Shared test helpers: DeviceMeshes over a fake process group, so no GPUs or peer processes are needed."""

import math

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.testing._internal.distributed.fake_pg import FakeStore

FAKE_WORLD_SIZE = 128


def init_fake_world(world_size: int = FAKE_WORLD_SIZE) -> None:
    """(Re)initialise the default group as a fake one of ``world_size`` ranks, with this process as rank 0."""
    if dist.is_initialized() and dist.get_world_size() == world_size:
        return
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)


def fake_mesh(shape: tuple[int, ...], names: tuple[str, ...] | None = None) -> DeviceMesh:
    """A row-major mesh over ranks 0..prod(shape)-1 of the fake world, growing the world if it is too small."""
    size = math.prod(shape)
    if not dist.is_initialized() or dist.get_world_size() < size:
        init_fake_world(max(size, FAKE_WORLD_SIZE))
    return DeviceMesh("cpu", torch.arange(size).reshape(shape), mesh_dim_names=names)


def expected_on_cpu(planned: dict) -> dict:
    """A plan's collective counts as a CPU (gloo/fake) graph has them: local steps are not collectives."""
    return {k: v for k, v in planned.items() if k != "local"}
