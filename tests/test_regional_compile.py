"""Regional compilation: the lowered graphs are cut at layer boundaries and identical layers share
one compiled region, so compile time follows the number of distinct layers, not the depth."""

import pytest
import torch
from conftest import fake_mesh
from parallel_run import FSDP, LLAMA_TP, plan_and_apply

from autoplan.lower.lowering import REGION_KEY
from autoplan.lower.passes.fsdp_recompute import RECOMPUTE_KEY
from autoplan.run.compile import MIN_COMPUTE_OPS, compile_regions, compute_ops, region_ids, structure_key

LAYER_PARAMS = 9  # two norms, four attention and three feed-forward weights


def _lowered(name: str, pins):
    _, lowered, _ = plan_and_apply(fake_mesh((2, 4), ("dp", "tp")), name, pins, batch_rows=8)
    return lowered


@pytest.fixture(scope="module")
def tp4():
    """A 4-layer LLaMA (two middle layers alike) with tensor-parallel pins, lowered on a 2x4 mesh."""
    return _lowered("llama4", LLAMA_TP)


def _counting():
    compiled = []

    def compile_region(gm):
        compiled.append(gm)
        return gm

    return compiled, compile_region


def test_identical_layers_share_one_compiled_region(tp4):
    for gm in (tp4.forward, tp4.backward):
        tags = {n.meta.get(REGION_KEY) for n in gm.graph.nodes} - {None, ""}
        assert tags == {f"layers.{i}" for i in range(4)}
        compiled, compile_region = _counting()
        split, stats = compile_regions(gm, compile_region)
        assert stats.regions >= 4 and stats.distinct == len(compiled)
        # the middle layers (same neighbours on both sides) reuse one region's code
        assert stats.distinct <= stats.regions - stats.eager - 1
        assert all(compute_ops(m) >= MIN_COMPUTE_OPS for m in compiled)
        keys = [structure_key(m) for m in compiled]
        assert len(set(keys)) == len(keys)


def test_regions_without_compute_run_eagerly():
    """A region that only gathers (views and a collective) is not worth a compile; one that computes is."""
    g = torch.fx.Graph()
    x = g.placeholder("x")
    gathered = g.call_function(torch.ops._c10d_functional.all_gather_into_tensor.default, (x, 2, "0"))
    waited = g.call_function(torch.ops._c10d_functional.wait_tensor.default, (gathered,))
    flat = g.call_function(torch.ops.aten.view.default, (waited, [-1]))
    y = g.call_function(torch.ops.aten.sin.default, (flat,))
    y = g.call_function(torch.ops.aten.mul.Tensor, (y, y))
    y = g.call_function(torch.ops.aten.add.Tensor, (y, flat))
    g.output(y)
    for n, tag in zip(list(g.nodes)[1:-1], ["layers.0"] * 3 + ["layers.1"] * 3):
        n.meta[REGION_KEY] = tag
    compiled, compile_region = _counting()
    _, stats = compile_regions(torch.fx.GraphModule(torch.nn.Module(), g), compile_region)
    assert (stats.regions, stats.distinct, stats.eager) == (2, 1, 1)
    assert [str(n.target) for n in compiled[0].graph.nodes if n.op == "call_function"] == [
        "aten.sin.default",
        "aten.mul.Tensor",
        "aten.add.Tensor",
    ]


def test_regions_compute_what_the_graph_computes(tp4):
    """The cut graph, with shared regions, gives the same values as the uncut one."""
    gm = tp4.forward
    split, _ = compile_regions(gm, lambda region: region)
    torch.manual_seed(0)
    inputs = []
    for n in gm.graph.find_nodes(op="placeholder"):
        val = n.meta["val"]
        if val.dtype == torch.int64:
            high = 2 if n.name == "mesh_coordinate" else 64
            inputs.append(torch.randint(0, high, val.shape))
        else:
            inputs.append(torch.randn(val.shape, dtype=val.dtype))
    with torch.no_grad():
        want, got = gm(*inputs), split(*inputs)
    assert len(want) == len(got)
    assert all(torch.equal(a, b) for a, b in zip(want, got))


def test_region_ids_never_decrease_along_edges(tp4):
    ids = region_ids(tp4.backward.graph)
    for n, i in ids.items():
        assert all(ids[a] <= i for a in n.all_input_nodes if a in ids)


def _most_regathered_live(gm) -> int:
    """Most re-gathered weights alive at once in a backward graph: a tagged chain's end lives from
    where it is made to its last reader."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    ends = [
        n for n in gm.graph.nodes if n.meta.get(RECOMPUTE_KEY) and any(not u.meta.get(RECOMPUTE_KEY) for u in n.users)
    ]
    spans = [(order[n], max(order[u] for u in n.users)) for n in ends]
    return max(sum(1 for s, e in spans if s <= i <= e) for i in range(len(order)))


def test_backward_regathers_each_layer_just_in_time():
    """FSDP re-gathers run right before the layer's backward reads them, not all at the start."""
    lowered = _lowered("llama4", FSDP)
    assert lowered.recompute.chains >= 3 * LAYER_PARAMS  # most weights: the plan may use some sharded, ungathered
    assert 0 < _most_regathered_live(lowered.backward) <= LAYER_PARAMS
