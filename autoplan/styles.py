"""A plan in the words of a hand-written ``parallelize_module`` plan, as torchtitan's ``parallelize_llama``
writes one: per module and mesh dim, ``ColwiseParallel``, ``RowwiseParallel``, ``SequenceParallel``,
``ExpertParallel``, ``FSDP`` (``fully_shard``), ``DDP`` (``replicate``) or ``Replicate``, wherever the
module's placements are what that style does, so a plan reads next to a hand-written one at a glance.

A style is read from what the plan does with a module's weight, not from how it is stored alone: stored
sharded and read sharded the same way by its matmul, the weight is tensor parallel (colwise when the
output features are split, rowwise when the input features are); stored sharded but gathered for a
matmul whose tokens are split on that mesh dim, it is FSDP. A mixture of experts' module, whose
experts' weights ``[experts, in, out]`` are read by batched matmuls over per-expert buffers
``[experts, slots, features]`` or by grouped matmuls over tokens sorted by expert, is expert parallel
where they are split over the experts (each rank runs its own experts on the tokens routed to
them), and colwise or rowwise where each expert is split. A convolution reads its weight ``[out, in,
*kernel]`` as a linear does, over activations ``[batch, channels, ...]``: split as stored on its out
channels it is the colwise analogue, ``ColwiseParallel (out channels)``, on its in channels the rowwise
one, and gathered for a split batch FSDP. A module whose first forward op reads what a convolution
just made (its batch norm) is read on that convolution's output: each rank normalising its own out
channels with its weight split alike follows the convolution's split, and ``Plan.styles`` shows the
pair on one row, ``conv1+bn1``. Anything else is shown as placements.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch.distributed.tensor import Replicate, Shard

from autoplan.shard.expert_rows import ExpertRows

if TYPE_CHECKING:
    from autoplan.plan import NodePlan, Placements, Redistribution

COLWISE = "ColwiseParallel"
ROWWISE = "RowwiseParallel"
SEQUENCE = "SequenceParallel"
EXPERT = "ExpertParallel"
CONV_COLWISE = "ColwiseParallel (out channels)"  # a convolution's (and its batch norm's) out channels split
CONV_ROWWISE = "RowwiseParallel (in channels)"
FSDP = "FSDP"
DDP = "DDP"
REPLICATE = "Replicate"
STYLES = (COLWISE, ROWWISE, CONV_COLWISE, CONV_ROWWISE, SEQUENCE, EXPERT, FSDP, DDP, REPLICATE)

_MATMULS = ("aten.mm.default", "aten.addmm.default")  # nn.Linear's forward: ``(addmm|mm)(..., x, t(w))``
_EMBEDDING = "aten.embedding.default"  # ``embedding(w, indices)``
_BMM = "aten.bmm.default"  # experts: ``bmm(buffer [E, slots, in], w [E, in, out])``
# experts: ``grouped_mm(tokens [routed, in], w [E, in, out], offsets)``
_GROUPED = ("aten._grouped_mm.default", "autoplan.grouped_mm.default")
_TRANSPOSE = "aten.t.default"
_CONV = "aten.convolution.default"  # ``convolution(x [batch, in, ...], w [out, in, *kernel], bias, ...)``


@dataclass(frozen=True)
class WeightUse:
    """How a module's forward uses its weight, one placement per mesh dim: as stored, as the module's
    op reads it (in the weight's own dims) and as the op's activations are split.

    ``op`` is ``"matmul"`` (activations [tokens, in features]), ``"embedding"`` (activations: the
    indices), ``"experts"`` (activations [experts, slots, in features]), ``"grouped"`` (experts
    reading tokens sorted by expert, [routed tokens, in features]), ``"conv"`` (activations [batch,
    in channels, ...]), ``"channels"`` (a module after a convolution, its batch norm: the activations
    are that convolution's output, [batch, out channels, ...]) or ``""`` for any other module (a
    norm: the activations are what its ops output, laid out [batch, sequence, ...] as in a
    transformer, and the weight is read as they require)."""

    op: str
    stored: Placements
    read: Placements | None = None  # None: no single op reads it (an elementwise module, or several ops)
    data: Placements | None = None  # None: the module's ops disagree
    out_dim: int = 0  # the weight's output features: 0 for nn.Linear ([out, in]), 1 for embeddings, 2 for experts


def style(use: WeightUse, mesh_dim: int) -> str:
    """The style of ``use`` on ``mesh_dim``, or its placements (``w S(0)->R, x R``: the weight stored
    ``S(0)``, read ``R``, its op's activations ``R``) where no style does what the plan does."""
    stored = use.stored[mesh_dim]
    read = None if use.read is None else use.read[mesh_dim]
    data = None if use.data is None else use.data[mesh_dim]
    if use.op and read is not None:
        if isinstance(read, Shard) and read == stored:
            if use.op in ("experts", "grouped") and read.dim == 0:
                return EXPERT
            if use.op == "conv" and read.dim in (0, 1):  # its out or in channels, not a kernel dim
                return CONV_COLWISE if read.dim == 0 else CONV_ROWWISE
            if use.op != "conv":
                return COLWISE if read.dim == use.out_dim else ROWWISE
        token_dim = 1 if use.op == "experts" else 0  # the slots of an expert's buffer are tokens
        tokens_split = isinstance(data, Shard) and (data.dim == token_dim or use.op == "embedding")
        if read == Replicate() and tokens_split:
            return FSDP if isinstance(stored, Shard) else DDP
        if read == stored == data == Replicate():
            return REPLICATE
    elif use.op == "channels" and data is not None:
        if data == Shard(1) and stored == Shard(0):  # its own out channels, normalised by their weights
            return CONV_COLWISE
        if data == Shard(0):
            return FSDP if isinstance(stored, Shard) else DDP
        if data == stored == Replicate():
            return REPLICATE
    elif not use.op and data is not None:
        if data == Shard(1) and stored == Replicate():
            return SEQUENCE
        if data == Shard(0):  # the weight, broadcast over the batch, is read whole
            return FSDP if isinstance(stored, Shard) else DDP
        if data == stored == Replicate():
            return REPLICATE
    text = f"w {stored}" + (f"->{read}" if read is not None and read != stored else "")
    return text + (f", x {data}" if data is not None else "")


def weight_uses(nodes: Iterable[NodePlan], params: dict[str, Placements]) -> dict[str, WeightUse]:
    """Module FQN -> how its forward uses its ``weight`` (or its only parameter, or the first of a
    mixture of experts' expert weights); other modules of several parameters and none named
    ``weight``, and the root module's own parameters, are left out."""
    by_module: dict[str, list[str]] = {}
    for fqn in params:
        module, _, _ = fqn.rpartition(".")
        if module:
            by_module.setdefault(module, []).append(fqn)
    nodes = list(nodes)
    forward: dict[str, list[NodePlan]] = {m: [] for m in by_module}
    for node in nodes:
        if node.phase == "forward" and node.module in forward:
            forward[node.module].append(node)
    after = conv_norms(nodes, params)
    uses = {}
    for module, fqns in by_module.items():
        experts = any(n.op == _BMM or n.op in _GROUPED for n in forward[module])
        weight = f"{module}.weight" if f"{module}.weight" in fqns else fqns[0] if len(fqns) == 1 or experts else None
        if weight is None:
            continue
        if module in after:  # a batch norm: what it normalises is its convolution's output
            conv = next(n for n in reversed(forward[after[module]]) if n.op == _CONV)
            uses[module] = WeightUse("channels", params[weight], data=conv.outputs[0])
        else:
            uses[module] = _use(params[weight], forward[module])
    return uses


def conv_norms(nodes: Iterable[NodePlan], params: dict[str, Placements]) -> dict[str, str]:
    """Module FQN -> the convolution module it follows: a module of parameters, computing no matmul
    or convolution, whose first forward op that computes comes right after that convolution
    module's last (a ``Conv2d`` then its ``BatchNorm2d``, with no op between them)."""
    modules = {fqn.rpartition(".")[0] for fqn in params}
    computing = [n for n in nodes if n.phase == "forward" and n.compute_s > 0]
    convs = {n.module for n in computing if n.op == _CONV}
    heavy = {n.module for n in computing if n.op in (_CONV, *_MATMULS, _EMBEDDING, _BMM, *_GROUPED)}
    out: dict[str, str] = {}
    seen = {computing[0].module} if computing else set()
    for before, node in zip(computing, computing[1:]):
        module = node.module
        if module != before.module and module not in seen:
            seen.add(module)
            if before.module in convs and module in modules and module not in heavy and module:
                out[module] = before.module
    return out


def module_styles(nodes: Iterable[NodePlan], params: dict[str, Placements]) -> dict[str, tuple[str, ...]]:
    """Module FQN -> its style per mesh dim (``style``)."""
    return {
        module: tuple(style(use, d) for d in range(len(use.stored)))
        for module, use in weight_uses(nodes, params).items()
    }


def _use(stored: Placements, forward: list[NodePlan]) -> WeightUse:
    """The weight's use by the module's matmul, embedding or convolution (read unknown where its calls
    differ), else, for an elementwise module, the placement all its computing ops output (unknown
    where they differ)."""
    transposed = any(n.op == _TRANSPOSE for n in forward)
    matmuls = {
        (_transpose(n.inputs[-1]) if transposed else n.inputs[-1], n.inputs[-2]) for n in forward if n.op in _MATMULS
    }
    lookups = {(n.inputs[0], n.inputs[1]) for n in forward if n.op == _EMBEDDING}
    convs = {(n.inputs[1], n.inputs[0]) for n in forward if n.op == _CONV}
    if convs:
        (read, data), *others = convs
        return WeightUse("conv", stored, None if others else read, None if others else data)
    for op, kind in ((_BMM,), "experts"), (_GROUPED, "grouped"):
        # a later matmul of the experts reading their rows where the first left them reads its tokens whole
        experts = {(n.inputs[1], _whole(n.inputs[0])) for n in forward if n.op in op}
        if experts:
            (read, data), *others = experts
            return WeightUse(kind, stored, None if others else read, None if others else data, 2)
    if matmuls or lookups:
        (read, data), *others = matmuls | lookups
        unique = not others
        op, out_dim = ("matmul", 0 if transposed else 1) if matmuls else ("embedding", 1)
        return WeightUse(op, stored, read if unique else None, data if unique else None, out_dim)
    outputs = {n.outputs[0] for n in forward if n.compute_s > 0 and n.outputs and n.outputs[0] is not None}
    return WeightUse("", stored, data=outputs.pop() if len(outputs) == 1 else None)


def _whole(placements: Placements) -> Placements:
    """Expert rows read as the whole routed tokens they are each rank's rows of."""
    return tuple(Replicate() if isinstance(p, ExpertRows) else p for p in placements)


def _transpose(placements: Placements) -> Placements:
    """A 2-D tensor's placements seen through ``t``: its dims 0 and 1 swap."""
    return tuple(Shard(1 - p.dim % 2) if isinstance(p, Shard) else p for p in placements)


def _splits_experts(n: NodePlan, inputs: tuple) -> bool:
    """Whether an experts' matmul (``_BMM`` or ``_GROUPED``) reads its experts' weights split over
    the experts (dim 0) on some mesh dim under the placements ``inputs``."""
    return any(p == Shard(0) for p in inputs[1])


def expert_lines(
    matched: list[NodePlan],
    styles: dict[str, tuple[str, ...]],
    redistributions: Iterable[Redistribution],
    mesh: dict[str, int],
    strategy_str,
) -> list[str]:
    """What ``explain`` says first about a mixture of experts' block (the nodes ``matched``; of
    repeated layers, the first): how its experts are split per mesh dim (the expert-parallel
    degree), what moves into and out of its experts' matmuls per step, by collective, and, per
    forward experts' matmul, the best alternative on the other side of the expert-parallel choice
    (each alone, every other node kept) and how much slower the step would be. Empty where
    ``matched`` holds no experts' matmul."""
    matmuls = [n for n in matched if n.op == _BMM or n.op in _GROUPED]
    if not matmuls:
        return []
    module = matmuls[0].module
    matmuls = [n for n in matmuls if n.module == module]
    forward = [n for n in matmuls if n.phase == "forward"]
    dims = [d for d in range(len(mesh)) if any(n.inputs[1][d] == Shard(0) for n in forward)]
    degree = math.prod(list(mesh.values())[d] for d in dims)
    over = " over " + " x ".join(list(mesh)[d] for d in dims) if dims else ""
    how = ", ".join(f"{label} on {name}" for name, label in zip(mesh, styles.get(module, ())))
    lines = [f"experts of {module}: expert-parallel degree {degree}{over}" + (f" ({how})" if how else "")]
    names = {n.name for n in matmuls}
    by_kind: dict[str, list] = {}
    for r in redistributions:
        if r.consumer in names or r.producer in names:
            for kind in dict.fromkeys(k for k, _ in r.collectives if k not in ("local", "relayout")):
                by_kind.setdefault(kind, []).append(r)
    moved = []
    for kind, rs in sorted(by_kind.items()):
        mib, ms = sum(r.nbytes for r in rs) / 2**20, sum(r.seconds for r in rs) * 1e3
        moved.append(f"{kind} {len(rs)} ({mib:.2f} MiB per rank, {ms:.3f} ms)")
    lines.append("  into and out of its experts' matmuls per step: " + (", ".join(moved) or "nothing moves"))
    for n in forward:
        chosen = _splits_experts(n, n.inputs)
        other = [a for a in n.alternatives if _splits_experts(n, a.inputs) != chosen]
        side = "not split over the experts" if chosen else "split over the experts"
        if other:
            best = min(other, key=lambda a: a.delta_s)
            lines.append(f"  {n.name}: next best {side}: {strategy_str(best)}, {best.delta_s * 1e3:+.3f} ms per step")
        else:
            lines.append(f"  {n.name}: no alternative {side} among the next-best strategies kept")
    return lines
