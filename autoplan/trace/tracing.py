"""Capture the joint forward+backward ATen graph of a model on fake tensors.

No real memory is used: parameters become fake tensors on the mesh's device type, so an 8B model
on ``meta`` traces on a laptop. Every node is tagged with the module path it came from (backward
nodes inherit the path of the forward op they differentiate), which clustering and pins rely on.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

from autoplan.adapters.autograd import sequence_number
from autoplan.adapters.fake import FakeTensorMode
from autoplan.adapters.functorch import InputLabel, OutputLabel, export_joint
from autoplan.adapters.fx import lazy_graph_modules
from autoplan.adapters.ops import OpOverload, schema
from autoplan.adapters.pytree import tree_flatten, tree_map_only, tree_unflatten
from autoplan.errors import TracingError
from autoplan.progress import ticker
from autoplan.trace import attention as attn
from autoplan.trace import precision, regions, stamping
from autoplan.trace.constants import KnownValues
from autoplan.trace.functions import TracedFunctions, current_module_path
from autoplan.trace.inputs import InputSpec, OutputSpec, split_call
from autoplan.trace.stamping import PATH_KEY  # the stage that stamps layers reads the paths tracing writes
from autoplan.trace.trace_errors import named_failures, reads_data

aten = torch.ops.aten
# runtime checks a decomposition leaves in the graph (one_hot's range check, once functionalized):
# ops without an output, which every rank runs on the whole value
RUNTIME_CHECKS = (aten._assert_async.default, aten._assert_async.msg)
PHASE_KEY = "autoplan_phase"
RERUN_KEY = "autoplan_rerun"  # a forward op the model's own checkpointing runs again in the backward
CHECKPOINT_KEY = "autoplan_checkpointed"  # a forward op it recomputes, its copy folded (``recompute``)
_BACKWARD = "autoplan_backward"  # in the tracer's current meta while the backward is traced
log = logging.getLogger(__name__)


@dataclass
class TracedGraph:
    """The joint graph plus the labels that tie its placeholders and outputs back to the model."""

    gm: fx.GraphModule
    input_labels: list[InputLabel]  # one per placeholder, in order
    output_labels: list[OutputLabel]  # one per graph output, in order
    joint: Any = field(repr=False)  # opaque functorch object, for later compilation
    fake_mode: FakeTensorMode = field(repr=False)
    tied: dict[str, str] = field(default_factory=dict)  # FQN of a shared parameter/buffer -> its traced FQN
    stamped: int = 0  # layers of a repeated stack copied from a traced one rather than traced (``stamping``)
    # outputs that are the new values of buffers the forward writes (output index -> buffer FQN): they
    # follow the model's own outputs, stay replicated like their buffers and are copied back after a step
    written_buffers: dict[int, str] = field(default_factory=dict)
    inputs: InputSpec | None = None  # the traced call: its tensors are the "input" placeholders, in order
    precision: dict[str, str] = field(default_factory=dict)  # the mixed-precision policy traced, by field
    returns: OutputSpec | None = None  # what forward returned: its tensors are the "output" outputs, in order

    @property
    def placeholders(self) -> list[fx.Node]:
        return [n for n in self.gm.graph.nodes if n.op == "placeholder"]

    @property
    def output_node(self) -> fx.Node:
        return next(n for n in reversed(self.gm.graph.nodes) if n.op == "output")

    def checkpointed(self, recomputed: frozenset[fx.Node] = frozenset()) -> dict[str, int]:
        """Module path -> forward ops the model's own checkpointing runs again in the backward: the
        copies traced as they are, and the folded ones (``CHECKPOINT_KEY``) among ``recomputed``
        (their aliases aside)."""
        counts: dict[str, int] = {}
        for n in self.gm.graph.nodes:
            folded = n.meta.get(CHECKPOINT_KEY) and n in recomputed and n.target is not torch.ops.aten.alias.default
            if n.meta.get(RERUN_KEY) or folded:
                counts[n.meta[PATH_KEY]] = counts.get(n.meta[PATH_KEY], 0) + 1
        return dict(sorted(counts.items()))

    def placeholder_for(self, kind: str) -> dict[Any, fx.Node]:
        """Map label target -> placeholder for one kind ("param", "buffer", "input", "tangent")."""
        return {lab[1]: n for n, lab in zip(self.placeholders, self.input_labels) if lab[0] == kind}

    def resident(self) -> set[fx.Node]:
        """Placeholders alive for the whole step and never recomputed: parameters, buffers, the batch."""
        return {n for n, lab in zip(self.placeholders, self.input_labels) if lab[0] in ("param", "buffer", "input")}

    def outputs_of(self, kind: str) -> dict[Any, fx.Node | None]:
        """Map label target -> node returned as that output ("output", "grad_param", "grad_input")."""
        outs = self.output_node.args[0]
        return {lab[1]: n for n, lab in zip(outs, self.output_labels) if lab[0] == kind}

    def output_sinks(self, fixed: Mapping[int, Any]) -> list[OutputSink]:
        """The model outputs with a placement to meet: the one ``fixed`` gives them (the user's
        constraints, by output index), else their tangent's, which the backward reads them against.
        The one rule the ILP, the costs, the memory model and the lowering all follow."""
        tangents = self.placeholder_for("tangent")
        return [
            OutputSink(i, o, None if i in fixed else tangents[i], fixed.get(i))
            for i, o in self.outputs_of("output").items()
            if isinstance(o, fx.Node) and (i in fixed or i in tangents)
        ]


@dataclass(frozen=True)
class OutputSink:
    """Model output ``index`` (graph node ``node``) must end up in ``fixed`` when given, else in
    the placement chosen for the placeholder ``tangent``."""

    index: int
    node: fx.Node
    tangent: fx.Node | None
    fixed: Any = None


class _LossWrapper(nn.Module):
    """Runs the model, then the user's loss; the model is a child so parameter FQNs keep a fixed prefix."""

    def __init__(
        self,
        model: nn.Module,
        loss_fn: Callable | None,
        inputs: InputSpec | None = None,
        policy: precision.MixedPrecisionPolicy | None = None,
        known_values: bool = False,
    ):
        super().__init__()
        self.model = model
        self.known_values = known_values  # trace under ``autoplan.trace.constants.KnownValues``
        self.loss_fn = loss_fn
        self.inputs = inputs  # the traced call: where the tensors go, and the constants between them
        self.policy = policy  # mixed precision: the casts a forward makes (``autoplan.trace.precision``)
        self.returns: OutputSpec | None = None  # what the whole model's forward returned (its first call)

    def forward(self, *tensors):
        # the graph's inputs are the call's tensors alone: its constants (None, Python numbers) go back
        # in between them here, so the trace bakes them in
        args, kwargs = (tensors, {}) if self.inputs is None else self.inputs.call(tensors)
        args, kwargs = precision.cast_inputs((args, kwargs), self.policy)
        out = precision.cast_outputs(self.model(*args, **kwargs), self.policy)
        if self.loss_fn is not None:
            out = self.loss_fn(out)
        if self.returns is None:
            self.returns = OutputSpec.of(out)
        # the outputs' tensors: output dataclasses (Hugging Face's ModelOutput) flatten, and what is no
        # tensor (a KV cache object, None, a Python number) needs no placement, so it is dropped
        return [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]


_PREFIX = "model."


def _fake_like(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)


def _fake_skeleton(model: nn.Module, fake_mode: FakeTensorMode, device: torch.device) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are fake tensors on ``device``.

    The memo makes deepcopy reuse our fakes instead of copying real (or meta) storage.
    """
    memo: dict[int, Any] = {}
    with fake_mode:
        for p in model.parameters():
            memo[id(p)] = nn.Parameter(_fake_like(p, device), requires_grad=p.requires_grad)
        for b in model.buffers():
            memo[id(b)] = _fake_like(b, device)
    return copy.deepcopy(model, memo)


@contextlib.contextmanager
def _record_module_paths(root: nn.Module, tick: Callable[[], None]):
    """Keep ``nn_module_stack`` in the tracer's current meta up to date with forward hooks (and count
    module calls, the progress of a trace). A module called while the backward is traced is the
    model's own checkpointing running its forward again: the ops it makes are marked ``RERUN_KEY``.
    The exit hook runs even when a recomputation raises (a checkpoint stops it early so); a failing
    forward keeps its module on the stack for the error that names it."""
    handles = []

    def pre(name: str):
        def hook(mod, args):
            tick()
            stack = dict(fx_traceback.current_meta.get("nn_module_stack", {}))
            stack[name] = (name, type(mod))
            fx_traceback.current_meta["nn_module_stack"] = stack
            custom = fx_traceback.current_meta.get("custom") or {}
            if custom.get(_BACKWARD):
                fx_traceback.current_meta["custom"] = {**custom, RERUN_KEY: True}

        return hook

    def post(name: str):
        def hook(mod, args, out):
            custom = fx_traceback.current_meta.get("custom") or {}
            if sys.exc_info()[1] is not None and not custom.get(RERUN_KEY):
                return  # a failing forward: its error is reported with the module it failed in
            stack = dict(fx_traceback.current_meta.get("nn_module_stack", {}))
            stack.pop(name, None)
            fx_traceback.current_meta["nn_module_stack"] = stack
            if custom.get(RERUN_KEY) and not stack:
                fx_traceback.current_meta["custom"] = {_BACKWARD: True}

        return hook

    for name, mod in root.named_modules():
        if name.startswith(_PREFIX):
            fqn = name[len(_PREFIX) :]
            handles.append(mod.register_forward_pre_hook(pre(fqn)))
            handles.append(mod.register_forward_hook(post(fqn), always_call=True))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _deepest_path(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack") or {}
    return next(reversed(stack.values()))[0] if stack else ""


def _strip(label: tuple[str, Any]) -> tuple[str, Any]:
    kind, target = label
    if isinstance(target, str) and target.startswith(_PREFIX):
        target = target[len(_PREFIX) :]
    return (kind, target)


def make_fake_inputs(
    input_fn: Callable[[], Any], fake_mode: FakeTensorMode, device: torch.device, forward: Callable | None = None
) -> tuple[InputSpec, tuple]:
    """Call ``input_fn`` under fake mode (no real memory; real tensors it returns are faked too) and
    read its value as the call of ``forward`` (``autoplan.trace.inputs``): the call's spec, and its tensors,
    the graph's inputs in order."""
    with fake_mode, torch.device(device):
        value = input_fn()
    args, kwargs = split_call(value)
    args, kwargs = tree_map_only(
        torch.Tensor, lambda t: t if fake_mode.is_our_fake(t) else fake_mode.from_tensor(t.to(device)), (args, kwargs)
    )
    spec = InputSpec.of_call(forward, args, kwargs)
    return spec, tuple(spec.bind(args, kwargs))


def _differentiable(t) -> bool:
    return isinstance(t, torch.Tensor) and t.requires_grad and (t.dtype.is_floating_point or t.dtype.is_complex)


def _probe(wrapper: _LossWrapper, args: tuple, fake_mode: FakeTensorMode, watch=None) -> tuple[list, Any]:
    """The model's flat outputs, from one forward on fake tensors, and what ``watch`` saw: a context
    to run it in, given the parameters and buffers by FQN and the flat inputs."""
    state = {**dict(wrapper.named_parameters()), **dict(wrapper.named_buffers())}
    with fake_mode, (watch or _unwatched)(state, tree_flatten(args)[0]) as seen:
        return tree_flatten(torch.func.functional_call(wrapper, state, args))[0], seen


def _unwatched(state: dict, flat_args: list) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


def _trace_fast(wrapper: _LossWrapper, args: tuple, fake_mode: FakeTensorMode, flat_out: list):
    """Joint graph by tracing autograd itself with ``make_fx``: one pass, no functionalization.

    Placeholders are ``primals_*`` (params, buffers, inputs) then ``tangents_*``; outputs are the
    model outputs, then gradients of params, then of differentiable inputs (``None`` where unused).
    ``flat_out`` are the model's outputs (from ``_probe``), whose shapes the tangents take.
    """
    named_params = list(wrapper.named_parameters())
    named_buffers = list(wrapper.named_buffers())
    flat_args, args_spec = tree_flatten(args)
    diff_out = [i for i, o in enumerate(flat_out) if _differentiable(o)]
    with fake_mode:
        tangents = [torch.empty_like(flat_out[i]) for i in diff_out]
    n_p, n_b = len(named_params), len(named_buffers)
    diff_in = [i for i, a in enumerate(flat_args) if _differentiable(a)]

    def joint(primals, tangents):
        state = {name: t for (name, _), t in zip(named_params + named_buffers, primals[: n_p + n_b])}
        inputs = tree_unflatten(primals[n_p + n_b :], args_spec)
        out = tree_flatten(torch.func.functional_call(wrapper, state, inputs))[0]
        wrt = [*primals[:n_p], *(primals[n_p + n_b + i] for i in diff_in)]
        trained = [i for i, t in enumerate(wrt) if t.requires_grad]  # a frozen parameter has no gradient
        _tag_backward_seq_nr([out[i] for i in diff_out])
        fx_traceback.current_meta["custom"] = {_BACKWARD: True}
        grads = [None] * len(wrt)
        try:
            if diff_out and trained:
                found = torch.autograd.grad(
                    [out[i] for i in diff_out], [wrt[i] for i in trained], tangents, allow_unused=True
                )
                for i, g in zip(trained, found):
                    grads[i] = g
        finally:
            fx_traceback.current_meta.pop("custom", None)
        return [*out, *grads]

    primals = [p.detach().requires_grad_(p.requires_grad) for _, p in named_params]
    primals += [b for _, b in named_buffers] + flat_args
    with fake_mode, lazy_graph_modules():
        gm = make_fx(joint, tracing_mode="real")(primals, tangents)
    in_labels, out_labels = _labels(wrapper, flat_args, flat_out)
    _lift_module_constants(gm, in_labels, wrapper)
    return gm, in_labels, out_labels


def _lift_module_constants(gm: fx.GraphModule, in_labels: list, wrapper: nn.Module) -> None:
    """Read the parameter or buffer placeholder where the graph reads a module's own tensor as a
    constant. A checkpointed closure over a layer recomputes in backward, after the traced call has
    put the module's own tensors back in place of the placeholders, so the tracer saw them as
    constants (``_param_constant0``); they are the same tensors, by identity."""
    owned = {id(t): ("param", fqn) for fqn, t in wrapper.named_parameters()}
    owned |= {id(t): ("buffer", fqn) for fqn, t in wrapper.named_buffers()}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    by_label = {tuple(lab): n for n, lab in zip(placeholders, in_labels)}
    changed = False
    for n in list(gm.graph.find_nodes(op="get_attr")):
        label = owned.get(id(getattr(gm, n.target, None)))
        if label is None:
            continue
        n.replace_all_uses_with(by_label[label])
        gm.graph.erase_node(n)
        delattr(gm, n.target)
        changed = True
    if changed:
        gm.recompile()


def _labels(wrapper: _LossWrapper, flat_args: list, flat_out: list) -> tuple[list, list]:
    """The fast path's placeholder and output labels, in graph order."""
    params = [n for n, _ in wrapper.named_parameters()]
    in_labels = [("param", n) for n in params] + [("buffer", n) for n, _ in wrapper.named_buffers()]
    in_labels += [("input", i) for i in range(len(flat_args))]
    in_labels += [("tangent", i) for i, o in enumerate(flat_out) if _differentiable(o)]
    out_labels = [("output", i) for i in range(len(flat_out))] + [("grad_param", n) for n in params]
    out_labels += [("grad_input", i) for i, a in enumerate(flat_args) if _differentiable(a)]
    return in_labels, out_labels


def _tag_backward_seq_nr(outputs: list[torch.Tensor]) -> None:
    """Make each backward op record the sequence number of the autograd node it runs for.

    Forward ops record the same number when they create that node, so backward ops can later be
    mapped to the module path of the forward op they differentiate.
    """
    seen: set = set()
    stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
    while stack:
        fn = stack.pop()
        if fn in seen:
            continue
        seen.add(fn)
        seq = sequence_number(fn)
        fn.register_prehook(lambda grads, seq=seq: fx_traceback.set_grad_fn_seq_nr(seq))
        stack.extend(f for f, _ in fn.next_functions if f is not None)


def _drop_empty_outputs(gm: fx.GraphModule, labels: list) -> list:
    """Remove the gradient slots of non-differentiable inputs, as the fast path never emits them."""
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    keep = [i for i, lab in enumerate(labels) if lab[0] != "none"]
    out.args = ([out.args[0][i] for i in keep],)
    gm.recompile()
    return [labels[i] for i in keep]


def _buffer_updates_as_outputs(gm: fx.GraphModule, labels: list) -> dict[str, str]:
    """Put the new values of the buffers the forward writes (BatchNorm's running statistics) right
    after the model outputs, labelled as further outputs: forward values with no gradient, which the
    parallel module copies back into its buffers after each step. Returns output label -> buffer FQN."""
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    values = dict(zip(map(tuple, labels), out.args[0]))
    outputs = [lab for lab in labels if lab[0] == "output"]
    written = [lab for lab in labels if lab[0] == "buffer_update"]
    new = {("output", len(outputs) + j): lab for j, lab in enumerate(written)}
    order = outputs + list(new) + [lab for lab in labels if lab[0] not in ("output", "buffer_update")]
    values |= {lab: values[old] for lab, old in new.items()}
    out.args = ([values[lab] for lab in order],)
    gm.recompile()
    labels[:] = order
    return {lab[1]: old[1] for lab, old in new.items()}


def _shared_names(wrapper: nn.Module) -> dict[str, str]:
    """Each extra FQN of a tensor that several module attributes share -> the FQN the module lists it by."""
    named = [*wrapper.named_parameters(remove_duplicate=False), *wrapper.named_buffers(remove_duplicate=False)]
    first: dict[int, str] = {}
    for fqn, t in named:
        first.setdefault(id(t), fqn)
    return {fqn: first[id(t)] for fqn, t in named if first[id(t)] != fqn}


def _merge_tied(gm: fx.GraphModule, in_labels: list, out_labels: list, shared: dict[str, str]) -> None:
    """One placeholder per tensor that several module attributes share (a tied embedding and head).

    The functionalizing export lifts every attribute separately, so a shared weight would get two
    placement decisions, count twice in the memory budget and receive two partial gradients. The
    copies' readers now read the first placeholder, and its gradient is the sum of the copies'.
    """
    if not shared:
        return
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    kept = {lab[1]: n for n, lab in zip(placeholders, in_labels) if lab[0] in ("param", "buffer")}
    for fqn, canonical in shared.items():
        if fqn in kept:
            kept[fqn].replace_all_uses_with(kept[canonical])
            gm.graph.erase_node(kept[fqn])
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    grads = dict(zip(out_labels, out.args[0]))
    for fqn, canonical in shared.items():
        extra, own = grads.pop(("grad_param", fqn), None), grads.get(("grad_param", canonical))
        if extra is not None and own is not None:
            with gm.graph.inserting_before(out):
                total = gm.graph.call_function(aten.add.Tensor, (own, extra))
            total.meta = {**own.meta, "val": own.meta["val"] + extra.meta["val"]}
            grads[("grad_param", canonical)] = total
        elif extra is not None:
            grads[("grad_param", canonical)] = extra
    out_labels[:] = [lab for lab in out_labels if lab in grads]
    out.args = ([grads[lab] for lab in out_labels],)
    in_labels[:] = [lab for lab in in_labels if not (lab[0] in ("param", "buffer") and lab[1] in shared)]
    gm.recompile()


def _mutating_ops(gm: fx.GraphModule) -> list[fx.Node]:
    return [
        n
        for n in gm.graph.nodes
        if n.op == "call_function" and isinstance(n.target, OpOverload) and schema(n.target).is_mutable
    ]


def _inherit_backward_paths(gm: fx.GraphModule) -> None:
    """Backward ops carry the autograd sequence number of the forward op they differentiate. A
    gradient's accumulation (functorch's export marks it, with whichever sequence number was
    current) runs when its last addend arrives: it takes the path of the op that made that one."""
    by_seq = {}
    for n in gm.graph.nodes:
        if n.meta.get(PATH_KEY) and "seq_nr" in n.meta:
            by_seq.setdefault(n.meta["seq_nr"], n.meta[PATH_KEY])
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    for n in gm.graph.nodes:
        if n.meta.get("is_gradient_acc") and n.all_input_nodes:
            n.meta[PATH_KEY] = max(n.all_input_nodes, key=position.__getitem__).meta.get(PATH_KEY, "")
        elif not n.meta.get(PATH_KEY) and "seq_nr" in n.meta and n.op != "placeholder":
            n.meta[PATH_KEY] = by_seq.get(n.meta["seq_nr"], "")


def _label_paths(gm: fx.GraphModule) -> None:
    """Each op's module path. Placeholders have none: the tracer made them under whatever module
    stack an earlier trace left in its current meta."""
    for node in gm.graph.nodes:
        node.meta[PATH_KEY] = "" if node.op == "placeholder" else _deepest_path(node)
        if (node.meta.get("custom") or {}).get(RERUN_KEY) and node.op == "call_function":
            node.meta[RERUN_KEY] = True
    _inherit_backward_paths(gm)
    regions.label(gm)


def forward_nodes(graph: fx.Graph, n_outputs: int) -> set[fx.Node]:
    """The forward part of a joint graph: everything its first ``n_outputs`` outputs depend on."""
    out = next(n for n in reversed(graph.nodes) if n.op == "output")
    stack = [a for a in out.args[0][:n_outputs] if isinstance(a, fx.Node)]
    forward: set[fx.Node] = set()
    while stack:
        n = stack.pop()
        if n not in forward:
            forward.add(n)
            stack.extend(n.all_input_nodes)
    return forward


def _mark_phases(gm: fx.GraphModule, n_outputs: int) -> None:
    forward = forward_nodes(gm.graph, n_outputs)
    for n in gm.graph.nodes:
        n.meta[PHASE_KEY] = "forward" if n in forward else "backward"


_MUTATES = object()  # ``_trace_repeats``: the layers write tensors in place (export them instead)


def _trace_repeats(
    wrapper: _LossWrapper, args: tuple, fake_mode: FakeTensorMode, stack: stamping.Stack, full, flat_out: list
) -> tuple | object | None:
    """The joint graph of ``wrapper`` traced with two layers of ``stack`` and stamped to all of them,
    or ``None`` where that is not proven to give what tracing every layer gives, or ``_MUTATES``
    where the layers write tensors in place (``_export_repeats`` then stamps the functional
    graph). ``full`` is the recording of the whole model's forward, ``flat_out`` its outputs."""
    if not stamping.layers_alike(full, len(stack.layers), _PREFIX + stack.path):
        log.debug("layers of %s differ: tracing all of them", stack.path)
        return None
    try:
        with stamping.truncated(stack, 2):
            short = _probe(wrapper, args, fake_mode, functools.partial(stamping.recording, stack))[1]
    except Exception as e:  # noqa: BLE001 - code that needs every layer (a depth check) is not a repeat
        log.debug("%s does not run with two layers (%s): tracing all of them", stack.path, e)
        return None
    if not stamping.proven_repeats(full, short, len(stack.layers), 2, _PREFIX + stack.path):
        log.debug("layers of %s are not proven identical: tracing all of them", stack.path)
        return None
    traced = {}
    for k in (2, 3):
        with stamping.truncated(stack, k):
            traced[k] = _trace_fast(wrapper, args, fake_mode, flat_out)
        _label_paths(traced[k][0])
        if _mutating_ops(traced[k][0]):
            return _MUTATES
    return _stamped(traced, stack, _labels(wrapper, tree_flatten(args)[0], flat_out))


def _export_repeats(
    wrapper: _LossWrapper, args: tuple, stack: stamping.Stack, attention: str, expected: tuple[list, list]
) -> tuple | None:
    """``_trace_repeats`` for layers that write tensors in place (a buffer a forward updates): two
    and three layers exported functionalized, the two stamped to all and checked against the
    three; ``None`` where that does not give the same graph. ``expected``: the fast path's labels,
    which the stamped graph's must be, less its buffer updates."""
    traced = {}
    for k in (2, 3):
        try:
            with stamping.truncated(stack, k), contextlib.ExitStack() as es:
                _enter_tracing(es, wrapper, attention, f"tracing {k} layers (functionalized)")
                gm, in_labels, out_labels, _ = export_joint(es, wrapper, args)
        except Exception as e:  # noqa: BLE001 - the whole model's export then says what fails, and where
            log.debug("%s does not export with %d layers (%s): exporting all of them", stack.path, k, e)
            return None
        traced[k] = (gm, in_labels, _drop_empty_outputs(gm, out_labels))
        _label_paths(gm)
    return _stamped(traced, stack, expected, ignore=("buffer_update",))


def _stamped(traced: dict, stack: stamping.Stack, expected: tuple[list, list], ignore: tuple = ()) -> tuple | None:
    """The two-layer graph ``traced[2]`` stamped to every layer where stamping it to three gives
    ``traced[3]`` and the result's labels (less the outputs labelled ``ignore``) are ``expected``."""
    gm2, _, out_labels = traced[2]
    # a functional graph's buffer updates come first, then the outputs: all forward values
    n_forward = sum(1 for lab in out_labels if lab[0] in ("output", "buffer_update"))
    backward = set(gm2.graph.nodes) - forward_nodes(gm2.graph, n_forward)
    try:
        if stamping.same_graph(stamping.stamp(traced[2], 3, stack.path, _PREFIX, backward), traced[3]):
            stamped = stamping.stamp(traced[2], len(stack.layers), stack.path, _PREFIX, backward)
            labels = (stamped[1], [lab for lab in stamped[2] if lab[0] not in ignore])
            if labels == tuple(map(list, expected)):
                return stamped
        log.debug("stamping %s to three layers does not give the traced graph: tracing all layers", stack.path)
    except (stamping.StampError, KeyError) as e:  # a KeyError: a copy reads a node no copy made
        log.debug("cannot stamp %s (%s): tracing all layers", stack.path, e)
    return None


def _enter_tracing(stack: contextlib.ExitStack, wrapper: nn.Module, attention: str, desc: str) -> None:
    """What every trace of ``wrapper`` runs under: progress, module paths, the attention kernels, the
    values of tensors built from constants where the model reads them (``autoplan.trace.constants``)
    and named errors (entered last, so a failure still sees the module it happened in)."""
    tick = stack.enter_context(ticker(desc, "module calls"))
    stack.enter_context(fx_traceback.preserve_node_meta())
    stack.enter_context(_record_module_paths(wrapper, tick))
    stack.enter_context(precision.casting(wrapper, wrapper.policy, "model"))  # after the paths: casts carry them
    stack.enter_context(TracedFunctions(attention))
    if wrapper.known_values:  # the values of the tensors built from constants, which the model reads
        stack.enter_context(KnownValues())
    stack.enter_context(named_failures(current_module_path))


def trace_joint(
    model: nn.Module,
    input_fn: Callable[[], Any],
    loss_fn: Callable | None = None,
    device: torch.device | str = "cpu",
    attention: str = "auto",
    repeats: bool = True,
    mp_policy: precision.MixedPrecisionPolicy | None = None,
) -> TracedGraph:
    """Trace ``loss_fn(model(...))`` (or the model's outputs) forward and backward on fake tensors,
    the model called as ``input_fn``'s value says (``autoplan.trace.inputs``: a tensor, positional arguments,
    keyword arguments or both; its tensors are the graph's inputs, its other values constants).

    The fast path traces autograd directly; models that mutate tensors in place are re-traced
    through functorch's functionalizing joint export instead. ``attention`` picks the kernel
    ``F.scaled_dot_product_attention`` traces to (see ``autoplan.trace.attention.choose_backend``):
    ``"auto"`` what a CUDA GPU runs, ``"flash"``, ``"efficient"``, ``"cudnn"``, ``"math"``
    (decomposed), or ``"cpu"`` (the host's own choice, on a CPU mesh). With ``repeats``, a deep
    stack of layers proven identical is traced as two layers and copied (``autoplan.trace.stamping``),
    on either path. ``mp_policy`` traces mixed precision (``autoplan.trace.precision``): each module's
    casts of its parameters, and which gradients must be cast before they are reduced.

    A model that reads a value (``.item()``, ``torch.equal``, a branch on a tensor) is traced again
    with the values of the tensors built from constants alone known (``autoplan.trace.constants``,
    e.g. ``nn.Transformer`` checking whether its mask is causal); keeping them costs every op one
    more dispatch, so only such models pay it.
    """
    args = (model, input_fn, loss_fn, device, attention, repeats, mp_policy)
    try:
        return _trace_joint(*args, known_values=False)
    except TracingError as e:
        if not reads_data(e):
            raise
    return _trace_joint(*args, known_values=True)


def _trace_joint(model, input_fn, loss_fn, device, attention, repeats, mp_policy, known_values: bool) -> TracedGraph:
    attn.check_option(attention)
    device = torch.device(device)
    if attention == "cpu" and device.type != "cpu":
        raise ValueError(f"attention='cpu' traces the host's CPU kernel and needs a CPU mesh, not {device.type!r}")
    fake_mode = FakeTensorMode(allow_non_fake_inputs=False)
    inputs, args = make_fake_inputs(input_fn, fake_mode, device, model.forward)
    skeleton = _fake_skeleton(model, fake_mode, device)
    wrapper = _LossWrapper(skeleton, loss_fn, inputs, precision.check_policy(mp_policy), known_values)
    joint, shared, written = None, _shared_names(wrapper), {}
    stack = stamping.find_stack(wrapper, _PREFIX) if repeats else None
    with contextlib.ExitStack() as es:
        _enter_tracing(es, wrapper, attention, "tracing")
        watch = functools.partial(stamping.recording, stack) if stack else None
        flat_out, full = _probe(wrapper, args, fake_mode, watch)
        traced = _trace_repeats(wrapper, args, fake_mode, stack, full, flat_out) if stack else None
        copied = traced is not None and traced is not _MUTATES  # layers stamped
        if traced is None:
            traced = _trace_fast(wrapper, args, fake_mode, flat_out)
            _label_paths(traced[0])
    if traced is _MUTATES or _mutating_ops(traced[0]):
        if traced is _MUTATES:
            expected = _labels(wrapper, tree_flatten(args)[0], flat_out)
            traced = _export_repeats(wrapper, args, stack, attention, expected)
        else:
            traced = None
        copied = traced is not None
        if traced is None:
            with contextlib.ExitStack() as es:
                _enter_tracing(es, wrapper, attention, "tracing (functionalized)")
                gm, in_labels, out_labels, joint = export_joint(es, wrapper, args)
            traced = (gm, in_labels, _drop_empty_outputs(gm, out_labels))
        gm, in_labels, out_labels = traced
        written = _buffer_updates_as_outputs(gm, out_labels)
        with fake_mode:
            _merge_tied(gm, in_labels, out_labels, shared)
        if not copied:
            _label_paths(gm)
        else:  # a stamped graph's paths are its layers' own; a tied gradient's sum has none
            for node in gm.graph.nodes:
                node.meta.setdefault(PATH_KEY, "")
    gm, in_labels, out_labels = traced
    stamped = len(stack.layers) - 2 if copied else 0
    for check in RUNTIME_CHECKS:
        for node in gm.graph.find_nodes(op="call_function", target=check):
            node.meta.setdefault("val", None)  # no output
    _mark_phases(gm, sum(1 for lab in out_labels if lab[0] == "output"))
    tg = TracedGraph(
        gm=gm,
        input_labels=[_strip(lab) for lab in in_labels],
        output_labels=[_strip(lab) for lab in out_labels],
        joint=joint,
        fake_mode=fake_mode,
        tied={_strip(("", a))[1]: _strip(("", b))[1] for a, b in shared.items()},
        stamped=stamped,
        written_buffers={i: _strip(("", fqn))[1] for i, fqn in written.items()},
        inputs=inputs,
        returns=wrapper.returns,
        precision=precision.describe(wrapper.policy),
    )
    precision.mark_reduced_gradients(list(tg.outputs_of("grad_param").values()), wrapper.policy)
    return tg
