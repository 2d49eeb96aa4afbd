"""Trace a deep stack of identical layers as a short one, then stamp the other layers' copies.

Tracing costs about half a millisecond per ATen op, most of a deep model's plan. Layers of one stack
that run the same ATen program on their own parameters leave the same fragment in the joint graph,
so the stack is traced with two layers and that fragment is copied.

Only where it is proven, else every layer is traced:
- a recording of the full model's forward shows every layer of the stack running the same ops,
  wired the same way, with the same autograd nodes, and its inputs chained from the previous
  layer's outputs (or shared, and needing no gradient); the code around the stack does the same
  as with the short stack;
- stamping the two-layer graph to three layers reproduces the traced three-layer graph node for node.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch import nn

from autoplan.adapters.fake import FakeTensor
from autoplan.adapters.fx import graph_module
from autoplan.adapters.modules import child_names
from autoplan.adapters.ops import TorchDispatchMode
from autoplan.adapters.pytree import tree_flatten

SMALL_CONSTANT = 4096  # elements: constants up to this size are compared by value
MIN_LAYERS = 8  # below this, tracing two and three layers to prove the stamp costs about as much as all
PATH_KEY = "autoplan_module_path"

Traced = tuple[fx.GraphModule, list, list]  # graph, input labels, output labels (as ``tracing`` makes them)


@dataclass(frozen=True)
class Stack:
    """A run of same-type layers held by one container at ``path`` (its FQN in the model)."""

    parent: nn.Module
    attr: str
    path: str
    layers: tuple[nn.Module, ...]


def find_stack(root: nn.Module, prefix: str) -> Stack | None:
    """The longest ``ModuleList``/``Sequential`` under ``prefix`` of at least ``MIN_LAYERS`` same-type layers."""
    best = None
    for name, mod in root.named_modules():
        # exactly these containers: a subclass may have its own forward, which truncating would lose
        if not name.startswith(prefix) or type(mod) not in (nn.ModuleList, nn.Sequential):
            continue
        kids = tuple(mod.children())
        if (
            len(kids) < MIN_LAYERS
            or len({type(k) for k in kids}) != 1
            or child_names(mod) != [str(i) for i in range(len(kids))]
        ):
            continue
        if best is None or len(kids) > len(best[1]):
            best = (name, kids)
    if best is None:
        return None
    parent_name, _, attr = best[0].rpartition(".")
    return Stack(root.get_submodule(parent_name), attr, best[0][len(prefix) :], best[1])


@contextlib.contextmanager
def truncated(stack: Stack, n: int) -> Iterator[None]:
    """The stack holds its first ``n`` layers only, while inside."""
    full = getattr(stack.parent, stack.attr)
    kept = stack.layers[:n]
    setattr(stack.parent, stack.attr, nn.Sequential(*kept) if isinstance(full, nn.Sequential) else nn.ModuleList(kept))
    try:
        yield
    finally:
        setattr(stack.parent, stack.attr, full)


# ---------------------------------------------------------------------------------------------
# The forward recording


def _meta(t: torch.Tensor) -> tuple:
    return (tuple(t.shape), tuple(t.stride()), t.dtype, t.requires_grad)


@dataclass
class Recording:
    """The forward's ATen ops split into segments: before the stack, one per layer call, between
    calls, after the stack. Each tensor is named by the op that made it (segment, op, output), a
    parameter's FQN, or a model input's position; the tensors are kept so their ids stay unique."""

    ref: dict[int, tuple]
    keep: list
    segments: list[list] = field(default_factory=lambda: [[]])
    layer_inputs: list[list] = field(default_factory=list)  # flat inputs of each layer call
    layer_outputs: list[list] = field(default_factory=list)  # flat outputs of each layer call
    layer_autograd: list[tuple] = field(default_factory=list)  # grad_fn names of each layer call
    ordered: bool = True  # layers called in order, once each, with nothing between their calls
    outside: dict[int, torch.Tensor] = field(default_factory=dict)  # tensors no recorded op made, by id

    def refer(self, a) -> object:
        if isinstance(a, torch.Tensor):
            found = self.ref.get(id(a))
            if found is None:
                found = self.ref[id(a)] = ("ext", id(a))
                self.outside[id(a)] = a
            return (found, _meta(a))
        return repr(a)

    def constants(self, r):
        """``r`` with the small real tensors no op made (a module making ``torch.tensor(...)`` in
        every call) named by value; read after recording, as reading them under fake mode fails."""
        if isinstance(r, tuple) and r[0][0] == "ext":
            value = _by_value(self.outside[r[0][1]])
            if value is not None:
                return (("const", *value), r[1])
        return r


class _Recorder(TorchDispatchMode):
    def __init__(self, rec: Recording):
        super().__init__()
        self.rec = rec

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.namespace == "prim":  # metadata queries (a tensor's device), asked only while uncached
            return out
        rec = self.rec
        flat, spec = tree_flatten((args, kwargs))
        seg = rec.segments[-1]
        here = (len(rec.segments) - 1, len(seg))
        seg.append((str(func), str(spec), tuple(rec.refer(a) for a in flat)))
        for i, t in enumerate(tree_flatten(out)[0]):
            if isinstance(t, torch.Tensor):
                rec.ref[id(t)] = ("op", *here, i)
                rec.keep.append(t)
        return out


def _autograd_names(outputs: list, inputs: list) -> tuple:
    """The autograd nodes a layer call built, walked from its outputs back to its inputs."""
    stop = {t.grad_fn for t in inputs if isinstance(t, torch.Tensor) and t.grad_fn is not None}
    seen, names = set(), []
    todo = [t.grad_fn for t in outputs if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    while todo:
        fn = todo.pop()
        if fn in seen or fn in stop:
            continue
        seen.add(fn)
        names.append(fn.name())
        todo.extend(f for f, _ in fn.next_functions if f is not None)
    return tuple(names)


@contextlib.contextmanager
def recording(stack: Stack, names: dict[str, torch.Tensor], inputs: list) -> Iterator[Recording]:
    """Record the forward's ops while inside (enter after the fake mode, so the recorder sees ops
    first). ``names`` are the parameters and buffers by FQN, ``inputs`` the flat model inputs."""
    ref = {id(t): ("param", n) for n, t in names.items()}
    ref.update({id(t): ("input", i) for i, t in enumerate(inputs) if isinstance(t, torch.Tensor)})
    rec = Recording(ref, [*names.values(), *inputs])
    calls = iter(range(len(stack.layers)))

    def pre(i):
        def hook(mod, args, kwargs):
            rec.ordered &= next(calls, None) == i and (i == 0 or not rec.segments[-1])
            flat = tree_flatten((args, kwargs))[0]
            rec.layer_inputs.append(flat)
            rec.keep.append(flat)
            rec.segments.append([])

        return hook

    def post(i):
        def hook(mod, args, kwargs, out):
            flat = tree_flatten(out)[0]
            rec.layer_outputs.append(flat)
            rec.layer_autograd.append(_autograd_names(flat, rec.layer_inputs[-1]))
            rec.keep.append(flat)
            rec.segments.append([])

        return hook

    handles = []
    for i, layer in enumerate(stack.layers):
        handles.append(layer.register_forward_pre_hook(pre(i), with_kwargs=True))
        handles.append(layer.register_forward_hook(post(i), with_kwargs=True))
    try:
        with _Recorder(rec):
            yield rec
    finally:
        for h in handles:
            h.remove()


def _rewritten(segment: list, rel: Callable) -> tuple:
    """A recorded segment with each op's tensor references renamed by ``rel``."""
    return tuple((f, spec, tuple(rel(a) for a in refs)) for f, spec, refs in segment)


def _layer_sig(rec: Recording, i: int, stack_path: str) -> tuple:
    """Layer call ``i`` with its own ops, inputs and parameters named relative to the layer."""
    seg = 1 + 2 * i
    own_param = f"{stack_path}.{i}."
    ins = {}
    for p, t in enumerate(rec.layer_inputs[i]):
        if isinstance(t, torch.Tensor):
            ins.setdefault(rec.refer(t)[0], ("in", p))

    def rel(r):
        if not isinstance(r, tuple):
            return r
        ref, meta = r = rec.constants(r)
        if ref in ins:
            return (ins[ref], meta)
        if ref[0] == "op" and ref[1] == seg:
            return (("own", *ref[2:]), meta)
        if ref[0] == "param" and ref[1].startswith(own_param):
            return (("param", ref[1][len(own_param) :]), meta)
        return r

    ops = _rewritten(rec.segments[seg], rel)
    io = tuple(rel(rec.refer(t)) for t in rec.layer_outputs[i])
    in_meta = tuple(_meta(t) if isinstance(t, torch.Tensor) else repr(t) for t in rec.layer_inputs[i])
    return ops, io, in_meta, rec.layer_autograd[i]


def _outer_sig(rec: Recording, n_layers: int) -> tuple:
    """The ops before and after the stack; references to the last layer's ops name it ``last``."""
    last = 1 + 2 * (n_layers - 1)

    def rel(r):
        r = rec.constants(r)
        if isinstance(r, tuple) and r[0][0] == "op" and r[0][1] == last:
            return (("last", *r[0][2:]), r[1])
        if isinstance(r, tuple) and r[0][0] == "op" and r[0][1] == 2 * n_layers:
            return (("after", *r[0][2:]), r[1])
        return r

    between = [rec.segments[2 + 2 * i] for i in range(n_layers - 1)]
    return _rewritten(rec.segments[0], rel), _rewritten(rec.segments[2 * n_layers], rel), all(not s for s in between)


def _chained(rec: Recording) -> bool:
    """Each layer's tensor inputs are the previous layer's outputs, or the same tensors as its
    inputs (needing no gradient: their gradients would sum over layers, which a copy cannot show)."""
    pattern = None
    for i in range(1, len(rec.layer_inputs)):
        prev_out = {id(t): q for q, t in enumerate(rec.layer_outputs[i - 1]) if isinstance(t, torch.Tensor)}
        here = []
        for p, t in enumerate(rec.layer_inputs[i]):
            if not isinstance(t, torch.Tensor):
                here.append(("value", repr(t)))
            elif id(t) in prev_out:
                here.append(("chain", prev_out[id(t)]))
            elif p < len(rec.layer_inputs[i - 1]) and rec.layer_inputs[i - 1][p] is t and not t.requires_grad:
                here.append(("shared",))
            else:
                return False
        if pattern is not None and here != pattern:
            return False
        pattern = here
    return True


def layers_alike(full: Recording, n_layers: int, stack_path: str) -> bool:
    """Every layer call of the full forward runs the same ops on tensors of the same shapes (its own
    parameters' included), chained from the previous layer: checked before the stack is truncated, since
    layers that differ (in width, stride, a flag or their submodules) may not even run as a short stack."""
    if not full.ordered or len(full.layer_inputs) != n_layers:
        return False
    first = _layer_sig(full, 0, stack_path)
    return all(_layer_sig(full, i, stack_path) == first for i in range(1, n_layers)) and _chained(full)


def proven_repeats(full: Recording, short: Recording, n_layers: int, n_short: int, stack_path: str) -> bool:
    """The full forward is the short one with more copies of one layer in its stack."""
    if not layers_alike(full, n_layers, stack_path) or not short.ordered or len(short.layer_inputs) != n_short:
        return False
    first = _layer_sig(full, 0, stack_path)
    same = all(_layer_sig(short, i, stack_path) == first for i in range(n_short))
    full_outer, short_outer = _outer_sig(full, n_layers), _outer_sig(short, n_short)
    return same and full_outer == short_outer and full_outer[2]


# ---------------------------------------------------------------------------------------------
# Stamping the traced graph


def _layer_index(stack_path: str) -> Callable[[str], int | None]:
    head = stack_path + "."

    def index(path: str) -> int | None:
        if not path.startswith(head):
            return None
        part = path[len(head) :].split(".", 1)[0]
        return int(part) if part.isdigit() else None

    return index


def _layers(gm: fx.GraphModule, in_labels: list, stack_path: str, prefix: str) -> dict[fx.Node, int | None]:
    """Node -> the stack layer it belongs to: parameters by their FQN, ops by their module path."""
    index = _layer_index(stack_path)
    label_of = dict(zip((n for n in gm.graph.nodes if n.op == "placeholder"), in_labels))
    layer: dict[fx.Node, int | None] = {}
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            target = label_of[n][1]
            layer[n] = index(target[len(prefix) :]) if isinstance(target, str) and target.startswith(prefix) else None
        elif n.op == "output":
            layer[n] = None
        else:
            layer[n] = index(n.meta.get(PATH_KEY, ""))
    return layer


def _runs(nodes: list[fx.Node], member: set[fx.Node]) -> list[list[fx.Node]]:
    """Maximal runs of consecutive ``nodes`` in ``member``."""
    return [list(run) for inside, run in itertools.groupby(nodes, key=member.__contains__) if inside]


class StampError(Exception):
    """The two-layer graph does not have the shape stamping needs; every layer is traced instead."""


def _relabel(label: tuple, old: str, new: str) -> tuple:
    kind, target = label
    return (kind, new + target[len(old) :]) if isinstance(target, str) and target.startswith(old) else label


def _paired_layers(
    gm: fx.GraphModule, nodes: list[fx.Node], in_labels: list, stack_path: str, prefix: str
) -> tuple[list[fx.Node], list[fx.Node]]:
    """Layer 0's and layer 1's nodes in graph order, paired by position: layer 0 is the template for
    what each copy of layer 1 reads, so the two must run the same ops."""
    layer = _layers(gm, in_labels, stack_path, prefix)
    t0 = [n for n in nodes if layer[n] == 0]
    t1 = [n for n in nodes if layer[n] == 1]
    target = functools.partial(_target, gm)
    if len(t0) != len(t1) or any(target(a) != target(b) for a, b in zip(t0, t1)):
        raise StampError("the two traced layers differ")
    return t0, t1


def _links(t: fx.Node, like: fx.Node, member0: set[fx.Node], member1: set[fx.Node]) -> dict[fx.Node, fx.Node | None]:
    """What layer 0's ``like`` reads where layer 1's ``t`` reads from outside both: layer 1's node (a
    link along the stack) or the same node (``None``: shared)."""
    mine = tree_flatten((t.args, t.kwargs))[0]
    theirs = tree_flatten((like.args, like.kwargs))[0]
    found: dict[fx.Node, fx.Node | None] = {}
    for a, b in zip(mine, theirs):
        if isinstance(a, fx.Node) and a not in member0 and a not in member1:
            if b is not a and b not in member1:
                raise StampError(f"{t.name} reads {a.name} where layer 0 reads {b}")
            role = None if b is a else b
            if found.setdefault(a, role) is not role:
                raise StampError(f"{t.name} reads {a.name} in two roles")
    return found


@dataclass
class _Stamping:
    """The stamped graph as ``stamp`` builds it: the nodes outside layer 1 copied once (``env``),
    layer 1's copied per layer (``copies[m]``, by layer 1's node), and the new inputs' labels."""

    n_layers: int
    stack_path: str
    prefix: str
    label_of: dict[fx.Node, tuple]  # placeholder -> its input label
    iso01: dict[fx.Node, fx.Node]  # layer 0's node -> layer 1's
    member0: set[fx.Node]
    member1: set[fx.Node]
    roles: dict[fx.Node, dict[fx.Node, fx.Node | None]]  # layer 1's op -> its ``_links``
    graph: fx.Graph = field(default_factory=fx.Graph)
    env: dict[fx.Node, fx.Node] = field(default_factory=dict)
    copies: list[dict[fx.Node, fx.Node]] = field(init=False)
    in_labels: list = field(default_factory=list)
    count: dict[str, int] = field(default_factory=lambda: {"primals": 0, "tangents": 0})

    def __post_init__(self) -> None:
        self.copies = [{} for _ in range(self.n_layers)]

    def fqn(self, m: int) -> str:
        """The FQN prefix of layer ``m``'s parameters."""
        return f"{self.prefix}{self.stack_path}.{m}."

    def outer_arg(self, reader: fx.Node) -> Callable[[fx.Node], fx.Node]:
        """How ``reader``, outside layer 1, reads: layer 1's nodes as their copy in layer 1 (for
        layer 0) or in the last layer (for the code after the stack), other nodes as copied."""
        copies, env, member1 = self.copies, self.env, self.member1
        last = 1 if reader in self.member0 else self.n_layers - 1
        return lambda a: copies[last][a] if a in member1 else env[a]

    def copy_arg(self, t: fx.Node, m: int) -> Callable[[fx.Node], fx.Node]:
        """How layer 1's ``t`` copied to layer ``m`` reads: layer 1's nodes as copy ``m``'s, layer
        0's as copy ``m-1``'s, a link along the stack as copy ``m+1``'s (past the last, as is)."""
        ext, copies, env, iso01 = self.roles[t], self.copies, self.env, self.iso01
        member0, member1, n_layers = self.member0, self.member1, self.n_layers

        def arg(a: fx.Node) -> fx.Node:
            if a in member1:
                return copies[m][a]
            if a in member0:
                return env[a] if m == 1 else copies[m - 1][iso01[a]]
            link = ext[a]
            return env[a] if link is None or m == n_layers - 1 else copies[m + 1][link]

        return arg

    def placeholder(self, like: fx.Node, label: tuple) -> fx.Node:
        """Named ``primals_k`` or ``tangents_k``, numbered from 1 as tracing names them."""
        kind = "tangents" if label[0] == "tangent" else "primals"
        self.count[kind] += 1
        new = self.graph.placeholder(f"{kind}_{self.count[kind]}")
        new.meta = dict(like.meta)
        self.in_labels.append(label)
        return new

    def emit_copy(self, t: fx.Node, m: int) -> None:
        """Layer 1's ``t`` copied to layer ``m``: its parameters relabelled, its module path moved."""
        if t.op == "placeholder":
            new = self.placeholder(t, _relabel(self.label_of[t], self.fqn(1), self.fqn(m)))
        else:
            new = self.graph.node_copy(t, self.copy_arg(t, m))
            new.meta = {k: v for k, v in t.meta.items() if k not in ("nn_module_stack", "fwd_nn_module_stack")}
            new.meta[PATH_KEY] = t.meta.get(PATH_KEY, "").replace(f"{self.stack_path}.1", f"{self.stack_path}.{m}", 1)
        self.copies[m][t] = new

    def emit_run(self, run: list[fx.Node], backward: set[fx.Node]) -> None:
        """A run of layer 1's nodes copied to each layer; a backward run last layer first, the order
        the backward reaches the layers in."""
        descending = all(t.op != "placeholder" and t in backward for t in run)
        for m in range(self.n_layers - 1, 0, -1) if descending else range(1, self.n_layers):
            for t in run:
                self.emit_copy(t, m)

    def outputs(self, out: fx.Node, out_labels: list) -> tuple[list, list]:
        """Layer 1's parameter gradients and the new values of the buffers it writes (a functional
        graph's ``buffer_update`` outputs) become every copy's, in their order (layer by layer)."""
        old = self.fqn(1)
        labels, values = [], []
        blocks = {
            kind: [lab for lab in out_labels if lab[0] == kind and lab[1].startswith(old)]
            for kind in ("grad_param", "buffer_update")
        }
        block_of = {lab: block for block in blocks.values() for lab in block}
        grads = dict(zip(out_labels, out.args[0]))
        for lab in out_labels:
            if lab in block_of:
                block = block_of[lab]
                if lab is not block[0]:
                    continue
                for m in range(1, self.n_layers):
                    for b in block:
                        g = grads[b]
                        if g is not None and g not in self.member1:
                            raise StampError(f"the {b[0]} output {g.name} of {b[1]} is not made inside its layer")
                        labels.append(_relabel(b, old, self.fqn(m)))
                        values.append(None if g is None else self.copies[m][g])
            else:
                labels.append(lab)
                values.append(None if grads[lab] is None else self.outer_arg(out)(grads[lab]))
        return labels, values


def stamp(traced: Traced, n_layers: int, stack_path: str, prefix: str, backward: set[fx.Node]) -> Traced:
    """The two-layer joint graph ``traced`` with its second layer copied to layers 1..n_layers-1.

    Layer copy ``m`` reads what layer 1 read, moved along the stack: layer 0's values become layer
    ``m-1``'s, the gradient arriving from after the stack becomes layer ``m+1``'s (it reaches layer
    1 from there, as layer 0's comes from layer 1). Code after the stack reads the last copy; layer
    0 reads copy 1. ``backward`` holds the backward nodes: their runs are stamped last layer first.
    """
    gm, in_labels, out_labels = traced
    nodes = list(gm.graph.nodes)
    t0, t1 = _paired_layers(gm, nodes, in_labels, stack_path, prefix)
    member0, member1 = set(t0), set(t1)
    label_of = dict(zip((n for n in nodes if n.op == "placeholder"), in_labels))
    first_of_run = {run[0]: run for run in _runs(nodes, member1)}
    roles = {b: _links(b, a, member0, member1) for a, b in zip(t0, t1) if b.op != "placeholder"}
    s = _Stamping(n_layers, stack_path, prefix, label_of, dict(zip(t0, t1)), member0, member1, roles)
    new_out_labels: list = []
    for n in nodes:
        if n in first_of_run:
            s.emit_run(first_of_run[n], backward)
        if n in member1:
            continue
        if n.op == "placeholder":
            s.env[n] = s.placeholder(n, label_of[n])
        elif n.op == "output":
            new_out_labels, values = s.outputs(n, out_labels)
            s.graph.output(values).meta = dict(n.meta)
        else:
            s.env[n] = s.graph.node_copy(n, s.outer_arg(n))
    return graph_module(gm, s.graph), s.in_labels, new_out_labels


def same_graph(a: Traced, b: Traced) -> bool:
    """Node for node the same graph (names aside): ops, targets, wiring, values' metadata, labels.
    Module paths are not compared: a backward op's is inferred, and the inference can differ."""
    (ga, ia, oa), (gb, ib, ob) = a, b
    na, nb = list(ga.graph.nodes), list(gb.graph.nodes)
    owner = {n: ga for n in na} | {n: gb for n in nb}
    if ia != ib or oa != ob or len(na) != len(nb):
        return False
    pos = {n: i for i, n in enumerate(na)} | {n: i for i, n in enumerate(nb)}

    def sig(n: fx.Node) -> tuple:
        target = _target(owner[n], n)
        flat, spec = tree_flatten((n.args, n.kwargs))
        val = n.meta.get("val")
        vals = tuple(_value_meta(v) for v in (val if isinstance(val, (tuple, list)) else (val,)))
        args = tuple(("node", pos[x]) if isinstance(x, fx.Node) else repr(x) for x in flat)
        return target, str(spec), args, vals

    return all(sig(x) == sig(y) for x, y in zip(na, nb))


def _target(gm: fx.GraphModule, n: fx.Node) -> tuple:
    """What a node runs: placeholders are told apart by their labels, constants by their values
    (each layer's copy of a constant gets its own attribute name)."""
    if n.op == "placeholder":
        return (n.op,)
    if n.op == "get_attr":
        value = _by_value(getattr(gm, n.target))
        if value is not None:
            return (n.op, *value)
    return (n.op, n.target)


def _by_value(t: object) -> tuple | None:
    """A small real CPU tensor as (dtype, shape, values), to be compared by value; else None."""
    if not isinstance(t, torch.Tensor) or isinstance(t, FakeTensor) or t.device.type != "cpu":
        return None
    if t.numel() > SMALL_CONSTANT:
        return None
    return t.dtype, tuple(t.shape), tuple(t.detach().flatten().tolist())


def _value_meta(v) -> object:
    if isinstance(v, torch.Tensor):
        return (tuple(v.shape), tuple(v.stride()), v.dtype, v.device)
    return repr(v)
