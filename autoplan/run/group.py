"""The process group a command runs in: the caller's when there is one, else one it makes."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def join_group(device_type: str, single: bool) -> bool:
    """Make the default process group unless one exists; returns whether this call made it (its
    maker tears it down; a caller's group, a test's or a notebook's, outlives the command).

    Under torchrun (``WORLD_SIZE`` set) the group spans its processes: NCCL on ``"cuda"``, gloo on
    a CPU. Started without torchrun, a one-process group is made only when ``single`` asks for it
    (a command that runs collectives), on a local rendezvous. On CUDA the process's device is
    its ``LOCAL_RANK``."""
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if dist.is_initialized():
        return False
    if "WORLD_SIZE" not in os.environ:
        if not single:
            return False
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29517"))
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    elif int(os.environ["WORLD_SIZE"]) == 1 and not single:
        return False
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo")
    return True
