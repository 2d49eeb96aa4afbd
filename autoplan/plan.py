"""``Plan``: the chosen placements for every node, what they cost, and how they were found.

Costs here are recomputed from scratch on the *expanded* graph (every layer, every edge), never
taken from the reduced ILP, so a reduction bug shows up as a disagreement rather than a wrong report.
"""

from __future__ import annotations

import difflib
import functools
import json
import re
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from autoplan.shard.expert_rows import ExpertRows
from autoplan.solve.reports import IlpReport, SolverReport
from autoplan.styles import STYLES, conv_norms, expert_lines, module_styles

Placements = tuple[Placement, ...]


def placement_str(p: Placement) -> str:
    if isinstance(p, Replicate):
        return "R"
    if isinstance(p, Shard):
        return f"S({p.dim})"
    if isinstance(p, ExpertRows):
        return str(p)
    if isinstance(p, Partial):
        return f"P({p.reduce_op})"
    raise ValueError(f"cannot serialise placement {p!r}")


def parse_placement(s: str) -> Placement:
    if s == "R":
        return Replicate()
    m = re.fullmatch(r"S\((-?\d+)\)", s)
    if m:
        return Shard(int(m.group(1)))
    m = re.fullmatch(r"P\((\w+)\)", s)
    if m:
        return Partial(m.group(1))
    m = re.fullmatch(r"E\((\d)\)", s)
    if m:
        return ExpertRows(int(m.group(1)))
    raise ValueError(f"cannot parse placement {s!r}")


def placements_str(ps: Placements | None) -> str | None:
    return None if ps is None else _placements_text(tuple((type(p), p) for p in ps))


@functools.lru_cache(maxsize=4096)
def _placements_text(typed: tuple[tuple[type, Placement], ...]) -> str:
    """Cached: a plan has a few dozen distinct placements and writes each 10^5 times. Keyed by type
    too, since subclasses compare equal to their base (``Shard(0) == _StridedShard(0, ...)``)."""
    return "".join(placement_str(p) for _, p in typed)


_PLACEMENT = re.compile(r"R|S\(-?\d+\)|P\(\w+\)|E\(\d\)")


@functools.lru_cache(maxsize=4096)
def parse_placements(s: str | None) -> Placements | None:
    """Cached, as ``placements_str`` is: a loaded plan reads the same few texts 10^5 times."""
    return None if s is None else tuple(parse_placement(t) for t in _PLACEMENT.findall(s))


def parse_placements_strict(s: str) -> Placements:
    """Like ``parse_placements``, but for text a person typed: anything that is no placement is an error."""
    if _PLACEMENT.sub("", s.replace(" ", "")):
        raise ValueError(f"expected placements like 'S(0)R' (R, S(d), P(sum)), got {s!r}")
    return parse_placements(s)


@dataclass(frozen=True)
class Alternative:
    """Another strategy for a node, priced with every other node's choice kept: what switching this
    node alone would cost (``delta_s`` > 0: slower than the chosen one)."""

    outputs: tuple[Placements | None, ...]
    inputs: tuple[Placements, ...]
    compute_s: float
    comm_s: float  # redistributions into and out of the node under this strategy
    delta_s: float


@dataclass(frozen=True)
class NodePlan:
    name: str
    op: str
    module: str
    phase: str  # "forward" | "backward" | "" (placeholders)
    outputs: tuple[Placements | None, ...]
    inputs: tuple[Placements, ...]
    compute_s: float
    rule: str = ""  # where the strategy came from: "dtensor", "dtensor-1d", "autoplan", "fallback", "placeholder"
    comm_s: float = 0.0  # redistributions into and out of the node (each is also counted at its other end)
    alternatives: tuple[Alternative, ...] = ()  # the next-best strategies, cheapest first


@dataclass(frozen=True)
class Redistribution:
    """A placement change the plan implies: producer's output -> what a consumer (or a sink) expects."""

    consumer: str  # node name, or "grad:<fqn>" / "output:<i>" for graph outputs
    producer: str
    src: Placements
    dst: Placements
    collectives: tuple[tuple[str, int], ...]  # (kind, mesh dim) in execution order
    seconds: float
    phase: str
    nbytes: int = 0  # one rank's shard of the moved tensor, in its source placement
    again: bool = False  # the backward's second run of a forward move (a parameter's regather)


@dataclass(frozen=True)
class CostBreakdown:
    compute_forward: float
    compute_backward: float
    comm_forward: float
    comm_backward: float
    recompute: float = 0.0  # forward ops the backward runs again (compute and input moves)
    hidden_comm: float = 0.0  # communication that runs under compute (``autoplan.cost.overlap``)
    ideal_compute: float = 0.0  # the step's model FLOPs at the devices' peak rate, spread over all of them
    # in comm, exposed: what the buckets' latency adds beyond the shares of it the moves paid. Each
    # bucket of a layer's parameter or gradient moves pays one launch and latency; the ILP prices
    # each move at its share (``Move.share``), so this is 0 where a plan moves all of a layer's,
    # and the ILP's objective is ``total - bucket_latency``
    bucket_latency: float = 0.0

    @property
    def comm(self) -> float:
        return self.comm_forward + self.comm_backward

    @property
    def exposed_comm(self) -> float:
        return max(self.comm - self.hidden_comm, 0.0)  # all hidden: not a rounding's -0.0

    @property
    def total(self) -> float:
        return self.compute_forward + self.compute_backward + self.exposed_comm + self.recompute

    @property
    def mfu(self) -> float:
        """Model FLOPs utilisation the estimate implies: model FLOPs / (devices x peak x step)."""
        return self.ideal_compute / self.total if self.total > 0 else 0.0


@dataclass(frozen=True)
class MemoryReport:
    """Per-device bytes of one training step (``autoplan.cost.memory``): parameters, gradients, optimizer
    states, the activations saved for backward, and the peak of the step with what is alive then."""

    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    per_param: dict[str, int] = field(default_factory=dict)  # FQN -> per-device bytes of that parameter
    activation_bytes: int = 0  # forward values the backward reads
    peak_bytes: int = 0  # the most bytes alive at once, optimizer states included
    peak_at: str = ""  # the node running then
    peak_phase: str = ""
    peak_parts: dict[str, int] = field(default_factory=dict)  # what is alive at the peak, by kind


@dataclass
class Plan:
    mesh_shape: tuple[int, ...]
    mesh_dim_names: tuple[str, ...] | None
    device: str
    nodes: dict[str, NodePlan]
    param_placements: dict[str, Placements]
    cost: CostBreakdown
    memory: MemoryReport
    redistributions: list[Redistribution]
    solver: SolverReport
    ilp: IlpReport
    timings: dict[str, float]
    layer_classes: list[list[str]] = field(default_factory=list)
    passes: dict[str, int] = field(default_factory=dict)  # what the post-solve passes did when applied
    recompute: dict[str, str] = field(default_factory=dict)  # layer -> recompute option (``autoplan.trace.recompute``)
    # module -> forward ops the model's own checkpointing (``torch.utils.checkpoint``) reruns in backward
    checkpointed: dict[str, int] = field(default_factory=dict)
    # per layer and phase: the compute its prefetches and gradient reductions can hide under, s
    overlap_budget: dict[str, float] = field(default_factory=dict)
    # what the plan was made for: each parameter's, buffer's and input's dtype and global shape
    signature: dict[str, str] = field(default_factory=dict)
    # priced for a program that gathers parameters a layer ahead (``AutoParallel(prefetch=True)``)
    prefetch: bool = False
    # the mixed-precision policy traced (``AutoParallel(mp_policy=...)``): its dtypes by field, set ones only
    precision: dict[str, str] = field(default_factory=dict)

    # ---- reporting -------------------------------------------------------------------------

    def collective_counts(self) -> dict[str, int]:
        """The collectives one step runs, by kind: the backward's regathers of parameters included."""
        counts: dict[str, int] = defaultdict(int)
        for r in self.redistributions:
            for kind, _ in r.collectives:
                counts[kind] += 1
        return dict(sorted(counts.items()))

    def summary(self) -> str:
        """A readable report; repeated layers appear once, as ``layers.*``."""
        lines = [
            f"autoplan plan on mesh {self._mesh_label()} for {self.device}",
            f"estimated step: {self.cost.total * 1e3:.2f} ms  (compute fwd {self.cost.compute_forward * 1e3:.2f}"
            f" / bwd {self.cost.compute_backward * 1e3:.2f}, comm fwd {self.cost.comm_forward * 1e3:.2f}"
            f" / bwd {self.cost.comm_backward * 1e3:.2f} of which {self.cost.hidden_comm * 1e3:.2f} under compute"
            f" and {self.cost.bucket_latency * 1e3:.2f} buckets' latency beyond their moves' shares,"
            f" recompute {self.cost.recompute * 1e3:.2f}); MFU {self.cost.mfu:.1%}",
            *_replicated_lines(self.nodes, self.ilp),
            f"recompute: {_recompute_line(self.recompute, self.checkpointed)}",
            *([f"mixed precision: {_precision_line(self.precision)}"] if self.precision else []),
            f"memory per device: params {_gib(self.memory.param_bytes)}, grads {_gib(self.memory.grad_bytes)},"
            f" optimizer {_gib(self.memory.optimizer_bytes)}, activations saved {_gib(self.memory.activation_bytes)}",
            f"estimated peak: {_gib(self.memory.peak_bytes)} at {self.memory.peak_at} ({self.memory.peak_phase}): "
            + ", ".join(f"{k} {_gib(v)}" for k, v in self.memory.peak_parts.items()),
            "",
            f"{'parameter':<48} {'placement':<14} copies",
        ]
        for pattern, (pl, n) in _by_pattern(self.param_placements).items():
            lines.append(f"{pattern:<48} {pl:<14} {n}")
        lines += _style_lines(self._style_rows(), self._dim_names())
        lines += ["", f"{'matmul-like op (module)':<48} {'inputs -> output':<40} copies"]
        heavy = defaultdict(int)
        for node in self.nodes.values():
            if _short_op(node.op) in _HEAVY_OPS:
                ins = ", ".join(placements_str(p) or "-" for p in node.inputs)
                key = (
                    f"{_pattern(node.module)} {_short_op(node.op)} [{node.phase[:3]}]",
                    f"{ins} -> {placements_str(node.outputs[0])}",
                )
                heavy[key] += 1
        for (where, how), n in heavy.items():
            lines.append(f"{where:<48} {how:<40} {n}")
        lines += [
            "",
            "collectives: " + ", ".join(f"{k} {v}" for k, v in self.collective_counts().items()),
            f"ops with no sharding rule (run replicated): {_no_rule_line(self.nodes)}",
            f"ILP: {self.ilp.get('n_vars')} variables, {self.ilp.get('n_rows')} rows;"
            f" solver {self.solver.get('backend')} {self.solver.get('status')}, gap {self.solver.get('gap')}",
            *_refinement_lines(self.ilp.get("refinements", [])),
            "planning time: " + ", ".join(f"{k} {v:.2f}s" for k, v in self.timings.items()),
        ]
        return "\n".join(lines + _pass_lines(self.passes))

    def styles(self) -> dict[str, tuple[str, ...]]:
        """Per module, one entry per mesh dim: the plan in the words of a hand-written
        ``parallelize_module`` plan (``ColwiseParallel``, ``FSDP``, ...; ``autoplan.styles``), or the
        placements where no style does what the plan does. Repeated layers appear once, as
        ``layers.*``; a copy that differs gets its own entry. A convolution and the batch norm after
        it are one entry, ``blocks.*.conv1+bn1`` (a cell ``conv / bn`` where they differ)."""
        return {module: labels for module, (labels, _) in self._style_rows().items()}

    def styles_by_module(self) -> dict[str, tuple[str, ...]]:
        """``styles`` for every module by its own path (each layer's copy apart)."""
        return module_styles(self.nodes.values(), self.param_placements)

    def _style_rows(self) -> dict[str, tuple[tuple[str, ...], int]]:
        return _fold(_paired(self.styles_by_module(), conv_norms(self.nodes.values(), self.param_placements)))

    def param_table(self) -> list[tuple[str, str, int, int]]:
        """One row per layer pattern (``layers.*.attention.wq.weight``): placements, copies, and
        per-device bytes of all copies together. A copy placed differently gets its own row."""
        rows, keys = _by_pattern(self.param_placements), _row_keys(self.param_placements)
        nbytes: dict[str, int] = defaultdict(int)
        for fqn, n in self.memory.per_param.items():
            nbytes[keys[fqn]] += n
        return [(pattern, pl, copies, nbytes.get(pattern, 0)) for pattern, (pl, copies) in rows.items()]

    def matching(self, target: str) -> list[NodePlan]:
        """Nodes named ``target``, or in the module ``target`` (a path or a ``layers.*`` pattern)."""
        if target in self.nodes:
            return [self.nodes[target]]
        pattern = re.compile(re.escape(target).replace(r"\*", r"[^.]+") + r"(\..*)?")
        found = [n for n in self.nodes.values() if pattern.fullmatch(n.module)]
        if not found:
            modules = sorted({_pattern(n.module) for n in self.nodes.values() if n.module})
            close = difflib.get_close_matches(_pattern(target), modules, n=5) or modules[:10]
            raise KeyError(f"no node or module {target!r} in the plan; modules include: {', '.join(close)}")
        return found

    def explain(self, target: str, all_ops: bool = False) -> str:
        """Why ``target`` (a node name or module path) took its placements: each node's chosen
        strategy with its compute and redistribution seconds, then the next-best alternatives and
        how much slower each would make the step. Repeated layers given as ``layers.*`` show once.

        Of a module, only the ops that compute are shown unless ``all_ops``: its views, aliases and
        tuple items (ops of no compute time, most of a module's nodes) are left out, and the data
        moved into them (a parameter's gather, say) is listed after, one line per move."""
        seen: set[tuple] = set()
        moved, hidden = [], set()
        matched = self.matching(target)
        mesh = dict(zip(self._dim_names(), self.mesh_shape))
        lines = expert_lines(matched, self.styles_by_module(), self.redistributions, mesh, _strategy_str)
        for node in matched:
            key = (_pattern(node.module), node.op, node.phase, node.inputs, node.outputs)
            if "*" in target and key in seen:
                continue
            seen.add(key)
            if all_ops or node.name == target or node.compute_s > 0:
                lines += _explain_node(node)
            else:
                hidden.add(node.name)
        for r in self.redistributions:
            if r.consumer in hidden and r.collectives:
                moved.append(_move_line(r, self.nodes[r.consumer]))
        if moved:
            lines += ["moves into the views and aliases left out (parameter gathers among them):", *moved]
        if hidden:
            lines.append(
                f"({len(hidden)} views, aliases and tuple items left out: explain(..., all_ops=True) or --all)"
            )
        return "\n".join(lines)

    def diff(self, other: Plan) -> PlanDiff:
        """What ``other`` does differently: cost, parameter placements and node strategies, grouped
        by layer pattern. Plans of two meshes, models or devices compare too, with a warning saying
        what differs (``PlanDiff.unlike``): their placements differ for that reason alone."""
        params: dict[tuple, int] = defaultdict(int)
        for fqn, pl in self.param_placements.items():
            theirs = other.param_placements.get(fqn)
            if theirs != pl:
                params[(_pattern(fqn), placements_str(pl), placements_str(theirs))] += 1
        nodes: dict[tuple, int] = defaultdict(int)
        for name, a in self.nodes.items():
            b = other.nodes.get(name)
            if b is None or (a.inputs, a.outputs) != (b.inputs, b.outputs):
                nodes[(_pattern(a.module), _short_op(a.op), a.phase, _strategy_str(a), b and _strategy_str(b))] += 1
        return PlanDiff(
            cost={k: (getattr(self.cost, k), getattr(other.cost, k)) for k in _COST_FIELDS},
            collectives=(self.collective_counts(), other.collective_counts()),
            params=dict(params),
            nodes=dict(nodes),
            unlike=tuple(_unlike(self, other)),
        )

    def _dim_names(self) -> tuple[str, ...]:
        return self.mesh_dim_names or tuple(f"d{i}" for i in range(len(self.mesh_shape)))

    def _mesh_label(self) -> str:
        return "(" + ", ".join(f"{n}={s}" for n, s in zip(self._dim_names(), self.mesh_shape)) + ")"

    # ---- JSON --------------------------------------------------------------------------------

    def to_dict(self, timings: bool = True) -> dict:
        """Plain data; without ``timings`` no wall-clock figure is kept (planning phases, solver and
        re-solve seconds), so the same model, mesh and constraints give the same bytes every run."""
        d = asdict(replace(self, nodes={}, param_placements={}, redistributions=[]))  # asdict deep-copies: slow
        if not timings:
            d["timings"] = {}
            d["solver"] = {k: v for k, v in d["solver"].items() if k not in ("build_time", "solve_time")}
            d["ilp"]["refinements"] = [{k: v for k, v in r.items() if k != "solve_s"} for r in d["ilp"]["refinements"]]
        d["nodes"] = {k: _strategy_to_dict(v) for k, v in self.nodes.items()}
        d["param_placements"] = {k: placements_str(v) for k, v in self.param_placements.items()}
        d["redistributions"] = [_redistribution_to_dict(r) for r in self.redistributions]
        return d

    def to_json(self, path: str | Path | None = None, timings: bool = True) -> str:
        """``to_dict`` as JSON text, one line per node and per redistribution: a diff of two plans
        reads node by node, and each line goes through json's C encoder (``indent`` would put all
        of an 8B plan's 10^4 nodes through its pure-Python one)."""
        text = "{\n" + ",\n".join(f" {json.dumps(k)}: {_json_lines(v)}" for k, v in self.to_dict(timings).items())
        text += "\n}\n"
        if path is not None:
            Path(path).write_text(text)
        return text

    @classmethod
    def from_dict(cls, d: dict) -> Plan:
        return cls(
            mesh_shape=tuple(d["mesh_shape"]),
            mesh_dim_names=tuple(d["mesh_dim_names"]) if d["mesh_dim_names"] is not None else None,
            device=d["device"],
            nodes={k: _node_from_dict(v) for k, v in d["nodes"].items()},
            param_placements={k: parse_placements(v) for k, v in d["param_placements"].items()},
            cost=CostBreakdown(**d["cost"]),
            memory=MemoryReport(**d["memory"]),
            redistributions=[
                Redistribution(
                    consumer=r["consumer"],
                    producer=r["producer"],
                    src=parse_placements(r["src"]),
                    dst=parse_placements(r["dst"]),
                    collectives=tuple((k, m) for k, m in r["collectives"]),
                    seconds=r["seconds"],
                    phase=r["phase"],
                    nbytes=r.get("nbytes", 0),
                    again=r.get("again", False),
                )
                for r in d["redistributions"]
            ],
            solver=SolverReport.from_dict(d["solver"]),
            ilp=IlpReport.from_dict(d["ilp"]),
            timings=d["timings"],
            layer_classes=d["layer_classes"],
            passes=d.get("passes", {}),
            recompute=d.get("recompute", {}),
            checkpointed=d.get("checkpointed", {}),
            overlap_budget=d.get("overlap_budget", {}),
            signature=d.get("signature", {}),
            prefetch=d.get("prefetch", False),
            precision=d.get("precision", {}),
        )

    @classmethod
    def from_json(cls, text_or_path: str | Path) -> Plan:
        text = str(text_or_path)
        if not text.lstrip().startswith("{"):
            text = Path(text_or_path).read_text()
        return cls.from_dict(json.loads(text))


_HEAVY_OPS = {
    "mm",
    "addmm",
    "bmm",
    "embedding",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
}


_PASS_STAGES = (
    "before_passes",
    "after_round_trips",
    "after_passes",
    "per_layer_forward_before_bucketing",
    "per_layer_backward_before_bucketing",
    "per_layer_forward",
    "per_layer_backward",
)


# where replicated ops take at least this share of the forward compute time, the summary says what splitting costs
REPLICATED_SHARE = 0.5


def forward_compute(nodes: Iterable[NodePlan]) -> list[NodePlan]:
    """The forward ops that compute: every op priced with compute time (matmuls, convolutions,
    attention, pointwise ops, reductions, norms, copies), not views, aliases or tuple items, which
    take none; nor a ``local_map`` region's ops, which run on each rank's shards whatever their
    (replicated) strategy says."""
    return [n for n in nodes if n.phase == "forward" and n.compute_s > 0 and n.rule != "local_map"]


def replicated(outputs: tuple[Placements | None, ...], inputs: tuple[Placements | None, ...]) -> bool:
    """Whether a strategy runs its op whole on every rank: each output ``Replicate`` on every mesh
    dim, and no input split (``Shard``) on any."""
    whole = all(o is None or all(isinstance(p, Replicate) for p in o) for o in outputs)
    return whole and not any(isinstance(p, Shard) for i in inputs if i is not None for p in i)


def replicated_compute(nodes: Iterable[NodePlan]) -> tuple[int, int, float]:
    """Of the forward compute ops (``forward_compute``): how many run replicated (``replicated``),
    how many there are, and the replicated ones' share of their compute seconds (0 where none)."""
    compute = forward_compute(nodes)
    whole = [c for c in compute if replicated(c.outputs, c.inputs)]
    total = sum(c.compute_s for c in compute)
    return len(whole), len(compute), sum(c.compute_s for c in whole) / total if total > 0 else 0.0


def _replicated_lines(nodes: dict[str, NodePlan], ilp: IlpReport) -> list[str]:
    """``compute replicated on all ranks: 26 of 26 forward ops, 100.0% of their time``; where that
    share of the time is at least ``REPLICATED_SHARE`` and the planner priced a plan splitting them
    (``IlpReport.split_objective``), a second line comparing the two."""
    n, total, share = replicated_compute(nodes.values())
    if not total:
        return []
    lines = [f"compute replicated on all ranks: {n} of {total} forward ops, {share:.1%} of their compute time"]
    split, chosen = ilp.get("split_objective"), ilp.get("objective")
    if share < REPLICATED_SHARE or split is None:
        return lines
    priced = f"{split * 1e3:.3f} ms per step against this plan's {chosen * 1e3:.3f} ms (the ILP's estimates)"
    if split > chosen:
        why = f"{priced}: its collectives cost more than splitting the compute saves"
    else:
        why = f"{priced}, no faster"
    return [*lines, f"  why: the best plan splitting every forward op that can split takes {why}"]


def _pass_lines(passes: dict[str, int]) -> list[str]:
    """``passes: round trips removed 32, ...`` then one line of collective counts per stage."""
    if not passes:
        return []
    counts = {k: v for k, v in passes.items() if not k.endswith(_PASS_STAGES)}
    lines = ["passes: " + ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in counts.items())]
    for stage in _PASS_STAGES:
        kinds = {k.removesuffix(f"_{stage}"): v for k, v in passes.items() if k.endswith(f"_{stage}")}
        if kinds:
            lines.append(f"collectives {stage.replace('_', ' ')}: " + ", ".join(f"{k} {v}" for k, v in kinds.items()))
    return lines


def _precision_line(precision: dict[str, str]) -> str:
    """``MixedPrecisionPolicy``'s fields in the words of a training recipe."""
    words = {
        "param_dtype": "compute and parameter gathers in {}",
        "reduce_dtype": "gradients reduced in {}",
        "output_dtype": "outputs in {}",
    }
    said = ", ".join(words[k].format(v) for k, v in precision.items() if k in words)
    return said + "; parameters and optimizer states keep their own dtype"


def _recompute_line(choice: dict[str, str], checkpointed: dict[str, int]) -> str:
    """``full: layers.0-31`` style: layers grouped by option, then what the model checkpoints itself."""
    by_option: dict[str, list[str]] = defaultdict(list)
    for layer, option in choice.items():
        by_option[option].append(layer)
    parts = [f"{option} on {len(layers)} layers ({', '.join(layers)})" for option, layers in by_option.items()]
    if checkpointed:
        parts.append(
            f"the model's own checkpointing reruns {sum(checkpointed.values())} forward ops in backward"
            f" ({', '.join(checkpointed)})"
        )
    return "; ".join(parts) if parts else "none (every forward value the backward reads is saved)"


def _refinement_lines(refinements: list[dict]) -> list[str]:
    """``boundary layers re-solved on their own: layers.0 (-3.97 us, kept), layers.3 (no gain)``."""
    if not refinements:
        return []
    steps = [
        f"{'+'.join(r['layers'])} " + (f"(-{r['gain_s'] * 1e6:.3g} us, kept)" if r["kept"] else "(no gain)")
        for r in refinements
    ]
    return ["boundary layers re-solved on their own: " + ", ".join(steps)]


def _no_rule_line(nodes: dict[str, NodePlan]) -> str:
    """How many nodes fell back to running replicated for want of a sharding rule, by op."""
    ops = Counter(n.op for n in nodes.values() if n.rule == "fallback")
    if not ops:
        return "none"
    n = sum(ops.values())
    return f"{n} node{'s' * (n != 1)}: " + ", ".join(f"{op} ({k})" for op, k in ops.most_common())


def _short_op(op: str) -> str:
    """``aten.mm.default`` -> ``mm``."""
    parts = op.split(".")
    return parts[1] if len(parts) > 2 else op


def _gib(n: int) -> str:
    """Bytes in the largest binary unit that keeps a leading digit (a debug model has no GiB)."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def _pattern(path: str) -> str:
    return re.sub(r"\.\d+(\.|$)", r".*\1", path)


def _row_keys(params: dict[str, object]) -> dict[str, str]:
    """FQN -> its row: the layer pattern, or the FQN itself for a copy placed unlike the first."""
    first: dict[str, object] = {}
    keys = {}
    for fqn, pl in params.items():
        pattern = _pattern(fqn)
        keys[fqn] = pattern if first.setdefault(pattern, pl) == pl else fqn
    return keys


def _fold(values: dict) -> dict:
    """Path -> value folded into rows (``_row_keys``): row -> (its value, copies)."""
    out = {}
    for path, key in _row_keys(values).items():
        value, n = out.get(key, (values[path], 0))
        out[key] = (value, n + 1)
    return out


def _by_pattern(params: dict[str, Placements]) -> dict[str, tuple[str, int]]:
    return {key: (placements_str(pl), n) for key, (pl, n) in _fold(params).items()}


def _paired(styles: dict[str, tuple[str, ...]], after: dict[str, str]) -> dict[str, tuple[str, ...]]:
    """``styles`` with each convolution and the batch norm after it (``after``: norm -> convolution)
    as one entry, ``conv+bn`` (the norm by its own name where the two are siblings: ``blocks.0.conv1+bn1``,
    ``stem.0+1``); a cell reads ``conv / bn`` where their styles differ."""
    follower = {conv: bn for bn, conv in after.items() if bn in styles and conv in styles}
    out = {}
    for module, labels in styles.items():
        if module in follower:
            bn = follower[module]
            parent, _, name = bn.rpartition(".")
            short = name if parent == module.rpartition(".")[0] else bn
            out[f"{module}+{short}"] = tuple(c if c == b else f"{c} / {b}" for c, b in zip(labels, styles[bn]))
        elif module not in follower.values():
            out[module] = labels
    return out


def _style_lines(rows: dict[str, tuple[tuple[str, ...], int]], dims: tuple[str, ...]) -> list[str]:
    """The table of ``Plan.styles``: a module per row, a mesh dim per column, then its copies."""
    if not rows:
        return []
    widths = [max(len(dim), *(len(labels[i]) for labels, _ in rows.values())) for i, dim in enumerate(dims)]

    def line(module: str, cells: tuple[str, ...], copies: object) -> str:
        return f"{module:<48} " + "  ".join(f"{c:<{w}}" for c, w in zip(cells, widths)) + f"  {copies}"

    lines = ["", line("module (torchtitan style)", dims, "copies")]
    lines += [line(module, labels, n) for module, (labels, n) in rows.items()]
    if any(part not in STYLES for labels, _ in rows.values() for label in labels for part in label.split(" / ")):
        lines.append("(other cells: w = the weight as stored->as its op reads it, x = that op's activations)")
    return lines


def _placements_list(ps) -> list[str | None]:
    return [placements_str(p) for p in ps]


def _json_lines(value) -> str:
    """``value`` as JSON; a dict or list of dicts (nodes, redistributions) one entry per line."""
    if isinstance(value, dict) and value and all(isinstance(v, dict) for v in value.values()):
        return "{\n" + ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in value.items()) + "\n }"
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        return "[\n" + ",\n".join(f"  {json.dumps(v)}" for v in value) + "\n ]"
    return json.dumps(value)


def _strategy_to_dict(s: NodePlan | Alternative) -> dict:
    """A node's plan or one of its alternatives as JSON data, its fields in declaration order. Built
    field by field: ``dataclasses.asdict`` would deep-copy every placement, only for the save to turn
    it into text."""
    d = {f.name: getattr(s, f.name) for f in fields(s)}
    d["outputs"], d["inputs"] = _placements_list(s.outputs), _placements_list(s.inputs)
    if isinstance(s, NodePlan):
        d["alternatives"] = [_strategy_to_dict(a) for a in s.alternatives]
    return d


def _redistribution_to_dict(r: Redistribution) -> dict:
    d = {f.name: getattr(r, f.name) for f in fields(r)}
    d["src"], d["dst"] = placements_str(r.src), placements_str(r.dst)
    d["collectives"] = [list(c) for c in r.collectives]
    return d


def _parse_list(ps: list) -> tuple:
    return tuple(parse_placements(p) for p in ps)


def _node_from_dict(d: dict) -> NodePlan:
    return NodePlan(
        name=d["name"],
        op=d["op"],
        module=d["module"],
        phase=d["phase"],
        outputs=_parse_list(d["outputs"]),
        inputs=_parse_list(d["inputs"]),
        compute_s=d["compute_s"],
        rule=d["rule"],
        comm_s=d.get("comm_s", 0.0),
        alternatives=tuple(
            Alternative(_parse_list(a["outputs"]), _parse_list(a["inputs"]), a["compute_s"], a["comm_s"], a["delta_s"])
            for a in d.get("alternatives", [])
        ),
    )


def _strategy_str(n: NodePlan | Alternative) -> str:
    ins = ", ".join(placements_str(p) or "-" for p in n.inputs)
    outs = ", ".join(placements_str(p) or "-" for p in n.outputs)
    return f"{ins} -> {outs}" if n.inputs else outs


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:.1f} us"


def _unlike(a: Plan, b: Plan) -> list[str]:
    """What makes ``a`` and ``b`` plans of different meshes, models or devices, first things first."""
    found = []
    if tuple(a.mesh_shape) != tuple(b.mesh_shape):
        found.append(f"mesh {a._mesh_label()} in the first plan, {b._mesh_label()} in the second")
    if a.signature and b.signature:  # each parameter's, buffer's and input's dtype and shape
        keys = sorted(k for k in a.signature.keys() | b.signature.keys() if a.signature.get(k) != b.signature.get(k))
    else:  # a plan saved before signatures: its parameter names
        keys = sorted(a.param_placements.keys() ^ b.param_placements.keys())
    if keys:
        ka = a.signature.get(keys[0], "absent") if a.signature else "-"
        kb = b.signature.get(keys[0], "absent") if b.signature else "-"
        found.append(f"another model: {len(keys)} parameters, buffers or inputs differ, e.g. {keys[0]} ({ka} | {kb})")
    else:  # the same tensors, another program (loss, attention kernel...): the ops node by node
        ops = [
            k
            for k in a.nodes.keys() | b.nodes.keys()
            if getattr(a.nodes.get(k), "op", None) != getattr(b.nodes.get(k), "op", None)
        ]
        if ops:
            found.append(f"another graph: {len(ops)} nodes are in one plan only or run another op, e.g. {min(ops)}")
    if a.device != b.device:
        found.append(f"priced for {a.device} in the first plan, {b.device} in the second")
    return found


def _move_line(r: Redistribution, consumer: NodePlan) -> str:
    """``  alias_default_71 (aten.alias.default in layers.0.attention.wq [forward]) <- t: S(0)S(0) -> RS(0),
    all_gather on mesh dim 0, 327.5 us``."""
    how = ", ".join(f"{kind} on mesh dim {dim}" for kind, dim in r.collectives)
    return (
        f"  {r.consumer} ({consumer.op} in {consumer.module} [{consumer.phase}]) <- {r.producer}:"
        f" {placements_str(r.src)} -> {placements_str(r.dst)}, {how}, {_us(r.seconds)}"
    )


def _explain_node(node: NodePlan) -> list[str]:
    where = f" in {node.module}" if node.module else ""
    lines = [
        f"{node.name}: {node.op}{where} [{node.phase or 'input'}] (rule: {node.rule or '-'})",
        f"  chosen      {_strategy_str(node)}  compute {_us(node.compute_s)}, redistribution {_us(node.comm_s)}",
    ]
    for alt in node.alternatives:
        lines.append(
            f"  {'+' + _us(alt.delta_s):<11} {_strategy_str(alt)}  compute {_us(alt.compute_s)},"
            f" redistribution {_us(alt.comm_s)}"
        )
    if not node.alternatives:
        lines.append("  (no other strategy: the constraints or the op leave one choice)")
    return lines


_COST_FIELDS = (
    "compute_forward",
    "compute_backward",
    "comm_forward",
    "comm_backward",
    "hidden_comm",
    "exposed_comm",
    "recompute",
    "total",
)


@dataclass(frozen=True)
class PlanDiff:
    """Two plans of the same model side by side; keys of ``params`` and ``nodes`` end with the first
    plan's placements then the second's, and map to how many copies (layers) differ that way."""

    cost: dict[str, tuple[float, float]]  # seconds: (first, second)
    collectives: tuple[dict[str, int], dict[str, int]]
    params: dict[tuple, int]  # (pattern, first, second) -> copies
    nodes: dict[tuple, int]  # (module pattern, op, phase, first, second) -> copies
    unlike: tuple[str, ...] = ()  # what makes the plans of different meshes, models or devices

    @property
    def same(self) -> bool:
        return not self.params and not self.nodes

    def __str__(self) -> str:
        lines = [f"warning: {u}: placements differ for that reason alone" for u in self.unlike]
        lines.append("cost (ms)            first      second     delta")
        for k, (a, b) in self.cost.items():
            lines.append(f"  {k:<18} {a * 1e3:>9.3f}  {b * 1e3:>9.3f}  {(b - a) * 1e3:>+9.3f}")
        first, second = self.collectives
        kinds = sorted({*first, *second})
        lines.append("collectives: " + ", ".join(f"{k} {first.get(k, 0)} -> {second.get(k, 0)}" for k in kinds))
        if self.same:
            return "\n".join([*lines, "same placements everywhere"])
        lines.append(f"parameters placed differently ({sum(self.params.values())}):")
        lines += [f"  {p:<44} {a} -> {b}  x{n}" for (p, a, b), n in self.params.items()]
        lines.append(f"nodes with another strategy ({sum(self.nodes.values())}), by layer pattern:")
        for (module, op, phase, a, b), n in sorted(self.nodes.items(), key=lambda kv: (kv[0][0], -kv[1])):
            lines.append(f"  {module or '(top)'} {op} [{phase[:3] or 'in'}] x{n}: {a}  |  {b or 'absent'}")
        return "\n".join(lines)
