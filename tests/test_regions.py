"""``autoplan.local_map`` regions: traced on local shapes, planned as declared, run as written on
each rank's shards, with single-device numerics where the body is row by row."""

from collections import Counter

import pytest
import torch
from conftest import fake_mesh
from models import CapacityMoE
from parallel_run import check_run, graph_report, one_value, parallel_run, plan_and_apply, reference_run
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.tensor import Replicate, Shard

from autoplan import AutoParallel, TracingError, local_map

ROWS, WHOLE = (Shard(0), Replicate()), (Replicate(), Replicate())


def test_region_runs_as_written_on_local_shards_with_single_device_numerics():
    """The body's ops, forward and backward, are the region's, on local shapes, replicated; the
    plan moves values to and from the declared placements; three AdamW steps match one device."""
    mesh = fake_mesh((2, 4), ("dp", "tp"))
    ref = reference_run("local_region", batch_rows=8)
    plan, lowered, pmod = plan_and_apply(mesh, "local_region", [], batch_rows=8)
    with LocalTensorMode(8):
        r = parallel_run(mesh, pmod, ref, False, plain=one_value)
    check_run(r | {"ref_losses": ref.losses} | graph_report(plan, lowered))
    enters = [p for p in plan.nodes.values() if "region_enter" in p.op]
    exits = [p for p in plan.nodes.values() if "region_exit" in p.op]
    assert len(enters) == 2 + 1 and len(exits) == 1 + 2  # forward: 2 in, 1 out; backward: 1 in, 2 out
    assert {p.inputs[0] for p in enters if p.phase == "forward"} == {ROWS, WHOLE}
    assert {p.outputs[0] for p in exits if p.phase == "forward"} == {ROWS}
    body = [p for p in plan.nodes.values() if p.rule == "local_map" and "region_" not in p.op]
    assert {p.phase for p in body} == {"forward", "backward"}
    assert all(pl == WHOLE for p in body for pl in (*p.inputs, *p.outputs) if pl is not None)


def test_expert_parallel_moe_runs_with_single_device_numerics():
    """Routing in regions (each rank's tokens into its own capacity slots and back), the experts'
    matmuls split over the experts on dp: the buffers travel by all-to-all, forward and backward,
    and three AdamW steps match one device."""
    mesh = fake_mesh((2, 4), ("dp", "tp"))
    ref = reference_run("capacity_moe", batch_rows=8)
    experts = (Shard(0), Replicate())
    pins = [("w1", experts), ("w2", experts), ("bmm", experts), ("bmm_1", experts)]
    plan, lowered, pmod = plan_and_apply(mesh, "capacity_moe", pins, batch_rows=8)
    assert lowered.collective_counts().get("all_to_all", 0) >= 3
    with LocalTensorMode(8):
        r = parallel_run(mesh, pmod, ref, False, plain=one_value)
    check_run(r | {"ref_losses": ref.losses} | graph_report(plan, lowered))


@pytest.mark.parametrize("experts", ["large", "small"])
def test_expert_parallelism_emerges_from_costs(experts):
    """Nothing pins it: with experts large beside the tokens routed (64 of 1024 x 2048, 2 K tokens)
    the plan splits the experts' matmuls over the experts and moves the buffers by all-to-all; with
    small ones and many tokens (4 of 512 x 256, 16 K tokens) it splits each expert and moves none."""
    dim, hidden, n, batch = (1024, 2048, 64, 8) if experts == "large" else (512, 256, 4, 64)
    mesh = fake_mesh((8, 8), ("dp", "tp"))
    with torch.device("meta"):
        model = CapacityMoE(dim=dim, hidden=hidden, experts=n)
    with AutoParallel(model, mesh, input_fn=lambda: torch.randn(batch, 256, dim)) as ap:
        ap.add_input_constraints([ROWS])
        ap.add_output_constraints([ROWS])
        plan = ap.optimize_placement()
    moves = Counter(kind for r in plan.redistributions for kind, _ in r.collectives)
    split_experts = [n for n in plan.nodes.values() if n.op == "aten.bmm.default" and Shard(0) in n.outputs[0]]
    if experts == "large":
        assert moves["all_to_all"] > 0 and split_experts
        assert Shard(0) in plan.param_placements["w1"]
    else:
        assert moves["all_to_all"] == 0 and not split_experts


def test_untraced_region_with_data_dependent_shapes_runs_with_single_device_numerics():
    """A region declared ``traced=False`` holds nonzero and boolean indexing: it plans as one op
    (forward, and a backward that runs it again and differentiates it) between its declared
    boundaries, runs as written on each rank's rows, and three AdamW steps match one device."""
    mesh = fake_mesh((2, 4), ("dp", "tp"))
    ref = reference_run("data_dependent", batch_rows=8)
    plan, lowered, pmod = plan_and_apply(mesh, "data_dependent", [], batch_rows=8)
    ops = Counter(p.op for p in plan.nodes.values() if p.rule == "local_map")
    assert ops["autoplan.untraced_region.default"] == ops["autoplan.untraced_region_backward.default"] == 1
    assert not [p for p in plan.nodes.values() if p.rule == "local_map" and p.op.startswith("aten.")]
    with LocalTensorMode(8):
        r = parallel_run(mesh, pmod, ref, False, plain=one_value)
    check_run(r | {"ref_losses": ref.losses} | graph_report(plan, lowered))


class _Branching(torch.nn.Module):
    def forward(self, x):
        @local_map(out_placements=ROWS, in_placements=(ROWS,), traced=False)
        def body(h):
            return h[: int((h > 0).sum())]  # a Python int read from the data

        return body(x).sum()


def test_untraced_region_of_unknowable_shape_is_a_named_error():
    """An untraced region whose output's shape is read from the data: a TracingError naming the
    region and what its body must do instead."""
    with pytest.raises(TracingError, match=r"(?s)local_map region .*body \(traced=False\).*static shapes") as info:
        AutoParallel(_Branching(), fake_mesh((2, 4)), input_fn=lambda: torch.randn(8, 32)).__enter__()
    assert "a Python int read from the data" in info.value.source


def test_data_dependent_op_outside_regions_points_at_local_map():
    """Outside any region, a data-dependent op keeps its named error, which points at ``local_map``."""

    class Nonzero(torch.nn.Module):
        def forward(self, x):
            return x[x > 0].sum()

    with pytest.raises(TracingError, match=r"aten\.nonzero.*\n.*\n.*local_map\(\.\.\., traced=False\)"):
        AutoParallel(Nonzero(), fake_mesh((8,)), input_fn=lambda: torch.randn(8, 32)).__enter__()


def _untraced_rows(fn):
    """An untraced region applying ``fn`` to each rank's rows: every model built with it has a region
    of the same name (``_untraced_rows.<locals>.body``), which each trace numbers from 0 alike."""

    @local_map(out_placements=ROWS, in_placements=(ROWS,), traced=False)
    def body(h):
        return fn(h)

    return body


class _RegionBetweenLinears(torch.nn.Module):
    def __init__(self, dim: int, fn):
        super().__init__()
        self.fc1, self.fc2, self.fn = torch.nn.Linear(dim, dim), torch.nn.Linear(dim, dim), fn

    def forward(self, x):
        return self.fc2(_untraced_rows(self.fn)(self.fc1(x)))


def test_two_plans_with_untraced_regions_of_one_name_each_run_their_own():
    """Two models whose untraced regions have one name (tanh on 32 features, a square on 16), planned
    and applied in one process, the second after the first: the first's module, run after the second
    was traced, still computes its own function (and its own shapes) forward and backward, as one device does."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    mesh = fake_mesh((2, 4), ("dp", "tp"))
    models = {"tanh": (32, torch.tanh), "square": (16, torch.square)}
    built, pmods = {}, {}
    for name, (dim, fn) in models.items():
        torch.manual_seed(0)
        built[name] = _RegionBetweenLinears(dim, fn)
        with torch.device("meta"):
            model = _RegionBetweenLinears(dim, fn)
        with AutoParallel(model, mesh, input_fn=lambda dim=dim: torch.randn(8, dim)) as ap:
            ap.add_input_constraints([ROWS])
            ap.add_output_constraints([ROWS])
            pmods[name] = ap.apply_placement(ap.optimize_placement())
    for name in ("tanh", "square"):  # the first one first: the second's trace came after it
        dim, _ = models[name]
        x = torch.randn(8, dim, generator=torch.Generator().manual_seed(1))
        pmod = pmods[name]
        with LocalTensorMode(8):
            pmod.to_empty(device="cpu")
            pmod.load_state_dict(built[name].state_dict())
            out = pmod(distribute_tensor(x, mesh, ROWS).to_local())
            placed = DTensor.from_local(out, mesh, ROWS, run_check=False)
            got = one_value(placed)
            placed.square().mean().backward()
            grads = [one_value(pmod.get_parameter(f"{fc}.weight").grad) for fc in ("fc1", "fc2")]
        expected = built[name](x)
        expected.square().mean().backward()
        torch.testing.assert_close(got, expected.detach(), msg=name)
        torch.testing.assert_close(grads, [built[name].fc1.weight.grad, built[name].fc2.weight.grad], msg=name)
