"""Checks on every lowered graph (device, contiguous collective inputs, host-only ops) and the
contiguity step that makes collective inputs contiguous by construction."""

import pytest
import torch
import torch.fx as fx
from conftest import fake_mesh
from parallel_run import FSDP, MLP_TP, plan_and_apply
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard

import autoplan.lower.lowering
from autoplan.lower.collectives import is_c10d_collective as is_collective
from autoplan.lower.lowering import LoweringError
from autoplan.lower.passes.contiguity import contiguous_by_construction, make_collective_inputs_contiguous
from autoplan.lower.passes.fsdp_recompute import RECOMPUTE_KEY
from autoplan.lower.validate import GraphCheckError, check_lowered, host_only

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
NOT_CONTIGUOUS = r"_c10d_functional\.\w+\.default\) reads .* not contiguous by construction"


# FSDP with the weights stored split on dim 1: gathered cheapest as their transposes' dim 0, read
# through ``t`` (a weight split on dim 0 is gathered before its ``t`` and reads no transposed shard)
FSDP_DIM1 = [("*weight", (Shard(1), Shard(1)))]


@pytest.fixture(scope="module")
def fsdp_mlp():
    mesh = fake_mesh((2, 4), ("dp", "tp"))
    _, lowered, _ = plan_and_apply(mesh, "mlp", FSDP_DIM1, batch_rows=8)
    return mesh, lowered


def _cuda_mesh(names: tuple[str, ...] | None = None) -> DeviceMesh:
    fake_mesh((2, 4))  # the fake world
    return DeviceMesh("cuda", torch.arange(8).reshape(2, 4), mesh_dim_names=names)


def _graph(device: str, build) -> fx.Graph:
    """A hand-made graph: ``build(graph, x)`` adds nodes after a (8, 4) placeholder on ``device``;
    the values it does not set are computed on fake tensors, as lowering records them."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    with FakeTensorMode():
        x.meta["val"] = torch.empty(8, 4, device=device)
        out = build(graph, x)
        for n in graph.nodes:
            if n.op == "call_function" and "val" not in n.meta:
                args = fx.map_arg(n.args, lambda a: a.meta["val"])
                n.meta["val"] = n.target(*args, **n.kwargs)
    graph.output(out)
    return graph


def _gather(graph: fx.Graph, source: fx.Node) -> fx.Node:
    gathered = graph.call_function(c10d.all_gather_into_tensor.default, (source, 2, "0"))
    return graph.call_function(c10d.wait_tensor.default, (gathered,))


def _transposed_gather(graph, x):
    return _gather(graph, graph.call_function(aten.t.default, (x,)))


def test_lowered_graph_passes_and_every_collective_reads_a_contiguous_value(fsdp_mlp):
    mesh, lowered = fsdp_mlp
    check_lowered(lowered.joint.graph, mesh, lowered.joint)
    collectives = [n for n in lowered.joint.graph.nodes if is_collective(n)]
    assert len(collectives) == lowered.contiguity.collectives > 0
    assert all(contiguous_by_construction(n.args[0]) for n in collectives)
    assert lowered.contiguity.inserted > 0


def _runtime_layouts(gm: fx.GraphModule) -> list[tuple[str, bool]]:
    """Run the joint graph eagerly on real tensors (rank 0 of the fake process group, where
    collectives return at once) and record whether each collective's input is contiguous."""
    seen = []

    class Recorder(fx.Interpreter):
        def run_node(self, n):
            if not is_collective(n):
                return super().run_node(n)
            (source, *rest), kwargs = self.fetch_args_kwargs_from_env(n)
            seen.append((n.name, source.is_contiguous()))
            return n.target(source.contiguous(), *rest, **kwargs)  # torch 2.11 rejects a non-contiguous one

    gen = torch.Generator().manual_seed(0)
    inputs = []
    for p in gm.graph.find_nodes(op="placeholder"):
        val = p.meta["val"]
        if val.dtype == torch.int64:  # the mesh coordinate (rank 0) and token ids
            inputs.append(torch.zeros(val.shape, dtype=val.dtype))
        else:
            inputs.append(torch.randn(val.shape, generator=gen, dtype=val.dtype))
    with torch.no_grad():
        Recorder(gm).run(*inputs)
    return seen


def _without_contiguity_step(gm: fx.GraphModule) -> fx.GraphModule:
    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    for n in list(graph.nodes):
        if n.target is aten.contiguous.default and all(is_collective(u) for u in n.users):
            n.replace_all_uses_with(n.args[0])
            graph.erase_node(n)
    return fx.GraphModule(gm, graph)


def test_collective_inputs_are_contiguous_at_run_time(fsdp_mlp):
    """The traced layouts say every collective input is contiguous; at run time an FSDP gather of a
    weight split on dim 1 reads a transposed weight shard (``view(t(w))``). torch 2.11's collectives reject that; the
    contiguity step copies it, and only it."""
    mesh, lowered = fsdp_mlp
    seen = _runtime_layouts(lowered.joint)
    assert seen and all(ok for _, ok in seen), [name for name, ok in seen if not ok]

    bare = _without_contiguity_step(lowered.joint)
    wrong = [name for name, ok in _runtime_layouts(bare) if not ok]
    assert wrong, "without the step some gather should read a transposed shard"
    nodes = {n.name: n for n in bare.graph.nodes}
    assert not any(contiguous_by_construction(nodes[name].args[0]) for name in wrong)
    with pytest.raises(GraphCheckError, match=NOT_CONTIGUOUS):
        check_lowered(bare.graph, mesh)


def test_lower_runs_the_check(monkeypatch):
    """Without the contiguity step, lowering itself rejects its graph, naming the collective."""
    mesh = fake_mesh((2, 4), ("dp", "tp"))
    monkeypatch.setattr(autoplan.lower.lowering, "make_collective_inputs_contiguous", lambda graph: None)
    with pytest.raises(LoweringError, match=NOT_CONTIGUOUS):
        plan_and_apply(mesh, "mlp", MLP_TP, batch_rows=8)


def test_contiguity_step_copies_only_what_it_must():
    graph = _graph("cpu", _transposed_gather)
    with pytest.raises(GraphCheckError, match=r"all_gather_into_tensor_default .*reads t_default \(aten\.t\.default\)"):
        check_lowered(graph, fake_mesh((2, 4)))
    stats = make_collective_inputs_contiguous(graph)
    assert (stats.inserted, stats.collectives) == (1, 1)
    check_lowered(graph, fake_mesh((2, 4)))
    (gather,) = [n for n in graph.nodes if is_collective(n)]
    assert gather.args[0].target is aten.contiguous.default
    assert gather.args[0].meta["val"].is_contiguous()
    # a gather of a gathered value (through views) reads a fresh tensor: nothing to insert
    chained = _graph("cpu", lambda g, x: _gather(g, g.call_function(aten.view.default, (_gather(g, x), [-1]))))
    assert make_collective_inputs_contiguous(chained).inserted == 1  # the first gather's placeholder input only


def test_inserted_copies_are_recomputed_with_their_gathers(fsdp_mlp):
    """An FSDP re-gather's inserted copy runs again in backward; the forward never saves one."""
    _, lowered = fsdp_mlp
    joint = {n.name: n for n in lowered.joint.graph.nodes}
    copies = [n for n in joint.values() if n.target is aten.contiguous.default]
    assert any(n.meta.get(RECOMPUTE_KEY) for n in copies)
    for n in copies:
        (user,) = n.users
        assert n.meta.get(RECOMPUTE_KEY) == user.meta.get(RECOMPUTE_KEY)
        assert n.meta.get("partitioner_tag") == user.meta.get("partitioner_tag")
    out = next(n for n in lowered.forward.graph.nodes if n.op == "output")
    saved = [a.name for a in out.args[0][lowered.n_outputs :] if isinstance(a, fx.Node)]
    assert not [s for s in saved if joint[s].target is aten.contiguous.default]
    regathered = [n for n in lowered.backward.graph.nodes if n.target is aten.contiguous.default]
    assert regathered


def test_host_only_op_on_a_cuda_mesh_is_rejected():
    def attention(graph, x):
        q = graph.call_function(aten.view.default, (x, [1, 1, 8, 4]))
        out = graph.call_function(aten._scaled_dot_product_flash_attention_for_cpu.default, (q, q, q))
        return graph.call_function(lambda t: t[0], (out,))

    with pytest.raises(GraphCheckError, match=r"_scaled_dot_product_flash_attention_for_cpu\.default\) runs only"):
        check_lowered(_graph("cuda", attention), _cuda_mesh())
    check_lowered(_graph("cpu", attention), fake_mesh((2, 4)))  # the host kernel is right on a CPU mesh

    def sync(graph, x):
        total = graph.call_function(aten.sum.default, (x,))
        scalar = graph.call_function(aten._local_scalar_dense.default, (total,))
        scalar.meta["val"] = 0.0  # a host number (fake tensors cannot make one without a shape env)
        return scalar

    with pytest.raises(GraphCheckError, match=r"_local_scalar_dense"):
        check_lowered(_graph("cuda", sync), _cuda_mesh())


def test_host_only_rule():
    assert host_only(aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
    assert host_only(aten.mkldnn_rnn_layer.default)
    assert host_only(aten._weight_int4pack_mm_for_cpu.default)
    assert host_only(aten.item.default)
    assert not host_only(aten._scaled_dot_product_flash_attention.default)
    assert not host_only(aten.mm.default)
    assert not host_only(c10d.all_gather_into_tensor.default)


def test_tensor_on_the_wrong_device_is_rejected(fsdp_mlp):
    # a graph lowered for a CPU mesh has host tensors everywhere
    _, lowered = fsdp_mlp
    with pytest.raises(GraphCheckError, match=r"mesh_coordinate \(mesh_coordinate\) makes a tensor on cpu.*cuda"):
        check_lowered(lowered.joint.graph, _cuda_mesh())

    def to_host(graph, x):
        return graph.call_function(aten._to_copy.default, (x,), {"device": torch.device("cpu")})

    with pytest.raises(GraphCheckError, match=r"_to_copy_default \(aten\._to_copy\.default\) makes a tensor on cpu"):
        check_lowered(_graph("cuda", to_host), _cuda_mesh())


@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="a joint trace on fake CUDA tensors needs a GPU: autograd aborts on a CPU-only build, and a "
    "CUDA build without a device fails in the backward engine",
)
def test_llama_flash_plan_lowered_on_a_cuda_mesh_passes_the_check():
    """What a GPU runs: planned and lowered on a CUDA mesh (fake process group), the graph keeps the
    GPU attention kernels, has every value on the GPU and reads every collective input contiguous."""
    mesh = _cuda_mesh(("dp", "tp"))
    _, lowered, _ = plan_and_apply(mesh, "llama", FSDP, batch_rows=8, attention="flash")
    ops = {n.target for n in lowered.joint.graph.nodes}
    assert aten._scaled_dot_product_flash_attention.default in ops
    assert aten._scaled_dot_product_flash_attention_backward.default in ops
    assert not any(host_only(op) for op in ops)
    assert lowered.contiguity.collectives > 0
    check_lowered(lowered.joint.graph, mesh, lowered.joint)
