"""``autoplan calibrate``: the profile it measures loads back wherever a profile name goes, prices
plans differently from the built-in one, and fits the links of real gloo processes."""

import dataclasses
import json
import math
import time

import pytest
import torch
import torch.distributed as dist
from conftest import fake_mesh
from gloo import run_gloo
from models import MLP
from torch.distributed.tensor import Partial, Replicate, Shard

from autoplan import AutoParallel
from autoplan.adapters.dtensor import tensor_meta
from autoplan.bench.validate import host_speed, kendall_tau, reference_probe, split_waits
from autoplan.cli import main
from autoplan.cost.calibrate import calibrate
from autoplan.cost.costs import CostModel, roofline_seconds
from autoplan.cost.devices import (
    CPU_GLOO,
    LinkKind,
    dtype_name,
    profile_from_json,
    profile_to_json,
    resolve_profile,
    thinness,
)
from autoplan.cost.links import GroupRows, fit_groups, fit_kinds, fit_link, group_report, mesh_groups
from autoplan.cost.measure import TIMED_SECONDS, CalibrateOptions, calls_filling
from autoplan.cost.network import GroupSpan, collective_seconds, flat_collective_seconds
from autoplan.errors import ConstraintError

R, P = Replicate(), Partial()


def _plan(profile, inputs=None):
    """An MLP whose matmuls are compute-bound on a CPU (8.6 GFLOP each) on a fake 4-way mesh."""
    with torch.device("meta"):
        model = MLP(1024, 4096, 1024)
    with AutoParallel(model, fake_mesh((4,)), lambda: torch.randn(1024, 1024), device_profile=profile) as ap:
        if inputs is not None:
            ap.add_input_constraints([inputs])
        return ap.optimize_placement()


@pytest.mark.slow  # 12-23 s of measuring: no numerics, kept out of the README's ten-minute command
def test_fast_calibration_writes_a_profile_that_loads_back_and_plans(tmp_path, capsys):
    out = tmp_path / "profile.json"
    world = fake_mesh((4,)).get_group()  # the caller's process group: the command must leave it alone
    assert main(["calibrate", "--fast", "--device", "cpu", "--out", str(out)]) == 0
    assert dist.is_initialized() and dist.get_world_size(world) == 4 and dist.get_world_size() >= 4
    printed = capsys.readouterr().out
    assert "matmul float32" in printed and f"wrote {out}" in printed
    doc = json.loads(out.read_text())
    assert doc["format"] == "autoplan-device-profile" and doc["version"] == 4 and doc["measured"]["attention"]
    profile = profile_from_json(out)
    assert profile.name.startswith("calibrated cpu") and profile.compute_efficiency == 1.0
    for dtype in (torch.float32, torch.bfloat16):  # one curve per dtype measured
        curve = profile.curve_for("matmul", dtype)
        sizes = len(doc["measured"]["matmul"][dtype_name(dtype)]) // 3  # a slow bf16 stops early
        assert len(curve) == sizes and (dtype == torch.bfloat16 or sizes == 4) and all(0 < f <= 1 for _, f in curve)
        # the fastest shape is the peak (a thin one, on a CPU whose bf16 is emulated)
        assert max(f for _, c in profile.curves_for("matmul", dtype) for _, f in c) == 1.0
        assert profile.efficiency_at(curve[0][0], dtype) == curve[0][1]
        assert profile.efficiency_at(1e30, dtype) == curve[-1][1]
        assert [t for t, _ in profile.curves_for("matmul", dtype)] == [1.0, 1.667, 3.57]  # square and two thin
        attention = profile.curve_for("attention", dtype)
        assert len(attention) == 2 or (dtype == torch.bfloat16 and len(attention) == 1)
        assert all(0 < f <= 1 for _, f in attention)
    assert profile.curve_for("matmul", torch.float32) != profile.curve_for("matmul", torch.bfloat16)
    # a dtype not measured takes the curves of the measured one nearest in rate: which one that is
    # depends on the rates measured (this host's emulated bf16 runs at a quarter to a half of fp32)
    rate = math.log(profile.flops_for(torch.float64))
    nearest = min((torch.float32, torch.bfloat16), key=lambda d: abs(math.log(profile.flops_for(d)) - rate))
    assert profile.curve_for("matmul", torch.float64) == profile.curve_for("matmul", nearest)
    assert resolve_profile(str(out)) == profile
    plan = _plan(str(out), (Shard(0),))
    assert plan.device == profile.name and plan.cost.total > 0


def test_sizes_past_the_longest_call_are_left_out_and_the_curves_end_where_measured():
    """A kernel slower than ``call_seconds`` a call (bf16 on a CPU without native bf16 runs a
    2048-cube matmul for ~20 s) ends its dtype's table: here every size past the smallest, which
    is always measured, so each curve has one point and the profile still plans."""
    said = []
    opts = CalibrateOptions(fast=True, call_seconds=0.0)
    profile, measured = calibrate("cpu", opts=opts, say=said.append)
    assert [len(rows) for rows in measured["matmul"].values()] == [3, 3]  # square and two thin, one size
    assert [len(rows) for rows in measured["attention"].values()] == [1, 1]
    assert sum("larger sizes left out" in line for line in said) == 4  # matmul and attention, per dtype
    for dtype in (torch.float32, torch.bfloat16):
        assert len(profile.curve_for("matmul", dtype)) == 1 and len(profile.curve_for("attention", dtype)) == 1
    assert _plan(profile, (Shard(0),)).cost.total > 0


def test_a_kernel_is_timed_over_as_many_calls_as_fill_the_timing_not_as_its_flops_say():
    """A GPU runs a thin 4x128x128 matmul at its launch rate, not its FLOP rate: sizing the calls
    by FLOPs ran it 1.5 million times and took the H200's calibration past its 90 s limit. The
    count comes from the time one call takes."""
    slow = lambda: time.sleep(0.01)
    assert calls_filling(slow, torch.device("cpu"), TIMED_SECONDS) == 1
    calls = []
    fast = lambda: calls.append(time.perf_counter())
    n = calls_filling(fast, torch.device("cpu"), TIMED_SECONDS)
    assert 10 < n < 10**7  # a list append takes well under a microsecond (more, if the host is busy)
    t0 = time.perf_counter()
    for _ in range(n):
        fast()
    assert time.perf_counter() - t0 < 20 * TIMED_SECONDS  # n calls span about the timing, not minutes


@pytest.mark.slow  # plans two 8B layers at 1x4096 twice
def test_the_h200_profile_predicts_the_steps_an_h200_ran():
    """The built-in H200 profile carries the kernel curves ``calibrate`` measured on one (2026-11-28).
    There, ``bench validate --model llama3-8b --layers L --batch 1 --seq 4096 --dtype bfloat16`` on
    one rank measured the forward and backward at 39.95, 40.30 and 40.56 ms for 2 layers (three
    runs) and 61.82 and 62.27 ms for 4; the datasheet profile with its guessed 0.6 of peak had said
    46.2 and 69.7 ms."""
    from autoplan.bench.workloads import named_model
    from autoplan.cost.memory import TORCH_ADAMW

    tokens = torch.randint(0, 128256, (1, 4096))
    for layers, measured in ((2, 40.30e-3), (4, 62.05e-3)):  # the medians
        model = named_model("llama3-8b", torch.bfloat16, layers, 1)[0]
        with AutoParallel(model, fake_mesh((1,)), lambda: tokens, device_profile="h200", optimizer=TORCH_ADAMW) as ap:
            ap.add_input_constraints([(Shard(0),)])
            predicted = ap.optimize_placement().cost.total
        assert abs(predicted - measured) / measured < 0.08, (layers, predicted, measured)


def test_a_changed_profile_changes_the_costs_and_where_it_should_the_plan(tmp_path):
    """Matmuls reaching a tenth of the peak price the step's compute several times higher. Links
    as fast as memory make splitting the batch pay; links a million times slower than gloo's make
    every rank compute the whole step itself (nothing pins the input)."""

    def write(name, **changes):
        path = tmp_path / f"{name}.json"
        path.write_text(profile_to_json(dataclasses.replace(CPU_GLOO, name=name, **changes)))
        return str(path)

    def compute(plan):
        return plan.cost.compute_forward + plan.cost.compute_backward

    def curve(fraction, dtype="float32"):
        return (("matmul", dtype, 1e3, fraction), ("matmul", dtype, 1e12, fraction))

    quick = _plan(write("quick", kernel_efficiency=curve(1.0)), (Shard(0),))
    slow = _plan(write("slow", kernel_efficiency=curve(0.1)), (Shard(0),))
    assert compute(slow) > 5 * compute(quick)
    bf16_slow = _plan(write("bf16_slow", kernel_efficiency=curve(1.0) + curve(0.1, "bfloat16")), (Shard(0),))
    assert compute(bf16_slow) == pytest.approx(compute(quick))  # an fp32 model: the bf16 curve prices nothing
    fast_links = _plan(write("fast", intra_node_bandwidth=1e15, intra_node_latency=0.0))
    slow_links = _plan(write("slow_links", intra_node_bandwidth=1e4, intra_node_latency=1.0))
    assert fast_links.cost.comm > 0 and compute(fast_links) < compute(slow_links) / 2
    assert slow_links.cost.comm == 0 and all(p == (Replicate(),) for p in slow_links.param_placements.values())


def test_comm_overlap_scales_what_communication_hides_under():
    """A profile whose collectives cannot run beside compute (``comm_overlap=0``) hides nothing: an
    FSDP plan whose gathers are prefetched pays all its communication, and more than where it
    hides under its layers' compute. Half of each collective running beside compute hides half of
    what all of it does, where the layers' compute is long enough to hide all of it."""
    from autoplan.bench.handplans import hand_plan

    costs = {}
    for overlap in (1.0, 0.5, 0.0):
        with torch.device("meta"):
            model = MLP(1024, 4096, 1024)
        profile = dataclasses.replace(CPU_GLOO, comm_overlap=overlap)
        mesh = fake_mesh((4,))
        with AutoParallel(model, mesh, lambda: torch.randn(8192, 1024), device_profile=profile, prefetch=True) as ap:
            ap.add_input_constraints([(Shard(0),)])
            costs[overlap] = hand_plan(ap, "fsdp", 1).cost
    assert costs[0.0].hidden_comm == 0 and costs[1.0].hidden_comm > 0
    compute = costs[1.0].compute_forward + costs[1.0].compute_backward
    assert costs[1.0].hidden_comm < compute / 4  # far below the compute: the exact half below shows no budget binds
    assert costs[0.5].hidden_comm == pytest.approx(costs[1.0].hidden_comm / 2, rel=1e-9)
    assert costs[0.0].total == pytest.approx(costs[0.0].compute_forward + costs[0.0].compute_backward + costs[0.0].comm)
    assert costs[0.0].total > costs[1.0].total


def test_rank_skew_prices_every_op_of_a_step_of_several_ranks_as_the_slowest_ranks():
    """A profile measuring that ranks finish the same work 20% apart prices each op of a 4-rank
    mesh, under every strategy, 1.2 times as long, and leaves a one-rank mesh's (nothing to wait
    for) and the moves as they are; a skew outside [0, 1] is refused."""
    skewed = dataclasses.replace(CPU_GLOO, rank_skew=0.2)
    with torch.device("meta"):
        model = MLP(1024, 4096, 1024)
    for shape, factor in (((4,), 1.2), ((1,), 1.0)):
        mesh = fake_mesh(shape)
        with AutoParallel(model, mesh, lambda: torch.randn(1024, 1024)) as ap:
            node = next(n for n in ap.strategies if n.name == "addmm")
            choices = ap.strategies[node].strategies
        plain, slowest = CostModel(mesh, CPU_GLOO), CostModel(mesh, skewed)
        assert len(choices) > 1 and all(
            slowest.op_seconds(node, s) == pytest.approx(factor * plain.op_seconds(node, s), rel=1e-12)
            and plain.op_seconds(node, s) > 0
            for s in choices
        )
        m = tensor_meta(torch.empty(1024, 1024, device="meta"))
        moved = plain.redistribute_cost((P,), (R,), m)
        assert slowest.redistribute_cost((P,), (R,), m) == moved and (moved > 0) == (shape == (4,))
    with pytest.raises(ValueError, match="rank_skew"):
        dataclasses.replace(CPU_GLOO, rank_skew=1.5)


def test_a_profile_file_that_is_not_one_is_refused_by_name(tmp_path):
    bad = tmp_path / "other.json"
    bad.write_text(json.dumps({"format": "something", "version": 1}))
    with pytest.raises(ConstraintError, match="not an autoplan device profile"):
        resolve_profile(str(bad))
    newer = tmp_path / "newer.json"
    newer.write_text(profile_to_json(CPU_GLOO).replace('"version": 4', '"version": 99'))
    with pytest.raises(ConstraintError, match="version 99"):
        resolve_profile(str(newer))
    bad_kind = tmp_path / "bad_kind.json"
    bad_kind.write_text(
        profile_to_json(CPU_GLOO).replace(
            '"kernel_efficiency": []', '"kernel_efficiency": [["conv", "float32", 1e6, 0.5]]'
        )
    )
    with pytest.raises(ConstraintError, match="'conv'"):
        resolve_profile(str(bad_kind))
    with pytest.raises(ConstraintError, match="no device profile file"):
        resolve_profile(str(tmp_path / "missing.json"))


def test_a_version_1_profile_loads_with_its_one_curve_for_every_dtype(tmp_path):
    doc = json.loads(profile_to_json(CPU_GLOO))
    fields = {k: v for k, v in doc["profile"].items() if k != "kernel_efficiency"}
    old = tmp_path / "v1.json"
    old.write_text(
        json.dumps(doc | {"version": 1, "profile": fields | {"matmul_efficiency": [[1e6, 0.25], [1e9, 1.0]]}})
    )
    profile = resolve_profile(str(old))
    for dtype in (torch.float32, torch.bfloat16):
        assert profile.curve_for("matmul", dtype) == ((1e6, 0.25), (1e9, 1.0))
        assert profile.efficiency_at(1e6, dtype, "attention") == 0.25 * CPU_GLOO.compute_efficiency


def test_a_thin_matmul_is_priced_on_the_thin_curve():
    # the thinness of a shape does not depend on its size; a square matmul's is 1
    assert thinness(2 * 512**3, 4 * 3 * 512**2, 4) == pytest.approx(1.0)
    for n in (64, 1024):
        m, k = n // 8, n
        assert thinness(2 * m * k * n, 4 * (m * k + k * n + m * n), 4) == pytest.approx(5 / 3)
    rows = (("matmul", "float32", 1e6, 0.5, 1.0), ("matmul", "float32", 1e9, 1.0, 1.0))
    rows += (("matmul", "float32", 1e6, 0.25, 2.0), ("matmul", "float32", 1e9, 0.5, 2.0))
    profile = dataclasses.replace(CPU_GLOO, kernel_efficiency=rows, compute_efficiency=1.0)
    assert profile.curve_for("matmul", torch.float32) == ((1e6, 0.5), (1e9, 1.0))  # the square one
    assert profile.efficiency_at(1e9, torch.float32, thinness=1.0) == 1.0
    assert profile.efficiency_at(1e9, torch.float32, thinness=2.0) == 0.5
    assert profile.efficiency_at(1e9, torch.float32, thinness=9.0) == 0.5  # flat past the thinnest
    assert profile.efficiency_at(1e9, torch.float32, thinness=2**0.5) == pytest.approx(0.75)  # halfway in log
    # the cost model prices an (n/8, n, n) matmul of the same FLOPs slower than a square one
    model = CostModel(fake_mesh((4,)), profile)
    flops = 2 * 256**3
    square = model.compute_cost(flops, [(tensor_meta(torch.empty(256, 256, device="meta")), (R,))] * 2, [])
    n = 512
    thin_in = [
        (tensor_meta(torch.empty(n // 8, n, device="meta")), (R,)),
        (tensor_meta(torch.empty(n, n, device="meta")), (R,)),
    ]
    thin = model.compute_cost(flops, thin_in, [(tensor_meta(torch.empty(n // 8, n, device="meta")), (R,))])
    assert thin > square


def test_the_link_fit_recovers_latency_and_bandwidth_from_the_cost_models_own_times():
    rows = [
        (
            kind,
            n,
            nbytes,
            flat_collective_seconds(kind, n, nbytes, 2e9, 40e-6)
            if kind != "all_reduce"
            else 2 * (n - 1) * 40e-6 + 2 * (n - 1) / n * nbytes / 2e9,
        )
        for kind in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")
        for n in (2, 4)
        for nbytes in (2**12, 2**16, 2**20, 2**23)
    ]
    latency, bandwidth = fit_link(rows)
    assert latency == pytest.approx(40e-6, rel=1e-6) and bandwidth == pytest.approx(2e9, rel=1e-6)


def test_each_kind_fits_its_own_link_and_is_priced_on_it():
    # a backend whose reduce-scatter reduces the whole tensor (gloo's): 2.5x the ring's bytes, and
    # whose all-reduce pays 1 ms per step
    link = {"all_gather": (40e-6, 2e9), "reduce_scatter": (40e-6, 0.8e9), "all_to_all": (40e-6, 2e9)}
    link["all_reduce"] = (1e-3, 2e9)
    rows = [
        (kind, n, nbytes, flat_collective_seconds(kind, n, nbytes, bw, lat) if kind != "all_reduce" else 0.0)
        for kind, (lat, bw) in link.items()
        for n in (2, 4)
        for nbytes in (2**12, 2**20, 2**23)
    ]
    rows = [  # the all-reduce measured as a ring
        (k, n, b, s or 2 * (n - 1) * link[k][0] + 2 * (n - 1) / n * b / link[k][1]) for k, n, b, s in rows
    ]
    kinds = {kind: (lat, bw) for kind, lat, bw in fit_kinds(rows)}
    for kind, (lat, bw) in link.items():
        assert kinds[kind] == pytest.approx((lat, bw), rel=1e-6)
    profile = dataclasses.replace(
        CPU_GLOO, intra_node_latency=40e-6, intra_node_bandwidth=2e9, bandwidth_efficiency=1.0
    )
    fitted = dataclasses.replace(profile, collective_links=tuple((k, *v) for k, v in kinds.items()))
    mesh = fake_mesh((4,))
    m = tensor_meta(torch.empty(1024, 1024, device="meta"))
    plain, measured = CostModel(mesh, profile), CostModel(mesh, fitted)
    scatter, gather = ((P,), (Shard(0),)), ((Shard(0),), (R,))
    assert measured.redistribute_cost(*scatter, m) == pytest.approx(
        flat_collective_seconds("reduce_scatter", 4, 2**22, 0.8e9, 40e-6)
    )
    assert measured.redistribute_cost(*scatter, m) > 2 * plain.redistribute_cost(*scatter, m)
    assert measured.redistribute_cost(*gather, m) == pytest.approx(plain.redistribute_cost(*gather, m))
    with pytest.raises(ValueError, match="collective_links"):
        dataclasses.replace(CPU_GLOO, collective_links=(("broadcast", 1e-5, 1e9),))


def _ring_rows(n: int, latency: float, bandwidth: float) -> tuple:
    """Rows a backend running the cost model's algorithms on a (latency, bandwidth) link would measure
    over ``n`` ranks (the all-reduce as a ring)."""
    return tuple(
        (
            kind,
            n,
            nbytes,
            flat_collective_seconds(kind, n, nbytes, bandwidth, latency)
            if kind != "all_reduce"
            else 2 * (n - 1) * latency + 2 * (n - 1) / n * nbytes / bandwidth,
        )
        for kind in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")
        for nbytes in (2**12, 2**16, 2**20, 2**23)
    )


def test_each_mesh_dim_is_measured_on_its_own_groups_and_fits_its_class_of_link():
    # hosts of 2 ranks, a (2, 2) mesh: dim 0's groups span the hosts one rank on each, dim 1's
    # stay inside a host, and the whole mesh has two ranks on each of two hosts
    group = fake_mesh((4,)).get_group()
    named = mesh_groups((2, 2), group, torch.device("cpu"), local=2)
    spans = {name: span for name, _, span in named}
    assert spans == {"mesh dim 0": GroupSpan(1, 2), "mesh dim 1": GroupSpan(2, 1), "whole mesh": GroupSpan(2, 2)}
    assert [dist.get_world_size(g) for _, g, _ in named] == [2, 2, 4]
    assert [(name, span.size) for name, _, span in mesh_groups((4, 1), group, torch.device("cpu"), 4)] == [
        ("mesh dim 0", 4)
    ]  # a dim of one rank moves nothing, and one dim is the whole mesh
    with pytest.raises(ConstraintError, match=r"--mesh 3x2 takes 6 ranks; the process group has 4"):
        mesh_groups((3, 2), group, torch.device("cpu"), 2)

    # what each class of link measured is what its fit recovers; the group on both links fits neither
    network, nvlink = (70e-6, 3e9), (8e-6, 200e9)
    groups = [
        GroupRows("mesh dim 0", spans["mesh dim 0"], _ring_rows(2, *network)),
        GroupRows("mesh dim 1", spans["mesh dim 1"], _ring_rows(2, *nvlink)),
        GroupRows("whole mesh", spans["whole mesh"], _ring_rows(4, 1.0, 1e3)),
    ]
    assert [g.link for g in groups] == [LinkKind.INTER_NODE, LinkKind.INTRA_NODE, None]
    base = dataclasses.replace(CPU_GLOO, gpus_per_node=2, bandwidth_efficiency=1.0)
    profile = fit_groups(base, groups)
    assert (profile.inter_node_latency, profile.inter_node_bandwidth) == pytest.approx(network, rel=1e-6)
    assert (profile.intra_node_latency, profile.intra_node_bandwidth) == pytest.approx(nvlink, rel=1e-6)
    assert len(profile.collective_links) == 4  # inside a node, each kind fits its own rows
    for _, lat, bw in profile.collective_links:
        assert (lat, bw) == pytest.approx(nvlink, rel=1e-6)
    reports = [group_report(profile, g) for g in groups]
    assert [r["link"] for r in reports] == ["network", "nvlink", "both"]
    assert reports[0]["priced_median_error"] < 1e-6 and reports[1]["priced_median_error"] < 1e-6
    assert reports[2]["priced_median_error"] > 0.9  # a second per step against the profile's microseconds
    # the cost model prices a collective over a dim with that dim's class of link
    assert collective_seconds("all_gather", spans["mesh dim 0"], 2**20, profile) == pytest.approx(
        flat_collective_seconds("all_gather", 2, 2**20, network[1], network[0])
    )
    # only a class measured changes: a single host's groups leave the network's figures alone
    one_host = fit_groups(base, groups[1:2])
    assert (one_host.inter_node_latency, one_host.inter_node_bandwidth) == (
        base.inter_node_latency,
        base.inter_node_bandwidth,
    )


def test_calibrate_refuses_a_mesh_that_does_not_cover_the_ranks_before_measuring(tmp_path):
    fake_mesh((4,))
    started = time.perf_counter()
    with pytest.raises(SystemExit, match=r"calibrate --mesh 3x5 takes 15 ranks; the process group has 128"):
        main(["calibrate", "--fast", "--device", "cpu", "--mesh", "3x5", "--out", str(tmp_path / "p.json")])
    assert time.perf_counter() - started < 1.0 and not (tmp_path / "p.json").exists()
    with pytest.raises(SystemExit, match=r"--mesh: a mesh is sizes joined by 'x'"):
        main(["calibrate", "--mesh", "2y2", "--out", str(tmp_path / "p.json")])


def _calibrate_mesh_rank(rank: int):
    torch.set_num_threads(1)
    profile, measured = calibrate("cpu", opts=CalibrateOptions(fast=True, dtypes=(torch.float32,), mesh=(2, 2)))
    return profile, measured["groups"], len(measured["collectives"])


@pytest.mark.slow  # ~30 s: four gloo processes calibrating on a (2, 2) mesh
def test_calibration_on_a_2x2_mesh_measures_each_dim_and_the_whole_mesh():
    (profile, groups, rows), *_ = run_gloo(_calibrate_mesh_rank, 4)
    assert [(g["name"], g["ranks"], g["link"], len(g["rows"])) for g in groups] == [
        ("mesh dim 0", 2, "nvlink", 12),
        ("mesh dim 1", 2, "nvlink", 12),
        ("whole mesh", 4, "nvlink", 12),
    ]
    assert rows == 36 and all(math.isfinite(g["priced_median_error"]) for g in groups)
    # one host: every group fits the link inside a node, and the profile's is their joint fit
    joint = fit_link([tuple(r) for g in groups for r in g["rows"]])
    assert (profile.intra_node_latency, profile.intra_node_bandwidth) == pytest.approx(joint)
    assert (profile.inter_node_latency, profile.inter_node_bandwidth) != joint


def _calibrate_rank(rank: int):
    torch.set_num_threads(1)  # as torchrun starts each rank: two ranks of two threads on two cores spin for minutes
    profile, measured = calibrate("cpu", opts=CalibrateOptions(fast=True, dtypes=(torch.float32,)))
    assert 0.0 <= profile.comm_overlap <= 1.0 and profile.comm_overlap == measured["comm_overlap"]
    assert 0.0 <= profile.rank_skew <= 1.0 and profile.rank_skew == measured["rank_skew"]
    return profile.intra_node_latency, profile.intra_node_bandwidth, len(measured["collectives"])


@pytest.mark.slow  # ~12 s: two gloo processes calibrating
def test_calibration_on_two_gloo_processes_fits_their_link():
    (latency, bandwidth, rows), _ = run_gloo(_calibrate_rank, 2)
    assert rows == 4 * 3  # four collectives at three sizes
    assert math.isfinite(latency) and 0 < latency < 0.1 and math.isfinite(bandwidth) and bandwidth > 1e6
    assert (latency, bandwidth) != (CPU_GLOO.intra_node_latency, CPU_GLOO.intra_node_bandwidth)


def test_kendall_tau_counts_agreeing_pairs():
    assert kendall_tau([1, 2, 3, 4], [10, 20, 30, 40]) == 1.0
    assert kendall_tau([1, 2, 3, 4], [40, 30, 20, 10]) == -1.0
    assert kendall_tau([1, 2, 3], [1, 3, 2]) == pytest.approx(1 / 3)
    # one plan under two names, predicted alike: its measured order is noise, neither agreeing nor
    # disagreeing, and the predicted order has five pairs, not six (tau-a: 5/6 and 3/6)
    assert kendall_tau([1, 1, 3, 4], [11, 10, 30, 40]) == pytest.approx(5 / math.sqrt(5 * 6))
    assert kendall_tau([1, 1, 3, 2], [11, 10, 30, 40]) == pytest.approx(3 / math.sqrt(5 * 6))
    assert kendall_tau([1, 1], [2, 2]) == 1.0 and kendall_tau([1, 1], [2, 3]) == 0.0


def _validate_rank(rank: int, out: str):
    from autoplan.bench import main as bench_main

    argv = ["validate", "--model", "llama3-debug", "--layers", "1", "--plans", "autoplan,ddp,fsdp", "--steps", "2"]
    return bench_main([*argv, "--json", out])


@pytest.mark.slow  # ~40 s: three plans made and run on two gloo processes
def test_validate_runs_plans_on_two_gloo_processes_and_reports_predicted_and_measured(tmp_path):
    out = tmp_path / "validate.json"
    assert run_gloo(_validate_rank, 2, str(out)) == [0, 0]
    result = json.loads(out.read_text())
    assert result["mesh"] == [2] and [r["plan"] for r in result["plans"]] == ["autoplan", "ddp", "fsdp"]
    for r in result["plans"]:
        assert r["predicted_ms"] > 0 and r["measured_ms"] > 0 and len(r["steps_ms"]) == 2
        assert 0.8 < r["estimated_peak_mib"] / r["measured_peak_mib"] < 1.25  # 1.7/1.7, 1.7/1.7, 1.4/1.5 MiB
        assert r["measured_compute_ms"] > 0 and r["error"] == pytest.approx(
            (r["predicted_ms"] - r["measured_ms"]) / r["measured_ms"]
        )
    assert -1 <= result["kendall_tau"] <= 1
    # the host's speed during the run, against the profile's: a compute re-priced at it
    speed = result["host_speed"]
    assert 0 < speed["min"] <= speed["median"] <= speed["max"] < math.inf
    for r in result["plans"]:
        compute = r["predicted_compute_ms"]
        at_speed = r["predicted_ms"] - compute + compute / speed["median"]
        assert r["error_at_host_speed"] == pytest.approx((at_speed - r["measured_ms"]) / r["measured_ms"])
    # one profiled step's waits on collectives, split into their exposed time and the slowest rank's
    skew = resolve_profile("cpu").rank_skew
    for r in result["plans"]:
        waits = r["waits"]
        assert waits["collectives"] > 0 and waits["exposed_ms"] >= 0 and waits["straggler_ms"] >= 0
        assert waits["exposed_ms"] + waits["straggler_ms"] < waits["step_ms"]  # waits are part of the step
        # the lowered program's collectives, priced, pair up with the waits the profiler saw, in order
        assert waits["priced_alone_ms"] > 0 and all(x["priced_ms_per_call"] > 0 for x in waits["largest"])
        assert sum(x["calls"] for x in waits["largest"]) <= waits["collectives"]
        assert r["predicted_straggler_ms"] == pytest.approx(r["predicted_compute_ms"] * skew / (1 + skew))


def test_waits_split_into_each_collectives_exposed_time_and_the_wait_for_the_slowest_rank():
    # rank 0 reached the first collective 3 ms before rank 1, rank 1 reached the second 3 ms early
    rank0 = [("(4, 4)", 0.005), ("(8,)", 0.001), ("(8,)", 0.002)]
    rank1 = [("(4, 4)", 0.002), ("(8,)", 0.004), ("(8,)", 0.002)]
    split = split_waits([rank0, rank1], largest=1)
    assert split["collectives"] == 3
    assert split["exposed_ms"] == pytest.approx(2 + 1 + 2)  # the last rank to join waits only for the collective
    assert split["straggler_ms"] == pytest.approx(1.5 + 1.5 + 0)  # the mean wait over that
    assert split["largest"] == [{"shape": "(8,)", "calls": 2, "ms_per_call": pytest.approx(1.5)}]
    assert split["priced_alone_ms"] is None and "priced_ms_per_call" not in split["largest"][0]
    # each wait's collective priced alone, in the order the program meets them
    priced = [("(4, 4)", 0.003), ("(8,)", 0.0005), ("(8,)", 0.0015)]
    split = split_waits([rank0, rank1], largest=1, priced=priced)
    assert split["priced_alone_ms"] == pytest.approx(5.0)
    assert split["largest"][0]["priced_ms_per_call"] == pytest.approx(1.0)
    assert split_waits([rank0, rank1], priced=priced[::-1])["priced_alone_ms"] is None  # out of order: unpaired
    # ranks that met different collectives pair up nothing
    assert split_waits([rank0, rank1[:2]]) is None
    assert split_waits([rank0, [("(4, 4)", 0.002), ("(9,)", 0.004), ("(8,)", 0.002)]]) is None


def test_host_speed_is_the_profiles_price_of_the_reference_matmul_over_its_time():
    priced = roofline_seconds(2.0 * 512**3, 3 * 4 * 512**2, torch.float32, CPU_GLOO)  # the cost model's own price
    assert host_speed(CPU_GLOO, priced) == pytest.approx(1.0)
    assert host_speed(CPU_GLOO, priced / 2) == pytest.approx(2.0)  # twice as fast as priced
    assert reference_probe("cpu")() > 0


@pytest.mark.slow  # ~55 s: twelve checks, each its own process
def test_bench_gpu_runs_what_it_can_on_a_cpu_and_skips_the_rest_saying_why(tmp_path):
    from autoplan.bench import main as bench_main

    out = tmp_path / "gpu.json"
    assert bench_main(["gpu", "--device", "cpu", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    checks = result["checks"]
    skipped = {k for k, v in checks.items() if v["status"] == "skipped"}
    assert skipped == {k for k in checks if k.startswith(("overhead", "memory"))} and len(skipped) == 5
    assert all(v["why"] == "needs a CUDA device; none here" for k, v in checks.items() if k in skipped)
    assert all(v["status"] == "ok" for k, v in checks.items() if k not in skipped), checks
    assert result["profile"]["format"] == "autoplan-device-profile"
    assert checks["validate debug (one rank)"]["json"]["plans"][0]["measured_ms"] > 0


def test_a_gpu_check_that_hangs_is_stopped_and_says_where(tmp_path):
    """A check past its limit is aborted: its stack (faulthandler) and what it printed come back,
    and the command goes on to the next check."""
    from autoplan.bench.gpu import Check, _run

    hang = "import time\nprint('started', flush=True)\ndef wait_forever():\n    time.sleep(600)\nwait_forever()"
    r = _run(Check("hang", ("-c", hang)), tmp_path, tmp_path / "profile.json", limit_s=3)
    assert r["status"] == "timeout" and r["limit_s"] == 3 and r["seconds"] < 30
    assert "started" in r["stdout_tail"]
    assert "Fatal Python error: Aborted" in r["stderr_tail"] and "wait_forever" in r["stderr_tail"]
