"""The parallel module: the user's module with DTensor parameters, running the lowered graphs.

Forward and backward run the partitioned per-rank graphs through one ``autograd.Function``: the
forward graph returns the outputs and the tensors it saves, the backward graph consumes them. The
module keeps the original class (so ``init_weights`` and friends still work) and the original FQNs.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.experimental import implicit_replication

from autoplan.adapters.dtensor import dtensor_spec, local_shape, local_tensor, set_local_tensor, with_spec
from autoplan.adapters.fx import boxed
from autoplan.adapters.local_tensor import (
    mesh_coordinate,
    per_rank,
    per_rank_empty,
    same_state,
    world_key,
    write_state,
)
from autoplan.adapters.modules import add_load_state_dict_pre_hook, clear_forward_hooks, non_persistent_buffers
from autoplan.cost.devices import dtype_name
from autoplan.errors import ConstraintError, InputMismatchError
from autoplan.lower.lowering import LoweredGraph
from autoplan.lower.passes.reinplace import reduce_in_place
from autoplan.plan import placements_str
from autoplan.shard.strategies import Placements
from autoplan.shard.uneven import is_uneven, local_shape_at
from autoplan.trace.inputs import InputSpec, OutputSpec


@dataclass
class Executor:
    """The compiled (or eager) forward and backward graphs and how to feed them."""

    forward: Callable
    backward: Callable  # takes its arguments as one list, which it empties (``adapters.fx.boxed``)
    n_outputs: int
    grad_slots: list[int]  # for each backward output, the forward argument it is the gradient of
    n_args: int
    tensor_outputs: list[bool]  # per model output: a tensor that can carry a gradient


class _PlanFunction(torch.autograd.Function):
    """The lowered forward and backward as one autograd node. DTensor arguments (the parameters)
    enter as they are and run on their local shards, and their gradients leave as DTensors of the
    same spec: one node for all of them, where ``to_local`` would add two Python autograd
    functions per parameter and step (its own in the forward, ``from_local``'s in the backward)."""

    @staticmethod
    def forward(ctx, executor: Executor, *args):
        ctx.specs = {i: dtensor_spec(a) for i, a in enumerate(args) if isinstance(a, DTensor)}
        args = [local_tensor(a) if i in ctx.specs else a for i, a in enumerate(args)]
        results = executor.forward(*args)
        outs, saved = results[: executor.n_outputs], results[executor.n_outputs :]
        ctx.executor = executor
        ctx.save_for_backward(*saved)
        for o, diff in zip(outs, executor.tensor_outputs):
            if isinstance(o, torch.Tensor) and not diff:
                ctx.mark_non_differentiable(o)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grad_outputs):
        executor: Executor = ctx.executor
        # one list the backward empties, and no saved copy left here: each activation is freed at
        # its last use in the backward, not when the backward ends (as the memory model counts)
        args = [*ctx.saved_tensors, *(g for g, diff in zip(grad_outputs, executor.tensor_outputs) if diff)]
        ctx.maybe_clear_saved_tensors()
        with torch.no_grad():
            grads = executor.backward(args)
        out: list = [None] * executor.n_args
        for slot, g in zip(executor.grad_slots, grads):
            out[slot] = with_spec(g, ctx.specs[slot]) if slot in ctx.specs and g is not None else g
        return (None, *out)


def make_executor(
    lowered: LoweredGraph, compile_graph: Callable[[fx.GraphModule], fx.GraphModule] | None = None
) -> Executor:
    n_args = sum(1 for k, _ in lowered.input_labels if k != "tangent")
    slot_of = {(k, t): i for i, (k, t) in enumerate(lowered.input_labels)}
    grad_slots = [slot_of[(kind.removeprefix("grad_"), t)] for kind, t in lowered.output_labels[lowered.n_outputs :]]
    tangents = {t for k, t in lowered.input_labels if k == "tangent"}
    compile_graph = compile_graph or reduce_in_place  # Inductor reinplaces what it compiles itself
    return Executor(
        forward=compile_graph(lowered.forward),
        backward=boxed(compile_graph(lowered.backward)),
        n_outputs=lowered.n_outputs,
        grad_slots=grad_slots,
        n_args=n_args,
        tensor_outputs=[i in tangents for i in range(lowered.n_outputs)],
    )


class ParallelMixin:
    """Methods mixed into the user's module class for the parallel copy."""

    _autoplan: _State

    def to_empty(self, *, device, recurse: bool = True):
        super().to_empty(device=device, recurse=recurse)
        for t in [*self.parameters(), *self.buffers()]:
            if isinstance(t, DTensor) and is_uneven(t.shape, t.placements, t.device_mesh.shape):
                # the meta shard has one rank's rows; each (simulated) rank gets its own piece's
                shape, placements, mesh = tuple(t.shape), t.placements, t.device_mesh
                at = lambda c, shape=shape, placements=placements, mesh=mesh: local_shape_at(  # noqa: E731
                    shape, placements, mesh.shape, c
                )
                set_local_tensor(t, per_rank_empty(local_tensor(t), mesh, at))
            elif isinstance(t, DTensor):
                set_local_tensor(t, per_rank(local_tensor(t)))
        # a buffer outside the state dict keeps what to_empty left unless something fills it
        unfilled = _non_persistent(self)
        for fqn in unfilled:
            _fill_unset(self.get_buffer(fqn))
        self._autoplan.unfilled = {fqn: _written(self.get_buffer(fqn)) for fqn in unfilled}
        return self

    def forward(self, *args, **kwargs):
        state = self._autoplan
        if state.unfilled:
            _check_filled(self, state)
        flat = state.bind(args, kwargs)
        _check_inputs(flat, state)
        params = [
            p if i not in state.padded else _PaddedShard.apply(p, state.padded[i])
            for i, p in enumerate(state.params(self))
        ]
        buffers = [b.to_local() if isinstance(b, DTensor) else b for b in state.buffers(self)]
        coordinate, *constants = state.per_rank([state.coordinate(), *buffers, *flat])
        outs = _PlanFunction.apply(state.executor, coordinate, *params, *constants)
        if state.written_buffers:
            outs = _write_buffers(self, state.written_buffers, outs)
        outs = [state.wrap_output(i, o) for i, o in enumerate(outs)]
        if state.returns is not None and state.returns.n_tensors == len(outs):
            return state.returns.build(outs)
        return outs[0] if len(outs) == 1 else tuple(outs)


def _write_buffers(module: nn.Module, written: list[str], outs: tuple) -> tuple:
    """Copy the step's new buffer values (the outputs after the model's own) into the module's
    buffers, as the model's forward writes them; the model's outputs remain."""
    n = len(outs) - len(written)
    with torch.no_grad():
        for fqn, value in zip(written, outs[n:]):
            buffer = module.get_buffer(fqn)
            (buffer.to_local() if isinstance(buffer, DTensor) else buffer).copy_(value)
    return outs[:n]


class _PaddedShard(torch.autograd.Function):
    """An unevenly split parameter's shard padded with zeros at its end to ``shape``, the largest
    shard's, which the lowered graph takes on every rank (``autoplan.shard.uneven``). Its gradient, the
    unpadded part, is handed back placed as the parameter with the parameter's global shape and
    strides (``to_local``'s own backward infers the strides from the rank's rows, which differ by
    rank on an uneven dim)."""

    @staticmethod
    def forward(ctx, param: DTensor, shape: tuple[int, ...]) -> torch.Tensor:
        local = param.to_local()
        ctx.param = (param.device_mesh, param.placements, param.shape, param.stride(), tuple(local.shape))
        pads = [p for d in reversed(range(local.ndim)) for p in (0, shape[d] - local.shape[d])]
        return torch.nn.functional.pad(local, pads)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        mesh, placements, shape, stride, rows = ctx.param
        for d, size in enumerate(rows):
            grad = grad.narrow(d, 0, size)
        return DTensor.from_local(grad, mesh, placements, run_check=False, shape=shape, stride=stride), None


def _non_persistent(module: nn.Module) -> list[str]:
    """FQNs of the buffers ``state_dict`` leaves out (``register_buffer(..., persistent=False)``)."""
    return [f"{name}.{b}" if name else b for name, m in module.named_modules() for b in non_persistent_buffers(m)]


def _written(t: torch.Tensor) -> tuple:
    """Which tensor holds a buffer's values (a weak reference: an id could be reused by a tensor
    that replaced it), and what it holds (``write_state``)."""
    local = local_tensor(t) if isinstance(t, DTensor) else t
    return weakref.ref(local), write_state(local)


def _fill_unset(t: torch.Tensor) -> None:
    """Fill a buffer ``to_empty`` just allocated with what no initialiser writes: NaN, or an integer
    dtype's largest value. Its uninitialised memory could already hold the very values the model's
    initialiser writes (memory a freed copy of the model left), and an in-place write through a
    DTensor leaves the local tensor's version counter alone, so only its bytes tell a write."""
    local = local_tensor(t) if isinstance(t, DTensor) else t
    if local.dtype.is_floating_point or local.dtype.is_complex:
        value = float("nan")
    elif local.dtype == torch.bool:
        return
    else:
        value = torch.iinfo(local.dtype).max
    with torch.no_grad():
        local.fill_(value)


def _check_filled(module: nn.Module, state: _State) -> None:
    """Refuse to run while a buffer outside the state dict still holds what ``to_empty`` left in it
    (``_fill_unset``): ``load_state_dict`` does not fill it (a positions ``arange`` would become
    out-of-range indices). Written in place or replaced since, it is filled."""
    stale = []
    for fqn, (held_by, seen) in state.unfilled.items():
        now_by, now = _written(module.get_buffer(fqn))
        if now_by() is held_by() and same_state(now, seen):
            stale.append(fqn)
    if stale:
        raise ConstraintError(
            f"buffer {', '.join(repr(f) for f in stale)} is not in the state dict (persistent=False) and still"
            " holds what to_empty left in it (NaN or the largest integer): call the model's init_weights() (or whatever"
            " computes it) after to_empty, or copy its values from a model built off the meta device"
            " (get_buffer(name).copy_(values) under torch.distributed.tensor.experimental.implicit_replication())"
        )
    state.unfilled = {}


def _replicating(init: Callable) -> Callable:
    """The model's own initialiser, with the plain tensors it mixes in treated as replicated."""

    def init_weights(self, *args, **kwargs):
        with implicit_replication():
            return init(self, *args, **kwargs)

    return init_weights


@dataclass
class _State:
    mesh: DeviceMesh
    executor: Executor
    param_fqns: list[str]
    buffer_fqns: list[str]
    input_locals: list[tuple[tuple[int, ...], tuple[int, ...], Placements]]  # (local, global, placements)
    inputs: InputSpec  # the traced call: how a call's arguments become the graph's inputs
    output_placements: list[Placements | None]
    output_shapes: list[tuple[torch.Size, tuple[int, ...]] | None]
    return_dtensor: bool
    written_buffers: list[str]  # buffers the forward writes, in the order their new values follow the outputs
    returns: OutputSpec | None = None  # what the model's forward returns, built around its output tensors
    padded: dict[int, tuple[int, ...]] = field(default_factory=dict)  # uneven parameter's index -> its padded shape
    coordinates: dict = field(default_factory=dict)  # per simulated world (``world_key``): this rank's mesh coordinate
    unfilled: dict = field(default_factory=dict)  # non-persistent buffer FQN -> ``_written`` right after to_empty

    @staticmethod
    @torch.compiler.disable
    def per_rank(values: list) -> list:
        """Graph inputs without gradients, each with its own storage per simulated rank (a compiled
        graph cannot mix simulated-rank tensors with plain ones); unchanged on a real rank."""
        return [per_rank(v) if isinstance(v, torch.Tensor) else v for v in values]

    @torch.compiler.disable
    def bind(self, args: tuple, kwargs: dict) -> list[torch.Tensor]:
        """The graph's inputs from a call of the module, checked against the traced call (``InputSpec.bind``)."""
        return self.inputs.bind(args, kwargs)

    @torch.compiler.disable
    def coordinate(self) -> torch.Tensor:
        key = world_key()
        if key not in self.coordinates:
            self.coordinates[key] = mesh_coordinate(self.mesh)
        return self.coordinates[key]

    def params(self, module: nn.Module) -> list[torch.Tensor]:
        return [module.get_parameter(f) for f in self.param_fqns]

    def buffers(self, module: nn.Module) -> list[torch.Tensor]:
        return [module.get_buffer(f) for f in self.buffer_fqns]

    def wrap_output(self, i: int, out):
        pl = self.output_placements[i]
        if not self.return_dtensor or pl is None or not isinstance(out, torch.Tensor):
            return out
        shape, stride = self.output_shapes[i]
        return DTensor.from_local(out, self.mesh, pl, run_check=False, shape=shape, stride=stride)


def _check_inputs(flat: list[torch.Tensor], state: _State) -> None:
    """Each graph input is this rank's shard of the traced one: its local shape and its dtype."""
    for i, (x, (name, traced), (local, glob, pl)) in enumerate(zip(flat, state.inputs.tensors, state.input_locals)):
        if x.dtype != traced.dtype:
            raise InputMismatchError(
                [f"argument {name!r} is {dtype_name(x.dtype)}, traced as {dtype_name(traced.dtype)}"],
                f"input {i} (argument {name!r}) has dtype {dtype_name(x.dtype)}, but the plan was traced with"
                f" {dtype_name(traced.dtype)}: pass it as {traced.dtype} (e.g. x.to({traced.dtype})), or plan again"
                " with an input_fn giving this dtype",
            )
        if tuple(x.shape) != local:
            raise InputMismatchError(
                [f"argument {name!r} has shape {tuple(x.shape)}, its shard is {local}"],
                f"input {i} has shape {tuple(x.shape)}, but each rank must pass its local shard of shape {local}"
                f" (argument {name!r}: global shape {glob} placed as {placements_str(pl)} on mesh"
                f" {tuple(state.mesh.shape)}). A plan runs the shapes it was traced with: for another batch"
                " (an epoch's short last batch, say), plan again with an input_fn giving that shape, or drop the"
                " short batch (DataLoader(..., drop_last=True))",
            )


def _dtensor_like(t: torch.Tensor, mesh: DeviceMesh, placements: Placements) -> torch.Tensor:
    """Shard a copy of a real tensor onto the mesh (the model's own tensors are left as they were:
    a shard or a replica of them would otherwise be their storage), or make a meta DTensor of the
    right local shape."""
    if t.device.type == "meta":
        local = torch.empty(local_shape(t.shape, mesh, placements), dtype=t.dtype, device="meta")
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=t.shape, stride=t.stride())
    return distribute_tensor(t.detach().to(mesh.device_type, copy=True), mesh, placements)


def _distribute_full_state(module, state_dict, prefix, *args):
    """Load-state-dict pre-hook: full (unsharded) tensors are distributed to the planned placements."""
    for name, current in list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False)):
        key = prefix + name
        value = state_dict.get(key)
        if isinstance(current, DTensor) and isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
            # a copy: a replicated placement's local tensor would be the caller's own tensor (and
            # the broadcast writes into it), which training would then update in place
            full = value.detach().to(current.device, copy=True)
            shards = distribute_tensor(full, current.device_mesh, current.placements)
            # adopt the shard storage itself: under a simulated world (LocalTensorMode) a local tensor
            # made by ``to_empty`` outside the simulation is shared by all ranks, so copy_ cannot fill it
            set_local_tensor(current, per_rank(local_tensor(shards).detach()))
            state_dict[key] = shards


def build_parallel_module(
    model: nn.Module,
    mesh: DeviceMesh,
    lowered: LoweredGraph,
    param_placements: dict[str, Placements],
    buffer_placements: dict[str, Placements],
    output_shapes: list,
    executor: Executor,
    inputs: InputSpec,
    return_dtensor: bool = False,
    written_buffers: list[str] = (),
    returns: OutputSpec | None = None,
) -> nn.Module:
    memo: dict[int, object] = {}
    for fqn, p in model.named_parameters():
        memo[id(p)] = nn.Parameter(_dtensor_like(p, mesh, param_placements[fqn]), requires_grad=p.requires_grad)
    for fqn, b in model.named_buffers():
        if fqn in buffer_placements:
            memo[id(b)] = _dtensor_like(b, mesh, buffer_placements[fqn])
    pmod = copy.deepcopy(model, memo)
    cls = type(model)
    extra = {"init_weights": _replicating(cls.init_weights)} if hasattr(cls, "init_weights") else {}
    pmod.__class__ = type(f"Parallel{cls.__name__}", (ParallelMixin, cls), extra)
    for m in pmod.modules():
        add_load_state_dict_pre_hook(m, _distribute_full_state)
        # the traced graph already contains what the hooks did; running them again would redo it
        clear_forward_hooks(m)
    input_locals, params = [], []
    for (kind, _), pl, local in zip(lowered.input_labels, lowered.input_placements, lowered.local_shapes):
        if kind == "input":
            input_locals.append(local + (pl,))
        elif kind == "param":
            params.append(local[0] if is_uneven(local[1], pl, mesh.shape) else None)
    object.__setattr__(
        pmod,
        "_autoplan",
        _State(
            mesh=mesh,
            executor=executor,
            param_fqns=[t for k, t in lowered.input_labels if k == "param"],
            buffer_fqns=[t for k, t in lowered.input_labels if k == "buffer"],
            input_locals=input_locals,
            inputs=inputs,
            output_placements=lowered.output_placements[: lowered.n_outputs],
            output_shapes=output_shapes,
            return_dtensor=return_dtensor,
            written_buffers=list(written_buffers),
            returns=returns,
            padded={i: shape for i, shape in enumerate(params) if shape is not None},
        ),
    )
    return pmod
