"""Chained all-gather fusion on hand-built graphs (structure) and on a gloo 2x2 mesh (numerics)."""

import pytest
import torch
import torch.fx as fx
from conftest import fake_mesh
from gloo import run_gloo
from torch._subclasses.fake_tensor import FakeTensorMode

from autoplan.lower.passes.gather_fusion import (
    fuse_all_reduce_chains,
    fuse_gather_chains,
    fuse_reduce_scatter_chains,
)

c10d = torch.ops._c10d_functional
aten = torch.ops.aten


def chain_graph(mesh, first_dim: int, view: str = "identity", extra_user: bool = False, dtype_cast: bool = False):
    """x -> gather(first_dim) -> wait -> [view] -> gather(other dim) -> wait -> output."""
    g = fx.Graph()
    fake = FakeTensorMode()
    shard = (2, 3)
    x = g.placeholder("x")
    with fake:
        x.meta["val"] = torch.empty(shard)
    n = mesh.shape

    def gather(inp, dim):
        node = g.call_function(c10d.all_gather_into_tensor.default, (inp, n[dim], mesh.get_group(dim).group_name))
        node.meta["val"] = inp.meta["val"].new_empty([inp.meta["val"].shape[0] * n[dim], *inp.meta["val"].shape[1:]])
        wait = g.call_function(c10d.wait_tensor.default, (node,))
        wait.meta["val"] = node.meta["val"]
        return wait

    mid = gather(x, first_dim)
    outs = []
    if extra_user:
        outs.append(mid)
    if view == "identity":
        v = g.call_function(aten.view.default, (mid, list(mid.meta["val"].shape)))
        v.meta["val"] = mid.meta["val"]
        mid = v
    elif view == "reshape":
        v = g.call_function(aten.view.default, (mid, [-1]))
        v.meta["val"] = mid.meta["val"].reshape(-1)
        mid = v
    if dtype_cast:
        v = g.call_function(aten._to_copy.default, (mid,), {"dtype": torch.float64})
        v.meta["val"] = mid.meta["val"].to(torch.float64)
        mid = v
    last = gather(mid, 1 - first_dim)
    g.output([last, *outs])
    return fx.GraphModule(torch.nn.Module(), g)


def count(gm, op):
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target is op)


@pytest.mark.parametrize("first_dim", [0, 1])
def test_identity_chain_becomes_one_gather(first_dim):
    mesh = fake_mesh((2, 2))
    gm = chain_graph(mesh, first_dim)
    stats = fuse_gather_chains(gm.graph, mesh)
    assert stats.fused == 1
    assert count(gm, c10d.all_gather_into_tensor.default) == 1
    (gather,) = [n for n in gm.graph.nodes if n.target is c10d.all_gather_into_tensor.default]
    assert gather.args[1] == 4
    # gathering dp (dim 0) first leaves chunks column-major: the pass must reorder them
    assert count(gm, aten.transpose.int) == (1 if first_dim == 0 else 0)


@pytest.mark.parametrize(
    "kwargs",
    [{"view": "reshape"}, {"extra_user": True}, {"dtype_cast": True}],
    ids=["non-identity", "multi-user", "dtype"],
)
def test_unsafe_chains_are_left_alone(kwargs):
    mesh = fake_mesh((2, 2))
    gm = chain_graph(mesh, 1, **kwargs)
    fuse_gather_chains(gm.graph, mesh)
    assert count(gm, c10d.all_gather_into_tensor.default) == 2


def test_same_group_twice_is_not_fused():
    mesh = fake_mesh((2, 2))
    gm = chain_graph(mesh, 1)
    for n in gm.graph.nodes:  # make both gathers use the tp group: they do not cover the mesh
        if n.target is c10d.all_gather_into_tensor.default:
            n.args = (n.args[0], 2, mesh.get_group(1).group_name)
    stats = fuse_gather_chains(gm.graph, mesh)
    assert stats.fused == 0 and count(gm, c10d.all_gather_into_tensor.default) == 2


def _numerics_worker(rank: int, first_dim: int) -> bool:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2))
    gm = chain_graph(mesh, first_dim)
    x = torch.arange(6.0).reshape(2, 3) + 100 * rank
    expected = gm(x)[0]
    assert fuse_gather_chains(gm.graph, mesh).fused == 1
    gm.recompile()
    return bool(torch.equal(gm(x)[0], expected))


@pytest.mark.parametrize(
    "first_dim",
    [0, pytest.param(1, marks=pytest.mark.slow)],  # ~16 s each on 4 gloo processes
    ids=["dp-first (column-major)", "tp-first (row-major)"],
)
def test_fused_gather_matches_on_gloo(first_dim):
    assert all(run_gloo(_numerics_worker, 4, first_dim))


def reduction_chain_graph(mesh, first_dim: int, scatter: bool = True):
    """x -> reduce_scatter(first_dim) -> wait -> reduce_scatter(other dim) -> wait -> output, or
    the same with all-reduces."""
    g = fx.Graph()
    with FakeTensorMode():
        x = g.placeholder("x")
        x.meta["val"] = torch.empty(8, 3)
        node = x
        for dim in (first_dim, 1 - first_dim):
            n, group = mesh.shape[dim], mesh.get_group(dim).group_name
            rows = node.meta["val"].shape[0] // n if scatter else 8
            if scatter:
                node = g.call_function(c10d.reduce_scatter_tensor.default, (node, "sum", n, group))
            else:
                node = g.call_function(c10d.all_reduce.default, (node, "sum", group))
            node.meta["val"] = torch.empty(rows, 3)
            node = g.call_function(c10d.wait_tensor.default, (node,))
            node.meta["val"] = torch.empty(rows, 3)
    g.output([node])
    return fx.GraphModule(torch.nn.Module(), g)


@pytest.mark.parametrize("first_dim", [0, 1], ids=["dp-first (row-major)", "tp-first (column-major)"])
def test_a_reduce_scatter_chain_becomes_one_with_the_same_values(first_dim):
    """A gradient reduce-scattered over dp then tp (or tp then dp) runs as one reduce-scatter over
    the whole mesh, each rank getting the same chunk with the same sum (four simulated ranks)."""
    from torch.distributed._local_tensor import LocalTensor, LocalTensorMode

    mesh = fake_mesh((2, 2))
    gm = reduction_chain_graph(mesh, first_dim)
    x = LocalTensor({r: torch.arange(24.0).reshape(8, 3) * (r + 1) + r for r in range(4)})
    with LocalTensorMode(4):
        expected = gm(x)[0]
    assert fuse_reduce_scatter_chains(gm.graph, mesh).fused == 1
    gm.recompile()
    (scatter,) = [n for n in gm.graph.nodes if n.target is c10d.reduce_scatter_tensor.default]
    assert scatter.args[2] == 4
    assert count(gm, aten.transpose.int) == first_dim  # tp first: the input's chunks are reordered
    with LocalTensorMode(4):
        got = gm(x)[0]
    assert all(torch.equal(got._local_tensors[r], expected._local_tensors[r]) for r in range(4))


def test_an_all_reduce_chain_becomes_one_with_the_same_values():
    """A replicated weight's gradient all-reduced over dp then tp runs as one all-reduce over the
    whole mesh, with the same sums (four simulated ranks)."""
    from torch.distributed._local_tensor import LocalTensor, LocalTensorMode

    mesh = fake_mesh((2, 2))
    gm = reduction_chain_graph(mesh, 0, scatter=False)
    x = LocalTensor({r: torch.arange(24.0).reshape(8, 3) * (r + 1) + r for r in range(4)})
    with LocalTensorMode(4):
        expected = gm(x)[0]
    assert fuse_all_reduce_chains(gm.graph, mesh).fused == 1
    gm.recompile()
    assert count(gm, c10d.all_reduce.default) == 1
    with LocalTensorMode(4):
        got = gm(x)[0]
    assert all(torch.equal(got._local_tensors[r], expected._local_tensors[r]) for r in range(4))
