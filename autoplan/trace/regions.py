"""``autoplan.local_map``: code the planner does not split, run as written on each rank's shards.

The meaning is torch's ``local_map``: the function receives each input's local shard, in the
placements ``in_placements`` declares (per mesh dim), and its outputs are the local shards of
tensors placed as ``out_placements`` declares; ``in_grad_placements`` are the placements of the
inputs' gradients it makes (by default ``in_placements``). Outside autoplan's tracing it *is*
torch's ``local_map``.

While autoplan traces, the region's inputs pass through ``autoplan::region_enter`` (the global
tensor to its local shard's shape) and its outputs through ``autoplan::region_exit`` (back), and
the body is traced between them on local shapes; backward, each boundary's gradient crosses the
other way. Every op of the body, forward and backward, is tagged with the region
(``REGION_KEY``): the planner gives it one strategy, replicated, which is what running it as
written on each rank's local tensors means, and prices it on the local shapes it really has. The
planner chooses only how values reach the region's inputs and leave its outputs. Code the
planner cannot see into, or must not split (data-dependent routing, its own collectives), goes
in a region.

A region declared ``traced=False`` is not traced at all: its body becomes one op,
``autoplan::untraced_region``, which runs the function on each rank's local tensors; its
backward, ``autoplan::untraced_region_backward``, runs it again with autograd on and
differentiates it (the region's activations are recomputed, not saved). This is the way for code
of data-dependent shapes (nonzero, boolean masks, split sizes from ``.tolist()``): its outputs'
shapes are found once by running the body on fake tensors whose data-dependent sizes are
symbols, and its FLOPs are what the user declares. Every tensor it reads must be an argument.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from collections.abc import Callable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from dataclasses import replace as dataclasses_replace

import torch
from torch import Tensor
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.experimental import local_map as torch_local_map
from torch.fx import traceback as fx_traceback

from autoplan.adapters.autograd import autograd_within_op
from autoplan.adapters.fake import data_dependent_fake_mode
from autoplan.adapters.pytree import tree_flatten, tree_unflatten
from autoplan.errors import ConstraintError, TracingError
from autoplan.trace.trace_errors import failing_op, source_line

REGION_KEY = "autoplan_region"  # in a node's meta["custom"]: the local_map region it belongs to
# the mesh shape of the trace under way (``tracing_on``), None outside autoplan's tracing
_MESH: ContextVar[tuple[int, ...] | None] = ContextVar("autoplan_region_mesh", default=None)
# the trace under way: its number in this process and its untraced regions' count so far
_CALLS: ContextVar[tuple[int, itertools.count] | None] = ContextVar("autoplan_region_calls", default=None)
_TRACES = itertools.count()  # every trace of this process gets its own number (``tracing_on``)


@contextlib.contextmanager
def tracing_on(mesh_shape: Sequence[int]):
    """Within it, ``local_map`` regions are traced as regions for a mesh of ``mesh_shape``; untraced
    regions are numbered in call order from 0 within the trace, and each trace has its own number
    (``_BODIES``' keys hold both), so no trace's region replaces another trace's."""
    token, calls = _MESH.set(tuple(mesh_shape)), _CALLS.set((next(_TRACES), itertools.count()))
    try:
        yield
    finally:
        _MESH.reset(token)
        _CALLS.reset(calls)


def _spec(mesh_shape: Sequence[int], placements: Sequence) -> str:
    """A boundary's placements as the string its op carries, e.g. ``"2x4|S0,R"``."""
    names = []
    for p in placements:
        if isinstance(p, Shard):
            names.append(f"S{p.dim}")
        elif isinstance(p, Partial):
            names.append("P")
        elif isinstance(p, Replicate):
            names.append("R")
        else:
            raise ConstraintError(f"local_map placement {p!r}: only Shard, Replicate and Partial are planned")
    return "x".join(map(str, mesh_shape)) + "|" + ",".join(names)


def placements_of(spec: str) -> tuple:
    """The placements a boundary's ``spec`` names."""
    made = {"R": Replicate(), "P": Partial()}
    return tuple(made[n] if n in made else Shard(int(n[1:])) for n in spec.split("|")[1].split(","))


def _shape(spec: str, shape: Sequence[int], to_local: bool) -> list[int]:
    mesh = [int(s) for s in spec.split("|")[0].split("x")]
    out = list(shape)
    for size, p in zip(mesh, placements_of(spec)):
        if isinstance(p, Shard):
            if to_local and out[p.dim] % size:
                raise ConstraintError(
                    f"local_map input placed {spec.split('|')[1]}: dim {p.dim} of a {tuple(shape)} tensor"
                    f" does not split {size} ways evenly"
                )
            out[p.dim] = out[p.dim] // size if to_local else out[p.dim] * size
    return out


def _grad_spec(spec: str) -> str:
    """The placements of a boundary's gradient as it crosses back: a partial sum's gradient is
    every rank's whole gradient."""
    mesh, names = spec.split("|")
    return mesh + "|" + ",".join("R" if n == "P" else n for n in names.split(","))


@torch.library.custom_op("autoplan::region_enter", mutates_args=())
def region_enter(x: Tensor, region: str, spec: str, grad_spec: str) -> Tensor:
    """A region's input: the tensor placed as ``spec``, as its local shard (the lowering passes the
    shard through; here, for a tensor already local, a copy)."""
    return x.clone()


@region_enter.register_fake
def _(x: Tensor, region: str, spec: str, grad_spec: str) -> Tensor:
    return x.new_empty(_shape(spec, x.shape, to_local=True))


@torch.library.custom_op("autoplan::region_exit", mutates_args=())
def region_exit(y: Tensor, region: str, spec: str) -> Tensor:
    """A region's output: a local shard, as the tensor placed as ``spec``."""
    return y.clone()


@region_exit.register_fake
def _(y: Tensor, region: str, spec: str) -> Tensor:
    return y.new_empty(_shape(spec, y.shape, to_local=False))


def _enter_backward(ctx, grad: Tensor):
    return region_exit(grad, ctx.region + "'", ctx.grad_spec), None, None, None


def _enter_context(ctx, inputs, output) -> None:
    _, ctx.region, _, ctx.grad_spec = inputs


def _exit_backward(ctx, grad: Tensor):
    spec = _grad_spec(ctx.spec)
    return region_enter(grad, ctx.region + "'", spec, spec), None, None


def _exit_context(ctx, inputs, output) -> None:
    _, ctx.region, ctx.spec = inputs


region_enter.register_autograd(_enter_backward, setup_context=_enter_context)
region_exit.register_autograd(_exit_backward, setup_context=_exit_context)
ENTER, EXIT = torch.ops.autoplan.region_enter.default, torch.ops.autoplan.region_exit.default


@dataclass(frozen=True)
class _Body:
    """An untraced region's body: the function with its non-tensor arguments in place, its outputs'
    local (shape, stride, dtype) and its FLOPs per rank, as declared."""

    func: Callable
    args: tuple  # the flat arguments, None where a tensor goes
    spec: object  # their pytree spec
    kwargs: dict
    outputs: tuple
    flops: float

    def __call__(self, tensors: Sequence[Tensor]) -> list[Tensor]:
        return self.run(tensors)[0]

    def run(self, tensors: Sequence[Tensor]) -> tuple[list, object]:
        """The body's flat outputs and their pytree spec."""
        given = iter(tensors)
        flat = [next(given) if a is None else a for a in self.args]
        return tree_flatten(self.func(*tree_unflatten(flat, self.spec), **self.kwargs))


# Untraced regions by key, ``region#t.n``: the n-th untraced region of trace t (``tracing_on``). A
# trace's keys are its own, so two ``AutoParallel``s of models whose regions share a name (one
# function called in both, a body defined alike) each run their own body, whatever was traced
# since; a body stays as long as the process, as the graphs naming its key may.
_BODIES: dict[str, _Body] = {}


def flops_of_body(key: str) -> float:
    return _BODIES[key].flops


@torch.library.custom_op("autoplan::untraced_region", mutates_args=())
def untraced_region(args: list[Tensor], key: str) -> list[Tensor]:
    """An untraced region's body run on the local tensors ``args`` (an output that is an input's
    memory is copied: an op's outputs are its own)."""
    inputs = {a.untyped_storage().data_ptr() for a in args}
    return [o.clone() if o.untyped_storage().data_ptr() in inputs else o for o in _BODIES[key](args)]


@untraced_region.register_fake
def _(args: list[Tensor], key: str) -> list[Tensor]:
    device = args[0].device
    return [
        torch.empty_strided(shape, stride, dtype=dtype, device=device) for shape, stride, dtype in _BODIES[key].outputs
    ]


@torch.library.custom_op("autoplan::untraced_region_backward", mutates_args=())
def untraced_region_backward(args: list[Tensor], grads: list[Tensor], key: str) -> list[Tensor]:
    """The gradients of an untraced region's floating inputs: its body run again with autograd
    on, differentiated against ``grads`` (an input it does not read gets zeros)."""
    with autograd_within_op():
        xs = [a.detach().requires_grad_(a.is_floating_point()) for a in args]
        wrt = [x for x in xs if x.requires_grad]
        outs = [(o, g) for o, g in zip(_BODIES[key](xs), grads) if o.requires_grad]
        found = torch.autograd.grad([o for o, _ in outs], wrt, [g for _, g in outs], allow_unused=True)
    return [torch.zeros_like(x) if g is None else g for x, g in zip(wrt, found)]


@untraced_region_backward.register_fake
def _(args: list[Tensor], grads: list[Tensor], key: str) -> list[Tensor]:
    return [torch.empty_like(a) for a in args if a.is_floating_point()]


def _untraced_backward(ctx, grads):
    made = iter(untraced_region_backward(list(ctx.saved_tensors), list(grads), ctx.key))
    return [next(made) if a.is_floating_point() else None for a in ctx.saved_tensors], None


def _untraced_context(ctx, inputs, output) -> None:
    args, ctx.key = inputs
    ctx.save_for_backward(*args)


untraced_region.register_autograd(_untraced_backward, setup_context=_untraced_context)
UNTRACED = (torch.ops.autoplan.untraced_region.default, torch.ops.autoplan.untraced_region_backward.default)


def _run_untraced(func, region: str, local: list, spec, kwargs: dict, flops: float):
    """The body of an untraced region as one op: its outputs' shapes found by running it on fake
    tensors where data-dependent sizes are symbols (``data_dependent_fake_mode``)."""
    tensors = [a for a in local if isinstance(a, Tensor)]
    if not tensors:
        raise ConstraintError(f"local_map region {region}: an untraced region takes at least one tensor")
    args = tuple(None if isinstance(a, Tensor) else a for a in local)
    body = _Body(func, args, spec, kwargs, (), flops)
    try:
        with data_dependent_fake_mode():
            probe = [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device) for t in tensors]
            outs, out_spec = body.run(probe)
            metas = tuple((tuple(map(int, o.shape)), tuple(map(int, o.stride())), o.dtype) for o in outs)
    except Exception as e:  # noqa: BLE001 - any failure of the user's body is reported as the region's
        source = source_line(e.__traceback__)
        raise TracingError(
            f"local_map region {region} (traced=False): its outputs' shapes could not be found on fake tensors"
            f" ({type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]})\n  at {source or '<no source line>'}"
            "\n  its outputs must have static shapes, its code must not branch on data-dependent values (int(),"
            " if, for over them), and every tensor it reads must be one of its arguments",
            op=failing_op(e),
            module_path="",
            source=source,
        ) from e
    trace, calls = _CALLS.get()
    key = f"{region}#{trace}.{next(calls)}"
    _BODIES[key] = dataclasses_replace(body, outputs=metas)
    return tree_unflatten(untraced_region(tensors, key), out_spec)


def in_region(node) -> bool:
    """Whether a traced node is a ``local_map`` region's op: a boundary, or an op of its body
    (``label``)."""
    return node.target in (ENTER, EXIT) or REGION_KEY in node.meta


def label(gm) -> None:
    """Mark each op of a region's body with its region (``REGION_KEY`` in its meta): forward ops
    were made under the region's annotation, backward ops differentiate one of them (the same
    autograd sequence number)."""
    by_seq = {}
    for n in gm.graph.nodes:
        region = (n.meta.get("custom") or {}).get(REGION_KEY)
        if region is not None and n.op == "call_function":
            n.meta[REGION_KEY] = region
            if "seq_nr" in n.meta:
                by_seq.setdefault(n.meta["seq_nr"], region)
    for n in gm.graph.nodes:
        if REGION_KEY not in n.meta and n.op == "call_function" and n.meta.get("seq_nr") in by_seq:
            n.meta[REGION_KEY] = by_seq[n.meta["seq_nr"]]


def local_map(
    func: Callable | None = None,
    out_placements=None,
    in_placements=None,
    in_grad_placements=None,
    device_mesh=None,
    *,
    redistribute_inputs: bool = True,
    traced: bool = True,
    flops: float = 0.0,
):
    """torch's ``local_map`` (same arguments, usable as a decorator), which autoplan plans as a
    region (see the module's docstring): the planner moves each input to its ``in_placements``,
    so ``redistribute_inputs`` is ``True`` by default here. ``traced=False``: the body is one op
    (data-dependent code), priced at ``flops`` per rank and call."""
    if func is None:
        return functools.partial(
            local_map,
            out_placements=out_placements,
            in_placements=in_placements,
            in_grad_placements=in_grad_placements,
            device_mesh=device_mesh,
            redistribute_inputs=redistribute_inputs,
            traced=traced,
            flops=flops,
        )
    eager = torch_local_map(
        func, out_placements, in_placements, in_grad_placements, device_mesh, redistribute_inputs=redistribute_inputs
    )

    @functools.wraps(func)
    def run(*args, **kwargs):
        mesh = _MESH.get()
        if mesh is None:
            return eager(*args, **kwargs)
        placements = (out_placements, in_placements, in_grad_placements)
        return _traced(func, mesh, placements, args, kwargs, None if traced else flops)

    return run


def _traced(func, mesh, placements, args, kwargs, untraced_flops: float | None):
    """The region's call while autoplan traces: inputs entered, the body traced (or, with
    ``untraced_flops``, run as one op), outputs exited."""
    out_placements, in_placements, in_grad_placements = placements
    region = getattr(func, "__qualname__", "local_map")
    flat, spec = tree_flatten(args)
    if in_placements is None or len(in_placements) != len(flat):
        raise ConstraintError(
            f"local_map region {region}: in_placements must give one entry per argument ({len(flat)}), got"
            f" {in_placements!r}"
        )
    grads = in_grad_placements if in_grad_placements is not None else in_placements
    local = []
    with fx_traceback.annotate({REGION_KEY: region}):
        for a, p, g in zip(flat, in_placements, grads):
            if isinstance(a, Tensor):
                if p is None:
                    raise ConstraintError(f"local_map region {region}: a tensor argument has no placements")
                a = region_enter(a, region, _spec(mesh, p), _spec(mesh, g))
            local.append(a)
        if untraced_flops is None:
            out = func(*tree_unflatten(local, spec), **kwargs)
        else:
            out = _run_untraced(func, region, local, spec, kwargs, untraced_flops)
        flat_out, out_spec = tree_flatten(out)
        placed = out_placements if isinstance(out_placements, tuple) and len(flat_out) > 1 else (out_placements,)
        if len(placed) != len(flat_out):
            raise ConstraintError(
                f"local_map region {region}: out_placements must give one entry per output ({len(flat_out)})"
            )
        made = [
            region_exit(o, region, _spec(mesh, p)) if isinstance(o, Tensor) else o for o, p in zip(flat_out, placed)
        ]
    return tree_unflatten(made, out_spec)
