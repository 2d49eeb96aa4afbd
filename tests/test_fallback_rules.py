"""Ops that ran replicated for want of a sharding rule (issue 65): MobileNet's hard activations,
stochastic depth's random mask, ``as_strided`` views that keep the batch, ``fill`` with a tensor
value and ``nn.EmbeddingBag``. Each model is planned on a fake (2, 4) mesh with its input and output
split on the batch: no op falls back (no warning, and the summary counts none), the ops split the
batch, and a training step under ``LocalTensorMode`` matches one device (loss and gradients, fp32)."""

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import fake_mesh
from parallel_run import close, one_value
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

import autoplan.shard.strategies as strategies
from autoplan import AutoParallel

R, S0 = Replicate(), Shard(0)
IO = (S0, R)
NO_RULE = "no sharding rule"


class HardBlock(nn.Module):
    """A MobileNetV3-style block: a convolution with hardswish, squeeze-and-excitation gated by
    hardsigmoid, pooled to a linear head."""

    def __init__(self, channels: int = 8, classes: int = 6):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.squeeze = nn.Conv2d(channels, channels // 2, 1)
        self.excite = nn.Conv2d(channels // 2, channels, 1)
        self.head = nn.Linear(channels, classes)

    def forward(self, x):
        x = F.hardswish(self.conv(x))
        gate = F.hardsigmoid(self.excite(F.relu(self.squeeze(x.mean((2, 3), keepdim=True)))))
        return self.head((x * gate).mean((2, 3)))


class StochasticDepth(nn.Module):
    """A residual block whose branch each sample keeps with probability ``keep`` (torchvision's
    stochastic depth, written out): a [B, 1, 1, 1] mask drawn with ``bernoulli_``, scaled by 1/keep."""

    def __init__(self, keep: float, channels: int = 8, classes: int = 6):
        super().__init__()
        self.keep = keep
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.head = nn.Linear(channels, classes)

    def forward(self, x):
        branch = self.conv(x)
        if self.training:
            mask = torch.empty([x.shape[0], 1, 1, 1], dtype=x.dtype, device=x.device).bernoulli_(self.keep)
            branch = branch * mask.div_(self.keep)
        return self.head((x + branch).mean((2, 3)))


class StridedRows(nn.Module):
    """A linear layer's output viewed with ``as_strided``: per sample the first two of its four rows,
    the batch's size and stride kept (its gradient scatters back through ``as_strided_scatter``)."""

    def __init__(self, dim: int = 16):
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, dim)

    def forward(self, x):  # x: [B, 4, dim]
        y = self.proj(x)
        b, rows, dim = y.shape
        first = y.as_strided((b, 2, dim), (rows * dim, dim, 1), y.storage_offset())
        return self.head(first.sum(1))


class FilledScale(nn.Module):
    """A tensor filled in place with a learned 0-d value (``fill_`` with a tensor, as Swin fills its
    attention mask): the value is detached, as a mask's is."""

    def __init__(self, dim: int = 16):
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.scale = nn.Parameter(torch.tensor(0.75))

    def forward(self, x):
        y = self.proj(x)
        return y * torch.zeros_like(y).fill_(self.scale.detach()) + y


class BagRecommender(nn.Module):
    """A recommender's sparse features: each sample a bag of item ids pooled by ``nn.EmbeddingBag``
    (``weighted``: summed with learned per-item weights, as per-sample weights), then an MLP."""

    def __init__(self, mode: str, items: int = 64, dim: int = 16, out: int = 8, weighted: bool = False):
        super().__init__()
        self.bag = nn.EmbeddingBag(items, dim, mode=mode)
        self.score = nn.Embedding(items, 1) if weighted else None
        self.mlp = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, out))

    def forward(self, ids):  # ids: [B, L]
        weights = None if self.score is None else torch.sigmoid(self.score(ids).squeeze(-1))
        return self.mlp(self.bag(ids, per_sample_weights=weights))


def _run(build, x, target, ops, train=True, constrain=lambda ap: None):
    """One forward and backward of ``build()`` on one device and of its plan on a simulated (2, 4)
    mesh, input and output split on the batch over the first mesh dim, the global RNG seeded alike
    before both forwards. Checks that the ``ops`` ran and none fell back (no warning, none counted
    in the summary, our rules chose); returns the plan and what differs (empty when the loss and
    every gradient match)."""
    torch.manual_seed(0)
    ref = build().train(train)
    state = {k: v.clone() for k, v in ref.state_dict().items()}
    torch.manual_seed(1)
    loss = (ref(x) - target).square().mean()
    loss.backward()
    want = {n: p.grad.clone() for n, p in ref.named_parameters() if p.grad is not None}

    mesh, ranks = fake_mesh((2, 4)), 8
    with torch.device("meta"):
        model = build().train(train)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with AutoParallel(model, mesh, lambda: _like(x)) as ap:
            ap.add_input_constraints([IO])
            ap.add_output_constraints([IO])
            constrain(ap)
            plan = ap.optimize_placement()
            pmod = ap.apply_placement(plan)
    fallbacks = [str(w.message) for w in caught if NO_RULE in str(w.message)]
    assert not [m for m in fallbacks if any(op in m for op in ops)], fallbacks
    assert "ops with no sharding rule (run replicated): none" in plan.summary()
    traced = {n.op for n in plan.nodes.values()}
    assert set(ops) <= traced, (ops, traced)
    assert all(plan.nodes[n].rule == "autoplan" for n in plan.nodes if plan.nodes[n].op in ops)

    differ = []
    with LocalTensorMode(ranks):
        pmod.to_empty(device="cpu")
        pmod.load_state_dict(state)
        pmod.train(train)
        torch.manual_seed(1)
        out = DTensor.from_local(pmod(distribute_tensor(x, mesh, IO).to_local()), mesh, IO, run_check=False)
        got = (out - distribute_tensor(target, mesh, IO)).square().mean()
        got.backward()
        if not close(one_value(got, ranks), loss.detach()):
            differ.append("loss")
        for n, p in pmod.named_parameters():
            grad = None if p.grad is None else one_value(p.grad, ranks)
            if (grad is None) != (n not in want) or (grad is not None and not close(grad, want[n])):
                differ.append(n)
    return plan, differ


def _like(x: torch.Tensor) -> torch.Tensor:
    """A fresh tensor of ``x``'s shape and dtype (``input_fn`` runs under the trace's fake mode)."""
    return torch.randn(x.shape) if x.is_floating_point() else torch.randint(0, 64, x.shape)


def _splits_batch(plan, op: str) -> bool:
    """Some node of ``op`` has an input or output split on dim 0 over the batch's mesh dim."""
    return any(p is not None and p[0] == S0 for n in plan.nodes.values() if n.op == op for p in (*n.inputs, *n.outputs))


def _images(shape=(16, 8, 8, 8), classes=6, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g), torch.randn(shape[0], classes, generator=g)


def test_hard_activations_and_their_gradients_split_the_batch():
    """hardswish, and the gradients of hardswish and hardsigmoid (DTensor has rules for none of
    them), split like any elementwise op: the block's convolutions keep the batch split."""
    ops = ("aten.hardswish.default", "aten.hardswish_backward.default", "aten.hardsigmoid_backward.default")
    x, y = _images()
    plan, differ = _run(HardBlock, x, y, ops)
    assert not differ, differ
    for op in ops:
        assert _splits_batch(plan, op), op


def test_stochastic_depth_draws_one_devices_mask_and_splits_the_batch():
    """In training, the mask is drawn whole on every rank from the generator state one device
    draws it from, each rank keeping its own rows (a split draw would give each rank the stream's
    first values), so the step is one device's, mask included; the multiply by the activation
    splits the batch, with no move of the mask between."""
    x, y = _images()
    plan, differ = _run(lambda: StochasticDepth(keep=0.5), x, y, ("aten.empty.memory_format", "aten.bernoulli.p"))
    assert not differ, differ
    (draw,) = [n for n in plan.nodes.values() if n.op == "aten.bernoulli.p"]
    assert draw.inputs[0] == (R, R) and draw.outputs[0][0] == S0  # drawn whole, its rows kept
    (mul,) = [n for n in plan.nodes.values() if n.op == "aten.mul.Tensor" and n.phase == "forward"]
    assert mul.outputs[0][0] == S0 and all(p[0] == S0 for p in mul.inputs)


def test_empty_can_be_made_split():
    """``empty`` is memory its readers fill: each rank may make just its shard."""
    import torch.fx as fx

    from autoplan.shard.strategies import StrategyBuilder

    mesh = fake_mesh((2, 4))
    g = fx.Graph()
    n = g.call_function(torch.ops.aten.empty.memory_format, ([16, 8],), {"dtype": torch.float32})
    n.meta["val"] = torch.empty(16, 8, device="meta")
    outs = {s.outputs[0] for s in StrategyBuilder(mesh).for_op(n, {}).strategies}
    assert {(S0, R), (S0, Shard(1)), (Shard(1), S0), (R, R)} <= outs


def test_as_strided_views_that_keep_the_batch_split_it():
    """A view through ``as_strided`` that keeps the batch's size and stride (and its gradient's
    ``as_strided_scatter`` into a flat buffer of the whole input) splits the batch: each rank views
    its own rows, with local sizes and offsets."""
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 4, 16, generator=g), torch.randn(16, 16, generator=g)
    ops = ("aten.as_strided.default", "aten.as_strided_scatter.default")
    plan, differ = _run(StridedRows, x, y, ops)
    assert not differ, differ
    for op in ops:
        assert _splits_batch(plan, op), op


def test_as_strided_views_that_reach_across_rows_stay_whole():
    """A view splits the batch where its rows tile its base's rows block by block, however it steps
    inside them (every other element, or twice as many rows of half the length); one whose rows
    reach into the next block (a sliding window), or that skips the last rows, keeps only the whole
    rules (a partial sum views apart)."""
    import torch.fx as fx

    from autoplan.shard.strategies import StrategyBuilder, all_placements

    mesh = fake_mesh((2, 4))
    g = fx.Graph()
    base = g.placeholder("base")
    base.meta["val"] = torch.empty(16, 4, device="meta")
    cases = [((16, 2), (4, 1), True), ((16, 2), (4, 3), True), ((32, 2), (2, 1), True)]
    cases += [((16, 2), (4, 4), False), ((16, 8), (4, 1), False), ((8, 2), (4, 1), False)]
    for size, stride, shardable in cases:
        n = g.call_function(torch.ops.aten.as_strided.default, (base, list(size), list(stride), 0))
        n.meta["val"] = torch.empty_strided(size, stride, device="meta")
        got = StrategyBuilder(mesh).for_op(n, {base: all_placements(base.meta["val"], (2, 4), partial=True)})
        assert got.source == "autoplan"
        assert any(s.outputs[0][0] == S0 for s in got.strategies) == shardable, (size, stride)
        assert any(s.outputs[0][0] == Partial() for s in got.strategies)


def test_fill_with_a_tensor_value_splits_like_its_input():
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 4, 16, generator=g), torch.randn(16, 4, 16, generator=g)
    plan, differ = _run(FilledScale, x, y, ("aten.fill.Tensor",))
    assert not differ, differ
    (fill,) = [n for n in plan.nodes.values() if n.op == "aten.fill.Tensor"]
    assert fill.outputs[0][0] == S0 and fill.inputs[1] == (R, R)


BAG_OPS = ("aten._embedding_bag.default", "aten._embedding_bag_backward.default")
WEIGHTS_GRAD = "aten._embedding_bag_per_sample_weights_backward.default"


@pytest.mark.parametrize("mode", ["sum", "mean", "max", "weighted"])
def test_embedding_bag_splits_over_the_bags(mode):
    """``nn.EmbeddingBag`` on [B, L] ids: its bags lie end to end, so the ids and bags (and the
    per-sample weights) split over the batch, the table whole and its gradient summed over the bags."""
    g = torch.Generator().manual_seed(1)
    ids, y = torch.randint(0, 64, (16, 5), generator=g), torch.randn(16, 8, generator=g)
    weighted = mode == "weighted"
    ops = BAG_OPS + ((WEIGHTS_GRAD,) if weighted else ())
    plan, differ = _run(lambda: BagRecommender("sum" if weighted else mode, weighted=weighted), ids, y, ops)
    assert not differ, differ
    (bag,) = [n for n in plan.nodes.values() if n.op == BAG_OPS[0]]
    assert bag.outputs[0][0] == S0 and bag.inputs[1][0] == S0


@pytest.mark.parametrize("mode", ["sum", "mean", "weighted"])
def test_embedding_bag_splits_its_table_rows(mode):
    """Pinned to split the table's rows over the second mesh dim (the bags over the first): each
    rank looks up its own rows and reads the others as zero, the bags come out partial sums (a
    mean's over the whole bag) and the table's gradient split like the table."""
    g = torch.Generator().manual_seed(1)
    ids, y = torch.randint(0, 64, (16, 5), generator=g), torch.randn(16, 8, generator=g)
    weighted = mode == "weighted"
    ops = BAG_OPS + ((WEIGHTS_GRAD,) if weighted else ())

    def rows(ap):
        ap.add_node_constraint("_embedding_bag", (S0, Partial()))
        ap.add_node_constraint("_embedding_bag_backward", (R, S0))
        if weighted:
            ap.add_node_constraint("_embedding_bag_per_sample_weights_backward", (S0, Partial()))

    model = lambda: BagRecommender("sum" if weighted else mode, weighted=weighted)  # noqa: E731
    plan, differ = _run(model, ids, y, ops, constrain=rows)
    assert not differ, differ
    (bag,) = [n for n in plan.nodes.values() if n.op == BAG_OPS[0]]
    assert bag.inputs[0] == (R, S0) and bag.outputs[0] == (S0, Partial())
    (grad,) = [n for n in plan.nodes.values() if n.op == BAG_OPS[1]]
    assert grad.outputs[0][1] == S0


def test_a_plan_reports_the_nodes_it_runs_replicated_without_a_rule(monkeypatch):
    """The summary counts the nodes with no sharding rule, by op: here hardswish and its gradient,
    their rules taken away, besides the warning naming each op once."""
    monkeypatch.delitem(strategies._OWN_RULES, torch.ops.aten.hardswish.default)
    monkeypatch.delitem(strategies._OWN_RULES, torch.ops.aten.hardswish_backward.default)
    mesh = fake_mesh((2, 4))
    with torch.device("meta"):
        model = HardBlock()
    with pytest.warns(UserWarning, match="no sharding rule for aten.hardswish.default"):
        with AutoParallel(model, mesh, lambda: torch.randn(16, 8, 8, 8)) as ap:
            plan = ap.optimize_placement()
    line = "ops with no sharding rule (run replicated): 2 nodes: "
    assert line + "aten.hardswish.default (1), aten.hardswish_backward.default (1)" in plan.summary()
