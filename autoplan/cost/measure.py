"""How ``calibrate`` measures: what it measures (``CalibrateOptions``) and its timers, the same on
every rank so that ranks that time alike take part in each collective alike."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class CalibrateOptions:
    """What to measure: ``fast`` takes smaller sizes and fewer repeats (seconds, for tests)."""

    fast: bool = False
    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)
    name: str | None = None  # the profile's name; default from the device
    # The mesh whose dims' groups the collectives are measured on, covering the process group; by
    # default (hosts, ranks per host) across hosts and one dim on one host (``default_mesh``).
    mesh: tuple[int, ...] | None = None
    # The longest one kernel call may take: a dtype's larger sizes past the first that takes longer
    # are left out (a CPU without native bf16 runs a 2048-cube bf16 matmul for ~20 s, and would
    # take minutes over the table), and its curve ends at the last size measured.
    call_seconds: float = 0.25

    def matmul_sizes(self, device: torch.device) -> tuple[int, ...]:
        """Square matmul sizes; a GPU's tensor cores fill up only past 4096."""
        if self.fast:
            return (64, 128, 256, 512)
        return (128, 256, 512, 1024, 2048) + ((4096, 8192) if device.type == "cuda" else ())

    def attention_shapes(self, device: torch.device) -> tuple[tuple[int, int, int], ...]:
        """(heads, sequence length, head dim) of one sequence's causal attention."""
        if self.fast:
            return ((4, 64, 32), (4, 128, 32))
        if device.type == "cuda":
            return ((16, 512, 128), (16, 2048, 128), (16, 8192, 128))
        return ((8, 128, 64), (8, 512, 64), (8, 1024, 64))

    @property
    def collective_bytes(self) -> tuple[int, ...]:
        """Sizes of the full tensor each collective is timed at: up to a step's largest moves (a
        LLaMA's logits, tens of MiB), which a fit of smaller ones would only extrapolate to."""
        return (2**12, 2**16, 2**20) if self.fast else (2**12, 2**15, 2**18, 2**21, 2**23, 2**25)

    @property
    def overlap_bytes(self) -> int:
        """The all-reduce ``measure_overlap`` issues beside compute: a layer's gradient."""
        return 2**20 if self.fast else 2**23

    @property
    def stream_bytes(self) -> int:
        return 2**24 if self.fast else 2**27

    @property
    def skew_gap(self) -> float:
        """Seconds of compute before the all-reduce ``measure_skew`` times: a layer's."""
        return 4e-3 if self.fast else 40e-3

    @property
    def skew_trials(self) -> int:
        """Trials of ``measure_skew`` at most: single trials on 2 gloo processes range from -13 to
        +22 ms around a mean of a few, so the mean needs ~100 (about 10 s there) to settle within 2%."""
        return 9 if self.fast else 120

    @property
    def skew_seconds(self) -> float:
        """When ``measure_skew`` stops short of ``skew_trials``: 4 processes on 2 cores take 30 s for 120."""
        return 1.0 if self.fast else 12.0

    @property
    def repeats(self) -> int:
        return 3 if self.fast else 7

    def collective_gap(self, device: torch.device) -> float:
        """Seconds of compute each timed collective follows (``measure_collectives``): a training
        step's gap between two of its collectives. 0 on GPUs, where the collective runs on its own
        stream and the host only queues the compute."""
        if device.type == "cuda":
            return 0.0
        return 1e-3 if self.fast else 5e-3


TIMED_SECONDS = 4e-3  # one timing of a kernel spans this long: launches and timer reads fade in it


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def seconds_per_call(fn: Callable[[], object], device: torch.device, repeats: int, inner: int | None = 1) -> float:
    """The median over ``repeats`` timings of ``inner`` calls of ``fn``, per call, after a warm-up;
    ``inner=None``: as many calls as fill ``TIMED_SECONDS`` (``calls_filling``)."""
    fn()
    sync(device)
    if inner is None:
        inner = calls_filling(fn, device, TIMED_SECONDS)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        sync(device)
        times.append((time.perf_counter() - t0) / inner)
    return statistics.median(times)


def calls_filling(fn: Callable[[], object], device: torch.device, seconds: float) -> int:
    """How many calls of ``fn`` take about ``seconds`` (at least one), from one timed call (warm it
    up first). Counted from time, not FLOPs: on a GPU a small kernel costs its launch,
    microseconds whatever its FLOPs, so a count sized by FLOPs runs the thinnest matmuls for minutes."""
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return max(1, int(seconds / max(time.perf_counter() - t0, 1e-7)))


def matmul_loop(
    seconds: float, side: int, device: torch.device, group, opts: CalibrateOptions
) -> tuple[Callable[[], None], int]:
    """(a loop of (``side``, ``side``) matmuls lasting about ``seconds``, its matmul count): the
    same count on every rank, so ranks that run it meet at the next collective alike."""
    a = torch.randn(side, side, device=device)
    per_mm = seconds_per_call(lambda: torch.mm(a, a), device, opts.repeats, inner=16)
    loops = agreed(max(1, round(seconds / per_mm)), group)

    def loop() -> None:
        for _ in range(loops):
            torch.mm(a, a)

    return loop, loops


def agreed(value: int, group) -> int:
    """The least of every rank's ``value``: ranks that loop alike take part in each collective alike."""
    t = torch.tensor([value], dtype=torch.int64)
    if dist.get_backend(group) == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return int(t.item())
