"""``AutoParallel``: the user-facing entry point, from (model, mesh, inputs) to a ``Plan``."""

from __future__ import annotations

import fnmatch
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate, Shard

from autoplan.adapters.pytree import tree_flatten
from autoplan.cost import memory
from autoplan.cost.costs import CostModel
from autoplan.cost.devices import H100_SXM, DeviceProfile, resolve_profile
from autoplan.errors import ConstraintError
from autoplan.heap import collector_paused
from autoplan.lower.lowering import LoweringOptions, collectives_per_layer, lower
from autoplan.lower.passes import alias_roundtrip
from autoplan.lower.passes.alias_roundtrip import ALIAS_KEY, RoundTripStats, insert_aliases
from autoplan.lower.passes.bucketing import DEFAULT_BUCKET_BYTES
from autoplan.plan import Plan, placements_str
from autoplan.run.compile import RegionStats, compile_regions
from autoplan.run.runtime import build_parallel_module, make_executor
from autoplan.shard.constraints import Pin, placement_error
from autoplan.shard.strategies import (
    Placements,
    StrategyBuilder,
    enumerate_strategies,
    output_vals,
)
from autoplan.shard.uneven import fsdp_bytes
from autoplan.solve import mismatch
from autoplan.solve.planner import DEFAULT_GAP, NO_RECOMPUTE, Planner, Request
from autoplan.trace import recompute, regions
from autoplan.trace.attention import check_option as check_attention_option
from autoplan.trace.clustering import Clustering, find_repeats, unclustered
from autoplan.trace.inputs import InputSpec, TensorInput
from autoplan.trace.precision import MixedPrecisionPolicy, check_policy
from autoplan.trace.tracing import PATH_KEY, PHASE_KEY, TracedGraph, trace_joint
from solvers import SolveOptions

log = logging.getLogger(__name__)  # under "autoplan": the command's --verbose shows it


def _check_mesh(mesh: Any) -> DeviceMesh:
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a torch.distributed.device_mesh.DeviceMesh, got {type(mesh).__name__}")
    if mesh.ndim < 1 or any(s < 1 for s in mesh.shape):
        raise ConstraintError(f"mesh has an invalid shape {tuple(mesh.shape)}: every dim needs at least one rank")
    names = mesh.mesh_dim_names or ()
    if len(set(names)) != len(names):
        raise ConstraintError(f"mesh dim names {names} repeat a name: each mesh dim needs its own")
    # planning alone (the fake backend) may use part of the world, to compare meshes in one session;
    # a run may not: the ranks outside the mesh would never join its collectives
    if dist.is_initialized() and dist.get_backend() != "fake" and mesh.size() != dist.get_world_size():
        raise ConstraintError(
            f"mesh {tuple(mesh.shape)} has {mesh.size()} ranks but the process group has {dist.get_world_size()}:"
            " plan for a mesh over every rank (init_device_mesh with the world size)"
        )
    return mesh


def _check_not_distributed(model: nn.Module) -> None:
    """autoplan distributes the model itself: one already split (FSDP2, DTensor parameters) would
    fail deep inside tracing or be split twice."""
    for name, m in model.named_modules():
        if isinstance(m, FSDPModule):
            raise ConstraintError(
                f"module {name or '<root>'} is wrapped by fully_shard (FSDP2): give AutoParallel the model before"
                " fully_shard; the plan decides how parameters are sharded"
            )
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if isinstance(t, DTensor):
            raise ConstraintError(
                f"{name} is already a DTensor ({placements_str(t.placements)} on mesh {tuple(t.device_mesh.shape)}):"
                " give AutoParallel the plain model, before distribute_tensor / parallelize_module; the plan"
                " decides the placements"
            )


def _unusable_mesh_dims(tg: TracedGraph, mesh: DeviceMesh) -> list[str]:
    """Mesh dims no tensor of the step can be split over (no dim of any value is a multiple of
    their size): on them every rank would repeat the same work, which is never what was meant."""
    sizes = set()
    for n in tg.gm.graph.nodes:
        for v in tree_flatten(n.meta.get("val"))[0]:
            if isinstance(v, torch.Tensor):
                sizes.update(int(d) for d in v.shape)
    names = mesh.mesh_dim_names or tuple(str(i) for i in range(mesh.ndim))
    return [
        f"{names[i]} (size {k})" for i, k in enumerate(mesh.shape) if k > 1 and not any(d % k == 0 for d in sizes if d)
    ]


def _executed_collectives(lowered) -> dict[str, int]:
    """Collectives a step runs: forward plus backward graphs (so FSDP re-gathers count)."""
    fwd, bwd = lowered.collective_counts(lowered.forward), lowered.collective_counts(lowered.backward)
    return {k: fwd.get(k, 0) + bwd.get(k, 0) for k in sorted({*fwd, *bwd})}


def _pass_report(plan: Plan, applied: Plan, trips: RoundTripStats, lowered) -> dict[str, int]:
    """What the post-solve passes did, and the collectives of one step before and after them.

    Before: the solved plan's redistributions. After round trips: the rewired plan's (``local`` counts
    shard-slicing steps, which is what a removed round trip's return leg usually is). After all
    passes: what the lowered forward and backward graphs run (gathers fused, FSDP re-gathers added,
    collectives bucketed), and of those, what one repeated layer runs in each phase, before and
    after bucketing.
    """
    return {
        "round_trips_removed": trips.removed,
        "aliases_dropped": trips.aliases_dropped,
        "gather_chains_fused": lowered.gather_fusion.fused,
        "gather_chains_rejected": lowered.gather_fusion.rejected,
        "reduce_scatter_chains_fused": lowered.scatter_fusion.fused,
        "all_reduce_chains_fused": lowered.reduce_fusion.fused,
        "recompute_chains_tagged": lowered.recompute.chains,
        "recompute_nodes_tagged": lowered.recompute.nodes,
        "activation_recompute_nodes": lowered.activation_recompute,
        "all_reduce_waits_sunk": lowered.waits.sunk,
        "gathers_prefetched": lowered.prefetch.gathers,
        "collectives_bucketed": lowered.buckets.merged,
        "buckets": lowered.buckets.buckets,
        **{f"{k}_before_passes": v for k, v in plan.collective_counts().items()},
        **{f"{k}_after_round_trips": v for k, v in applied.collective_counts().items()},
        **{f"{k}_after_passes": v for k, v in _executed_collectives(lowered).items()},
        **{
            f"{k}_per_layer_{phase}_before_bucketing": v
            for phase, counts in lowered.unbucketed_per_layer.items()
            for k, v in counts.items()
        },
        **{f"{k}_per_layer_forward": v for k, v in collectives_per_layer(lowered.forward).items()},
        **{f"{k}_per_layer_backward": v for k, v in collectives_per_layer(lowered.backward).items()},
    }


class AutoParallel:
    """Plan how to split a training step of ``model`` over ``mesh``.

    Use as a context manager: entering traces the model (on fake tensors) and enumerates
    strategies, constraints are then added, and ``optimize_placement`` solves the ILP.
    ``input_fn()`` gives the example call of ``forward`` (``autoplan.trace.inputs``): a tensor, a tuple or
    list of positional arguments, a dict of keyword arguments, or an ``(args_tuple, kwargs_dict)``
    pair; its tensors are the graph's inputs, and ``None`` and Python numbers in it are constants
    baked into the plan. The parallel module is called the same way, with the same constants.
    ``attention`` picks the kernel ``F.scaled_dot_product_attention`` traces to: ``"auto"`` (what
    the target GPU runs: flash for fp16/bf16 without a mask, else memory-efficient), ``"flash"``,
    ``"efficient"``, ``"cudnn"``, ``"math"`` or ``"cpu"`` (the host's kernel; CPU meshes only).
    Plans with GPU kernels still run on a CPU mesh: lowering computes them with the CPU kernel.
    ``device_profile`` is the target accelerator the costs describe, by name (``"h100"``,
    ``"h200"``, ``"a100"``, ``"b200"``, ``"mi300x"``, ``"cpu"``), by the path of a profile JSON
    measured on the machine at hand (``autoplan calibrate``) or as a ``DeviceProfile``; its
    ``gpus_per_node`` and the mesh's ranks decide which mesh dims stay inside a node.
    ``expert_imbalance``: how unevenly routing loads the experts, as the busiest expert-parallel
    rank's tokens over the mean (token counts depend on the data); a grouped matmul split over its
    experts is priced at that rank's work. 1, the default, prices the balanced case.
    ``mip_rel_gap``: how far from the optimum a plan may be, as a fraction of the solver's bound,
    when the solver stops (``plan.solver["gap"]`` says where it stopped). The default 1% is far
    below the cost model's own error; proving the last fraction of a percent can take minutes,
    because the overlap rows weaken the LP bound. ``0`` asks for the optimum itself.
    ``optimizer``: what the optimizer keeps per parameter, for the memory model. The default,
    ``memory.ADAMW``, is mixed-precision AdamW (two fp32 states, and an fp32 master copy of
    parameters stored in a lower precision); ``memory.TORCH_ADAMW`` is ``torch.optim.AdamW`` run on
    the parameters as they are (two states in each parameter's dtype).
    ``prefetch``: the parallel module issues each layer's parameter gathers while the layer before
    it computes (``apply_placement``'s default). The plan is priced for that program: the gathers
    hide under the previous layer's compute (without prefetch they are paid in full, as the
    program then waits for them), and the memory estimate counts the gathered weights from where
    they are issued. NCCL meshes only: gloo does not survive it.
    ``mp_policy``: mixed precision, as FSDP2's ``torch.distributed.fsdp.MixedPrecisionPolicy``
    means it (``autoplan.trace.precision``). Parameters and optimizer states stay in the model's
    dtype; each module computes on its parameters cast to ``param_dtype`` (the plan may cast a
    shard before gathering it, moving half the bytes); parameters' gradients are reduced in
    ``reduce_dtype`` and reach the optimizer in the parameters' dtype. ``MixedPrecisionPolicy(
    param_dtype=torch.bfloat16, reduce_dtype=torch.float32)`` is how large models train.
    """

    def __init__(
        self,
        model: nn.Module,
        mesh: DeviceMesh,
        input_fn: Callable[[], Any],
        loss_fn: Callable | None = None,
        device_profile: str | Path | DeviceProfile = H100_SXM,
        *,
        strict: bool = False,
        cluster_layers: bool = True,
        merge_followers: bool = True,
        solver_backend: str = "highs",
        time_limit: float | None = None,
        mip_rel_gap: float = DEFAULT_GAP,
        attention: str = "auto",
        optimizer: memory.OptimizerSpec = memory.ADAMW,
        expert_imbalance: float = 1.0,
        prefetch: bool = False,
        mp_policy: MixedPrecisionPolicy | None = None,
    ):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        _check_not_distributed(model)
        self.attention = check_attention_option(attention)
        self.model = model
        self.mesh = _check_mesh(mesh)
        self.input_fn = input_fn
        self.loss_fn = loss_fn
        self.device_profile = resolve_profile(device_profile)
        self.strict = strict
        self.cluster_layers = cluster_layers
        self.merge_followers = merge_followers
        if not 0.0 <= mip_rel_gap < 1.0:
            raise ConstraintError(f"mip_rel_gap={mip_rel_gap!r} must be a fraction in [0, 1), e.g. 0.01 for 1%")
        if not expert_imbalance >= 1.0:
            raise ConstraintError(
                f"expert_imbalance={expert_imbalance!r}: the busiest expert-parallel rank's tokens over the mean, >= 1"
            )
        self.expert_imbalance = float(expert_imbalance)
        self.prefetch = bool(prefetch)
        self.mp_policy = check_policy(mp_policy)
        self.solve_options = SolveOptions(backend=solver_backend, time_limit=time_limit, mip_rel_gap=mip_rel_gap)
        self._inputs: dict[int, tuple[str, Placements]] = {}  # graph input -> (how the user named it, placements)
        self._outputs: dict[int, Placements] = {}
        self._pins: list[Pin] = []
        self._pin_nodes: dict[str, list[fx.Node]] = {}  # pin target -> the nodes it matched
        self._param_budget: float | None = None
        self._peak_budget: float | None = None
        self._recompute: dict[str, str] = {}  # layer -> recompute option the user fixed ("none": never)
        self._planner_for: tuple | None = None  # the settings the cached planner was built with
        self.timings: dict[str, float] = {}
        self.traced: TracedGraph | None = None
        self.optimizer = optimizer

    # ---- lifecycle ------------------------------------------------------------------------

    def __enter__(self) -> AutoParallel:
        with collector_paused():
            t0 = time.perf_counter()
            with regions.tracing_on(self.mesh.shape):
                self.traced = trace_joint(
                    self.model,
                    self.input_fn,
                    self.loss_fn,
                    device=self.mesh.device_type,
                    attention=self.attention,
                    mp_policy=self.mp_policy,
                )
            recompute.fold_checkpoints(self.traced.gm.graph)
            ta = time.perf_counter()
            unusable = _unusable_mesh_dims(self.traced, self.mesh)
            if unusable:
                raise ConstraintError(
                    f"mesh dim {', '.join(unusable)} of mesh {tuple(self.mesh.shape)} cannot split any tensor of"
                    " this model's step (no tensor dim is a multiple of it): use a smaller mesh dim, or a bigger batch"
                )
            self.aliases = insert_aliases(self.traced)
            t1 = time.perf_counter()
            self.clustering = self._cluster()
            self.strategies = enumerate_strategies(
                self.traced.gm.graph,
                self.clustering.rep,
                StrategyBuilder(self.mesh, strict=self.strict),
                uneven=set(self.traced.placeholder_for("param").values()),
            )
            t2 = time.perf_counter()
        self.timings = {"trace": ta - t0, "aliases": t1 - ta, "strategies": t2 - t1}
        self._planner_for = None  # a new trace: the planner is built again
        log.info(
            "traced %d nodes (%d layers stamped, %d after clustering) and enumerated strategies in %.2fs",
            len(self.traced.gm.graph.nodes),
            self.traced.stamped,
            len(self.strategies),
            t2 - t0,
        )
        return self

    def __exit__(self, *exc) -> None:
        return None

    def _cluster(self) -> Clustering:
        return find_repeats(self.traced) if self.cluster_layers else unclustered(self.traced)

    def _require_traced(self) -> TracedGraph:
        if self.traced is None:
            raise RuntimeError("use AutoParallel as a context manager: `with AutoParallel(...) as ap:`")
        return self.traced

    # ---- constraints ----------------------------------------------------------------------

    def _check_placements(self, what: str, val, placements, whole: bool = False, uneven: bool = False) -> Placements:
        """``placements`` as a tuple, a negative ``Shard`` dim counted from ``val``'s last as DTensor
        counts it, or ``ConstraintError`` saying why they cannot place ``val`` (``uneven``: a
        parameter, which may be split unevenly)."""
        placements = tuple(placements)
        if not isinstance(val, torch.Tensor):
            raise ConstraintError(f"{what}: it is not a tensor ({type(val).__name__}), so it has no placement")
        why = placement_error(placements, val, tuple(self.mesh.shape), whole, uneven)
        if why is not None:
            raise ConstraintError(f"{what}: {why} (mesh {tuple(self.mesh.shape)})")
        return tuple(Shard(p.dim + val.ndim) if type(p) is Shard and p.dim < 0 else p for p in placements)

    def add_input_constraints(
        self, constraints: Sequence[Sequence | None] | Mapping[int | str, Sequence | None]
    ) -> None:
        """Placements of the model inputs: a list in ``input_fn()`` order (``None`` leaves one free), or a
        dict keyed by position in that order or by argument name: the parameter of ``forward`` an input
        binds to, however ``input_fn`` passed it (``{"input_ids": (Shard(0), Replicate())}``), with the
        path inside a nested argument (``"batch['mask']"``; ``autoplan.trace.inputs``). Constants (``None``,
        Python numbers) hold a position but take no placement."""
        inputs = self._require_traced().placeholder_for("input")
        spec = self.traced.inputs or InputSpec.positional([inputs[i].meta["val"] for i in range(len(inputs))])
        if isinstance(constraints, Mapping):
            items = list(constraints.items())
        else:
            if len(constraints) > len(spec.leaves):
                raise ConstraintError(
                    f"{len(constraints)} input constraints given, but the model has {len(spec.leaves)} inputs"
                )
            items = list(enumerate(constraints))
        chosen: dict[int, tuple[str, Placements]] = {}
        for key, c in items:
            position = spec.position(key)
            if c is None:
                continue
            label = f"{key!r}" if isinstance(key, str) else str(key)
            leaf = spec.leaves[position]
            if not isinstance(leaf, TensorInput):
                raise ConstraintError(
                    f"input {label} ({spec.names[position]}) is {leaf!r}, a constant baked into the trace and no"
                    " graph input: it has no placement"
                )
            val = inputs[leaf.index].meta["val"]
            chosen[leaf.index] = (label, self._check_placements(f"input {label}", val, c, whole=True))
        self._inputs.update(chosen)

    def add_output_constraints(self, constraints: Sequence[Sequence | None]) -> None:
        """Placements of the model outputs (and of their incoming gradients)."""
        tg = self._require_traced()
        outputs = {i: o for i, o in tg.outputs_of("output").items() if i not in tg.written_buffers}
        if len(constraints) > len(outputs):
            raise ConstraintError(
                f"{len(constraints)} output constraints given, but the model has {len(outputs)} outputs"
            )
        for i, c in enumerate(constraints):
            if c is not None:
                self._outputs[i] = self._check_placements(f"output {i}", outputs[i].meta["val"], c)

    def add_node_constraint(self, target: fx.Node | str, placements: Sequence) -> None:
        """Pin the output placements of a node, a parameter FQN or a module's forward output (globs allowed).

        Repeated layers share decisions, so pinning a node of one layer pins its copies too. A node
        with several outputs (an attention kernel) is pinned by its first output.
        """
        name = target.name if isinstance(target, fx.Node) else str(target)
        nodes = self._pin_targets(name)
        if not nodes:
            raise ConstraintError(f"node constraint {name!r} matches no node, parameter or module")
        params = set(self.traced.placeholder_for("param").values())
        checked = {
            n: self._check_placements(
                f"node constraint {name!r} ({n.name})",
                output_vals(n)[0],
                placements,
                whole=n in params,
                uneven=n in params,
            )
            for n in nodes
        }
        first_with: dict[Placements, fx.Node] = {}
        for n, pl in checked.items():
            first_with.setdefault(pl, n)
        if len(first_with) > 1:  # a negative Shard dim on values of different ranks
            (a, pa), (b, pb) = list(first_with.items())[:2]
            raise ConstraintError(
                f"node constraint {name!r} = {placements_str(tuple(placements))} is {placements_str(a)} on {pa.name}"
                f" but {placements_str(b)} on {pb.name} (values of different ranks): name the dim, not its"
                " place from the end"
            )
        placements = next(iter(first_with))
        for pin in self._pins:
            clash = [n.name for n in self._pin_nodes[pin.target] if n in nodes and pin.placements != placements]
            if clash:
                raise ConstraintError(
                    f"node constraint {name!r} = {placements_str(placements)} contradicts node constraint"
                    f" {pin.target!r} = {placements_str(pin.placements)} on {', '.join(clash[:3])}: remove one"
                    " (remove_node_constraint) or pin them alike"
                )
        self._pins.append(Pin(name, placements))
        self._pin_nodes[name] = nodes

    def remove_node_constraint(self, target: fx.Node | str) -> None:
        """Drop every pin added for ``target``: with ``add_*`` and a changed ``device_profile`` this
        explores what-ifs on one trace (each ``optimize_placement`` re-prices from scratch)."""
        name = target.name if isinstance(target, fx.Node) else str(target)
        kept = [p for p in self._pins if p.target != name]
        if len(kept) == len(self._pins):
            pinned = ", ".join(sorted({p.target for p in self._pins})) or "none"
            raise ConstraintError(f"no node constraint on {name!r} to remove (pinned: {pinned})")
        self._pins = kept
        del self._pin_nodes[name]

    def add_recompute_constraint(self, layers: str, option: str) -> None:
        """Fix the recompute choice of the layers matching ``layers`` (a glob over layer instances,
        e.g. ``"layers.*"``): ``"full"``, ``"selective"``, ``"checkpoint"`` (what the model's own
        ``torch.utils.checkpoint`` calls recompute) or ``"none"`` (never recompute). Without it the
        planner keeps the model's own checkpointing, and under a ``bytes_per_device`` cap chooses
        every layer's option itself (the model's checkpointing among them)."""
        if option not in (*recompute.OPTIONS, NO_RECOMPUTE):
            choices = ", ".join((*recompute.OPTIONS, NO_RECOMPUTE))
            raise ConstraintError(f"recompute constraint {layers!r}: unknown option {option!r}; choose from {choices}")
        offered = recompute.layers(self._require_traced().gm.graph)
        matched = [layer for layer in offered if fnmatch.fnmatchcase(layer, layers)]
        if not matched:
            known = ", ".join(list(offered)[:4]) or "none"
            raise ConstraintError(
                f"recompute constraint {layers!r} matches no layer that can recompute (layers: {known}, ...;"
                " layers with random ops cannot)"
            )
        if option == "checkpoint":
            own = set(recompute.checkpointed_layers(self.traced.gm.graph))
            if missing := [layer for layer in matched if layer not in own]:
                raise ConstraintError(
                    f"recompute constraint {layers!r}: {missing[0]} checkpoints nothing itself (layers that do:"
                    f" {', '.join(sorted(own)) or 'none'})"
                )
        self._recompute.update(dict.fromkeys(matched, option))

    def _recompute_pins(self) -> dict[str, str]:
        """The user's recompute constraints over the model's own checkpointing, which is kept unless a
        ``bytes_per_device`` cap lets the planner choose (it drops it where the cap allows)."""
        if self._peak_budget is not None:
            return dict(self._recompute)
        own = recompute.checkpointed_layers(self._require_traced().gm.graph)
        return {**dict.fromkeys(own, "checkpoint"), **self._recompute}

    def remove_recompute_constraint(self) -> None:
        self._recompute = {}

    def remove_memory_constraint(self) -> None:
        self._param_budget = self._peak_budget = None

    def add_memory_constraint(
        self,
        param_fraction: float | None = None,
        bytes_per_device: float | None = None,
        *,
        param_bytes: float | None = None,
    ) -> None:
        """Cap per-device memory: ``bytes_per_device`` bounds the estimated peak of a training step
        (parameters, gradients, optimizer states, saved activations and temporaries, see
        ``autoplan.cost.memory``); ``param_fraction`` (of the whole model's) or ``param_bytes`` bound the
        parameter bytes alone. Each call replaces the caps it names.

        ``param_fraction=1/N`` means what FSDP stores on N ranks: every parameter split N ways on
        some dim, ceil(n/N) rows per rank where the dim does not divide (the largest shard of an
        uneven split, ``autoplan.shard.uneven``), so a mesh of N ranks always meets it. Other fractions
        ``f`` allow the larger of ``f`` of the model's bytes and that sum for N = ceil(1/f)."""
        if param_fraction is None and bytes_per_device is None and param_bytes is None:
            raise ConstraintError("give bytes_per_device (the step's peak), or param_fraction or param_bytes")
        if param_fraction is not None and param_bytes is not None:
            raise ConstraintError("give one of param_fraction or param_bytes: both cap the parameter bytes")
        for name, value in (("bytes_per_device", bytes_per_device), ("param_bytes", param_bytes)):
            if value is not None and not value > 0:
                raise ConstraintError(f"{name} must be a positive number of bytes, got {value}")
        if param_fraction is not None:
            if not 0 < param_fraction <= 1:
                raise ConstraintError(f"param_fraction must be in (0, 1], got {param_fraction}")
            params = list(self.model.parameters())
            total = sum(p.numel() * p.element_size() for p in params)
            ways = math.ceil(1 / param_fraction - 1e-9)
            split = sum(fsdp_bytes(tuple(p.shape), p.element_size(), ways) for p in params)
            param_bytes = max(param_fraction * total, split)
        if param_bytes is not None:
            self._param_budget = float(param_bytes)
        if bytes_per_device is not None:
            self._peak_budget = float(bytes_per_device)

    def _pin_targets(self, name: str) -> list[fx.Node]:
        tg = self._require_traced()
        nodes = [n for n in tg.gm.graph.nodes if n.op != "output" and fnmatch.fnmatchcase(n.name, name)]
        params = tg.placeholder_for("param")
        nodes += [n for fqn, n in params.items() if fnmatch.fnmatchcase(fqn, name)]
        nodes += [params[c] for a, c in tg.tied.items() if c in params and fnmatch.fnmatchcase(a, name)]
        last_forward: dict[str, fx.Node] = {}
        for n in tg.gm.graph.nodes:
            if n.meta.get(PHASE_KEY) == "forward" and n.op == "call_function" and not n.meta.get(ALIAS_KEY):
                path = n.meta.get(PATH_KEY, "")
                for i in range(len(path.split("."))):
                    last_forward[".".join(path.split(".")[: i + 1])] = n
        nodes += [n for path, n in last_forward.items() if fnmatch.fnmatchcase(path, name)]
        return list(dict.fromkeys(nodes))

    # ---- solve ----------------------------------------------------------------------------

    def _fixed_outputs(self) -> list[tuple[str, list[fx.Node], Placements]]:
        """Every user constraint as (its name, the nodes it fixes, their output placements)."""
        tg = self._require_traced()
        inputs, tangents = tg.placeholder_for("input"), tg.placeholder_for("tangent")
        fixed = [
            (f"input constraint {label} = {placements_str(pl)}", [inputs[i]], pl)
            for i, (label, pl) in self._inputs.items()
        ]
        fixed += [
            (f"output constraint {i} = {placements_str(pl)}", [tangents[i]], pl)
            for i, pl in self._outputs.items()
            if i in tangents
        ]
        for pin in self._pins:
            name = f"node constraint {pin.target} = {placements_str(pin.placements)}"
            fixed.append((name, self._pin_targets(pin.target), pin.placements))
        buffers, replicated = tg.placeholder_for("buffer"), (Replicate(),) * self.mesh.ndim
        for fqn in tg.written_buffers.values():
            fixed.append((f"buffer {fqn}, written by the forward, is replicated", [buffers[fqn]], replicated))
        return fixed

    def _output_placements(self) -> dict[int, Placements]:
        """Where outputs must end up: the user's constraints, and the new values of written buffers
        replicated like the buffers they are copied into."""
        tg = self._require_traced()
        return self._outputs | {i: (Replicate(),) * self.mesh.ndim for i in tg.written_buffers}

    def apply_placement(
        self,
        plan: Plan,
        *,
        return_dtensor: bool = False,
        reshard_after_forward: bool = True,
        fuse_gathers: bool = True,
        prefetch: bool | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        remove_round_trips: bool = True,
        compile: bool = False,
    ) -> nn.Module:
        """The parallel module for ``plan``: DTensor parameters, the lowered graphs in forward/backward.

        Each rank passes its local shard of every input and gets local outputs (DTensors with
        ``return_dtensor``). A meta model is materialised with ``to_empty`` + ``init_weights()`` or
        ``load_state_dict`` of a full state dict. With ``remove_round_trips`` consumers that want a
        value in its producer's placement read it there instead of through a differently placed
        alias; with ``reshard_after_forward`` (FSDP's contract) the backward re-gathers sharded
        parameters instead of keeping the gathered copies; with ``fuse_gathers`` chained
        per-mesh-dim all-gathers (reduce-scatters, all-reduces) become one over the flattened mesh;
        with ``prefetch`` (by default as the planner was told, see the class) each parameter's
        gather is issued a layer ahead of its use and
        waited for where it is read (NCCL meshes: gloo cannot run it, see ``LoweringOptions.check``);
        the collectives a layer issues together (its weights' gathers, its gradients' reductions)
        run as one on a flat buffer of at most ``bucket_bytes`` (``lower.passes.bucketing``; 0: one
        collective per move). ``plan.passes`` reports what the passes did
        and the collectives before and after them; the plan actually lowered is ``self.applied_plan``.
        With ``compile`` the forward and backward graphs run through Inductor region by region:
        identical layers share one compiled region, so deep models compile in seconds
        (``self.regions`` says how many regions there are, how many were compiled and how many,
        too small to be worth it, run eagerly).
        """
        tg = self._require_traced()
        mismatch.check(plan, tg, tuple(self.mesh.shape))
        t0 = time.perf_counter()
        with collector_paused():  # the passes and lowering build graphs as large as the trace
            if remove_round_trips:
                cost_model = CostModel(self.mesh, self.device_profile, self.expert_imbalance)
                tg, applied, trips = alias_roundtrip.remove_round_trips(tg, plan, cost_model, self._output_placements())
            else:
                applied, trips = plan, RoundTripStats(0, 0)
            rerun = frozenset(n.name for n in recompute.chosen_nodes(tg.gm.graph, applied.recompute))
            ahead = self.prefetch if prefetch is None else prefetch
            options = LoweringOptions(reshard_after_forward, fuse_gathers, ahead, bucket_bytes)
            lowered = lower(tg, applied, self.mesh, self._output_placements(), options, rerun)
        regions: dict[fx.GraphModule, RegionStats] = {}

        def compile_graph(gm: fx.GraphModule) -> Callable:
            compiled, regions[gm] = compile_regions(gm)
            return compiled

        executor = make_executor(lowered, compile_graph if compile else None)
        self.regions = {"forward": regions[lowered.forward], "backward": regions[lowered.backward]} if compile else {}
        buffers = {fqn: plan.nodes[n.name].outputs[0] for fqn, n in tg.placeholder_for("buffer").items()}
        outputs = [
            (o.meta["val"].shape, o.meta["val"].stride()) if isinstance(o, fx.Node) else None
            for o in tg.outputs_of("output").values()
        ]
        vals = tg.placeholder_for("input")
        inputs = tg.inputs or InputSpec.positional([vals[i].meta["val"] for i in range(len(vals))])
        pmod = build_parallel_module(
            self.model,
            self.mesh,
            lowered,
            plan.param_placements,
            buffers,
            outputs,
            executor,
            inputs,
            return_dtensor,
            [fqn for _, fqn in sorted(tg.written_buffers.items())],
            tg.returns,
        )
        self.timings["apply"] = time.perf_counter() - t0
        self.lowered, self.applied_plan = lowered, applied
        plan.passes = applied.passes = _pass_report(plan, applied, trips, lowered)
        return pmod

    def _planner(self) -> Planner:
        """The planner for this trace and these settings; rebuilt when a setting it reads changed."""
        settings = {
            "device_profile": self.device_profile,
            "optimizer": self.optimizer,
            "solve_options": self.solve_options,
            "merge_followers": self.merge_followers,
            "expert_imbalance": self.expert_imbalance,
            "prefetch": self.prefetch,
        }
        key = tuple(settings.values())
        if self._planner_for != key:
            self._planner_obj = Planner(self.traced, self.clustering, self.strategies, self.mesh, **settings)
            self._planner_for = key
        return self._planner_obj

    def optimize_placement(self, start: Plan | None = None) -> Plan:
        """Solve for the cheapest plan under the constraints added so far (``autoplan.solve.planner``).

        ``start``, a plan of this model and mesh (one solved under other constraints, or loaded
        from JSON) that meets the current constraints, is where the solver begins: the plan found
        is never worse than it, whatever ``mip_rel_gap``.

        Identical layers share decisions; the first and last layers are then re-solved on their own
        (``plan.ilp["refinements"]``). Under a ``bytes_per_device`` cap the planner may recompute
        layers' forward values in backward (``plan.recompute``) and pays for it in the step time.
        """
        self._require_traced()
        request = Request(
            fixed=self._fixed_outputs(),
            outputs=self._output_placements(),
            param_budget=self._param_budget,
            peak_budget=self._peak_budget,
            recompute=self._recompute_pins(),
            start=start,
        )
        return self._planner().plan(request, self.timings)
