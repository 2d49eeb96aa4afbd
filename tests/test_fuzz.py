"""Random small MLPs and transformer blocks on random meshes (bounded, derandomized examples): each
either plans and runs one step to single-device numerics on simulated ranks, or raises one of
autoplan's named errors (an uneven batch split asked for, a mesh dim that splits nothing)."""

import math

import pytest
import torch
from conftest import fake_mesh
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from models import Block
from torch import nn
from torch.distributed._local_tensor import LocalTensor, LocalTensorMode
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.experimental import implicit_replication

from autoplan import AutoParallel, AutoplanError
from autoplan.bench.models.llama3 import LlamaConfig

MESHES = [(2,), (4,), (2, 2), (2, 4)]
FUZZ = settings(max_examples=6, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))


def _plain(t: torch.Tensor, ranks: int) -> torch.Tensor:
    """A replicated value as one tensor, after checking every simulated rank holds it."""
    if not isinstance(t, LocalTensor):
        return t
    values = [t._local_tensors[r] for r in range(ranks)]
    for v in values[1:]:
        torch.testing.assert_close(v, values[0], rtol=1e-6, atol=1e-7)
    return values[0]


def _check(build, x: torch.Tensor, shape: tuple[int, ...], shard_batch: bool) -> str:
    """Plan ``build()`` on a mesh of ``shape`` and run one step; returns "ran" or the error's class."""
    torch.manual_seed(0)
    real = build()
    with torch.device("meta"):
        meta = build()
    mesh = fake_mesh(shape)
    io = ((Shard(0),) if shard_batch else (Replicate(),)) + (Replicate(),) * (len(shape) - 1)
    try:
        with AutoParallel(meta, mesh, input_fn=lambda: x) as ap:
            ap.add_input_constraints([io])
            ap.add_output_constraints([io])
            pmod = ap.apply_placement(ap.optimize_placement())
    except AutoplanError as e:
        assert str(e).strip()
        return type(e).__name__
    loss = real(x).mean()
    loss.backward()
    ranks = math.prod(shape)
    with LocalTensorMode(ranks):
        pmod.to_empty(device="cpu")
        pmod.load_state_dict(real.state_dict())
        with implicit_replication():  # buffers outside the state dict (RoPE tables) come from the real model
            for name, b in real.named_buffers():
                if name not in real.state_dict():
                    pmod.get_buffer(name).copy_(b)
        out = pmod(distribute_tensor(x, mesh, io).to_local())
        got = DTensor.from_local(out, mesh, io, run_check=False).mean()
        got.backward()
        torch.testing.assert_close(_plain(got.full_tensor(), ranks), loss.detach(), rtol=1e-5, atol=1e-6)
        for name, p in pmod.named_parameters():
            want = real.get_parameter(name).grad
            torch.testing.assert_close(_plain(p.grad.full_tensor(), ranks), want, rtol=1e-5, atol=1e-6)
    return "ran"


@FUZZ
@given(
    widths=st.lists(st.sampled_from([4, 6, 8, 12, 16]), min_size=2, max_size=4),
    batch=st.sampled_from([2, 3, 4, 6, 8]),
    shape=st.sampled_from(MESHES),
    shard_batch=st.booleans(),
)
def test_random_mlps(widths, batch, shape, shard_batch):
    def build():
        layers = [m for a, b in zip(widths, widths[1:]) for m in (nn.Linear(a, b), nn.Tanh())]
        return nn.Sequential(*layers[:-1])

    x = torch.randn(batch, widths[0], generator=torch.Generator().manual_seed(1))
    _check(build, x, shape, shard_batch)


@pytest.mark.slow  # ~40 s: the random transformer blocks (MLPs stay in the default run)
@FUZZ
@given(
    heads=st.sampled_from([(2, 1), (2, 2), (4, 2)]),
    head_dim=st.sampled_from([4, 8]),
    batch=st.sampled_from([2, 4]),
    seq=st.sampled_from([4, 8]),
    shape=st.sampled_from(MESHES),
)
def test_random_transformer_blocks(heads, head_dim, batch, seq, shape):
    n_heads, n_kv = heads
    dim = n_heads * head_dim
    cfg = LlamaConfig(dim, 1, n_heads, n_kv, vocab_size=16, ffn_dim=2 * dim, max_seq_len=seq)
    x = torch.randn(batch, seq, dim, generator=torch.Generator().manual_seed(1))
    _check(lambda: Block(cfg), x, shape, shard_batch=True)
