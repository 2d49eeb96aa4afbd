"""Run a function on N gloo ranks (CPU processes) and gather what each rank returns."""

import os
import socket
import traceback

import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn, args, queue) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        queue.put((rank, fn(rank, *args), None))
    except Exception:  # noqa: BLE001 - reported to the parent with its traceback
        queue.put((rank, None, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_gloo(fn, world_size: int, *args, timeout: float = 600.0) -> list:
    """``fn(rank, *args)`` on every rank; returns the per-rank results, raising the first rank's error."""
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue)) for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    errors = []
    for _ in procs:
        rank, value, err = queue.get()
        if err:
            errors.append(f"rank {rank}:\n{err}")
        results[rank] = value
    for p in procs:
        p.join(timeout)
    if errors:
        raise RuntimeError("\n".join(errors))
    return [results[r] for r in range(world_size)]
