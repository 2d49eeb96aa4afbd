"""Joint forward+backward tracing: labels, module paths, phases, in-place fallback, user model untouched."""

from collections import Counter

import pytest
import torch
import torch.fx as fx
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from autoplan.bench.models.llama3 import LLAMA3_CONFIGS, Transformer
from autoplan.trace.tracing import PATH_KEY, PHASE_KEY, trace_joint

aten = torch.ops.aten
CFG = LLAMA3_CONFIGS["debug"]
BATCH, SEQ = 8, 16


def tokens():
    return torch.randint(0, CFG.vocab_size, (BATCH, SEQ))


def ancestors(nodes) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    stack = [n for n in nodes if isinstance(n, fx.Node)]
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return seen


def descendants(node: fx.Node) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    stack = [node]
    while stack:
        n = stack.pop()
        for u in n.users:
            if u not in seen:
                seen.add(u)
                stack.append(u)
    return seen


def mm_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target == aten.mm.default]


def mutating_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    return [
        n
        for n in gm.graph.nodes
        if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable
    ]


@pytest.fixture(scope="module")
def llama():
    with torch.device("meta"):
        model = Transformer(CFG)
    params_before = dict(model.named_parameters())
    traced = trace_joint(model, tokens)
    return model, params_before, traced


def test_placeholder_labels_follow_named_parameters(llama):
    model, _, tg = llama
    params = [fqn for fqn, _ in model.named_parameters()]
    buffers = [fqn for fqn, _ in model.named_buffers()]
    assert tg.input_labels == (
        [("param", f) for f in params] + [("buffer", b) for b in buffers] + [("input", 0), ("tangent", 0)]
    )
    assert len(tg.input_labels) == len(tg.placeholders)

    placeholders = tg.placeholder_for("param")
    assert list(placeholders) == params
    for fqn, p in model.named_parameters():
        val = placeholders[fqn].meta["val"]
        assert val.shape == p.shape and val.dtype == p.dtype
    (inp,) = tg.placeholder_for("input").values()
    assert inp.meta["val"].shape == (BATCH, SEQ) and inp.meta["val"].dtype == torch.int64
    (tangent,) = tg.placeholder_for("tangent").values()
    assert tangent.meta["val"].shape == (BATCH, SEQ, CFG.vocab_size)


def test_output_labels_are_logits_then_one_grad_per_parameter(llama):
    model, _, tg = llama
    params = dict(model.named_parameters())
    assert tg.output_labels == [("output", 0)] + [("grad_param", f) for f in params]
    (logits,) = tg.outputs_of("output").values()
    assert logits.meta["val"].shape == (BATCH, SEQ, CFG.vocab_size)
    grads = tg.outputs_of("grad_param")
    assert list(grads) == list(params)
    for fqn, g in grads.items():
        assert isinstance(g, fx.Node), fqn
        assert g.meta["val"].shape == params[fqn].shape, fqn
        assert g.meta[PHASE_KEY] == "backward", fqn


def test_every_mm_is_attributed_to_a_linear_module(llama):
    model, _, tg = llama
    linears = {name for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    mms = mm_nodes(tg.gm)
    assert mms
    for n in mms:
        assert n.meta[PATH_KEY] in linears, (n.name, n.meta[PATH_KEY])
    # each Linear: one forward mm, and two backward mms (grad of input, grad of weight) that inherit its path
    by_phase = Counter((n.meta[PATH_KEY], n.meta[PHASE_KEY]) for n in mms)
    expected = {(lin, "forward"): 1 for lin in linears} | {(lin, "backward"): 2 for lin in linears}
    assert dict(by_phase) == expected


def test_every_node_has_a_module_path_and_a_phase(llama):
    _, _, tg = llama
    for n in tg.gm.graph.nodes:
        assert isinstance(n.meta[PATH_KEY], str), n.name
        assert n.meta[PHASE_KEY] in ("forward", "backward"), n.name
    paths = {n.meta[PATH_KEY] for n in tg.gm.graph.nodes if n.op == "call_function"}
    assert {"tok_embeddings", "layers.0.attention", "layers.1.feed_forward.w2", "norm", "output"} <= paths


def test_phases_split_forward_from_backward(llama):
    model, _, tg = llama
    (logits,) = tg.outputs_of("output").values()
    logit_deps = ancestors([logits])
    forward_mms = {n for n in mm_nodes(tg.gm) if n.meta[PHASE_KEY] == "forward"}
    # the forward set is exactly what the logits depend on; all 15 Linear mms are in it
    assert forward_mms == {n for n in mm_nodes(tg.gm) if n in logit_deps}
    assert len(forward_mms) == 2 * 7 + 1
    for n in tg.gm.graph.nodes:
        if n.op == "call_function":
            assert (n.meta[PHASE_KEY] == "forward") == (n in logit_deps), n.name
    # nothing that reads the incoming gradient is forward
    (tangent,) = tg.placeholder_for("tangent").values()
    assert tangent.meta[PHASE_KEY] == "backward"
    assert all(n.meta[PHASE_KEY] == "backward" for n in descendants(tangent) if n.op != "output")
    # each Linear weight's gradient is computed by a backward mm of that Linear
    grads = tg.outputs_of("grad_param")
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear):
            deps = ancestors([grads[f"{name}.weight"]])
            assert any(
                n.meta[PATH_KEY] == name and n.meta[PHASE_KEY] == "backward" for n in mm_nodes(tg.gm) if n in deps
            ), name


def test_tracing_leaves_the_user_model_alone(llama):
    model, params_before, _ = llama
    assert dict(model.named_parameters()) == params_before  # same Parameter objects
    for fqn, p in model.named_parameters():
        assert p.device.type == "meta", fqn
        assert type(p) is nn.Parameter and not isinstance(p.data, FakeTensor), fqn
        assert p.grad is None, fqn
    assert model.freqs.device.type == "meta"
    for name, m in model.named_modules():
        assert not m._forward_hooks and not m._forward_pre_hooks, name
    assert not torch.cuda.is_initialized()


def test_tracing_a_real_model_does_not_change_its_weights():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    tg = trace_joint(model, lambda: torch.randn(4, 8))
    assert [lab for lab in tg.input_labels if lab[0] == "param"] == [("param", k) for k in before]
    for k, v in model.state_dict().items():
        assert not isinstance(v, FakeTensor), k
        assert torch.equal(v, before[k]), k
    assert all(p.grad is None for p in model.parameters())


def test_user_loss_fn_gives_a_scalar_output():
    with torch.device("meta"):
        model = Transformer(CFG)
    tg = trace_joint(model, tokens, loss_fn=lambda out: out.float().pow(2).mean())
    assert tg.output_labels[0] == ("output", 0)
    outs = tg.outputs_of("output")
    assert list(outs) == [0]
    loss = outs[0].meta["val"]
    assert loss.shape == torch.Size([]) and loss.dtype == torch.float32
    (tangent,) = tg.placeholder_for("tangent").values()
    assert tangent.meta["val"].shape == torch.Size([])
    assert outs[0].meta[PHASE_KEY] == "forward"
    # gradients still flow to every parameter
    assert list(tg.outputs_of("grad_param")) == [f for f, _ in model.named_parameters()]


def inplace_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(inplace=True), nn.Linear(16, 4))


def test_inplace_model_traces_to_a_functional_graph():
    model = inplace_mlp()
    tg = trace_joint(model, lambda: torch.randn(4, 8))
    assert tg.joint is not None  # went through the functionalizing fallback
    ops = [n for n in tg.gm.graph.nodes if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)]
    assert ops
    assert mutating_nodes(tg.gm) == []
    assert [lab for lab in tg.input_labels if lab[0] == "param"] == [("param", f) for f, _ in model.named_parameters()]
    assert tg.placeholder_for("input")[0].meta["val"].shape == (4, 8)
    grads = tg.outputs_of("grad_param")
    for fqn, p in model.named_parameters():
        assert grads[fqn].meta["val"].shape == p.shape, fqn
    # module paths and phases survive the fallback: the relu and its backward belong to module "1"
    relu = [n for n in ops if n.meta[PATH_KEY] == "1"]
    assert {n.meta[PHASE_KEY] for n in relu} == {"forward", "backward"}
    assert {n.meta[PATH_KEY] for n in ops if n.target == aten.mm.default} <= {"0", "2"}


def test_inplace_and_functional_variants_have_the_same_labels():
    torch.manual_seed(0)
    functional = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    torch.manual_seed(0)
    inplace = inplace_mlp()
    a = trace_joint(functional, lambda: torch.randn(4, 8))
    b = trace_joint(inplace, lambda: torch.randn(4, 8))
    assert a.joint is None and b.joint is not None  # the two tracing paths
    assert a.input_labels == b.input_labels
    assert a.output_labels == b.output_labels


def test_dropout_traces_as_the_fused_kernel_without_functionalizing():
    """Training with dropout traces ``aten.native_dropout`` (what a GPU runs), not the CPU's fresh
    mask filled in place, so the fast trace serves: no in-place op, no functionalizing re-trace."""
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.1), nn.Linear(8, 8))
    tg = trace_joint(model, lambda: torch.randn(4, 8))
    targets = Counter(n.target for n in tg.gm.graph.nodes if n.op == "call_function")
    assert tg.joint is None  # the fast path
    assert targets[torch.ops.aten.native_dropout.default] == 1
    assert not [t for t in targets if "bernoulli" in str(t)]
