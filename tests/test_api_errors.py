"""User-facing errors and warnings of ``AutoParallel``: each names what went wrong and where."""

import re
import warnings

import pytest
import torch
from conftest import fake_mesh
from torch import nn
from torch.distributed.tensor import Partial, Replicate, Shard

from autoplan import (
    AutoParallel,
    ConstraintError,
    Plan,
    PlanMismatchError,
    SolverLimitError,
    TracingError,
    UnsupportedOpError,
)
from autoplan.adapters.dtensor import has_full_rule, single_dim_rules
from autoplan.bench.models.llama3 import LLAMA3_CONFIGS, Transformer
from autoplan.shard.strategies import output_vals, tensor_inputs
from solvers import STOP_RESTRICTED, STOP_TIME_LIMIT, InfeasibleError

aten = torch.ops.aten
R, S0 = Replicate(), Shard(0)
CFG = LLAMA3_CONFIGS["debug"]


def tokens(batch: int = 8):
    return lambda: torch.randint(0, CFG.vocab_size, (batch, 16))


@pytest.fixture(scope="module")
def mesh():
    return fake_mesh((2, 4), ("dp", "tp"))


@pytest.fixture(scope="module")
def llama():
    with torch.device("meta"):
        return Transformer(CFG)


def mlp() -> nn.Module:
    with torch.device("meta"):
        return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))


# ---- infeasible constraint sets --------------------------------------------------------------


def test_conflicting_pins_name_both_constraints(llama, mesh):
    with AutoParallel(llama, mesh, input_fn=tokens()) as ap:
        name = ap.traced.placeholder_for("input")[0].name
        ap.add_input_constraints([(S0, R)])
        ap.add_node_constraint(name, (R, R))
        with pytest.raises(InfeasibleError) as info:
            ap.optimize_placement()
    msg = str(info.value)
    assert "input constraint 0 = S(0)R" in msg, msg
    assert f"node constraint {name} = RR" in msg, msg


@pytest.mark.slow  # ~70 s: proving a peak cap infeasible with recompute options (test_memory covers it on an MLP)
def test_too_small_memory_budget_names_the_memory_constraint(llama, mesh):
    with AutoParallel(llama, mesh, input_fn=tokens()) as ap:
        ap.add_memory_constraint(bytes_per_device=1)
        with pytest.raises(InfeasibleError, match="memory constraint") as info:
            ap.optimize_placement()
    assert "input constraint" not in str(info.value) and "node constraint" not in str(info.value)


def test_memory_constraint_arguments_are_checked(llama, mesh):
    with AutoParallel(mlp(), mesh, input_fn=lambda: torch.randn(8, 8)) as ap:
        with pytest.raises(ConstraintError, match="give bytes_per_device"):
            ap.add_memory_constraint()
        with pytest.raises(ConstraintError, match="one of param_fraction or param_bytes"):
            ap.add_memory_constraint(param_fraction=0.5, param_bytes=10)
        with pytest.raises(ConstraintError, match="bytes_per_device must be a positive number of bytes"):
            ap.add_memory_constraint(bytes_per_device=-1)
        with pytest.raises(ConstraintError, match="param_fraction"):
            ap.add_memory_constraint(param_fraction=0)
        with pytest.raises(ConstraintError, match="param_fraction"):
            ap.add_memory_constraint(param_fraction=1.5)


def test_every_error_is_an_autoplan_error_and_the_built_in_one(mesh):
    """The lowering's errors are ``AutoplanError``s and still ``RuntimeError``s; a parameter budget no
    plan meets raises ``autoplan.InfeasiblePlanError`` (exported), an ``InfeasibleError`` too; and
    ``autoplan.errors`` imports no stage of the pipeline (the stages import it)."""
    import ast
    from pathlib import Path

    import autoplan
    from autoplan.lower.validate import GraphCheckError, LoweringError

    for cls in (LoweringError, GraphCheckError):
        assert issubclass(cls, autoplan.AutoplanError) and issubclass(cls, RuntimeError), cls
    assert "InfeasiblePlanError" in autoplan.__all__
    with AutoParallel(mlp(), mesh, input_fn=lambda: torch.randn(8, 8)) as ap:
        ap.add_memory_constraint(param_bytes=1)
        with pytest.raises(autoplan.InfeasiblePlanError) as info:
            ap.optimize_placement()
    assert isinstance(info.value, (autoplan.AutoplanError, InfeasibleError))
    assert info.value.smallest_param_bytes > 1
    tree = ast.parse(Path(autoplan.errors.__file__).read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not {m for m in imported if m.split(".")[0] == "autoplan"}, imported


# ---- constraints that cannot apply to this model and mesh -----------------------------------


def test_unsplittable_input_shape(mesh):
    with AutoParallel(mlp(), mesh, input_fn=lambda: torch.randn(6, 8)) as ap:
        ap.add_input_constraints([(S0, R)])  # 6 splits over the 2-way dim
        with pytest.raises(ConstraintError) as info:
            ap.add_input_constraints([(R, S0)])  # but not over the 4-way one
    msg = str(info.value)
    assert "input 0" in msg and "(6, 8)" in msg and "(2, 4)" in msg, msg


def test_unsplittable_output_and_node_shapes(mesh):
    with AutoParallel(mlp(), mesh, input_fn=lambda: torch.randn(6, 8)) as ap:
        with pytest.raises(ConstraintError, match=re.escape("(6, 8)")):
            ap.add_output_constraints([(R, S0)])
        ap.add_node_constraint("0.weight", (S0, S0))  # (16, 8): 16 rows over 8 devices is fine
        with pytest.raises(ConstraintError, match=re.escape("(16, 8)")):
            ap.add_node_constraint("0.weight", (Shard(2), R))  # no dim 2
    with torch.device("meta"):
        model = nn.Linear(6, 4)
    with AutoParallel(model, mesh, input_fn=lambda: torch.randn(8, 6)) as ap:
        ap.add_node_constraint("weight", (R, Shard(1)))  # 6 columns over 4 devices: a parameter's storage may
        with pytest.raises(ConstraintError, match=r"'t'.*shape \(6, 4\).*mesh \(2, 4\)"):
            ap.add_node_constraint("t", (R, Shard(0)))  # an op's value may not: ops compute on even shards


def test_wrong_number_of_placements(mesh):
    with AutoParallel(mlp(), mesh, input_fn=lambda: torch.randn(8, 8)) as ap:
        with pytest.raises(ConstraintError, match="1 placements given for a 2-D mesh"):
            ap.add_input_constraints([(S0,)])
        with pytest.raises(ConstraintError, match="3 placements given for a 2-D mesh"):
            ap.add_node_constraint("2.weight", (R, R, R))
        with pytest.raises(ConstraintError, match="2 input constraints given, but the model has 1 inputs"):
            ap.add_input_constraints([(S0, R), (S0, R)])


def test_node_constraint_matching_nothing(llama, mesh):
    with AutoParallel(llama, mesh, input_fn=tokens()) as ap:
        ap.add_node_constraint("layers.*.attention.wq.weight", (S0, R))  # a glob that matches
        target = "layers.*.attention.nope.weight"
        with pytest.raises(ConstraintError, match=re.escape(repr(target))):
            ap.add_node_constraint(target, (S0, R))
    assert [p.target for p in ap._pins] == ["layers.*.attention.wq.weight"]  # the bad pin was not recorded


# ---- bad arguments and misuse ----------------------------------------------------------------


@pytest.mark.parametrize("gap", [-0.1, 1.0])
def test_mip_gap_must_be_a_fraction(llama, mesh, gap):
    with pytest.raises(ConstraintError, match=r"mip_rel_gap=.*must be a fraction in \[0, 1\)"):
        AutoParallel(llama, mesh, input_fn=tokens(), mip_rel_gap=gap)


def test_start_plan_must_be_of_this_model_and_mesh(mesh):
    """A start from another mesh or another model is refused, naming what differs; one of this
    model is where the solve begins, so the plan found is never worse than it."""
    with AutoParallel(mlp(), fake_mesh((8,), ("dp",)), input_fn=lambda: torch.randn(8, 8)) as ap:
        other_mesh = ap.optimize_placement()
    with AutoParallel(nn.Sequential(nn.Linear(8, 8)).to("meta"), mesh, input_fn=lambda: torch.randn(8, 8)) as ap:
        other_model = ap.optimize_placement()
    with AutoParallel(mlp(), mesh, input_fn=lambda: torch.randn(8, 8)) as ap:
        with pytest.raises(PlanMismatchError, match=r"mesh \(8,\) in the plan, \(2, 4\) here"):
            ap.optimize_placement(start=other_mesh)
        with pytest.raises(PlanMismatchError, match=r"param:0.weight is float32\[8, 8\] in the plan, float32\[16, 8\]"):
            ap.optimize_placement(start=other_model)
        ap.add_node_constraint("*.weight", (R, R))
        replicated = ap.optimize_placement()
        ap.remove_node_constraint("*.weight")
        free = ap.optimize_placement(start=replicated)
    assert free.cost.total <= replicated.cost.total * (1 + 1e-9)


def test_plan_json_applied_to_another_model_lists_the_differences(mesh):
    """A plan saved as JSON and applied to a model it was not made for: every difference counted,
    the first ones named (the parameter, its shape in the plan and here), before any lowering."""

    def wide():
        with torch.device("meta"):
            return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 8), nn.Linear(8, 8))

    with AutoParallel(mlp(), mesh, input_fn=lambda: torch.randn(8, 8)) as ap:
        text = ap.optimize_placement().to_json()
    with AutoParallel(wide(), mesh, input_fn=lambda: torch.randn(8, 8)) as ap:
        with pytest.raises(PlanMismatchError) as info:
            ap.apply_placement(Plan.from_json(text))
    e = info.value
    assert isinstance(e, ValueError)
    assert "param:0.weight is float32[16, 8] in the plan, float32[32, 8] here" in str(e)
    assert "param:3.weight float32[8, 8] is in this model but not in the plan" in e.differences
    assert "optimize_placement" in str(e)


def embed() -> nn.Module:
    with torch.device("meta"):
        return nn.Sequential(nn.Embedding(32, 16), nn.Linear(16, 8))


def test_float_indices_name_the_embedding_and_the_fix(mesh):
    with pytest.raises(TracingError, match=r"(?s)aten.embedding.default \(module 0\).*torch.long") as info:
        AutoParallel(embed(), mesh, input_fn=lambda: torch.randn(8, 4)).__enter__()
    assert isinstance(info.value.__cause__, RuntimeError)  # torch's own error, kept as the cause


def test_input_fn_must_return_tensors(mesh):
    with pytest.raises(ConstraintError, match="input_fn returned a str .*tensors"):
        AutoParallel(embed(), mesh, input_fn=lambda: ("hello",)).__enter__()


def test_partial_placements_where_no_pending_sum_can_be(mesh):
    """Token ids are integers (a partial sum of them means nothing), and inputs and parameters are
    held whole: each is refused as it is given, naming the reason, not a shape."""
    with AutoParallel(embed(), mesh, input_fn=lambda: torch.randint(0, 32, (8, 4))) as ap:
        with pytest.raises(ConstraintError, match="input 0: Partial.* int64 tensor .*pending sum of integers"):
            ap.add_input_constraints([(Partial(), R)])
        with pytest.raises(ConstraintError, match=r"'1.weight'.*Partial\(\) on mesh dim 1: .*held whole"):
            ap.add_node_constraint("1.weight", (R, Partial()))
        with pytest.raises(ConstraintError, match=r"Shard\(2\) on mesh dim 0 names a dim the 2-D tensor"):
            ap.add_input_constraints([(Shard(2), R)])
    with AutoParallel(mlp(), mesh, input_fn=lambda: torch.randn(8, 8)) as ap:
        with pytest.raises(ConstraintError, match="input 0: Partial.*held whole"):
            ap.add_input_constraints([(R, Partial())])


def test_contradicting_pins_are_refused_when_given(mesh):
    with AutoParallel(mlp(), mesh, input_fn=lambda: torch.randn(8, 8)) as ap:
        ap.add_node_constraint("*.weight", (S0, R))
        ap.add_node_constraint("0.weight", (S0, R))  # agrees: fine
        with pytest.raises(ConstraintError, match=r"'2.weight' = RR contradicts node constraint '\*.weight' = S\(0\)R"):
            ap.add_node_constraint("2.weight", (R, R))
        assert [p.target for p in ap._pins] == ["*.weight", "0.weight"]


def test_a_negative_shard_dim_counts_from_the_last_and_must_mean_one_dim(mesh):
    """``Shard(-1)`` is the last dim, as DTensor reads it: the pin holds the dim it names, so the
    plan places the value there. A glob matching values of different ranks would make it name
    different dims: refused, naming both."""
    with AutoParallel(mlp(), mesh, input_fn=lambda: torch.randn(8, 8)) as ap:
        ap.add_node_constraint("0.weight", (R, Shard(-1)))
        assert ap._pins[-1].placements == (R, Shard(1))
        plan = ap.optimize_placement()
        assert plan.param_placements["0.weight"] == (R, Shard(1))
        with pytest.raises(
            ConstraintError, match=r"'0\.\*' = RS\(-1\) is RS\(\d\) on \S+ but RS\(\d\) on \S+ \(values of"
        ):
            ap.add_node_constraint("0.*", (R, Shard(-1)))  # the (16, 8) weight and the (16,) bias


def test_bad_meshes_are_named():
    with torch.device("meta"):
        square = nn.Linear(6, 6)
    with pytest.raises(ConstraintError, match=r"mesh dim names \('dp', 'dp'\) repeat a name"):
        AutoParallel(mlp(), fake_mesh((2, 4), ("dp", "dp")), input_fn=lambda: torch.randn(8, 8))
    # no dim of any tensor (6 x 6 weights and batch) is a multiple of 4: the tp dim would only repeat work
    with pytest.raises(ConstraintError, match=r"mesh dim tp \(size 4\) of mesh \(2, 4\) cannot split any tensor"):
        AutoParallel(square, fake_mesh((2, 4), ("dp", "tp")), input_fn=lambda: torch.randn(6, 6)).__enter__()


def test_time_limit_without_any_plan_names_the_time_and_the_ilp_size(llama, mesh):
    with AutoParallel(llama, mesh, input_fn=tokens(), time_limit=1e-6) as ap:
        with pytest.raises(SolverLimitError, match=r"within time_limit=1e-06 s .* variables and \d+ rows"):
            ap.optimize_placement()


def test_models_already_distributed_are_refused(mesh):
    """autoplan splits the model itself: one wrapped by FSDP2, or holding DTensor parameters, is
    named before any tracing."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    wrapped = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    fully_shard(wrapped, mesh=fake_mesh((8,), ("dp",)))
    with pytest.raises(ConstraintError, match=r"module <root> is wrapped by fully_shard \(FSDP2\)"):
        AutoParallel(wrapped, mesh, input_fn=lambda: torch.randn(8, 8))
    dt = nn.Sequential(nn.Linear(8, 8))
    dt[0].weight = nn.Parameter(distribute_tensor(dt[0].weight.detach(), mesh, [R, S0]))
    with pytest.raises(ConstraintError, match=r"0.weight is already a DTensor \(RS\(0\) on mesh \(2, 4\)\)"):
        AutoParallel(dt, mesh, input_fn=lambda: torch.randn(8, 8))


def test_only_parameters_are_split_unevenly():
    """Batch 30 on 4 ranks and a 50257-token vocabulary on 8: an input or an op's value split
    unevenly is refused, naming the dim and the ways. A parameter may be stored split unevenly
    (``autoplan.shard.uneven``), but every op of the plan still reads and makes even shards."""
    mesh = fake_mesh((4,), ("dp",))
    with AutoParallel(mlp(), mesh, input_fn=lambda: torch.randn(30, 8)) as ap:
        with pytest.raises(ConstraintError, match=r"dim 0 of shape \(30, 8\) \(size 30\) cannot be split 4 ways"):
            ap.add_input_constraints([(S0,)])
    with torch.device("meta"):
        lm = nn.Sequential(nn.Embedding(50257, 16), nn.Linear(16, 50257))
    with AutoParallel(lm, fake_mesh((8,), ("tp",)), input_fn=lambda: torch.randint(0, 50257, (8, 4))) as ap:
        with pytest.raises(ConstraintError, match=r"\(size 50257\) cannot be split 8 ways"):
            ap.add_node_constraint("1", (Shard(2),))  # the logits
        ap.add_node_constraint("1.weight", (S0,))
        plan = ap.optimize_placement()
        ops = [n for n in ap.traced.gm.graph.nodes if n.op == "call_function" and n.name in plan.nodes]
    assert plan.param_placements["1.weight"] == (S0,)
    for n in ops:
        placed = plan.nodes[n.name]
        values = [(v.shape, pl) for v, pl in zip(output_vals(n), placed.outputs) if isinstance(v, torch.Tensor)]
        values += [(a.meta["val"].shape, pl) for a, pl in zip(tensor_inputs(n), placed.inputs)]
        for shape, placements in values:
            assert all(shape[p.dim] % 8 == 0 for p in placements if isinstance(p, Shard)), (n.name, placements, shape)


def _stopped_with(monkeypatch, stop: str) -> None:
    """The real solve's result reported 5% from its bound, ended by ``stop`` (``SolveResult.stop``)."""
    import dataclasses

    import autoplan.solve.planner

    real = autoplan.solve.planner.solve_placement

    def stopped_early(*args, **kwargs):
        out = real(*args, **kwargs)
        return dataclasses.replace(out, result=dataclasses.replace(out.result, gap=0.05, stop=stop))

    monkeypatch.setattr(autoplan.solve.planner, "solve_placement", stopped_early)


def test_a_plan_the_solver_stopped_on_warns_with_its_gap(monkeypatch, mesh):
    """When the time limit stops the solver with a plan 5% from its bound (made to happen here by
    reporting the real solve's result so), the plan comes back and a warning gives the gap."""
    _stopped_with(monkeypatch, STOP_TIME_LIMIT)
    with AutoParallel(mlp(), mesh, input_fn=lambda: torch.randn(8, 8), time_limit=30.0) as ap:
        with pytest.warns(UserWarning, match=r"stopped at time_limit=30.0 s, .* within 5.00% of its bound"):
            plan = ap.optimize_placement()
    assert plan.param_placements


@pytest.mark.parametrize(
    "stop, said",
    [
        (STOP_TIME_LIMIT, r"stopped at its 30 s limit for improving a found plan, after {s} s of solving, with"),
        (STOP_RESTRICTED, r"ended after {s} s of solving, no time limit reached: it searched to its end the columns"),
        ("", r"ended after {s} s of solving without proving its gap, no time limit reached, with"),
    ],
    ids=["time-limit", "restricted", "neither"],
)
def test_the_gap_warning_says_what_ended_the_search(monkeypatch, mesh, stop, said):
    """Without a time limit, a plan short of its gap warns of what ended the search, as the solver
    reports it, and of the seconds the solve really took; only a pass stopped at a time limit is
    said to have stopped at one (a plan found in seconds no longer reads as stopped at 30 s)."""
    _stopped_with(monkeypatch, stop)
    with AutoParallel(mlp(), mesh, input_fn=lambda: torch.randn(8, 8)) as ap:
        with pytest.warns(UserWarning, match="within 5.00% of its bound") as caught:
            plan = ap.optimize_placement()
    message = str(next(w.message for w in caught if "of its bound" in str(w.message)))
    assert re.search(said.format(s=re.escape(f"{plan.timings['solve']:.1f}")), message), message
    assert ("30 s" in message) == (stop == STOP_TIME_LIMIT)


def test_a_plan_found_in_seconds_does_not_read_as_stopped_at_30_s(mesh):
    """A small ResNet with the batch split at every convolution (``test_models``' pins): its ILP is
    large enough for the priced LP, whose columns a MIP searches to the end in about a second, 1.4%
    above the whole LP's bound; the warning says so, and no time limit (it once said 30 s)."""
    from models import ResNet
    from test_models import _batchnorm_means

    with torch.device("meta"):
        model = ResNet(classes=10)
    with AutoParallel(model, mesh, input_fn=lambda: torch.randn(16, 3, 16, 16)) as ap:
        ap.add_input_constraints([(S0, R)])
        ap.add_output_constraints([(S0, R)])
        for name in ("convolution", "convolution_[0-9]*", "relu*"):
            ap.add_node_constraint(name, (S0, R))
        for n in _batchnorm_means(ap):
            ap.add_node_constraint(n, (Partial("avg"), R))
        with pytest.warns(UserWarning, match="of its bound") as caught:
            plan = ap.optimize_placement()
    message = str(next(w.message for w in caught if "of its bound" in str(w.message)))
    said = f"the solver ended after {plan.timings['solve']:.1f} s of solving, no time limit reached: it searched"
    assert message.startswith(said) and "30 s" not in message, message
    assert plan.timings["solve"] < 30


@pytest.mark.parametrize(
    "seeded, polish_s, time_limit, said",
    [
        (False, None, None, "stopped at its 30 s limit for improving a found plan, after 11.7 s of solving"),
        (False, None, 5.0, "stopped at time_limit=5.0 s, after 11.7 s of solving"),
        (False, 12.5, None, "stopped at its 12.5 s limit for polishing the capped plan, after 11.7 s of solving"),
        (True, None, None, "stopped at the 10 s limit of the recompute trial whose plan it kept, after 11.7 s"),
        (True, None, 5.0, "stopped at time_limit=5.0 s, after 11.7 s of solving"),  # the trial had less than 10 s
    ],
)
def test_a_time_limit_stop_names_the_limit_that_stopped_it(seeded, polish_s, time_limit, said):
    """Of a solve stopped at a time limit, which one: the polish's and the recompute trials' own
    limits (a longer ``time_limit`` does not raise them, so no advice to), else ``time_limit`` or,
    without one, the 30 s a found plan is improved for; with the solve's own seconds."""
    from types import SimpleNamespace

    from autoplan.solve.planner import _stop_reason
    from solvers import SolveOptions

    solved = SimpleNamespace(result=SimpleNamespace(stop=STOP_TIME_LIMIT), seeded=seeded)
    main = SimpleNamespace(solved=solved, solve_s=11.74, polish_s=polish_s)
    why, advice = _stop_reason(main, SolveOptions(time_limit=time_limit))
    assert why.startswith(said), why
    assert ("raise time_limit" in advice) == (polish_s is None and not (seeded and time_limit is None))


def test_mesh_must_be_a_device_mesh(llama):
    with pytest.raises(TypeError, match="DeviceMesh.*tuple"):
        AutoParallel(llama, (2, 4), input_fn=tokens())


def test_model_must_be_a_module(mesh):
    with pytest.raises(TypeError, match="nn.Module.*function"):
        AutoParallel(lambda x: x, mesh, input_fn=tokens())


@pytest.mark.parametrize(
    "call",
    [
        lambda ap: ap.optimize_placement(),
        lambda ap: ap.add_input_constraints([(S0, R)]),
        lambda ap: ap.add_output_constraints([(S0, R)]),
        lambda ap: ap.add_node_constraint("0.weight", (R, R)),
    ],
    ids=["optimize_placement", "add_input_constraints", "add_output_constraints", "add_node_constraint"],
)
def test_use_outside_the_context_manager(mesh, call):
    ap = AutoParallel(mlp(), mesh, input_fn=lambda: torch.randn(8, 8))
    with pytest.raises(RuntimeError, match=r"context manager.*with AutoParallel\("):
        call(ap)


# ---- ops without a sharding rule ------------------------------------------------------------

UNSUPPORTED = aten.searchsorted.Tensor


class Bucketize(nn.Module):
    """Scales activations by their bucket index: ``searchsorted`` has no DTensor rule."""

    def __init__(self):
        super().__init__()
        self.register_buffer("bounds", torch.linspace(-1, 1, 8))

    def forward(self, y):
        return y * torch.searchsorted(self.bounds, y.detach()).to(y.dtype)


class WithBucketize(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.bucket = Bucketize()
        self.out = nn.Linear(16, 8)

    def forward(self, x):
        return self.out(self.bucket(self.inp(x)))


def test_searchsorted_really_has_no_rule():
    assert single_dim_rules(UNSUPPORTED, (), {}) is None
    assert not has_full_rule(UNSUPPORTED)


def test_unsupported_op_warns_and_runs_replicated(mesh):
    with pytest.warns(UserWarning, match=r"no sharding rule for aten\.searchsorted\.Tensor .*module bucket\)") as rec:
        with AutoParallel(WithBucketize(), mesh, input_fn=lambda: torch.randn(8, 8)) as ap:
            ap.add_input_constraints([(S0, R)])
            plan = ap.optimize_placement()
    assert sum("searchsorted" in str(w.message) for w in rec) == 1  # warned once
    (node,) = [n for n in plan.nodes.values() if n.op == str(UNSUPPORTED)]
    assert node.module == "bucket" and node.phase == "forward"
    assert node.outputs == ((R, R),)
    assert node.inputs and all(p == (R, R) for p in node.inputs)
    # the rest of the model is still planned: the pinned input keeps its sharding
    assert plan.nodes[ap.traced.placeholder_for("input")[0].name].outputs == ((S0, R),)


def test_unsupported_op_raises_in_strict_mode(mesh):
    with pytest.raises(UnsupportedOpError) as info:
        with AutoParallel(WithBucketize(), mesh, input_fn=lambda: torch.randn(8, 8), strict=True):
            pass
    msg = str(info.value)
    assert "aten.searchsorted.Tensor" in msg and "module bucket" in msg, msg


def test_strict_mode_accepts_fully_supported_models(mesh):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with AutoParallel(mlp(), mesh, input_fn=lambda: torch.randn(8, 8), strict=True) as ap:
            plan = ap.optimize_placement()
    assert set(plan.param_placements) == {"0.weight", "0.bias", "2.weight", "2.bias"}


def test_supported_op_does_not_fall_back_for_batch_6(llama, mesh):
    assert has_full_rule(aten.stack.default)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        with AutoParallel(llama, mesh, input_fn=tokens(batch=6)):
            pass
    fallbacks = [str(w.message) for w in rec if "no sharding rule" in str(w.message)]
    assert fallbacks == []


class _ReadsAValue(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        return self.proj(x) * x.abs().max().item()


class _TokenModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)

    def forward(self, tokens):
        return self.emb(tokens)


def test_errors_inside_torch_while_tracing_name_op_module_and_source_line(mesh):
    """Torch's own errors surface as ``TracingError``: the op, the module path and the model's source
    line (this file), with torch's exception as the cause; a data-dependent read gets a way out."""
    with torch.device("meta"):
        reads, embeds = _ReadsAValue(), _TokenModel()
    with pytest.raises(TracingError, match=r"static graph") as info:
        AutoParallel(reads, mesh, lambda: torch.randn(8, 8)).__enter__()
    assert info.value.op == "aten._local_scalar_dense.default" and info.value.module_path == ""
    assert "test_api_errors.py" in info.value.source and ".item()" in info.value.source
    with pytest.raises(TracingError, match=r"aten\.embedding\.default \(module emb\)") as info:
        AutoParallel(embeds, mesh, lambda: torch.randn(8, 4)).__enter__()  # float "tokens"
    assert "self.emb(tokens)" in info.value.source and isinstance(info.value.__cause__, RuntimeError)
