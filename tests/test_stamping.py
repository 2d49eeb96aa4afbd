"""A deep stack of identical layers is traced as two and stamped: the graph is the one tracing every
layer gives, node for node, and a plan of it runs with single-device numerics. Layers that differ,
a gradient shared across layers, or code that depends on the depth are traced layer by layer."""

import math

import pytest
import torch
from conftest import fake_mesh
from parallel_run import FSDP, check_run, graph_report, one_value, parallel_run, plan_and_apply, reference_run
from torch import nn
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from autoplan import AutoParallel
from autoplan.bench.models.llama3 import LLAMA3_CONFIGS, Transformer
from autoplan.trace import stamping
from autoplan.trace.clustering import find_repeats
from autoplan.trace.tracing import PATH_KEY, trace_joint

S0 = Shard(0)


def _both(model: nn.Module, input_fn, **kw):
    stamped = trace_joint(model, input_fn, **kw)
    full = trace_joint(model, input_fn, repeats=False, **kw)
    return stamped, full


def _same(a, b) -> bool:
    return stamping.same_graph((a.gm, a.input_labels, a.output_labels), (b.gm, b.input_labels, b.output_labels))


def test_llama_layers_stamped_are_the_traced_graph():
    cfg = LLAMA3_CONFIGS["debug"]
    model = Transformer(type(cfg)(**{**cfg.__dict__, "n_layers": 8}))
    stamped, full = _both(model, lambda: (torch.randint(0, cfg.vocab_size, (2, 16)),), attention="math")
    assert (stamped.stamped, full.stamped) == (6, 0)
    assert _same(stamped, full)
    per_layer = [
        sum(1 for n in stamped.gm.graph.nodes if n.meta[PATH_KEY].startswith(f"layers.{i}.")) for i in range(8)
    ]
    assert len(set(per_layer)) == 1 and per_layer[0] > 50  # every copy carries its own layer's module path


class Block(nn.Module):
    def __init__(self, dim: int, idx: int = 0, odd_one: int = -1):
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.idx, self.odd_one = idx, odd_one

    def forward(self, x, r, bias=None):
        h = torch.relu(self.lin(x)) + r
        if self.idx == self.odd_one:
            h = h * 2
        if bias is not None:
            h = h + bias
        return h, h * 0.5  # two values chained into the next layer


class Stack(nn.Module):
    def __init__(self, n=8, dim=16, odd_one=-1, shared_bias=False, by_depth=False, raw_input=False):
        super().__init__()
        self.embed = None if raw_input else nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(Block(dim, i, odd_one) for i in range(n))
        self.bias = nn.Parameter(torch.zeros(dim)) if shared_bias else None
        self.by_depth = by_depth

    def forward(self, x):
        h = x if self.embed is None else self.embed(x)
        r = h * 0.5
        for b in self.blocks:
            h, r = b(h, r, self.bias)
        out = (h + r).sum()
        return out / len(self.blocks) if self.by_depth else out


@pytest.mark.parametrize(
    "options, stamps",
    [
        ({}, True),
        ({"odd_one": 5}, False),  # one layer runs another op
        ({"shared_bias": True}, False),  # every layer adds to one parameter's gradient
        ({"by_depth": True}, False),  # the code after the stack reads the depth
        ({"raw_input": True}, False),  # layer 1 needs no gradient for one input, later layers do
    ],
    ids=["identical", "odd-layer", "shared-gradient", "depth-dependent", "grad-free-start"],
)
def test_stamping_only_where_proven(options, stamps):
    stamped, full = _both(Stack(**options), lambda: (torch.randn(4, 16),))
    assert stamped.stamped == (6 if stamps else 0)
    assert _same(stamped, full)
    if options.get("odd_one"):
        muls = [n for n in stamped.gm.graph.nodes if n.target == torch.ops.aten.mul.Tensor]
        assert any(n.meta[PATH_KEY] == "blocks.5" for n in muls)


def test_sequential_stack_is_stamped():
    blocks = nn.Sequential(*(nn.Sequential(nn.Linear(16, 16), nn.GELU()) for _ in range(9)))
    model = nn.Sequential(nn.Linear(8, 16), blocks)
    stamped, full = _both(model, lambda: (torch.randn(4, 8),), loss_fn=lambda y: y.square().mean())
    assert stamped.stamped == 7 and _same(stamped, full)


class Varied(nn.Module):
    """A block whose constructor arguments change its shapes or its code: a width, a stride, a flag
    and an optional submodule."""

    def __init__(self, c_in: int, c_out: int, stride: int = 1, flag: bool = False, extra: bool = False):
        super().__init__()
        self.conv = nn.Conv1d(c_in, c_out, 3, stride, 1)
        self.flag = flag
        self.extra = nn.Linear(c_out, c_out) if extra else None

    def forward(self, x):
        y = torch.relu(self.conv(x))
        if self.flag:
            y = y * 0.5
        if self.extra is not None:
            y = self.extra(y.transpose(1, 2)).transpose(1, 2)
        return y


@pytest.mark.parametrize(
    "differs",
    [
        dict(widths=[8, 8, 8, 8, 16, 16, 16, 16]),  # a ResNet's stages: the width grows
        dict(strides=[1, 1, 1, 2, 1, 1, 1, 1]),
        dict(flags=[False] * 7 + [True]),
        dict(extras=[True] + [False] * 7),
    ],
    ids=["width", "stride", "flag", "submodule"],
)
def test_blocks_of_one_class_that_differ_are_not_tied(differs):
    """Eight blocks of one class in one ``nn.Sequential`` that differ in a width, a stride, a flag or a
    submodule trace like ``repeats=False`` (no error from a truncated trial stack, nothing stamped);
    the same eight blocks made alike are stamped."""
    n = 8
    widths = differs.get("widths", [8] * n)
    strides, flags, extras = (differs.get(k, [d] * n) for k, d in (("strides", 1), ("flags", False), ("extras", False)))
    blocks = [Varied(8 if i == 0 else widths[i - 1], widths[i], strides[i], flags[i], extras[i]) for i in range(n)]
    length = 32 // math.prod(strides)
    # a head that fits the last block only: a two-block trial stack of different widths would fail in it
    model = nn.Sequential(nn.Conv1d(8, 8, 1), nn.Sequential(*blocks), nn.Flatten(), nn.Linear(widths[-1] * length, 4))
    stamped, full = _both(model, lambda: (torch.randn(2, 8, 32),), loss_fn=lambda y: y.square().mean())
    assert (stamped.stamped, full.stamped) == (0, 0)
    assert _same(stamped, full)
    alike = nn.Sequential(nn.Conv1d(8, 8, 1), nn.Sequential(*(Varied(8, 8) for _ in range(n))), nn.Flatten())
    assert trace_joint(alike, lambda: (torch.randn(2, 8, 32),), loss_fn=lambda y: y.square().mean()).stamped == 6


class VariedStack(nn.Module):
    def __init__(self, blocks: list[nn.Module]):
        super().__init__()
        self.layers = nn.ModuleList(blocks)

    def forward(self, x):
        for block in self.layers:
            x = block(x)
        return x


@pytest.mark.parametrize("differs", ["width", "stride", "flag", "submodule"])
def test_clustering_ties_only_blocks_that_are_alike(differs):
    """Eight ``Varied`` layers in a ``ModuleList``, one (or, for the width, the last four) built
    differently: clustering ties layers only where their constructor arguments and input shapes are
    the same, so the odd layer shares no decision with any other, and alike middle layers are tied."""
    kw = [dict(c_in=8, c_out=8) for _ in range(8)]
    if differs == "width":
        kw[4:] = [dict(c_in=8 if i == 4 else 16, c_out=16) for i in range(4, 8)]
    else:
        kw[5][{"stride": "stride", "flag": "flag", "submodule": "extra"}[differs]] = 2 if differs == "stride" else True
    lengths = [32 // math.prod(k.get("stride", 1) for k in kw[:i]) for i in range(8)]
    key = {f"layers.{i}": (tuple(sorted(k.items())), lengths[i]) for i, k in enumerate(kw)}
    tg = trace_joint(
        VariedStack([Varied(**k) for k in kw]), lambda: (torch.randn(2, 8, 32),), loss_fn=lambda y: y.square().mean()
    )
    classes = find_repeats(tg).classes
    assert classes, "alike middle layers are tied"
    for members in classes:
        assert len({key[m] for m in members}) == 1, members
    assert not any("layers.5" in members for members in classes if differs != "width")


def test_stamped_llama_plan_runs_with_single_device_numerics():
    """Eight layers, six of them stamped, FSDP on 4 simulated ranks (2x2): the losses and gradients
    of three AdamW steps are single-device's."""
    mesh = fake_mesh((2, 2), ("dp", "tp"))
    ref = reference_run("llama8", batch_rows=8)
    plan, lowered, pmod = plan_and_apply(mesh, "llama8", FSDP, batch_rows=8)
    with LocalTensorMode(4):
        r = parallel_run(mesh, pmod, ref, compiled=False, plain=lambda t: t)
    check_run(r | {"ref_losses": ref.losses} | graph_report(plan, lowered))


@pytest.mark.parametrize("family", ["llama", "gpt_neox"])
def test_hugging_face_layers_stamped_are_the_traced_graph(family):
    """Hugging Face layers make a fresh tensor constant in every call (their KV cache's empty start):
    compared by value, they still prove the layers identical."""
    transformers = pytest.importorskip("transformers")
    vocab = 256
    sizes = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_attention_heads=4)
    config = transformers.AutoConfig.for_model(family, **sizes, num_hidden_layers=8, max_position_embeddings=64)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    stamped, full = _both(model, lambda: (torch.randint(0, vocab, (2, 16)),))
    assert (stamped.stamped, full.stamped) == (6, 0)
    assert _same(stamped, full)


class Counting(nn.Module):
    """A residual block that counts, in a buffer of its own, the activations it let through."""

    def __init__(self, dim: int = 16):
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.register_buffer("passed", torch.zeros((), dtype=torch.int64))

    def forward(self, x):
        y = torch.relu(self.lin(x))
        self.passed.add_((y > 0).sum())
        return x + y


class CountingStack(nn.Module):
    def __init__(self, n: int = 8, dim: int = 16):
        super().__init__()
        self.embed = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(Counting(dim) for _ in range(n))
        self.head = nn.Linear(dim, dim)

    def forward(self, x):
        h = self.embed(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def test_layers_that_write_buffers_are_stamped_functionalized():
    """Layers that write a buffer go through the functionalizing export; two and three layers are
    exported, and the two stamped to all are the graph exporting every layer gives, each layer's
    buffer update an output of its own."""
    stamped, full = _both(CountingStack(), lambda: (torch.randn(4, 16),), loss_fn=lambda y: y.square().mean())
    assert (stamped.stamped, full.stamped) == (6, 0)
    assert _same(stamped, full)
    assert stamped.written_buffers == full.written_buffers
    assert sorted(stamped.written_buffers.values()) == [f"blocks.{i}.passed" for i in range(8)]


def test_stamped_buffer_writes_run_with_single_device_numerics():
    """A plan of the stamped graph on 4 simulated ranks, batch split: the loss, every gradient and
    every layer's count (summed over the ranks' rows) are one device's."""
    torch.manual_seed(0)
    ref, batch = CountingStack(), torch.randn(8, 16)
    state = {k: v.clone() for k, v in ref.state_dict().items()}
    ref_loss = ref(batch).square().mean()
    ref_loss.backward()
    mesh = fake_mesh((4,), ("dp",))
    with torch.device("meta"):
        model = CountingStack()
    with AutoParallel(model, mesh, input_fn=lambda: batch) as ap:
        ap.add_input_constraints([(S0,)])
        ap.add_output_constraints([(S0,)])
        ap.add_node_constraint("blocks.*.lin.weight", (S0,))  # the layers' weights really split
        pmod = ap.apply_placement(ap.optimize_placement())
    assert ap.traced.stamped == 6
    with LocalTensorMode(4):
        pmod.to_empty(device="cpu")
        pmod.load_state_dict(state)
        out = pmod(distribute_tensor(batch, mesh, (S0,)).to_local())
        loss = DTensor.from_local(out, mesh, (S0,), run_check=False).square().mean()
        loss.backward()
        assert torch.allclose(one_value(loss.full_tensor(), 4), ref_loss.detach(), rtol=1e-5)
        grads = {n: one_value(p.grad.full_tensor(), 4) for n, p in pmod.named_parameters()}
        counts = [int(one_value(b.passed, 4)) for b in pmod.blocks]
    assert all(torch.allclose(grads[n], p.grad, rtol=1e-5, atol=1e-6) for n, p in ref.named_parameters())
    assert counts == [int(b.passed) for b in ref.blocks] and all(c > 0 for c in counts)
