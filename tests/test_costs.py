import dataclasses
import math

import pytest
import torch
from conftest import fake_mesh, init_fake_world
from torch.distributed.tensor import Partial, Replicate, Shard

from autoplan.adapters.dtensor import tensor_meta
from autoplan.costs import (
    H100_SXM,
    CostModel,
    LinkKind,
    MeshTopology,
    UnsupportedRedistribution,
    local_bytes,
    node_flops,
)

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
    assert MeshTopology.from_mesh(fake_mesh(shape), gpus_per_node) == MeshTopology(shape, links)


def test_profile_gpus_per_node_changes_links():
    init_fake_world()
    mesh = fake_mesh((2, 4))
    assert CostModel(mesh).topology.links == (INTRA, INTRA)
    assert CostModel(mesh, dataclasses.replace(H100_SXM, gpus_per_node=4)).topology.links == (INTER, INTRA)


def test_all_gather_matches_ring_formula(model):
    m = meta(4096, 4096)
    full = 4096 * 4096 * 2
    bw = H100_SXM.intra_node_bandwidth * H100_SXM.bandwidth_efficiency
    expected = 7 / 8 * full / bw + 7 * H100_SXM.intra_node_latency
    assert model.redistribute_cost((R, Shard(0)), (R, R), m) == pytest.approx(expected)
    assert model.redistribute_collectives((R, Shard(0)), (R, R), m) == (("all_gather", 1),)


def test_inter_node_all_gather_costs_more(model):
    m = meta(4096, 4096)
    inter = model.redistribute_cost((Shard(0), R), (R, R), m)
    intra = model.redistribute_cost((R, Shard(0)), (R, R), m)
    assert inter > 5 * intra


def test_two_dim_gather_costs_more_than_one(model):
    m = meta(4096, 4096)
    both = model.redistribute_cost((Shard(0), Shard(0)), (R, R), m)
    one = model.redistribute_cost((Shard(0), R), (R, R), m)
    assert both > one
    assert model.redistribute_collectives((Shard(0), Shard(0)), (R, R), m) == (("all_gather", 1), ("all_gather", 0))


def test_all_reduce_is_twice_reduce_scatter(model):
    m = meta(8192, 4096)
    for partial, sharded in (((R, P), (R, Shard(0))), ((P, R), (Shard(0), R))):
        all_reduce = model.redistribute_cost(partial, (R, R), m)
        reduce_scatter = model.redistribute_cost(partial, sharded, m)
        assert all_reduce == pytest.approx(2 * reduce_scatter)


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


def test_size_one_mesh_dim_is_free():
    init_fake_world()
    model = CostModel(fake_mesh((1, 8)))
    assert model.redistribute_cost((Shard(0), R), (R, R), meta(64, 64)) == 0.0


def test_cost_depends_on_dtype(model):
    bf16 = model.redistribute_cost((R, Shard(0)), (R, R), meta(4096, 4096))
    fp32 = model.redistribute_cost((R, Shard(0)), (R, R), meta(4096, 4096, dtype=torch.float32))
    latency = 7 * H100_SXM.intra_node_latency
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
