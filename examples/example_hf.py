"""Plan Hugging Face models as users call them, from tiny configs (nothing is downloaded).

    pip install -e '.[hf]' && python examples/example_hf.py [--families llama,gpt2] [--meshes 8,2x4]

Each family's model is built on the meta device from a small config and planned on each mesh with
batch-split inputs and outputs and parameters split over every rank; the table says which plan and,
for those that do not, the error autoplan raised. The families are causal LMs (``model(input_ids)``)
and, beyond them, encoders, encoder-decoders called with keywords, vision and speech models
(``BEYOND``).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import math
import sys
import time
import warnings
from dataclasses import dataclass

import torch
from torch.distributed.tensor import Replicate, Shard

from autoplan import AutoParallel, any_dtype_grouped_mm
from autoplan.bench.workloads import fake_mesh, parse_mesh

VOCAB, BATCH, SEQ = 256, 8, 16
_DECODER = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
# model_type -> tiny config arguments (each family names its sizes its own way)
FAMILIES = {
    "gpt2": dict(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64),
    "llama": _DECODER,
    "mistral": _DECODER,
    "qwen2": _DECODER,
    "qwen3": _DECODER | dict(head_dim=16),
    "gemma": _DECODER | dict(head_dim=16),
    "gemma2": _DECODER | dict(head_dim=16),
    "phi3": _DECODER | dict(pad_token_id=0),
    "olmo": _DECODER,
    "stablelm": _DECODER,
    "starcoder2": _DECODER,
    "gpt_neox": dict(_DECODER, num_key_value_heads=None),
    "opt": dict(
        vocab_size=VOCAB,
        hidden_size=64,
        ffn_dim=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
        word_embed_proj_dim=64,
    ),
    "falcon": dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4),
    "bloom": dict(vocab_size=VOCAB, hidden_size=64, n_layer=2, n_head=4),
    "gptj": dict(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, rotary_dim=8, n_positions=64),
    "mixtral": _DECODER | dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen3_moe": _DECODER | dict(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
    "deepseek_v3": _DECODER  # MLA attention (a narrower value head), a shared expert, a dense first layer
    | dict(
        num_key_value_heads=4,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        n_shared_experts=1,
        first_k_dense_replace=1,
        kv_lora_rank=16,
        q_lora_rank=32,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
        n_group=1,
        topk_group=1,
    ),
    "gpt_oss": _DECODER | dict(head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8),
}
MOE = ("mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss")

_ENCODER = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
_SEQ2SEQ = dict(encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4)
_SEQ2SEQ |= dict(vocab_size=VOCAB, d_model=64, encoder_ffn_dim=128, decoder_ffn_dim=128)
_IMAGE = (3, 32, 32)  # an image's channels, height and width
# beyond causal LMs: model type -> (its transformers Auto class, tiny config arguments, the call's
# inputs by keyword: "tokens" for token ids of (BATCH, SEQ), else a float tensor's per-sample shape)
BEYOND: dict[str, tuple[str, dict, dict]] = {
    "bert": ("AutoModelForMaskedLM", _ENCODER | dict(max_position_embeddings=64), {"input_ids": "tokens"}),
    "roberta": (
        "AutoModelForSequenceClassification",
        _ENCODER | dict(max_position_embeddings=64, num_labels=3),
        {"input_ids": "tokens"},
    ),
    "t5": (
        "AutoModelForSeq2SeqLM",
        dict(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, decoder_start_token_id=0),
        {"input_ids": "tokens", "decoder_input_ids": "tokens"},
    ),
    "bart": (
        "AutoModelForSeq2SeqLM",
        _SEQ2SEQ | dict(max_position_embeddings=64),
        {"input_ids": "tokens", "decoder_input_ids": "tokens"},
    ),
    "whisper": (  # a frozen parameter (the encoder's positions)
        "AutoModelForSpeechSeq2Seq",
        _SEQ2SEQ
        | dict(num_mel_bins=16, max_source_positions=16, max_target_positions=32)
        | dict(pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1),
        {"input_features": (16, 32), "decoder_input_ids": "tokens"},
    ),
    "vit": (
        "AutoModelForImageClassification",
        dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, image_size=32)
        | dict(patch_size=8, num_labels=10),
        {"pixel_values": _IMAGE},
    ),
    "convnext": (
        "AutoModelForImageClassification",
        dict(hidden_sizes=[16, 32], depths=[1, 1], num_stages=2, num_labels=10),
        {"pixel_values": _IMAGE},
    ),
    "resnet": (  # BatchNorm in training mode
        "AutoModelForImageClassification",
        dict(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], num_labels=10),
        {"pixel_values": _IMAGE},
    ),
}
ALL = (*FAMILIES, *BEYOND)

# how a family's model is built, where not by its defaults (Mixtral's default experts kernel, the
# grouped matmul, traces in fp32 through autoplan's; its "eager" one routes tokens with nonzero)
MODEL_OPTIONS: dict[str, dict] = {}


def tiny_config(family: str):
    from transformers import AutoConfig

    sizes = FAMILIES[family] if family in FAMILIES else BEYOND[family][1]
    return AutoConfig.for_model(family, **{k: v for k, v in sizes.items() if v is not None})


def example_call(family: str, generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
    """The family's inputs for one call, by keyword: token ids, or images and spectrograms."""
    kinds = BEYOND[family][2] if family in BEYOND else {"input_ids": "tokens"}
    return {
        name: torch.randint(3, VOCAB, (BATCH, SEQ), generator=generator)
        if kind == "tokens"
        else torch.randn(BATCH, *kind, generator=generator)
        for name, kind in kinds.items()
    }


def _without_dropout(cfg):
    """The config with every dropout probability zero: a parallel step draws other random numbers."""
    for key, value in vars(cfg).items():
        if isinstance(value, float) and ("dropout" in key or key.endswith("pdrop")):
            setattr(cfg, key, 0.0)
    return cfg


def tiny_model(family: str, dropout: bool = True, device: str = "meta") -> torch.nn.Module:
    """The family's tiny model, by default on the meta device (planning needs no memory)."""
    import transformers

    cfg = tiny_config(family) if dropout else _without_dropout(tiny_config(family))
    auto = getattr(transformers, BEYOND[family][0] if family in BEYOND else "AutoModelForCausalLM")
    with torch.device(device):
        return auto.from_config(cfg, **MODEL_OPTIONS.get(family, {}))


def plan_family(family: str, shape: tuple[int, ...]) -> tuple[bool, str]:
    """(planned?, the estimated step or the error's first line)."""
    try:
        model, call = tiny_model(family), example_call(family)
        io = (Shard(0),) + (Replicate(),) * (len(shape) - 1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # replicated fallbacks: the table is about what plans
            with AutoParallel(model, fake_mesh(shape), lambda: call) as ap:
                ap.add_input_constraints(dict.fromkeys(call, io))
                ap.add_output_constraints([io])
                ap.add_memory_constraint(param_fraction=1 / math.prod(shape))
                plan = ap.optimize_placement()
        return True, f"{plan.cost.total * 1e3:.3f} ms"
    except Exception as e:  # noqa: BLE001 - the table reports every failure by its type and message
        return False, f"{type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}"


@dataclass
class Numerics:
    worst: float  # worst relative error over the loss and every parameter gradient
    bad: list[str]  # what is not fp32-close (allclose with rtol=1e-5, atol=1e-6)
    sharded: int  # parameters the plan shards (a plan that shards nothing would match trivially)
    plan: object  # the plan that ran


def numerics(
    family: str,
    shape: tuple[int, ...] = (2, 2),
    pins=None,
    mp_policy=None,
    tolerance=1e-5,
    compiled=False,
    mesh=None,
) -> Numerics:
    """One training step of the family's plan on ``shape`` under ``LocalTensorMode`` (every rank in this
    process, real collectives between them), or on ``mesh``, a real one (this process one of its
    ranks), against the same model on one device.

    Loss = mean of the squared logits; dropout is off in both (they would draw different numbers).
    ``pins``: a function of the traced graph giving (target, placements) node constraints. With a
    mixed-precision ``mp_policy`` (``AutoParallel(mp_policy=...)``), one device runs a copy of the
    model with its parameters in ``param_dtype``, its logits cast to ``output_dtype``, and its
    gradients cast back to the fp32 parameters'. ``tolerance``: elementwise ``rtol`` (and ``atol``
    a tenth of it) a gradient must meet. ``compiled``: the parallel module's regions run through Inductor.
    """
    from torch.distributed.tensor import DTensor, distribute_tensor

    from autoplan.adapters.local_tensor import rank_value, simulated_world

    torch.manual_seed(0)
    ref = tiny_model(family, dropout=False, device="cpu")
    call = example_call(family, torch.Generator().manual_seed(1))
    work = ref
    if mp_policy is not None:
        work = copy.deepcopy(ref)
        for p in work.parameters():
            p.data = p.data.to(mp_policy.param_dtype)
    with any_dtype_grouped_mm():  # an fp32 MoE's experts on CPU (ATen's grouped matmul takes bfloat16 only)
        logits = work(**call).logits
        out_dtype = None if mp_policy is None else mp_policy.output_dtype
        ref_loss = (logits if out_dtype is None else logits.to(out_dtype)).pow(2).mean()
    ref_loss.backward()
    for p, w in zip(ref.parameters(), work.parameters()):
        if w is not p and w.grad is not None:
            p.grad = w.grad.to(p.dtype)

    world = contextlib.nullcontext() if mesh is not None else simulated_world(math.prod(shape))
    mesh = mesh if mesh is not None else fake_mesh(shape)
    shape = tuple(mesh.shape)
    io = (Shard(0),) + (Replicate(),) * (len(shape) - 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = tiny_model(family, dropout=False)
        with AutoParallel(model, mesh, lambda: example_call(family), mp_policy=mp_policy) as ap:
            ap.add_input_constraints(dict.fromkeys(call, io))
            ap.add_output_constraints([io])  # output 0: the logits
            ap.add_memory_constraint(param_fraction=1 / math.prod(shape))
            for target, placements in pins(ap.traced) if pins else ():
                ap.add_node_constraint(target, placements)
            plan = ap.optimize_placement()
            pmod = ap.apply_placement(plan, compile=compiled)
    with world:
        pmod.to_empty(device="cpu")
        for name, b in pmod.named_buffers():  # RoPE tables and the like, which no state dict carries
            (b.to_local() if isinstance(b, DTensor) else b).copy_(ref.get_buffer(name))
        pmod.load_state_dict(ref.state_dict())
        out = pmod(**{name: distribute_tensor(t, mesh, io).to_local() for name, t in call.items()})
        logits = out.logits  # the parallel module returns what the model returns
        loss = DTensor.from_local(logits, mesh, io, run_check=False).pow(2).mean()
        loss.backward()
        errors = {"loss": (rank_value(loss.full_tensor()), ref_loss.detach())}
        for name, p in pmod.named_parameters():
            if p.requires_grad:
                errors[name] = (rank_value(p.grad.full_tensor()), ref.get_parameter(name).grad)
    worst, bad = 0.0, []
    for name, (got, want) in errors.items():
        # relative to the tensor's norm, or to atol where it is ~0 (a key bias' gradient is round-off)
        floor = tolerance / 10 * want.numel() ** 0.5
        worst = max(worst, float((got - want).norm() / want.norm().clamp_min(floor)))
        if not torch.allclose(got.to(want.dtype), want, rtol=tolerance, atol=tolerance / 10):
            bad.append(name)
    sharded = sum(any(isinstance(p, Shard) for p in pl) for pl in plan.param_placements.values())
    return Numerics(worst, bad, sharded, plan)


def _print_numerics(family: str) -> bool:
    t0 = time.perf_counter()
    try:
        r = numerics(family)
    except Exception as e:  # noqa: BLE001 - reported in the table like a planning failure
        ok, what = False, f"{type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}"
    else:
        ok = not r.bad and r.sharded > 0
        what = f"worst relative error {r.worst:.2e}, {r.sharded} parameters sharded"
        what += f"; differ: {r.bad}" if r.bad else ""
    print(f"{family:<11} {'2x2':<5} {'ok' if ok else 'FAIL':<4} {time.perf_counter() - t0:6.1f}s  numerics: {what}")
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default=",".join(ALL), help="comma-separated model types")
    parser.add_argument("--meshes", default="8,2x4", help="comma-separated mesh shapes")
    parser.add_argument(
        "--numerics",
        action="store_true",
        help="also train one step of each family planned on 2x2 under LocalTensorMode against one device",
    )
    args = parser.parse_args(argv)
    families = args.families.split(",")
    unknown = [f for f in families if f not in ALL]
    if unknown:
        raise SystemExit(f"unknown families {unknown}; choose from {', '.join(ALL)}")
    meshes = [parse_mesh(m) for m in args.meshes.split(",")]
    fake_mesh((math.prod(max(meshes, key=math.prod)),))  # the fake world, sized for the largest mesh
    rows, failures, matched = [], 0, 0
    for family in families:
        for shape in meshes:
            t0 = time.perf_counter()
            ok, what = plan_family(family, shape)
            failures += not ok
            rows.append((family, "x".join(map(str, shape)), "pass" if ok else "FAIL", time.perf_counter() - t0, what))
            print(f"{rows[-1][0]:<11} {rows[-1][1]:<5} {rows[-1][2]:<4} {rows[-1][3]:6.1f}s  {what}", flush=True)
        if args.numerics:
            matched += _print_numerics(family)
    print(f"\n{len(rows) - failures} of {len(rows)} plans made")
    if args.numerics:
        print(f"{matched} of {len(families)} families match single-device on 2x2")
    return 0


if __name__ == "__main__":
    sys.exit(main())
