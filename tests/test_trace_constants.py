"""Values a model builds from constants alone are known while tracing (``autoplan.trace.constants``):
torch's own ``nn.Transformer`` reads its causal ``tgt_mask`` to pick the causal kernel, and plans and
runs with single-device numerics; a value read from the inputs or parameters still fails, named."""

import pytest
import torch
from models import TorchTransformerSeq2Seq
from test_models import run_both
from torch import nn
from torch.distributed.tensor import Replicate, Shard

from autoplan.errors import TracingError
from autoplan.trace import attention as attn
from autoplan.trace import constants
from autoplan.trace.tracing import PHASE_KEY, trace_joint

aten = torch.ops.aten
R, S0 = Replicate(), Shard(0)
IO = (S0, R)
VOCAB, BATCH, SRC, TGT = 64, 8, 6, 5


def seq2seq_inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Source and target tokens and the source padding mask: row i pads its last i % 3 positions."""
    g = torch.Generator().manual_seed(seed)
    src, tgt = torch.randint(0, VOCAB, (BATCH, SRC), generator=g), torch.randint(0, VOCAB, (BATCH, TGT), generator=g)
    padded = torch.arange(SRC)[None, :] >= SRC - (torch.arange(BATCH)[:, None] % 3)
    return src, tgt, padded


def _targets(seed: int) -> torch.Tensor:
    return torch.randn(BATCH, TGT, VOCAB, generator=torch.Generator().manual_seed(100 + seed))


def run_seq2seq(build, steps: int = 2):
    """``steps`` AdamW steps of ``build()`` on one device and of its plan on a simulated (2, 4) mesh
    (``test_models.run_both``: the three inputs and the logits split on the batch over the first
    dim). Returns the traced graph and what differs (an empty list when all match)."""
    batches, targets = [seq2seq_inputs(s) for s in range(steps)], [_targets(s) for s in range(steps)]
    traced = []
    _, _, differ = run_both(build, batches, targets, constrain=lambda ap: traced.append(ap.traced))
    return traced[0], differ


def _forward_targets(traced) -> list:
    return [n.target for n in traced.gm.graph.nodes if n.meta.get(PHASE_KEY) == "forward"]


def _causal_flags(traced) -> list[bool]:
    """``is_causal`` of each forward attention kernel, sorted."""
    kernels = [(n, attn.spec_of(n.target)) for n in traced.gm.graph.nodes if n.meta.get(PHASE_KEY) == "forward"]
    return sorted(attn.is_causal(spec, n.args, n.kwargs) for n, spec in kernels if spec is not None)


def test_torch_transformer_with_causal_mask_built_in_forward_plans_and_runs():
    traced, differ = run_seq2seq(lambda: TorchTransformerSeq2Seq(VOCAB))
    assert not differ, differ
    # nn.Transformer found the mask causal, as it does when it runs: encoder self-attention and
    # decoder cross-attention attend with the padding, the decoder's self-attention causally
    assert _causal_flags(traced) == [False, False, True]


def test_generate_square_subsequent_mask_is_found_causal():
    traced = trace_joint(TorchTransformerSeq2Seq(VOCAB, square_mask=True), lambda: seq2seq_inputs(0))
    assert _causal_flags(traced) == [False, False, True]


def test_torch_transformer_with_a_windowed_mask_attends_with_the_mask():
    """A mask built from constants that is not causal: ``nn.Transformer`` reads it, finds it is not
    and attends with it; the graph computes it (a replicated constant) as the model does."""
    traced, differ = run_seq2seq(lambda: TorchTransformerSeq2Seq(VOCAB, window=2), steps=1)
    assert not differ, differ
    assert _causal_flags(traced) == [False, False, False]
    forward = _forward_targets(traced)
    assert aten.full.default in forward and aten.triu.default in forward and aten.tril.default in forward


def _trace(model: nn.Module, *inputs: torch.Tensor):
    """The joint graph with the host's attention kernel, so ``_run_forward`` can run it on the CPU."""
    return trace_joint(model, lambda: inputs if len(inputs) > 1 else inputs[0], attention="cpu")


def _run_forward(traced, model: nn.Module, inputs: tuple) -> torch.Tensor:
    """The traced joint graph run on the model's real parameters and ``inputs``: its first output."""
    values = []
    for kind, target in traced.input_labels:
        if kind == "param":
            values.append(model.get_parameter(target).detach())
        elif kind == "buffer":
            values.append(model.get_buffer(target).clone())
        elif kind == "input":
            values.append(inputs[target])
        else:  # a tangent: the output's shape
            values.append(torch.ones(traced.outputs_of("output")[target].meta["val"].shape))
    with torch.no_grad():
        return torch.fx.Interpreter(traced.gm).run(*values, enable_io_processing=False)[0]


class _ReadsConstants(nn.Module):
    """Reads values built from factory ops every way a model does; each read picks a branch."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        mask = torch.ones(4, 4, dtype=torch.bool).tril()
        steps = torch.arange(4)
        scale = torch.empty(()).fill_(2.0)
        if mask.any() and torch.equal(mask, torch.tril(torch.ones(4, 4)).bool()) and steps.sum().item() == 6:
            x = x * scale.item()
        if bool(steps[0] != 0) or torch.tensor([1.0, 2.0]).max().item() != 2.0:
            x = x * 0  # not taken
        buffer = torch.zeros(4)
        buffer[1:] = 3.0  # a known value written in place stays known
        return self.proj(x) + float(buffer[2])


def test_reads_of_values_built_from_constants_are_answered():
    traced = _trace(_ReadsConstants(), torch.randn(2, 4))
    calls = [(n.target, n.args[1:]) for n in traced.gm.graph.nodes if n.meta.get(PHASE_KEY) == "forward"]
    # the branches the reads took, and the values read, baked in: x * 2 (not * 0), then + 3
    assert (aten.mul.Tensor, (2.0,)) in calls and (aten.add.Tensor, (3.0,)) in calls
    assert not any(op is aten.mul.Tensor and args == (0,) for op, args in calls)
    assert aten._local_scalar_dense.default not in [op for op, _ in calls]


class _ReadsInput(nn.Module):
    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        if self.how == "item":
            scale = x.abs().max().item()
        elif self.how == "written":  # a constant overwritten with input values is no longer known
            scale = torch.zeros(2, 4)
            scale[:, 1:] = x[:, 1:]
            scale = 2.0 if scale.any() else 1.0
        else:  # a parameter's value
            scale = float(self.proj.weight.sum())
        return self.proj(x) * scale


@pytest.mark.parametrize("how", ["item", "written", "parameter"])
def test_a_value_read_from_inputs_or_parameters_still_fails_naming_the_op(how):
    with pytest.raises(TracingError, match=r"tracing failed in aten\._local_scalar_dense\.default") as info:
        _trace(_ReadsInput(how), torch.randn(2, 4))
    assert info.value.op == "aten._local_scalar_dense.default"
    assert "test_trace_constants.py" in info.value.source


def test_a_constant_too_large_to_keep_says_so(monkeypatch):
    monkeypatch.setattr(constants, "NUMEL_LIMIT", 8)

    class Big(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(4, 4)

        def forward(self, x):
            mask = torch.triu(torch.ones(4, 4), 1)  # 16 elements
            return self.proj(x) * (2.0 if mask.sum() > 0 else 1.0)

    with pytest.raises(TracingError, match="larger than the 8 elements") as info:
        _trace(Big(), torch.randn(2, 4))
    assert info.value.op == "aten._local_scalar_dense.default"


def test_a_tgt_mask_passed_as_an_input_names_tgt_is_causal():
    """A mask the model is given depends on its inputs: nn.Transformer's causal check cannot read it."""

    class GivenMask(nn.Module):
        def __init__(self):
            super().__init__()
            layer = nn.TransformerDecoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
            self.decoder = nn.TransformerDecoder(layer, 1)

        def forward(self, tgt, memory, tgt_mask):
            return self.decoder(tgt, memory, tgt_mask=tgt_mask)

    mask = torch.triu(torch.full((5, 5), float("-inf")), 1)
    with pytest.raises(TracingError, match="tgt_is_causal") as info:
        _trace(GivenMask(), torch.randn(2, 5, 16), torch.randn(2, 3, 16), mask)
    assert info.value.op == "aten._local_scalar_dense.default" and info.value.module_path == "decoder"


class _Encoder(nn.Module):
    """``nn.TransformerEncoder`` with a causal mask built in forward and a padding mask input,
    ``is_causal`` given or detected; in eval mode its nested-tensor fast path checks the padding."""

    def __init__(self, is_causal: bool | None, masked: bool = True):
        super().__init__()
        self.is_causal, self.masked = is_causal, masked
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2)

    def forward(self, x, padded):
        s = x.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(s) if self.masked else None
        return self.encoder(x, mask=mask, src_key_padding_mask=padded, is_causal=self.is_causal)


@pytest.mark.filterwarnings("ignore:Support for mismatched src_key_padding_mask and mask is deprecated")
@pytest.mark.parametrize(
    "is_causal, masked",
    [(None, True), (True, True), (False, True), (None, False)],
    ids=["detected", "True", "False", "padding"],
)
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_torch_transformer_encoder_traces_with_padding_and_causal_masks(is_causal, masked, training):
    model = _Encoder(is_causal, masked).train(training)
    x, padded = torch.randn(2, 6, 16), torch.arange(6)[None, :] >= torch.tensor([[6], [4]])
    traced = _trace(model, x, padded)
    with torch.no_grad():  # eval mode runs torch's nested-tensor fast path here, with zeros at padding
        ref = model(x, padded)
    out = _run_forward(traced, model, (x, padded))
    kept = ~padded[..., None].expand_as(ref)
    torch.testing.assert_close(out[kept], ref[kept], rtol=1e-5, atol=1e-6)
    # the padded path: no nested tensor, the masks merged into the attention's bias
    assert aten._nested_tensor_from_mask.default not in _forward_targets(traced)


def test_functionalized_trace_knows_constants_too():
    """A model writing a buffer in place traces through the functionalizing export: its reads of
    values built from constants are answered there as well."""

    class Counting(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(4, 4)
            self.register_buffer("calls", torch.zeros(()))

        def forward(self, x):
            self.calls.add_(1)
            steps = torch.arange(4)
            return self.proj(x) * (2.0 if bool((steps == torch.arange(4)).all()) else 1.0)

    model, x = Counting(), torch.randn(2, 4)
    traced = _trace(model, x)
    assert traced.written_buffers  # it went the functionalized way
    torch.testing.assert_close(_run_forward(traced, model, (x,)), model.proj(x) * 2.0)
