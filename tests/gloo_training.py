"""Training a planned model on real gloo processes next to one device: the ground truth for models
users bring.

A ``Case`` is a model, its batches and its loss. Both sides run the same two SGD steps from the same
weights: the first on one batch, the second accumulating the gradients of two micro-batches before
stepping. Each rank plans on the real process group (inputs and outputs split on the batch over the
mesh's first dim), loads the single-device weights, and feeds its own shard of every input; the
loss is formed from the rank's local output as a DTensor, so its backward flows into the plan. Rank
0 sends back the losses, each step's gradients and the final weights as full tensors (gathered from
every rank's shards), and the parent process compares them with one device's run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

R, S0 = Replicate(), Shard(0)
LR = 0.1
STEPS_SEED = 2


@dataclass(frozen=True)
class Case:
    """``build()`` makes the model; ``batches(generator)`` gives each step's micro-batches, each a
    tuple ``(inputs, target)`` with ``inputs`` the positional arguments of ``forward``; ``loss(out,
    target)`` is the step's loss (a mean over the batch, so micro-batches accumulate by halves)."""

    build: Callable[[], torch.nn.Module]
    batches: Callable[[torch.Generator], list]
    loss: Callable = lambda out, target: (out - target).square().mean()  # noqa: E731
    dtype: torch.dtype = torch.float32
    settings: dict = field(default_factory=dict)  # more AutoParallel keywords
    param_fraction: float | None = None
    rel: float = 1e-5  # relative norm error allowed on every gradient and weight, and on each loss


@dataclass
class Outcome:
    losses: list
    grads: list  # per step: {name: gradient}
    final: dict


def _steps(case: Case) -> list:
    return case.batches(torch.Generator().manual_seed(1))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)


def reference(case: Case) -> Outcome:
    """The two steps on one device."""
    torch.manual_seed(0)
    with _default_dtype(case.dtype):
        model = case.build()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, grads = [], []
    torch.manual_seed(STEPS_SEED)  # random ops in the steps (dropout, stochastic depth) draw alike
    for step in _steps(case):
        total = 0.0
        for inputs, target in step:
            loss = case.loss(model(*inputs), target) / len(step)
            loss.backward()
            total += float(loss.detach())
        losses.append(total)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        opt.step()
        opt.zero_grad()
    return Outcome(losses, grads, {n: p.detach().clone() for n, p in model.named_parameters()})


def _placements(t: torch.Tensor, ndim: int) -> tuple:
    """A batch-first tensor split on its batch over the first mesh dim; a scalar replicated."""
    return (S0, *[R] * (ndim - 1)) if t.ndim else (R,) * ndim


def parallel(rank: int, case: Case, shape: tuple[int, ...]) -> dict:
    """The two steps of ``case``'s plan on this gloo rank; on rank 0 what they gave (``Outcome``),
    the plan's summary and the lowered graph's collectives."""
    from torch.distributed.device_mesh import init_device_mesh

    from autoplan import AutoParallel

    mesh = init_device_mesh("cpu", shape)
    torch.manual_seed(0)
    with _default_dtype(case.dtype):
        initial = {k: v.clone() for k, v in case.build().state_dict().items()}
        with torch.device("meta"):
            model = case.build()
    steps = _steps(case)
    example, target = steps[0][0]
    shapes = [(t.shape, t.dtype) for t in example]  # input_fn runs under fake tensors: no real data in it
    with AutoParallel(model, mesh, lambda: tuple(torch.zeros(s, dtype=d) for s, d in shapes), **case.settings) as ap:
        ap.add_input_constraints([_placements(t, mesh.ndim) for t in example])
        ap.add_output_constraints([_placements(target, mesh.ndim)])
        if case.param_fraction is not None:
            ap.add_memory_constraint(param_fraction=case.param_fraction)
        plan = ap.optimize_placement()
        pmod = ap.apply_placement(plan)
    pmod.to_empty(device="cpu")
    pmod.load_state_dict(initial)
    opt = torch.optim.SGD(pmod.parameters(), lr=LR)
    losses, grads = [], []
    torch.manual_seed(STEPS_SEED)
    for step in steps:
        total = 0.0
        for inputs, target in step:
            local = [distribute_tensor(t, mesh, _placements(t, mesh.ndim)).to_local() for t in inputs]
            out_io = _placements(target, mesh.ndim)
            out = DTensor.from_local(pmod(*local), mesh, out_io, run_check=False)
            loss = case.loss(out, distribute_tensor(target, mesh, out_io)) / len(step)
            loss.backward()
            total += float(loss.detach().full_tensor())
        losses.append(total)
        grads.append({n: p.grad.full_tensor() for n, p in pmod.named_parameters() if p.grad is not None})
        opt.step()
        opt.zero_grad()
    final = {n: p.detach().full_tensor() for n, p in pmod.named_parameters()}
    if rank:  # full tensors: rank 0's hold every rank's shards
        return {}
    return {
        "outcome": _to_bytes(Outcome(losses, grads, final)),
        "summary": plan.summary(),
        "collectives": ap.lowered.collective_counts(),
        "batch_split": batch_split_share(plan),
    }


_ACTIVATION_ARG = {"aten.mm.default": 0, "aten.addmm.default": 1, "aten.convolution.default": 0}  # addmm: bias first


def batch_split_share(plan) -> float:
    """The share of the forward's matmuls and convolutions that read their activation split on its
    dim 0 (the batch, or the flattened batch and sequence) over some mesh dim."""
    nodes = [n for n in plan.nodes.values() if n.op in _ACTIVATION_ARG and n.phase == "forward"]
    split = [n for n in nodes if Shard(0) in n.inputs[_ACTIVATION_ARG[n.op]]]
    return len(split) / max(len(nodes), 1)


def _to_bytes(outcome: Outcome) -> bytes:
    """Tensors sent through a queue live in the sending process's shared memory, gone once it exits."""
    buffer = io.BytesIO()
    torch.save(dataclasses.asdict(outcome), buffer)
    return buffer.getvalue()


def compare(case: Case, sent: bytes) -> tuple[list[str], float]:
    """What differs between what rank 0 ``sent`` and one device's run of ``case`` (an empty list
    when all match), and the largest relative error of a gradient."""
    got = Outcome(**torch.load(io.BytesIO(sent)))
    ref = reference(case)
    differ = [
        f"loss {i}: {a} vs {b}" for i, (a, b) in enumerate(zip(got.losses, ref.losses)) if not _near(a, b, case.rel)
    ]
    for i, (mine, want) in enumerate(zip(got.grads, ref.grads)):
        if set(mine) != set(want):
            differ.append(f"step {i}: gradients of {sorted(set(mine) ^ set(want))} on one side only")
            continue
        differ += [
            f"step {i} grad {n}: {_rel(mine[n], want[n]):.2e}" for n in want if _rel(mine[n], want[n]) > case.rel
        ]
    differ += [
        f"weight {n}: {_rel(got.final[n], w):.2e}" for n, w in ref.final.items() if _rel(got.final[n], w) > case.rel
    ]
    worst = max(_rel(mine[n], want[n]) for mine, want in zip(got.grads, ref.grads) for n in want if n in mine)
    return differ, worst


def _near(a: float, b: float, rel: float) -> bool:
    return math.isclose(a, b, rel_tol=rel, abs_tol=1e-7)
