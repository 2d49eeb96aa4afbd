"""Inputs as ``forward`` takes them: ``input_fn`` gives positional arguments, keyword arguments or
both, with ``None`` and Python numbers where ``forward`` takes them (constants baked into the trace);
input constraints name inputs by keyword or position; the parallel module is called the same way,
and a call that differs from the traced one (another constant, a tensor for ``None``, another
dtype) is refused with the argument named.

Ground truth: the encoder-decoder ``models.EncDec`` on 8 simulated ranks (a 2x4 mesh,
``LocalTensorMode``) trains AdamW steps with the single-device losses and gradients.
"""

import pytest
import torch
from conftest import fake_mesh
from models import EncDec
from parallel_run import close, one_value
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from autoplan import AutoParallel, ConstraintError, InputMismatchError
from autoplan.trace.inputs import split_call
from autoplan.trace.tracing import trace_joint

RANKS = 8
R, S0 = Replicate(), Shard(0)
IO = (S0, R)
BATCH, SRC, TGT, VOCAB = 8, 12, 10, 64


def _batch(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "input_ids": torch.randint(0, VOCAB, (BATCH, SRC), generator=g),
        "decoder_input_ids": torch.randint(0, VOCAB, (BATCH, TGT), generator=g),
        "attention_mask": torch.rand(BATCH, SRC, generator=g),
    }


# how input_fn gives the example call, and how each step then calls the parallel module (positional
# tensors, keyword tensors); ``mask`` and ``scale`` say what stands for attention_mask and scale
FORMS = {
    # a dict of keywords with None and a float; steps call with keywords, then positionally
    "kwargs": dict(
        input_fn=lambda b: {**_tensors(b, "input_ids", "decoder_input_ids"), "attention_mask": None, "scale": 2.0},
        calls=[
            lambda b: ((), {**_tensors(b, "input_ids", "decoder_input_ids"), "attention_mask": None, "scale": 2.0}),
            lambda b: (_tensors(b, "input_ids", "decoder_input_ids").values(), {"scale": 2.0}),
        ],
        mask=None,
        scale=2.0,
    ),
    # positional, with None and a float in between
    "positional": dict(
        input_fn=lambda b: (b["input_ids"], b["decoder_input_ids"], None, 0.5),
        calls=[lambda b: ((b["input_ids"], b["decoder_input_ids"], None, 0.5), {})],
        mask=None,
        scale=0.5,
    ),
    # an (args, kwargs) pair whose keywords hold a tensor (a third graph input) and a float
    "pair": dict(
        input_fn=lambda b: (
            (b["input_ids"], b["decoder_input_ids"]),
            {"attention_mask": b["attention_mask"], "scale": 3.0},
        ),
        calls=[
            lambda b: ((b["input_ids"],), {**_tensors(b, "decoder_input_ids", "attention_mask"), "scale": 3.0}),
            lambda b: ((b["input_ids"], b["decoder_input_ids"], b["attention_mask"], 3.0), {}),
        ],
        mask="attention_mask",
        scale=3.0,
    ),
}


def _tensors(b: dict, *names: str) -> dict:
    return {n: b[n] for n in names}


def _reference(form: dict, steps: int) -> tuple[dict, list[float], dict]:
    torch.manual_seed(0)
    model = EncDec()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, grads = [], {}
    for step in range(steps):
        b = _batch(step)
        mask = b["attention_mask"] if form["mask"] else None
        loss = model(b["input_ids"], b["decoder_input_ids"], attention_mask=mask, scale=form["scale"]).mean()
        loss.backward()
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        losses.append(float(loss.detach()))
        opt.step()
        opt.zero_grad()
    return initial, losses, grads


def _plan(form: dict, placements: dict, memory: bool = True):
    with torch.device("meta"):
        model = EncDec()
    mesh = fake_mesh((2, 4), ("dp", "tp"))
    with AutoParallel(model, mesh, input_fn=lambda: form["input_fn"](_batch(0))) as ap:
        ap.add_input_constraints(placements)
        ap.add_output_constraints([IO])
        if memory:
            ap.add_memory_constraint(param_fraction=1 / 8)
        plan = ap.optimize_placement()
        pmod = ap.apply_placement(plan)
    return mesh, ap, plan, pmod


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n == "pair" else n for n in FORMS]
)  # ~10 s each: the pair form with the slow tests
def test_encdec_trains_like_one_device(name):
    """Input constraints by keyword (each input gets the placement asked), then AdamW steps under
    LocalTensorMode calling the parallel module as the form says: single-device loss every step and
    every first-step parameter gradient."""
    form = FORMS[name]
    asked = {"input_ids": IO, "decoder_input_ids": (S0, S0)}
    if form["mask"]:
        asked["attention_mask"] = IO
    mesh, ap, plan, pmod = _plan(form, asked)
    inputs = ap.traced.placeholder_for("input")
    assert len(inputs) == len(asked)  # None and the float are no graph inputs
    names = [n for n, _ in ap.traced.inputs.tensors]
    for i, node in inputs.items():
        assert plan.nodes[node.name].outputs[0] == asked[names[i]], names[i]
    steps = len(form["calls"])
    initial, ref_losses, ref_grads = _reference(form, steps)
    batches = [_batch(step) for step in range(steps)]  # outside the simulation, whose random ops draw per rank
    opt_losses = []
    with LocalTensorMode(RANKS):
        pmod.to_empty(device="cpu")
        pmod.load_state_dict(initial)
        opt = torch.optim.AdamW(pmod.parameters(), lr=1e-2)
        for step, call in enumerate(form["calls"]):
            b = batches[step]
            local = {k: distribute_tensor(b[k], mesh, asked.get(k, IO)).to_local() for k in b}
            args, kwargs = call(local)
            out = pmod(*args, **kwargs)
            loss = DTensor.from_local(out, mesh, IO, run_check=False).mean()
            loss.backward()
            if step == 0:
                bad = [
                    n for n, p in pmod.named_parameters() if not close(one_value(p.grad.full_tensor()), ref_grads[n])
                ]
                assert not bad, bad
            opt_losses.append(float(one_value(loss.full_tensor())))
            opt.step()
            opt.zero_grad()
    assert opt_losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)


@pytest.fixture(scope="module")
def kw_planned():
    """EncDec traced with keywords, None and a float; inputs constrained by keyword, no memory cap."""
    return _plan(FORMS["kwargs"], {"input_ids": IO, "decoder_input_ids": IO}, memory=False)


def _local_kwargs(dtype=torch.int64) -> dict:
    return {
        "input_ids": torch.zeros(BATCH // 2, SRC, dtype=dtype),
        "decoder_input_ids": torch.zeros(BATCH // 2, TGT, dtype=torch.int64),
    }


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda kw: ((), {**kw, "scale": 3.0}), r"argument 'scale' is 3\.0, but the plan was traced with 2\.0"),
        (lambda kw: ((), {**kw, "scale": 2}), r"argument 'scale' is 2, but the plan was traced with 2\.0"),
        (lambda kw: ((), kw), r"argument 'scale' is 1\.0, but the plan was traced with 2\.0"),  # forward's default
        (
            lambda kw: ((), {**kw, "attention_mask": torch.ones(BATCH // 2, SRC), "scale": 2.0}),
            r"argument 'attention_mask' is a tensor \(float32\[4, 12\]\), but the plan was traced with None there",
        ),
        (
            lambda kw: ((kw["input_ids"],), {"scale": 2.0}),
            r"argument 'decoder_input_ids' is missing: the plan was traced with a tensor \(int64\[8, 10\]\)",
        ),
        (
            lambda kw: ((), {**kw, "decoder_input_ids": None, "scale": 2.0}),
            r"argument 'decoder_input_ids' is None, but the plan was traced with a tensor \(int64\[8, 10\]\)",
        ),
        (lambda kw: ((), {**kw, "scale": 2.0, "labels": None}), r"argument 'labels' \(None\) is not in the call"),
        (
            lambda kw: ((kw["input_ids"],), {**kw, "scale": 2.0}),
            r"argument 'input_ids' is given twice",
        ),
    ],
    ids=["other-float", "int-for-float", "default", "tensor-for-None", "missing", "None-for-tensor", "extra", "twice"],
)
def test_call_other_than_traced_names_the_argument(kw_planned, call, match):
    _, _, _, pmod = kw_planned
    args, kwargs = call(_local_kwargs())
    with pytest.raises(InputMismatchError, match=match):
        pmod(*args, **kwargs)


def test_dtype_mismatch_names_input_and_dtypes(kw_planned):
    _, _, _, pmod = kw_planned
    with pytest.raises(
        InputMismatchError, match=r"argument 'input_ids'\) has dtype int32, but the plan was traced with int64"
    ):
        pmod(**_local_kwargs(torch.int32), scale=2.0)
    with pytest.raises(ValueError, match=r"input 1 has shape \(8, 10\).*shard of shape \(4, 10\).*'decoder_input_ids'"):
        pmod(**{**_local_kwargs(), "decoder_input_ids": torch.zeros(BATCH, TGT, dtype=torch.int64)}, scale=2.0)


def test_input_constraints_by_name_or_position(kw_planned):
    _, ap, _, _ = kw_planned
    tg = ap.traced
    assert tg.inputs.names == ["input_ids", "decoder_input_ids", "attention_mask", "scale"]
    with pytest.raises(ConstraintError, match=r"'input_idz'.*no such input.*input_ids.*decoder_input_ids"):
        ap.add_input_constraints({"input_idz": IO})
    with pytest.raises(ConstraintError, match=r"input 'scale' \(scale\) is 2\.0, a constant.*no placement"):
        ap.add_input_constraints({"scale": IO})
    with pytest.raises(ConstraintError, match=r"input 2 \(attention_mask\) is None, a constant"):
        ap.add_input_constraints([IO, IO, IO])
    with pytest.raises(ConstraintError, match=r"5 input constraints given, but the model has 4 inputs"):
        ap.add_input_constraints([None] * 5)
    with pytest.raises(ConstraintError, match=r"input 'input_ids': Shard\(2\)"):
        ap.add_input_constraints({"input_ids": (Shard(2), R)})
    ap.add_input_constraints({1: (S0, S0)})  # by position, in input_fn's order
    ap.add_input_constraints([None, None, None, None])  # a list: None leaves an input as it was
    plan = ap.optimize_placement()
    dec = tg.placeholder_for("input")[1]
    assert plan.nodes[dec.name].outputs[0] == (S0, S0)
    ap.add_input_constraints({"decoder_input_ids": IO})


@pytest.mark.parametrize(
    "value, expected",
    [
        ("t", (("t",), {})),
        (("a", "b"), (("a", "b"), {})),
        (["a", "b"], (("a", "b"), {})),
        ({"x": "a"}, ((), {"x": "a"})),
        ((("a",), {"x": "b"}), (("a",), {"x": "b"})),  # the pair
        ((["a", "b"], {}), (("a", "b"), {})),
        (("a", {"x": "b"}), (("a", {"x": "b"}), {})),  # a first item that is no tuple/list: two positionals
        ((("a",), {"x": "b"}, "c"), ((("a",), {"x": "b"}, "c"), {})),  # three items: positionals
        (((("a",), {"x": "b"}),), (((("a",), {"x": "b"}),), {})),  # the pair itself as one positional
    ],
)
def test_split_call_rule(value, expected):
    assert split_call(value) == expected


def test_trace_names_inputs_and_bakes_constants():
    """Positional, keyword and the pair give the same graph; constants are not placeholders, and a
    nested argument's tensors are named by their path."""
    ids, dec = torch.randint(0, VOCAB, (BATCH, SRC)), torch.randint(0, VOCAB, (BATCH, TGT))
    graphs = []
    for fn in (
        lambda: (ids, dec, None, 2.0),
        lambda: {"decoder_input_ids": dec, "input_ids": ids, "scale": 2.0},
        lambda: ((ids,), {"decoder_input_ids": dec, "scale": 2.0}),
    ):
        tg = trace_joint(EncDec(), fn)
        assert [n for n, _ in tg.inputs.tensors] in (
            ["input_ids", "decoder_input_ids"],
            ["decoder_input_ids", "input_ids"],
        )
        assert len(tg.placeholder_for("input")) == 2
        graphs.append(sorted(str(n.target) for n in tg.gm.graph.nodes if n.op == "call_function"))
    assert graphs[0] == graphs[1] == graphs[2]

    class Nested(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, batch, *extra, flag=False):
            out = self.lin(batch["x"]) + batch["y"][1]
            return out + extra[0] if flag else out

    x = torch.randn(2, 4)
    tg = trace_joint(Nested(), lambda: (({"x": x, "y": [None, x]}, x), {"flag": True}))
    assert [n for n, _ in tg.inputs.tensors] == ["batch['x']", "batch['y'][1]", "extra[0]"]
    assert tg.inputs.expected["flag"] is True


def test_input_fn_leaf_that_is_no_tensor_or_number():
    with pytest.raises(ConstraintError, match=r"input_fn returned a str for argument 'scale'"):
        trace_joint(EncDec(), lambda: {"input_ids": torch.zeros(2, 3, dtype=torch.long), "scale": "big"})
    with pytest.raises(ConstraintError, match=r"a dict holds forward's keyword arguments"):
        trace_joint(EncDec(), lambda: {0: torch.zeros(2, 3, dtype=torch.long)})
    with pytest.raises(ConstraintError, match=r"passes argument 'input_ids' twice"):
        trace_joint(EncDec(), lambda: ((torch.zeros(2, 3, dtype=torch.long),), {"input_ids": None}))


def test_functionalized_trace_takes_keywords():
    """A model that writes in place is traced again through the functionalizing export: it too sees
    only the call's tensors, the keyword tensor among them, and the constant baked in."""

    class InPlace(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x, mask=None, scale=1.0):
            h = self.lin(x).relu_() * scale
            return h if mask is None else h * mask

    x, mask = torch.randn(8, 4), torch.ones(8, 4)
    tg = trace_joint(InPlace(), lambda: ((x,), {"mask": mask, "scale": 3.0}))
    assert tg.joint is not None  # the functionalized path
    assert [n for n, _ in tg.inputs.tensors] == ["x", "mask"]
    assert [lab for lab in tg.input_labels if lab[0] == "input"] == [("input", 0), ("input", 1)]
    assert any(3.0 in n.args for n in tg.gm.graph.nodes if n.op == "call_function")


def test_the_parallel_module_returns_what_forward_returns():
    """``forward`` returning a structure (a dict holding a tuple, ``None`` and a number, as Hugging
    Face's ``ModelOutput`` holds logits beside ``None`` fields): the parallel module returns the
    same structure, its tensors the rank's local outputs, its other values as traced."""

    class Structured(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            h = self.lin(x)
            return {"out": (h, h.sum(-1)), "loss": None, "layers": 1}

    mesh = fake_mesh((2, 4))
    with torch.device("meta"):
        model = Structured()
    with AutoParallel(model, mesh, lambda: torch.randn(8, 4)) as ap:
        ap.add_input_constraints([IO])
        ap.add_output_constraints([IO, IO])
        pmod = ap.apply_placement(ap.optimize_placement())
    with LocalTensorMode(RANKS):
        pmod.to_empty(device="cpu")
        got = pmod(distribute_tensor(torch.randn(8, 4), mesh, IO).to_local())
    assert set(got) == {"out", "loss", "layers"} and got["loss"] is None and got["layers"] == 1
    h, total = got["out"]
    assert tuple(h.shape) == (4, 4) and tuple(total.shape) == (4,)  # the batch split over dp's 2 ranks
