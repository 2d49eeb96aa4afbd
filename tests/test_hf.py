"""Hugging Face causal LMs as users call them: ``model(input_ids)`` returns a ``ModelOutput`` holding
a KV cache. A tiny config (nothing downloaded) plans on a 2x4 mesh and trains one step under
``LocalTensorMode`` with the single-device loss and gradients."""

import importlib.util
import re
from pathlib import Path

import pytest
import torch
from conftest import fake_mesh
from parallel_run import close
from torch.distributed._local_tensor import LocalTensor, LocalTensorMode
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from autoplan import AutoParallel

transformers = pytest.importorskip("transformers")
EXAMPLE = Path(__file__).resolve().parents[1] / "examples/example_hf.py"
_spec = importlib.util.spec_from_file_location("example_hf", EXAMPLE)
example_hf = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(example_hf)

IO = (Shard(0), Replicate())


def _plain(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensors[0] if isinstance(t, LocalTensor) else t


def test_tiny_llama_matches_single_device():
    cfg = example_hf.tiny_config("llama")  # 2 layers, grouped-query attention
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (8, 16))
    out = ref(tokens)
    assert out.past_key_values is not None  # the usual call really returns a cache object
    ref_loss = out.logits.pow(2).mean()
    ref_loss.backward()

    model = example_hf.tiny_model("llama")
    mesh = fake_mesh((2, 4), ("dp", "tp"))
    with AutoParallel(model, mesh, input_fn=lambda: torch.randint(0, cfg.vocab_size, (8, 16))) as ap:
        ap.add_input_constraints([IO])
        ap.add_output_constraints([IO])  # output 0: the logits (the cache needs no placement)
        ap.add_memory_constraint(param_fraction=1 / 8)
        plan = ap.optimize_placement()
        pmod = ap.apply_placement(plan)
    assert any(isinstance(p, Shard) for pl in plan.param_placements.values() for p in pl)
    with LocalTensorMode(8):
        pmod.to_empty(device="cpu")
        for name, b in pmod.named_buffers():  # the RoPE tables, which no state dict carries
            (b.to_local() if isinstance(b, DTensor) else b).copy_(ref.get_buffer(name))
        pmod.load_state_dict(ref.state_dict())
        logits = pmod(distribute_tensor(tokens, mesh, IO).to_local())
        loss = DTensor.from_local(logits, mesh, IO, run_check=False).pow(2).mean()
        loss.backward()
        assert float(_plain(loss.full_tensor())) == pytest.approx(float(ref_loss), rel=1e-5)
        grads = {n: _plain(p.grad.full_tensor()) for n, p in pmod.named_parameters()}
    bad = [n for n, g in grads.items() if not close(g, ref.get_parameter(n).grad)]
    assert len(grads) == len(list(ref.parameters())) and not bad, bad


def test_family_table(capsys):
    """``examples/example_hf.py`` prints one row per family and mesh; a family that does not plan gets
    autoplan's error (Falcon's multi-query attention: the module and the way out are named)."""
    fake_mesh((8,))
    assert example_hf.main(["--families", "llama,falcon", "--meshes", "8"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^llama\s+8\s+pass\s.* ms$", out, re.M)
    assert re.search(r"^falcon\s+8\s+FAIL\s.*enable_gqa=True \(module transformer\.h\.0\.self_attention\)", out, re.M)
    assert "1 of 2 plans made" in out
