import dataclasses
import itertools
import math

import pytest
import torch
from conftest import fake_mesh, init_fake_world
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard
from torch.utils._python_dispatch import TorchDispatchMode

from autoplan.adapters.dtensor import redistribute_steps, tensor_meta
from autoplan.cost.costs import CostModel, UnsupportedRedistribution, largest_shard_shape, local_bytes
from autoplan.cost.devices import B200, DEVICE_PROFILES, H100_SXM, LinkKind, resolve_profile
from autoplan.cost.flops import node_flops
from autoplan.cost.network import GroupSpan, MeshTopology, collective_seconds, flat_collective_seconds
from autoplan.errors import ConstraintError
from autoplan.shard.expert_rows import ExpertRows

aten = torch.ops.aten
R, P = Replicate(), Partial()
INTER, INTRA = LinkKind.INTER_NODE, LinkKind.INTRA_NODE
HBM = H100_SXM.hbm_bandwidth * H100_SXM.bandwidth_efficiency


def meta(*shape: int, dtype: torch.dtype = torch.bfloat16):
    return tensor_meta(torch.empty(*shape, dtype=dtype, device="meta"))


@pytest.fixture(scope="module")
def model() -> CostModel:
    init_fake_world()
    return CostModel(fake_mesh((16, 8), ("dp", "tp")))


@pytest.mark.parametrize(
    ("shape", "gpus_per_node", "links"),
    [((16, 8), 8, (INTER, INTRA)), ((2, 4), 8, (INTRA, INTRA)), ((8,), 4, (INTER,)), ((2, 4), 4, (INTER, INTRA))],
)
def test_topology_from_mesh(shape, gpus_per_node, links):
    init_fake_world()
    assert MeshTopology.from_mesh(fake_mesh(shape), gpus_per_node).links == links


def test_profile_gpus_per_node_changes_links():
    init_fake_world()
    mesh = fake_mesh((2, 4))
    assert CostModel(mesh).topology.links == (INTRA, INTRA)
    assert CostModel(mesh, dataclasses.replace(H100_SXM, gpus_per_node=4)).topology.links == (INTER, INTRA)


def test_all_gather_matches_ring_formula(model):
    """The ring's bytes; NVSwitch multicasts, so the latency is two steps, not seven."""
    m = meta(4096, 4096)
    full = 4096 * 4096 * 2
    bw = H100_SXM.intra_node_bandwidth * H100_SXM.bandwidth_efficiency
    expected = 7 / 8 * full / bw + 2 * H100_SXM.intra_node_latency
    assert model.redistribute_cost((R, Shard(0)), (R, R), m) == pytest.approx(expected)
    assert model.redistribute_collectives((R, Shard(0)), (R, R), m) == (("all_gather", 1),)


def test_inter_node_all_gather_costs_more(model):
    m = meta(4096, 4096)
    inter = model.redistribute_cost((Shard(0), R), (R, R), m)
    intra = model.redistribute_cost((R, Shard(0)), (R, R), m)
    assert inter > 5 * intra


def test_two_dim_gather_costs_more_than_its_inner_gather_and_less_than_its_network_gather(model):
    """Gathering S(0)S(0) runs as one hierarchical gather over all 128 ranks, so it costs less than
    gathering S(0)R across nodes, where all 8 ranks of a node fetch the same bytes over their NICs."""
    m = meta(4096, 4096)
    both = model.redistribute_cost((Shard(0), Shard(0)), (R, R), m)
    inner = model.redistribute_cost((R, Shard(0)), (R, R), m)
    outer = model.redistribute_cost((Shard(0), R), (R, R), m)
    assert inner < both < outer
    assert model.redistribute_collectives((Shard(0), Shard(0)), (R, R), m) == (("all_gather", 1), ("all_gather", 0))


def test_large_ring_all_reduce_is_twice_reduce_scatter_but_nvswitch_reduces_in_network(model):
    m = meta(65536, 4096)
    across = model.redistribute_cost((P, R), (R, R), m)
    assert across == pytest.approx(2 * model.redistribute_cost((P, R), (Shard(0), R), m))
    inside = model.redistribute_cost((R, P), (R, R), m)  # NVLS: each byte sent and received once
    bw = H100_SXM.intra_node_bandwidth * H100_SXM.bandwidth_efficiency
    assert inside == pytest.approx(65536 * 4096 * 2 / bw + 2 * H100_SXM.intra_node_latency)
    assert inside < 2 * model.redistribute_cost((R, P), (R, Shard(0)), m)


def test_all_to_all_moves_a_shard(model):
    m = meta(4096, 4096)
    all_to_all = model.redistribute_cost((R, Shard(0)), (R, Shard(1)), m)
    all_gather = model.redistribute_cost((R, Shard(0)), (R, R), m)
    assert model.redistribute_collectives((R, Shard(0)), (R, Shard(1)), m) == (("all_to_all", 1),)
    assert all_to_all < all_gather


def test_local_slices_are_cheap(model):
    m = meta(4096, 4096)
    assert model.redistribute_collectives((R, R), (R, Shard(0)), m) == (("local", 1),)
    chunk = 4096 * 4096 * 2 / 8  # DTensor clones the chunk: it is read and written once
    assert model.redistribute_cost((R, R), (R, Shard(0)), m) == pytest.approx(2 * chunk / HBM + H100_SXM.kernel_launch)
    assert model.redistribute_cost((R, R), (R, P), m) < model.redistribute_cost((R, Shard(0)), (R, R), m)


def test_identical_placements_cost_nothing(model):
    m = meta(4096, 4096)
    assert model.redistribute_cost((Shard(0), P), (Shard(0), P), m) == 0.0
    assert model.redistribute_collectives((Shard(0), P), (Shard(0), P), m) == ()


def test_unsupported_redistributions(model):
    m = meta(4096, 4096)
    assert model.redistribute_cost((Shard(0), R), (P, R), m) == math.inf
    assert model.redistribute_cost((P, R), (Partial("max"), R), m) == math.inf
    assert model.redistribute_cost((P, Partial("max")), (R, R), m) == math.inf
    with pytest.raises(UnsupportedRedistribution):
        model.redistribute_collectives((Shard(0), R), (P, R), m)


def test_expert_rows_reduce_as_a_partial_sum_relabel_for_free_and_are_never_made_by_a_move(model):
    """Expert rows (an expert-parallel matmul's output) reduce as ``Partial`` does, become one for
    nothing, and no move makes them (only the ops that keep each rank's rows do)."""
    m, E0, E1 = meta(4096, 4096), ExpertRows(0), ExpertRows(1)
    assert model.redistribute_cost((E0, R), (R, R), m) == model.redistribute_cost((P, R), (R, R), m) > 0
    assert model.redistribute_cost((E0, R), (Shard(0), R), m) == model.redistribute_cost((P, R), (Shard(0), R), m)
    assert model.redistribute_cost((E0, R), (P, R), m) == 0.0
    assert model.redistribute_collectives((E0, R), (P, R), m) == ()
    for src in ((R, R), (P, R), (Shard(0), R), (E1, R)):
        assert model.redistribute_cost(src, (E0, R), m) == math.inf


def test_size_one_mesh_dim_is_free():
    init_fake_world()
    model = CostModel(fake_mesh((1, 8)))
    assert model.redistribute_cost((Shard(0), R), (R, R), meta(64, 64)) == 0.0


def test_cost_depends_on_dtype(model):
    bf16 = model.redistribute_cost((R, Shard(0)), (R, R), meta(4096, 4096))
    fp32 = model.redistribute_cost((R, Shard(0)), (R, R), meta(4096, 4096, dtype=torch.float32))
    latency = 2 * H100_SXM.intra_node_latency
    assert fp32 - latency == pytest.approx(2 * (bf16 - latency))


def test_local_bytes_uses_ceil():
    m = meta(10, 3, dtype=torch.float32)
    assert local_bytes(m, (Shard(0), R), (4, 8)) == 3 * 3 * 4
    assert local_bytes(m, (Shard(0), Shard(0)), (16, 8)) == 1 * 3 * 4
    assert local_bytes(m, (P, Shard(1)), (4, 8)) == 10 * 1 * 4
    assert local_bytes(m, (R, R), (4, 8)) == 10 * 3 * 4


def test_sharded_matmul_is_an_eighth(model):
    n = 8192
    a, b, out = meta(n, n), meta(n, n), meta(n, n)
    flops = 2.0 * n**3
    replicated = model.compute_cost(flops, [(a, (R, R)), (b, (R, R))], [(out, (R, R))])
    sharded = model.compute_cost(flops, [(a, (R, Shard(0))), (b, (R, R))], [(out, (R, Shard(0)))])
    launch = H100_SXM.kernel_launch
    assert replicated == pytest.approx(flops / (989e12 * 0.6) + launch)
    assert sharded - launch == pytest.approx((replicated - launch) / 8)


def test_partial_output_splits_work(model):
    n = 8192
    a, b, out = meta(n, n), meta(n, n), meta(n, n)
    row_parallel = model.compute_cost(2.0 * n**3, [(a, (R, Shard(1))), (b, (R, Shard(0)))], [(out, (R, P))])
    replicated = model.compute_cost(2.0 * n**3, [(a, (R, R)), (b, (R, R))], [(out, (R, R))])
    assert row_parallel < replicated / 4


def test_elementwise_add_is_memory_bound(model):
    x = meta(8192, 8192)
    cost = model.compute_cost(8192 * 8192, [(x, (R, R)), (x, (R, R))], [(x, (R, R))])
    assert cost == pytest.approx(3 * 8192 * 8192 * 2 / HBM + H100_SXM.kernel_launch)


def test_views_cost_nothing(model):
    x = meta(8192, 8192)
    assert model.compute_cost(0.0, [(x, (R, R))], [(x, (R, R))], is_view=True) == 0.0


def test_mm_flops():
    m, k, n = 64, 32, 16
    a, b = torch.empty(m, k, device="meta"), torch.empty(k, n, device="meta")
    assert node_flops(aten.mm.default, (a, b), {}, a @ b) == 2 * m * n * k
    bias = torch.empty(n, device="meta")
    assert node_flops(aten.addmm.default, (bias, a, b), {}, a @ b) == 2 * m * n * k
    x, y = torch.empty(4, m, k, device="meta"), torch.empty(4, k, n, device="meta")
    assert node_flops(aten.bmm.default, (x, y), {}, x @ y) == 4 * 2 * m * n * k


def test_convolution_flops():
    x, w = torch.empty(2, 3, 16, 16, device="meta"), torch.empty(8, 3, 3, 3, device="meta")
    args = (x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
    out = aten.convolution.default(*args)
    assert node_flops(aten.convolution.default, args, {}, out) == 2 * (2 * 8 * 16 * 16) * (3 * 3 * 3)


def test_sdpa_cpu_flops():
    b, h, s, d = 2, 8, 128, 64
    q = torch.empty(b, h, s, d, device="meta")
    fwd_op = aten._scaled_dot_product_flash_attention_for_cpu.default
    out, lse = fwd_op(q, q, q)
    full = 4 * b * h * s * s * d
    assert node_flops(fwd_op, (q, q, q), {}, (out, lse)) == full
    assert node_flops(fwd_op, (q, q, q, 0.0, True), {}, (out, lse)) == full / 2
    assert node_flops(fwd_op, (q, q, q), {"is_causal": True}, (out, lse)) == full / 2
    bwd_op = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    bwd_args = (out, q, q, q, out, lse, 0.0, False)
    assert node_flops(bwd_op, bwd_args, {}, (q, q, q)) == 2.5 * full


def test_ops_without_formula_have_no_flops():
    x = torch.empty(4, 4, device="meta")
    assert node_flops(aten.add.Tensor, (x, x), {}, x + x) == 0.0


# ---- re-layout copies around collectives on non-leading dims


def _copy_seconds(nbytes: float) -> float:
    """One local copy kernel: reads and writes ``nbytes``."""
    return 2 * nbytes / HBM + H100_SXM.kernel_launch


def test_gather_on_a_non_leading_dim_pays_a_copy(model):
    # a (4096, 14336) weight stored Shard(1): NCCL stacks the chunks on dim 0, a copy moves them to dim 1
    m = meta(4096, 14336)
    dim1 = model.redistribute_cost((R, Shard(1)), (R, R), m)
    dim0 = model.redistribute_cost((R, Shard(0)), (R, R), m)
    assert dim1 - dim0 == pytest.approx(_copy_seconds(4096 * 14336 * 2))
    # the copy is part of the gather, not a primitive of its own
    assert model.redistribute_collectives((R, Shard(1)), (R, R), m) == (("all_gather", 1),)


def test_only_a_moves_collectives_can_hide_under_compute(model):
    # the copies a move makes are kernels of the rank's own program, in line with its compute
    m = meta(4096, 14336)
    leading = model.redistribute_cost((R, Shard(0)), (R, R), m)
    assert model.hideable_cost((R, Shard(0)), (R, R), m) == leading  # nothing but the all-gather
    assert model.hideable_cost((R, Shard(1)), (R, R), m) == pytest.approx(leading)  # the re-layout copy stays out
    assert model.redistribute_cost((R, Shard(1)), (R, R), m) > leading
    assert model.hideable_cost((R, R), (R, Shard(0)), m) == 0.0  # a local slice
    pairs = [(R, Shard(0)), (R, Shard(1)), (R, R)]
    matrix = model.hideable_costs(pairs, [(R, R)], m)[:, 0]
    assert list(matrix) == [model.hideable_cost(p, (R, R), m) for p in pairs]


def test_gather_of_contiguous_blocks_is_a_view(model):
    # sequence-sharded activations with one local batch row: the stacked chunks already are dim 1
    seq_sharded = model.redistribute_cost((R, Shard(1)), (R, R), meta(1, 8192, 4096))
    batch_sharded = model.redistribute_cost((R, Shard(0)), (R, R), meta(8192, 1, 4096))
    assert seq_sharded == pytest.approx(batch_sharded)


def test_gather_copies_only_the_local_tensor(model):
    # gathering dim 1 over tp while dp still shards dim 0: the re-layout copies the (256, 14336) local result
    both = model.redistribute_cost((Shard(0), Shard(1)), (Shard(0), R), meta(4096, 14336))
    leading = model.redistribute_cost((Shard(1), Shard(0)), (Shard(1), R), meta(14336, 4096))
    assert both - leading == pytest.approx(_copy_seconds(4096 // 16 * 14336 * 2))


def test_reduce_scatter_on_a_non_leading_dim_pays_a_copy(model):
    m = meta(4096, 14336)
    dim1 = model.redistribute_cost((R, P), (R, Shard(1)), m)
    dim0 = model.redistribute_cost((R, P), (R, Shard(0)), m)
    assert dim1 - dim0 == pytest.approx(_copy_seconds(4096 * 14336 * 2))  # the re-layout before the scatter
    assert model.redistribute_collectives((R, P), (R, Shard(1)), m) == (("reduce_scatter", 1),)


def test_reduce_scatter_of_contiguous_blocks_is_a_view(model):
    seq_sharded = model.redistribute_cost((R, P), (R, Shard(1)), meta(1, 8192, 4096))
    batch_sharded = model.redistribute_cost((R, P), (R, Shard(0)), meta(8192, 1, 4096))
    assert seq_sharded == pytest.approx(batch_sharded)


def test_all_to_all_pays_for_moving_non_leading_dims(model):
    shard = 4096 * 4096 * 2 / 8
    # the same bytes with one local row: the new shard dim's chunks are contiguous, no copy either side
    exchange = model.redistribute_cost((R, Shard(0)), (R, Shard(1)), meta(8, 4096 * 4096 // 8))
    # S(0) -> S(1): the new shard dim goes to the front first; S(1) -> S(0): the gathered dim goes back after
    m = meta(4096, 4096)
    assert model.redistribute_cost((R, Shard(0)), (R, Shard(1)), m) == pytest.approx(exchange + _copy_seconds(shard))
    assert model.redistribute_cost((R, Shard(1)), (R, Shard(0)), m) == pytest.approx(exchange + _copy_seconds(shard))


def test_collective_of_a_transposed_view_copies_its_input_first(model):
    # a (14336, 4096) weight used transposed and gathered over tp: the local (512, 14336) view is made contiguous
    t_view = tensor_meta(torch.empty(14336, 4096, dtype=torch.bfloat16, device="meta").t())
    contiguous = meta(4096, 14336)
    gathered = model.redistribute_cost((R, Shard(0)), (R, R), t_view)
    assert gathered - model.redistribute_cost((R, Shard(0)), (R, R), contiguous) == pytest.approx(
        _copy_seconds(4096 // 8 * 14336 * 2)
    )
    # only the first collective copies: its output is contiguous
    both = model.redistribute_cost((Shard(0), Shard(0)), (R, R), t_view)
    assert both - model.redistribute_cost((Shard(0), Shard(0)), (R, R), contiguous) == pytest.approx(
        _copy_seconds(4096 // 128 * 14336 * 2)
    )
    # a local slice reads the view as it is
    assert model.redistribute_cost((R, R), (R, Shard(0)), t_view) == model.redistribute_cost(
        (R, R), (R, Shard(0)), contiguous
    )


def test_a_move_holds_its_result_and_the_buffers_around_its_collectives(model):
    """What the memory model counts while a move runs: a gather on dim 0 holds its result alone; on a
    non-leading dim the gathered chunks and their re-laid copy at once; a reduce-scatter there the
    re-laid input and its result; a two-dim gather each step's input and output."""
    m, full = meta(4096, 14336), 4096 * 14336 * 2
    assert model.redistribute_peak_bytes((R, Shard(0)), (R, Shard(0)), m) == 0
    assert model.redistribute_peak_bytes((R, Shard(0)), (R, R), m) == full
    assert model.redistribute_peak_bytes((R, Shard(1)), (R, R), m) == 2 * full
    assert model.redistribute_peak_bytes((R, P), (R, Shard(1)), m) == full + full // 8
    assert model.redistribute_peak_bytes((R, P), (R, Shard(0)), m) == full // 8
    # tp first (1/128 -> 1/16 of the tensor), then dp: the dp gather's input and output at once
    assert model.redistribute_peak_bytes((Shard(0), Shard(0)), (R, R), m) == full // 16 + full
    # a local slice holds its (new) chunk
    assert model.redistribute_peak_bytes((R, R), (R, Shard(0)), m) == full // 8


def test_a_move_that_frees_its_source_holds_it_only_beside_its_first_primitive(model):
    """A gradient's reduction is the last reader of the gradient as made (``consumed``): the source
    is freed once the first primitive has read it, so the bytes beyond the source's are that
    primitive's output, or the later buffers less the source where those are more."""
    m, full = meta(4096, 14336), 4096 * 14336 * 2
    assert model.redistribute_peak_bytes((R, P), (R, Shard(0)), m, consumed=True) == full // 8
    # the re-laid copy beside the source, then the reduce-scatter's result beside the copy
    assert model.redistribute_peak_bytes((R, P), (R, Shard(1)), m, consumed=True) == full
    # LLaMA's embedding gradient on 16x8: a local slice, its re-laid copy and a reduce-scatter; the
    # copy is made once the source is gone
    assert model.redistribute_peak_bytes((R, P), (Shard(1), Shard(1)), m) == full // 16 + full // 16
    assert model.redistribute_peak_bytes((R, P), (Shard(1), Shard(1)), m, consumed=True) == full // 16
    # tp gather, then dp gather: the source is gone when the second runs
    gathers = model.redistribute_peak_bytes((Shard(0), Shard(0)), (R, R), m, consumed=True)
    assert gathers == full // 16 + full - full // 128
    assert model.redistribute_peak_bytes((R, Shard(0)), (R, Shard(0)), m, consumed=True) == 0


# ---- collective algorithms and topology ------------------------------------------------------

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")
SPANS = [GroupSpan(8, 1), GroupSpan(1, 16), GroupSpan(8, 16), GroupSpan(4, 2)]


@pytest.mark.parametrize("profile", sorted(DEVICE_PROFILES))
@pytest.mark.parametrize("kind", KINDS)
def test_collectives_are_monotone_in_bytes_and_group_size(profile, kind):
    profile = DEVICE_PROFILES[profile]
    sizes = [2**k for k in range(8, 34, 3)]
    for span in SPANS:
        times = [collective_seconds(kind, span, b, profile) for b in sizes]
        assert times == sorted(times) and times[0] < times[-1], (span, times)
    # an all-to-all of a fixed tensor sends less per rank on more ranks: grow it with the group
    scale = (lambda span: span.size) if kind == "all_to_all" else (lambda span: 1)
    for grow in ((GroupSpan(2, 1), GroupSpan(4, 1), GroupSpan(8, 1)), (GroupSpan(1, 2), GroupSpan(1, 8))):
        for b in (2**12, 2**30):
            times = [collective_seconds(kind, span, b * scale(span), profile) for span in grow]
            assert times == sorted(times), (kind, grow, b, times)
    for per_node in (2, 8):  # more nodes of the same local size
        spans = [GroupSpan(per_node, k) for k in (2, 4, 16)]
        times = [collective_seconds(kind, span, 2**30 * scale(span), profile) for span in spans]
        assert times == sorted(times), (kind, per_node, times)


@pytest.mark.parametrize("kind", KINDS)
def test_intra_node_is_cheaper_than_inter_node(kind):
    for b in (2**16, 2**30):
        inside = collective_seconds(kind, GroupSpan(8, 1), b, H100_SXM)
        across = collective_seconds(kind, GroupSpan(1, 8), b, H100_SXM)
        assert inside < across


def test_a_group_spanning_nodes_runs_hierarchically():
    b, n = 2**30, 128
    spread = collective_seconds("all_gather", GroupSpan(8, 16), b, H100_SXM)
    one_per_node = collective_seconds("all_gather", GroupSpan(1, n), b, H100_SXM)
    net = H100_SXM.inter_node_bandwidth * H100_SXM.bandwidth_efficiency
    nvl = H100_SXM.intra_node_bandwidth * H100_SXM.bandwidth_efficiency
    expected = (
        15 / 16 * b / 8 / net + 15 * H100_SXM.inter_node_latency + 7 / 8 * b / nvl + 7 * H100_SXM.intra_node_latency
    )
    assert spread == pytest.approx(expected)
    assert collective_seconds("all_gather", GroupSpan(n, 1), b, H100_SXM) < spread < one_per_node / 4


def test_tree_beats_ring_for_small_all_reduces():
    net = H100_SXM.inter_node_bandwidth * H100_SXM.bandwidth_efficiency
    lat = H100_SXM.inter_node_latency
    n, small, large = 64, 2**12, 2**36
    ring = 2 * (n - 1) / n * small / net + 2 * (n - 1) * lat
    tree = 2 * small / net + 2 * 6 * lat
    assert collective_seconds("all_reduce", GroupSpan(1, n), small, H100_SXM) == pytest.approx(tree)
    assert tree < ring / 5
    ring_large = 2 * (n - 1) / n * large / net + 2 * (n - 1) * lat
    assert collective_seconds("all_reduce", GroupSpan(1, n), large, H100_SXM) == pytest.approx(ring_large)
    assert flat_collective_seconds("all_reduce", n, large, net, lat) < 2 * large / net  # ring wins big messages


def test_a_fused_gather_is_priced_as_one_collective_over_the_flattened_mesh(model):
    m = meta(4096, 4096)
    full = 4096 * 4096 * 2
    fused = model.redistribute_cost((Shard(0), Shard(0)), (R, R), m)
    assert fused == pytest.approx(collective_seconds("all_gather", model.topology.flat, full, H100_SXM))
    chained = collective_seconds("all_gather", model.topology.spans[1], full / 16, H100_SXM) + collective_seconds(
        "all_gather", model.topology.spans[0], full, H100_SXM
    )
    assert fused <= chained
    assert model.topology.flat == GroupSpan(8, 16)
    # a gather on a non-leading dim re-lays its chunks between the two gathers: nothing to fuse
    wide = meta(8, 4096, 4096)
    copies = [t for t in model._plan((Shard(1), Shard(1)), (R, R), wide) if t.kind == "relayout"]
    assert copies
    assert model.redistribute_cost((Shard(1), Shard(1)), (R, R), wide) > collective_seconds(
        "all_gather", model.topology.flat, 8 * full, H100_SXM
    )


def test_profiles_by_name():
    init_fake_world()
    mesh = fake_mesh((2, 4))
    for name, profile in DEVICE_PROFILES.items():
        assert resolve_profile(name) is profile and resolve_profile(name.upper()) is profile
        assert profile.flops_for(torch.bfloat16) > profile.flops_for(torch.float64) or name == "cpu"
    assert resolve_profile(B200) is B200
    with pytest.raises(ConstraintError, match="unknown device profile 'h800'.*h100"):
        resolve_profile("h800")
    m = meta(4096, 4096)
    costs = {
        n: CostModel(mesh, resolve_profile(n)).redistribute_cost((R, Shard(0)), (R, R), m)
        for n in ("a100", "h100", "b200")
    }
    assert costs["b200"] < costs["h100"] < costs["a100"]


@pytest.mark.parametrize(
    "shape, choices",
    [
        ((4, 2, 3), (R, P, Shard(0), Shard(1))),
        ((2, 1, 3), (R, P, Shard(0), Shard(2))),  # a size-1 mesh dim splits nothing
        ((1, 1), (R, P, Partial("max"), Shard(0), Shard(1))),  # a source split nowhere: one pass
        ((8,), (R, P, Partial("avg"), Shard(0), Shard(1), Shard(2))),
    ],
)
def test_redistribute_steps_are_dtensors_own(shape, choices):
    """The steps worked out from the placements alone are DTensor's own search's for every pair of
    placements, with its logical shapes, on even and uneven tensors (7 and 10 split unevenly)."""
    from torch.distributed.tensor._redistribute import _gen_transform_infos

    from autoplan.adapters.dtensor import make_spec

    init_fake_world()
    mesh = fake_mesh(shape)
    placements = list(itertools.product(choices, repeat=len(shape)))
    rank = 1 + max(p.dim for p in choices if isinstance(p, Shard))
    for m in (meta(*(96, 48, 24)[:rank]), meta(*(7, 10, 5)[:rank])):
        for src in placements:
            for dst in placements:
                infos = _gen_transform_infos(make_spec(mesh, src, m), make_spec(mesh, dst, m))
                theirs = tuple((i.mesh_dim, *i.src_dst_placements, tuple(i.logical_shape)) for i in infos)
                ours = tuple((s.mesh_dim, s.src, s.dst, s.logical_shape) for s in redistribute_steps(mesh, src, dst, m))
                assert ours == theirs, (src, dst, m.shape)


def test_every_rank_prices_an_uneven_move_alike():
    """DTensor records each step's logical shape as this rank sees it, smaller on the short shards of
    an uneven split. Priced that way, ranks planning on their own (torchrun) could pick different
    plans; the steps carry the largest shard's shape wherever this rank sits in the mesh."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor._redistribute import _gen_transform_infos

    from autoplan.adapters.dtensor import make_spec

    init_fake_world()
    first = fake_mesh((2, 4))
    last = DeviceMesh("cpu", torch.arange(8).flip(0).reshape(2, 4))  # this rank at coordinate (1, 3)
    src, dst, m = (Shard(0), Shard(0)), (R, R), meta(7, 3)
    seen_here = [tuple(i.logical_shape) for i in _gen_transform_infos(make_spec(last, src, m), make_spec(last, dst, m))]
    assert (3, 3) in seen_here  # DTensor's own view from the short shard
    steps = redistribute_steps(last, src, dst, m)
    assert steps == redistribute_steps(first, src, dst, m)
    assert [s.logical_shape for s in steps] == [(4, 3), (7, 3)]
    assert CostModel(last).redistribute_cost(src, dst, m) == CostModel(first).redistribute_cost(src, dst, m)


def test_moves_priced_together_cost_what_each_costs_alone():
    """A cost model keeps DTensor's steps per placement pair and tensor rank, and numbers placement
    tuples for its keys: every move it prices in a matrix, over tensors of several shapes, strides
    and dtypes, costs (and holds at its peak) what a fresh model prices for that move alone."""
    from torch.distributed.tensor._dtensor_spec import TensorMeta

    init_fake_world()
    mesh = fake_mesh((4, 2, 3))
    choices = (R, P, Shard(0), Shard(1))
    placements = [(a, b, c) for a in choices for b in choices for c in choices]
    # steps that depend on the shape (a strided shard's): priced pair by pair within the matrix
    placements += [(_StridedShard(0, split_factor=2), Shard(0), R), (R, _StridedShard(1, split_factor=3), Shard(1))]
    tensors = [
        meta(96, 48),
        meta(48, 96, dtype=torch.float32),
        meta(7, 10),  # uneven over 4, 2 and 3
        TensorMeta(torch.Size((96, 48)), (1, 96), torch.bfloat16),  # a transposed view: moves copy it first
    ]
    shared = CostModel(mesh)
    for m in tensors:
        matrix = shared.redistribute_costs(placements, placements, m)
        for i in [*range(0, len(placements), 5), len(placements) - 2, len(placements) - 1]:
            for j in [*range(0, len(placements), 3), len(placements) - 2, len(placements) - 1]:
                src, dst = placements[i], placements[j]
                alone = CostModel(mesh)
                assert matrix[i, j] == alone.redistribute_cost(src, dst, m), (src, dst, m)
                assert shared.redistribute_peak_bytes(src, dst, m) == alone.redistribute_peak_bytes(src, dst, m)


_COLLECTIVES = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "all_to_all_single")


class _SentBytes(TorchDispatchMode):
    """Records each functional collective DTensor issues: (op name, local bytes of its input)."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        namespace, _, name = func.name().partition("::")
        if namespace == "_c10d_functional" and name in _COLLECTIVES:
            self.sent.append((name, args[0].numel() * args[0].element_size()))
        return func(*args, **(kwargs or {}))


def test_collectives_are_priced_on_the_bytes_dtensor_sends():
    """Each collective of a move is priced on what rank 0 really sends: its local tensor at that
    step, which the shards of *other* mesh dims shrink (the FSDP gather of a TP-sharded weight
    sends 1/tp of the weight) and so do the steps the move already ran."""
    from torch.distributed.tensor import DTensor

    init_fake_world()
    mesh = fake_mesh((4, 2, 3))
    cost = CostModel(mesh)
    choices = (R, P, Shard(0), Shard(1))
    placements = [(a, b, c) for a in choices for b in choices for c in choices]
    m = meta(96, 48, dtype=torch.float32)
    # gloo has no all-to-all: DTensor gathers the same local input instead
    ops = {
        "all_gather": "all_gather_into_tensor",
        "reduce_scatter": "reduce_scatter_tensor",
        "all_to_all": "all_gather_into_tensor",
    }
    checked = 0
    for k in range(0, len(placements) ** 2, 7):
        src, dst = placements[k // len(placements)], placements[k % len(placements)]
        plan = cost._plan(src, dst, m)
        if not plan or any(isinstance(p, Partial) for p in dst):
            continue
        local = torch.zeros(local_shape_of(m, src, mesh), dtype=torch.float32)
        with _SentBytes() as seen:
            DTensor.from_local(local, mesh, src, run_check=False).redistribute(mesh, dst)
        expected = [
            (
                ops.get(t.kind, t.kind),
                t.nbytes // mesh.size(t.mesh_dim) if t.kind in ("all_gather", "all_to_all") else t.nbytes,
            )
            for t in plan
            if t.kind not in ("local", "relayout")
        ]
        assert seen.sent == expected, (src, dst)
        checked += 1
    assert checked > 200
    fsdp_tp = cost._plan((Shard(0), R, Shard(1)), (R, R, Shard(1)), m)
    assert [t.nbytes for t in fsdp_tp] == [m.shape.numel() * 4 // 3]


def test_a_local_step_writes_the_shard_it_leaves(model):
    """Slicing a replica on two mesh dims writes each step's own, shrinking, shard."""
    m = meta(4096, 4096)
    plan = model._plan((R, R), (Shard(0), Shard(1)), m)
    assert [t.kind for t in plan] == ["local", "local"]
    assert [t.nbytes for t in plan] == [4096 * 4096 * 2 // 16, 4096 * 4096 * 2 // 128]


def local_shape_of(m, placements, mesh) -> tuple[int, ...]:
    return largest_shard_shape(m.shape, placements, mesh.shape)


def test_placements_are_numbered_by_value_whatever_object_holds_them():
    """Cost keys number placement tuples, a tuple seen before found by identity: equal tuples
    built apart share a number, and a list (which may change) is numbered by what it holds now."""
    init_fake_world()
    cm = CostModel(fake_mesh((2, 4)))
    first = tuple([Shard(0), R])
    again = tuple([Shard(0), R])
    held = [Shard(0), R]
    assert first is not again and cm._id(first) == cm._id(again) == cm._id(held) == cm._id(first)
    held[0] = R
    assert cm._id(held) == cm._id((R, R)) != cm._id(first)
    assert cm.redistribute_cost(first, (R, R), meta(8, 8)) == cm.redistribute_cost(again, tuple(held), meta(8, 8)) > 0


@pytest.mark.parametrize("layout", ["2d x 3d", "3d x 3d", "2d x 2d", "3d x 2d"])
def test_grouped_mm_flops_count_the_routed_rows(layout):
    """A grouped matmul's FLOPs are the sum of its groups' products, whatever the offsets: each
    routed token meets one expert, not all of them (torch's flop counter has no formula, so it
    was free before)."""
    bf, e, m, k, n = torch.bfloat16, 3, 8, 16, 32
    sizes = [0, 48, 16]  # uneven groups, one empty: the total does not depend on them
    offs = torch.tensor(sizes, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    if layout == "2d x 3d":  # tokens sorted by expert, times each expert's weight
        a, b = torch.randn(sum(sizes), k, dtype=bf), torch.randn(e, k, n, dtype=bf)
        expected = sum(2 * g * k * n for g in sizes)
    elif layout == "3d x 3d":
        a, b, offs = torch.randn(e, m, k, dtype=bf), torch.randn(e, k, n, dtype=bf), None
        expected = e * 2 * m * k * n
    elif layout == "2d x 2d":  # the experts' weight gradient: groups split the inner dim
        a, b = torch.randn(k, sum(sizes), dtype=bf), torch.randn(sum(sizes), n, dtype=bf)
        expected = sum(2 * k * g * n for g in sizes)
    else:  # groups split the output columns
        a, b = torch.randn(e, m, k, dtype=bf), torch.randn(k, sum(sizes), dtype=bf)
        expected = sum(2 * m * k * g for g in sizes)
    out = torch._grouped_mm(a, b, offs)  # the layout is one the kernel runs
    assert node_flops(aten._grouped_mm.default, (a, b, offs), {}, out) == expected
    assert node_flops(torch.ops.autoplan.grouped_mm.default, (a, b, offs), {}, out) == expected  # fp32's
