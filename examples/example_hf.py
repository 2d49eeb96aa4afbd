"""Plan Hugging Face causal LMs as users call them, from tiny configs (nothing is downloaded).

    pip install -e '.[hf]' && python examples/example_hf.py [--families llama,gpt2] [--meshes 8,2x4]

Each family's model is built on the meta device from a small config and planned on each mesh with
batch-split inputs and outputs and parameters split over every rank; the table says which plan and,
for those that do not, the error autoplan raised.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import warnings

import torch
from torch.distributed.tensor import Replicate, Shard

from autoplan import AutoParallel
from autoplan.workloads import fake_mesh, parse_mesh

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
}


def tiny_config(family: str):
    from transformers import AutoConfig

    return AutoConfig.for_model(family, **{k: v for k, v in FAMILIES[family].items() if v is not None})


def tiny_model(family: str) -> torch.nn.Module:
    """The family's tiny model on the meta device (planning needs no memory)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(tiny_config(family))


def plan_family(family: str, shape: tuple[int, ...]) -> tuple[bool, str]:
    """(planned?, the estimated step or the error's first line)."""
    try:
        model = tiny_model(family)
        io = (Shard(0),) + (Replicate(),) * (len(shape) - 1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # replicated fallbacks: the table is about what plans
            with AutoParallel(model, fake_mesh(shape), lambda: torch.randint(0, VOCAB, (BATCH, SEQ))) as ap:
                ap.add_input_constraints([io])
                ap.add_output_constraints([io])
                ap.add_memory_constraint(param_fraction=1 / math.prod(shape))
                plan = ap.optimize_placement()
        return True, f"{plan.cost.total * 1e3:.3f} ms"
    except Exception as e:  # noqa: BLE001 - the table reports every failure by its type and message
        return False, f"{type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default=",".join(FAMILIES), help="comma-separated model types")
    parser.add_argument("--meshes", default="8,2x4", help="comma-separated mesh shapes")
    args = parser.parse_args(argv)
    families = args.families.split(",")
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        raise SystemExit(f"unknown families {unknown}; choose from {', '.join(FAMILIES)}")
    meshes = [parse_mesh(m) for m in args.meshes.split(",")]
    fake_mesh((math.prod(max(meshes, key=math.prod)),))  # the fake world, sized for the largest mesh
    rows, failures = [], 0
    for family in families:
        for shape in meshes:
            t0 = time.perf_counter()
            ok, what = plan_family(family, shape)
            failures += not ok
            rows.append((family, "x".join(map(str, shape)), "pass" if ok else "FAIL", time.perf_counter() - t0, what))
            print(f"{rows[-1][0]:<11} {rows[-1][1]:<5} {rows[-1][2]:<4} {rows[-1][3]:6.1f}s  {what}", flush=True)
    print(f"\n{len(rows) - failures} of {len(rows)} plans made")
    return 0


if __name__ == "__main__":
    sys.exit(main())
