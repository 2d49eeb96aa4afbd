"""Adapter over the private profiling hooks the benchmarks use (dispatch modes, the memory timeline).

Everything here measures a program that really runs: which ATen ops it dispatches, which kernels
the profiler saw (Inductor's C++ kernels included when they record themselves), and how much
memory the allocator held.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.profiler import DeviceType, ProfilerActivity, profile
from torch.profiler._memory_profiler import Action
from torch.utils._python_dispatch import TorchDispatchMode

# Ops that only allocate or re-describe memory: no kernel runs.
_NO_KERNEL = frozenset({"empty", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh", "detach"})
_INDUCTOR_KERNEL = "cpp_fused_"  # Inductor's C++ kernels (so named when they record themselves)


class _OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[f"{func.namespace}.{func._opname}"] += 1
        return func(*args, **(kwargs or {}))


def count_ops(fn: Callable[[], None]) -> Counter:
    """ATen ops ``fn`` dispatches, by ``namespace.name``. Eager code only: ``torch.compile`` runs
    compiled code eagerly under a dispatch mode, so a compiled program would be miscounted."""
    counter = _OpCounter()
    with counter:
        fn()
    return counter.ops


def launches_kernel(name: str) -> bool:
    """Whether an ATen op (``aten.mm`` or ``aten::mm``) runs a kernel: views and allocations do not."""
    namespace, _, op = name.replace("::", ".").partition(".")
    if op in _NO_KERNEL:
        return False
    packet = getattr(getattr(torch.ops, namespace), op, None)
    if packet is None:
        return True
    return not any(getattr(packet, o).is_view for o in packet.overloads())


@dataclass(frozen=True)
class StepProfile:
    host_kernels: int  # outermost kernel-launching ATen ops plus Inductor kernels, as the profiler saw them
    device_kernels: int  # GPU kernels (0 on CPU)
    memory_rise: int  # most bytes allocated during the step on top of what existed before it


def profile_step(fn: Callable[[], None], device: str) -> StepProfile:
    """Run ``fn`` once under the profiler.

    Host kernels: an ATen op counts unless an ATen op encloses it (its own sub-calls are part of
    it) or it only re-describes memory; Inductor's C++ kernels count one each. Memory: on CUDA the
    allocator's peak rise; elsewhere the profiler's memory timeline (every allocation and free of
    the step, replayed in order).
    """
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    base = 0
    if device == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    with profile(activities=activities, profile_memory=True, record_shapes=True, with_stack=True) as prof:
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
    events = prof.events()
    host = sum(1 for e in events if _is_host_kernel(e))
    gpu = sum(1 for e in events if e.device_type == DeviceType.CUDA)
    rise = torch.cuda.max_memory_allocated() - base if device == "cuda" else _timeline_peak(prof)
    return StepProfile(host, gpu, rise)


def _is_host_kernel(event) -> bool:
    if event.device_type != DeviceType.CPU:
        return False
    if _INDUCTOR_KERNEL in event.name:
        return True
    if not event.name.startswith("aten::") or not launches_kernel(event.name):
        return False
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("aten::"):
            return False
        parent = parent.cpu_parent
    return True


def _timeline_peak(prof) -> int:
    """Peak of the bytes allocated inside the window and not yet freed (frees of older tensors do
    not lower it: they were never counted).

    The timeline comes from the profiler's data-flow analysis, which refuses some steps (a gloo
    collective's in-place output: "version mismatch"); those fall back to the allocator's raw
    events in order, where a free of an older tensor does lower the count."""
    try:
        timeline = prof._memory_profile().timeline
    except AssertionError:
        return _event_peak(prof)
    live = peak = 0
    created: set = set()
    for _, action, (key, _), size in timeline:
        if action == Action.CREATE:
            created.add(key)
            live += size
        elif action == Action.DESTROY and key in created:
            created.discard(key)
            live -= size
        peak = max(peak, live)
    return peak


def _event_peak(prof) -> int:
    """Peak of the running sum of the window's allocations and frees on the host."""
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        if e.device_type() == DeviceType.CPU:
            live += e.nbytes()
            peak = max(peak, live)
    return peak


_WAIT = "_c10d_functional::wait_tensor"


def collective_waits(fn: Callable[[], None]) -> list[tuple[str, float]]:
    """Each wait on a collective while ``fn`` runs, in the order the host met them: (the waited
    tensor's shape, seconds the host was blocked in it). Where the backend blocks the host until
    the collective is done (gloo), that is the collective's own time plus however long the rank
    waited for the others to join; on CUDA the host only queues the wait, so it says nothing."""
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    waits = sorted((e for e in prof.events() if e.name == _WAIT), key=lambda e: e.time_range.start)
    return [(str(tuple(e.input_shapes[0])) if e.input_shapes else "?", e.cpu_time_total / 1e6) for e in waits]
