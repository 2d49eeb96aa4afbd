"""``Plan.styles``: a plan in the words of a hand-written ``parallelize_module`` plan (torchtitan's)."""

import dataclasses
import re
from fnmatch import fnmatchcase

import pytest
import torch
from conftest import fake_mesh
from parallel_run import LLAMA_TP
from torch.distributed.tensor import Partial, Replicate, Shard

from autoplan import AutoParallel, Plan
from autoplan.bench.models.llama3 import LLAMA3_CONFIGS, Transformer
from autoplan.plan import NodePlan
from autoplan.styles import (
    COLWISE,
    CONV_COLWISE,
    CONV_ROWWISE,
    DDP,
    EXPERT,
    FSDP,
    REPLICATE,
    ROWWISE,
    SEQUENCE,
    WeightUse,
    conv_norms,
    module_styles,
    style,
)
from autoplan.trace.tracing import PATH_KEY, PHASE_KEY

R, S0, S1, S2 = Replicate(), Shard(0), Shard(1), Shard(2)
CFG = LLAMA3_CONFIGS["debug"]
# How torch's ColwiseParallel and RowwiseParallel shard an nn.Linear weight ([out, in]) on their mesh dim
TORCH_TP = {S0: COLWISE, S1: ROWWISE}


def megatron_pins(traced) -> list:
    """``LLAMA_TP``'s weights (stored split on dp, and on tp as Megatron splits them), and each of
    their forward matmuls with its tokens split on dp and, on tp, computing what its style computes:
    colwise its output features (``S(1)``), rowwise a partial sum over its split input features."""
    pins = list(LLAMA_TP)
    for n in traced.gm.graph.nodes:
        if n.meta.get(PHASE_KEY) == "forward" and n.target == torch.ops.aten.mm.default:
            for glob, (_, tp) in LLAMA_TP:
                if fnmatchcase(n.meta.get(PATH_KEY, ""), glob.removesuffix(".weight")):
                    pins.append((n.name, (S0, S1 if tp == S0 else Partial())))
    return pins


@pytest.fixture(scope="module")
def plan() -> Plan:
    """LLaMA debug on a (2, 4) ("dp", "tp") mesh, batch-split input and output, Megatron-pinned."""
    mesh = fake_mesh((2, 4), ("dp", "tp"))
    with torch.device("meta"):
        model = Transformer(CFG)
    with AutoParallel(model, mesh, input_fn=lambda: torch.randint(0, CFG.vocab_size, (8, 16))) as ap:
        ap.add_input_constraints([(S0, R)])
        ap.add_output_constraints([(S0, R)])
        for target, placements in megatron_pins(ap.traced):
            ap.add_node_constraint(target, placements)
        return ap.optimize_placement()


def one_copy(module: str) -> str:
    """A module's FQN for a row of ``Plan.styles`` (its first layer for a ``layers.*`` row)."""
    return module.replace("layers.*", "layers.0")


# ---- a planned model -----------------------------------------------------------------------------


def test_a_megatron_plan_reads_as_fsdp_and_tensor_parallel(plan):
    """The pinned linears: FSDP on dp (stored split there, their matmuls' tokens split there, so each
    reads its weight whole) and, on tp, the torch style that shards the weight as pinned."""
    styles = plan.styles()
    expected = {}
    for glob, (dp, tp) in LLAMA_TP:
        assert dp == S0
        for module in styles:
            if fnmatchcase(module, glob.removesuffix(".weight")):
                expected[module] = (FSDP, TORCH_TP[tp])
    assert len(expected) == 7  # wq, wk, wv, wo, w1, w2, w3, every layer alike (no per-layer row)
    assert {m: styles[m] for m in expected} == expected


def test_every_other_module_is_named_as_its_weight_is_stored(plan):
    """Modules the plan chose freely: a style's name agrees with how the weight is stored on that dim
    (FSDP shards it, DDP, Replicate and SequenceParallel keep it whole); no style shows the placement."""
    for module, labels in plan.styles().items():
        stored = plan.param_placements[f"{one_copy(module)}.weight"]
        for label, placement in zip(labels, stored):
            if label in (FSDP, COLWISE, ROWWISE):
                assert isinstance(placement, Shard), (module, labels)
            elif label in (DDP, REPLICATE, SEQUENCE):
                assert placement == R, (module, labels)
            else:
                assert label.startswith(f"w {placement}"), (module, labels)


def test_summary_has_the_styles_table(plan):
    lines = plan.summary().splitlines()
    header = lines.index(next(line for line in lines if line.startswith("module (torchtitan style)")))
    assert lines[header].split()[-3:] == ["dp", "tp", "copies"]
    table = lines[header + 1 : lines.index("", header)]
    rows = {line.split()[0]: line.split()[1:] for line in table}
    assert len(rows) == len(plan.styles())
    for module, labels in plan.styles().items():
        assert rows[module][:2] == list(labels)
    assert rows["layers.*.attention.wq"] == [FSDP, COLWISE, str(CFG.n_layers)]
    unnamed = dataclasses.replace(plan, mesh_dim_names=None).summary().splitlines()
    assert unnamed[header].split()[-3:] == ["d0", "d1", "copies"]


def test_styles_come_back_from_json(plan):
    again = Plan.from_json(plan.to_json())
    assert again.styles() == plan.styles()
    assert again.summary() == plan.summary()


# ---- the rules on hand-made placements -----------------------------------------------------------


@pytest.mark.parametrize(
    "use, expected",
    [
        (WeightUse("matmul", (S0,), (S0,), (R,)), COLWISE),
        (WeightUse("matmul", (S1,), (S1,), (S1,)), ROWWISE),
        (WeightUse("matmul", (S0,), (R,), (S0,)), FSDP),
        (WeightUse("matmul", (S1,), (R,), (S0,)), FSDP),
        (WeightUse("matmul", (R,), (R,), (S0,)), DDP),
        (WeightUse("matmul", (R,), (R,), (R,)), REPLICATE),
        # gathered, but every rank computes the same tokens: sharded storage alone, no style
        (WeightUse("matmul", (S0,), (R,), (R,)), "w S(0)->R, x R"),
        # sliced where it is read but stored whole: torch's ColwiseParallel stores the shard
        (WeightUse("matmul", (R,), (S0,), (R,)), "w R->S(0), x R"),
        (WeightUse("matmul", (S0,), (S1,), (S1,)), "w S(0)->S(1), x S(1)"),
        # a weight stored [in, out] (``x @ w``): its output features are its dim 1
        (WeightUse("matmul", (S1,), (S1,), (R,), out_dim=1), COLWISE),
        (WeightUse("embedding", (S0,), (S0,), (R,), out_dim=1), ROWWISE),
        (WeightUse("embedding", (S1,), (S1,), (R,), out_dim=1), COLWISE),
        (WeightUse("embedding", (R,), (R,), (S1,), out_dim=1), DDP),
        (WeightUse("", (R,), data=(S1,)), SEQUENCE),
        (WeightUse("", (S0,), data=(S0,)), FSDP),
        (WeightUse("", (R,), data=(S0,)), DDP),
        (WeightUse("", (R,), data=(R,)), REPLICATE),
        (WeightUse("", (S0,), data=(S1,)), "w S(0), x S(1)"),
        (WeightUse("", (R,)), "w R"),
        # a mixture of experts' weights [experts, in, out] against buffers [experts, slots, in]
        (WeightUse("experts", (S0,), (S0,), (S0,), out_dim=2), EXPERT),
        (WeightUse("experts", (S2,), (S2,), (R,), out_dim=2), COLWISE),
        (WeightUse("experts", (S1,), (S1,), (S2,), out_dim=2), ROWWISE),
        (WeightUse("experts", (S0,), (R,), (S1,), out_dim=2), FSDP),
        (WeightUse("experts", (S0,), (R,), (S0,), out_dim=2), "w S(0)->R, x S(0)"),
        # a convolution's weight [out, in, kh, kw] against activations [batch, in channels, h, w]
        (WeightUse("conv", (S0,), (S0,), (R,)), CONV_COLWISE),
        (WeightUse("conv", (S1,), (S1,), (S1,)), CONV_ROWWISE),
        (WeightUse("conv", (S0,), (R,), (S0,)), FSDP),
        (WeightUse("conv", (R,), (R,), (S0,)), DDP),
        (WeightUse("conv", (R,), (R,), (R,)), REPLICATE),
        (WeightUse("conv", (S2,), (S2,), (R,)), "w S(2), x R"),  # a kernel dim: no style
        # its batch norm, on the convolution's output [batch, out channels, h, w]
        (WeightUse("channels", (S0,), data=(S1,)), CONV_COLWISE),
        (WeightUse("channels", (S0,), data=(S0,)), FSDP),
        (WeightUse("channels", (R,), data=(S0,)), DDP),
        (WeightUse("channels", (R,), data=(R,)), REPLICATE),
        (WeightUse("channels", (R,), data=(S1,)), "w R, x S(1)"),  # channels split, weight whole: not SP
    ],
)
def test_style_of_one_mesh_dim(use, expected):
    assert style(use, 0) == expected


def test_each_mesh_dim_has_its_own_style():
    use = WeightUse("matmul", (S0, S0), (R, S0), (S0, R))
    assert (style(use, 0), style(use, 1)) == (FSDP, COLWISE)


def node(name: str, op: str, module: str, inputs: tuple, outputs: tuple, compute_s: float = 1e-6) -> NodePlan:
    return NodePlan(name, f"aten.{op}.default", module, "forward", outputs, inputs, compute_s)


def test_a_linear_is_read_through_its_transpose():
    """``nn.Linear`` runs ``mm(x, t(w))``: the matmul's ``S(1)`` is the weight's dim 0, its output
    features; a module multiplying by its weight as stored (``x @ w``, [in, out]) reads it directly."""
    linear = [
        node("t", "t", "fc", ((S0, S0),), ((S1, S1),), 0.0),
        node("mm", "mm", "fc", ((S0, R), (R, S1)), ((S0, S1),)),
        node("mm_bwd", "mm", "fc", ((S0, R), (R, R)), ((S0, R),)),
    ]
    linear[2] = dataclasses.replace(linear[2], phase="backward")  # only the forward reads count
    plain = [node("mm_1", "mm", "proj", ((S0, R), (R, S1)), ((S0, S1),))]
    params = {"fc.weight": (S0, S0), "proj.weight": (S0, S1), "norm.weight": (R, R)}
    norm = [
        node("mul", "mul", "norm", ((S0, S1), (R, R)), ((S0, S1),)),
        node("a", "alias", "norm", ((R, R),), ((R, R),), 0.0),
    ]
    assert module_styles(linear + plain + norm, params) == {
        "fc": (FSDP, COLWISE),
        "proj": (FSDP, COLWISE),
        "norm": (DDP, SEQUENCE),
    }


def test_an_expert_parallel_plan_reads_as_expert_parallel():
    """The in-repo MoE decoder with its experts' matmuls pinned split over the experts on dp: its
    MoE modules read ExpertParallel on dp (replicated on tp), in the summary's table too; left to
    the costs on this tiny model, they are not expert parallel."""
    from autoplan.bench.models.moe import MOE_CONFIGS, MoETransformer

    cfg = dataclasses.replace(MOE_CONFIGS["debug"], n_layers=2)
    mesh = fake_mesh((2, 2), ("dp", "tp"))
    with torch.device("meta"):
        model = MoETransformer(cfg)
    with AutoParallel(model, mesh, input_fn=lambda: torch.randint(0, cfg.vocab_size, (4, 16))) as ap:
        ap.add_input_constraints([(S0, R)])
        ap.add_output_constraints([(S0, R)])
        free_plan = ap.optimize_placement()
        free = free_plan.styles()["layers.*.feed_forward"]
        ap.add_node_constraint("layers.*.feed_forward.w[123]", (S0, R))
        ap.add_node_constraint("bmm*", (S0, R))
        plan = ap.optimize_placement()
    assert EXPERT not in free
    assert plan.styles()["layers.*.feed_forward"] == (EXPERT, REPLICATE)
    assert "ExpertParallel" in plan.summary()
    # explain leads with the block: its degree, the all-to-alls moving its buffers, the next best
    head = plan.explain("layers.*.feed_forward").splitlines()
    assert head[0] == (
        "experts of layers.0.feed_forward: expert-parallel degree 2 over dp (ExpertParallel on dp, Replicate on tp)"
    )
    assert re.search(r"all_to_all \d+ \(\d+\.\d+ MiB per rank, \d+\.\d+ ms\)", head[1])
    assert head[2] == "  bmm: no alternative not split over the experts among the next-best strategies kept"  # pinned
    free_head = free_plan.explain("layers.*.feed_forward").splitlines()
    assert free_head[0].startswith("experts of layers.0.feed_forward: expert-parallel degree 1 (")
    assert re.match(r"  bmm\w*: next best split over the experts: .* \+\d+\.\d+ ms per step", free_head[2])


def test_grouped_matmul_experts_read_as_expert_parallel():
    """torchtitan-style grouped-matmul experts (``grouped_mm(tokens [routed, in], w [E, in, out])``):
    read split over the experts, they are ExpertParallel there whatever the tokens; read whole
    with the tokens split, FSDP."""
    experts = WeightUse("grouped", stored=(S0, S0), read=(S0, R), data=(R, Shard(0)), out_dim=2)
    assert (style(experts, 0), style(experts, 1)) == (EXPERT, FSDP)


def test_a_conv_split_on_out_channels_and_its_batch_norm_read_as_one_colwise_block():
    """A convolution whose weight is stored and read split on its out channels on tp (its batch
    split on dp, where the weight is gathered), then its batch norm on that output, weights split
    on tp alike: the conv analogue of colwise on tp for both, FSDP and DDP on dp; the norm pairs
    with the convolution it follows, and not with one an op stands between."""
    conv_out = (S0, S1)
    nodes = [
        node("conv", "convolution", "conv1", ((S0, R), (R, S0)), (conv_out,)),
        node("mean", "mean", "bn1", (conv_out,), ((Partial(), S0),)),
        node("sub", "sub", "bn1", (conv_out, (R, S0)), (conv_out,)),
        node("conv_1", "convolution", "conv2", ((S0, S1), (R, S1)), ((S0, Partial()),)),
        node("relu", "relu", "", ((S0, R),), ((S0, R),)),
        node("mul", "mul", "bn2", ((S0, R), (R, R)), ((S0, R),)),
    ]
    params = {
        "conv1.weight": (S0, S0),
        "bn1.weight": (R, S0),
        "bn1.bias": (R, S0),
        "conv2.weight": (R, S1),
        "bn2.weight": (R, R),
        "bn2.bias": (R, R),
    }
    assert conv_norms(nodes, params) == {"bn1": "conv1"}
    assert module_styles(nodes, params) == {
        "conv1": (FSDP, CONV_COLWISE),
        "bn1": (DDP, CONV_COLWISE),
        "conv2": (DDP, CONV_ROWWISE),
        "bn2": (DDP, REPLICATE),  # after the relu, an elementwise module of its own
    }


def test_a_resnets_table_groups_each_convolution_with_its_batch_norm():
    """A ResNet under FSDP's parameter budget: each block's convolutions and batch norms (and the
    stem's, and a shortcut's, siblings in an ``nn.Sequential``) read as one row of FSDP, in the
    summary's table too; ``styles_by_module`` keeps every module apart."""
    from models import ResNet

    mesh = fake_mesh((2, 4), ("dp", "tp"))
    with torch.device("meta"):
        model = ResNet(widths=(16, 32), classes=8)
    with AutoParallel(model, mesh, input_fn=lambda: torch.randn(64, 3, 32, 32)) as ap:
        ap.add_input_constraints([(S0, R)])
        ap.add_output_constraints([(S0, R)])
        ap.add_memory_constraint(param_fraction=1 / 8)
        plan = ap.optimize_placement()
    styles = plan.styles()
    assert list(styles) == ["stem.0+1", "blocks.*.conv1+bn1", "blocks.*.conv2+bn2", "blocks.*.shortcut.0+1", "fc"]
    assert set(styles.values()) == {(FSDP, FSDP)}
    by_module = plan.styles_by_module()
    assert by_module["blocks.0.conv1"] == by_module["blocks.0.bn1"] == (FSDP, FSDP)
    table = plan.summary().splitlines()
    assert any(line.split() == ["blocks.*.conv1+bn1", FSDP, FSDP, "4"] for line in table), table
