"""``Plan.explain`` and ``Plan.diff``: why a node took its placements, and what another plan changes."""

import dataclasses
import math

import pytest
import torch
from conftest import fake_mesh
from parallel_run import IO, LLAMA_TP, make
from torch.distributed.tensor import Replicate

from autoplan import AutoParallel, Plan
from autoplan.cost.costs import CostModel
from autoplan.solve.evaluate import reprice

W1 = "layers.*.feed_forward.w1"


def _traced() -> AutoParallel:
    """LLaMA debug traced for a (2, 4) mesh with batch-sharded I/O, open for constraints and solves."""
    build, batch_fn = make("llama", 8)
    with torch.device("meta"):
        model = build()
    with AutoParallel(model, fake_mesh((2, 4), ("dp", "tp")), input_fn=lambda: batch_fn(torch.Generator())) as ap:
        ap.add_input_constraints([IO])
        ap.add_output_constraints([IO])
    return ap


def _plan(pins: list, fix_node: tuple | None = None) -> tuple[Plan, str]:
    """The plan under ``pins`` and the solver status (explain's optimality argument needs a proven optimum)."""
    ap = _traced()
    for target, placements in pins + ([fix_node] if fix_node else []):
        ap.add_node_constraint(target, placements)
    plan = ap.optimize_placement()
    return plan, plan.solver["status"]


@pytest.fixture(scope="module")
def free_ap() -> tuple[AutoParallel, Plan]:
    ap = _traced()
    plan = ap.optimize_placement()
    assert plan.solver["status"] == "optimal"
    return ap, plan


@pytest.fixture(scope="module")
def free(free_ap) -> Plan:
    return free_ap[1]


@pytest.fixture(scope="module")
def tp() -> Plan:
    return _plan(LLAMA_TP)[0]


def test_no_single_node_switch_beats_the_optimum(free):
    """Step time is the nodes' compute plus the redistributions on edges, so switching one node
    changes only its own terms: at a proven optimum with nothing pinned, no alternative is cheaper."""
    deltas = [a.delta_s for n in free.nodes.values() for a in n.alternatives]
    assert deltas and min(deltas) >= -1e-12 * free.cost.total
    for n in free.nodes.values():  # cheapest first, none repeating the chosen strategy
        assert [a.delta_s for a in n.alternatives] == sorted(a.delta_s for a in n.alternatives)
        assert all((a.inputs, a.outputs) != (n.inputs, n.outputs) for a in n.alternatives)


def test_an_alternatives_delta_is_what_switching_that_node_alone_costs(free_ap):
    """Each node's strategies are priced at once (a cost row per edge, overlap spills per segment):
    ``delta_s`` must be the whole plan priced again with that one node switched, in the ILP's terms
    (the buckets' unshared latency, ``CostBreakdown.bucket_latency``, left out as the ILP does)."""
    ap, plan = free_ap
    cost_model = CostModel(ap.mesh, ap.device_profile)
    nodes = [n for n in plan.nodes.values() if n.alternatives]
    hidden = [n for n in nodes if n.op == "aten.all_gather_into_tensor.default" or n.name.startswith("p_")]
    picked = {n.name: n for n in nodes[::25] + hidden[:10]}
    assert len(picked) >= 20
    for node in picked.values():
        for alt in node.alternatives:
            switched = {**plan.nodes, node.name: dataclasses.replace(node, outputs=alt.outputs, inputs=alt.inputs)}
            priced = reprice(ap.traced, dataclasses.replace(plan, nodes=switched), cost_model, ap._outputs)
            ilp = priced.cost.total - priced.cost.bucket_latency
            expected = plan.cost.total - plan.cost.bucket_latency + alt.delta_s
            assert ilp == pytest.approx(expected, rel=1e-9, abs=1e-12), node.name


def test_forcing_an_alternative_costs_at_most_its_delta(free):
    """Pinning a node to its next-best output placement and re-solving can only do as well as
    switching that node alone (the solver may re-arrange the neighbours too)."""
    mm = next(n for n in free.nodes.values() if n.op == "aten.mm.default" and n.alternatives)
    alt = mm.alternatives[0]
    forced, _ = _plan([], (mm.name, alt.outputs[0]))
    assert forced.nodes[mm.name].outputs[0] == alt.outputs[0]
    free_ilp, forced_ilp = (p.cost.total - p.cost.bucket_latency for p in (free, forced))
    assert free_ilp * (1 - 1e-9) <= forced_ilp <= (free_ilp + alt.delta_s) * (1 + 1e-9)


def test_explain_a_module_pattern(tp):
    text = tp.explain(W1, all_ops=True)
    matmuls = [n for n in tp.matching("layers.0.feed_forward.w1") if n.op == "aten.mm.default"]
    assert len(matmuls) == 3  # forward, input gradient, weight gradient
    first = tp.nodes[matmuls[0].name]
    assert f"{first.name}: aten.mm.default in layers.0.feed_forward.w1 [forward]" in text
    assert "chosen" in text and "+" in text and " us" in text
    # under a pattern, layers placed alike show once; under a path, every node of that layer shows
    nodes = tp.matching(W1)
    alike = {(n.module.split(".", 2)[2], n.op, n.phase, n.inputs, n.outputs) for n in nodes}
    assert text.count(": aten.") == len(alike) < len(nodes)
    layer = tp.matching("layers.1.feed_forward.w1")
    assert tp.explain("layers.1.feed_forward.w1", all_ops=True).count(": aten.") == len(layer)
    # by default only the ops that compute (the matmuls among them), not the views and aliases
    short = tp.explain("layers.1.feed_forward.w1")
    assert short.count(": aten.") == sum(n.compute_s > 0 for n in layer) < len(layer)
    assert short.count(": aten.mm.default in ") == 3 and ": aten.t.default in " not in short


def test_explain_survives_json_and_names_unknown_targets(tp):
    again = Plan.from_json(tp.to_json())
    assert again.nodes == tp.nodes and again.explain(W1) == tp.explain(W1)
    with pytest.raises(KeyError, match="layers.\\*.feed_forward"):
        tp.explain("layers.*.feed_fwd")


def test_diff_groups_changes_by_layer_pattern(free, tp):
    assert free.diff(free).same and "same placements everywhere" in str(free.diff(free))
    d = free.diff(tp)
    assert not d.same
    # a pinned weight differs in both layers, reported once under its pattern
    wo = [(k, n) for k, n in d.params.items() if k[0] == "layers.*.attention.wo.weight"]
    assert wo and wo[0][1] == 2 and wo[0][0][2] == "S(0)S(1)"
    moved = [f for f, pl in tp.param_placements.items() if free.param_placements[f] != pl]
    assert sum(d.params.values()) == len(moved)
    changed = sum((a.inputs, a.outputs) != (tp.nodes[k].inputs, tp.nodes[k].outputs) for k, a in free.nodes.items())
    assert sum(d.nodes.values()) == changed > 0
    assert math.isclose(d.cost["total"][1], tp.cost.total) and math.isclose(d.cost["total"][0], free.cost.total)
    text = str(d)
    assert "layers.*.attention.wo.weight" in text and "x2" in text


def test_what_if_on_one_trace():
    """Constraints come and go and the device profile changes on an open ``AutoParallel``; each
    re-solve prices from scratch, so a changed cost changes the plan."""
    import dataclasses

    from autoplan.errors import ConstraintError

    ap = _traced()
    base = ap.optimize_placement()
    for target, placements in LLAMA_TP:
        ap.add_node_constraint(target, placements)
    pinned = ap.optimize_placement()
    for target, _ in LLAMA_TP:
        ap.remove_node_constraint(target)
    with pytest.raises(ConstraintError, match="no node constraint"):
        ap.remove_node_constraint(LLAMA_TP[0][0])
    again = ap.optimize_placement()
    # matmuls 1000x slower: duplicating them on the tp ranks no longer pays, so the plan splits them
    slow = dict(ap.device_profile.peak_flops)
    ap.device_profile = dataclasses.replace(ap.device_profile, peak_flops=tuple((k, v / 1000) for k, v in slow.items()))
    slow_compute = ap.optimize_placement()
    assert again.diff(base).same and not pinned.diff(base).same
    assert not slow_compute.diff(base).same
    assert slow_compute.cost.compute_forward < 1000 * base.cost.compute_forward

    def split_on_tp(plan: Plan) -> int:
        return sum(n.op == "aten.mm.default" and n.outputs[0][1] != Replicate() for n in plan.nodes.values())

    assert split_on_tp(slow_compute) > split_on_tp(base)


def test_a_small_model_computing_replicated_says_so_and_what_splitting_costs(tp):
    """A small ResNet (widths 16 and 32, 16 images of 16x16) on a (2, 4) mesh with batch-split I/O:
    its plan gathers the batch and every forward compute op runs whole on each rank, which the summary
    says, with the best plan that splits them, slower by the same cost model (and back from JSON).
    A tensor-parallel LLaMA splits most of its compute time: the count and share, no comparison."""
    import re

    from models import ResNet
    from torch.distributed.tensor import Shard

    from autoplan.plan import forward_compute, replicated, replicated_compute

    with torch.device("meta"):
        model = ResNet(widths=(16, 32), classes=8)
    with AutoParallel(model, fake_mesh((2, 4), ("dp", "tp")), input_fn=lambda: torch.randn(16, 3, 16, 16)) as ap:
        ap.add_input_constraints([(Shard(0), Replicate())])
        ap.add_output_constraints([(Shard(0), Replicate())])
        plan = ap.optimize_placement()
    compute = forward_compute(plan.nodes.values())
    assert {"aten.convolution.default", "aten.mean.dim", "aten.addmm.default"} <= {n.op for n in compute}
    assert all(n.compute_s > 0 and n.phase == "forward" for n in compute)
    assert all(replicated(n.outputs, n.inputs) for n in compute)
    lines = plan.summary().splitlines()
    said = (
        f"compute replicated on all ranks: {len(compute)} of {len(compute)} forward ops, 100.0% of their compute time"
    )
    assert lines[2] == said
    split, chosen = plan.ilp["split_objective"], plan.ilp["objective"]
    assert split > chosen
    assert re.fullmatch(
        rf"  why: the best plan splitting every forward op that can split takes {split * 1e3:.3f} ms per step"
        rf" against this plan's {chosen * 1e3:.3f} ms \(the ILP's estimates\): its collectives cost more .*",
        lines[3],
    )
    assert Plan.from_json(plan.to_json()).summary() == plan.summary()
    whole, total, share = replicated_compute(tp.nodes.values())
    assert share < 0.5 and tp.ilp["split_objective"] is None
    tp_lines = tp.summary().splitlines()
    assert (
        tp_lines[2]
        == f"compute replicated on all ranks: {whole} of {total} forward ops, {share:.1%} of their compute time"
    )
    assert not tp_lines[3].startswith("  why:")
