"""Parameters whose dims do not split evenly over the mesh (``autoplan.shard.uneven``): stored as DTensor's
uneven ``Shard`` (torch.chunk's layout), padded to the largest shard in the per-rank graph, priced on
that largest shard, and trained to single-device numerics on 8 simulated ranks."""

import itertools
import math

import pytest
import torch
from conftest import fake_mesh
from gloo import run_gloo
from models import MLP, ViT
from parallel_run import IO, check_run, graph_report, parallel_run, plan_and_apply, reference_run
from torch.distributed._local_tensor import LocalTensor, LocalTensorMode
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from autoplan import AutoParallel, ConstraintError
from autoplan.adapters.dtensor import redistribute
from autoplan.adapters.local_tensor import mesh_coordinate
from autoplan.errors import InfeasiblePlanError
from autoplan.shard.uneven import pieces

RANKS = 8
R, P, S0, S1 = Replicate(), Partial(), Shard(0), Shard(1)
MESH = (2, 4)


def _largest_shard(shape, placements, mesh_shape=MESH) -> tuple[int, ...]:
    """Rank 0's shard (the largest): each dim's size over the product of the mesh dims splitting
    it, rounded up."""
    ways = [1] * len(shape)
    for n, p in zip(mesh_shape, placements):
        if isinstance(p, Shard):
            ways[p.dim] *= n
    return tuple(-(-s // w) for s, w in zip(shape, ways))


def _uneven(shape, placements, mesh_shape=MESH) -> bool:
    ways = [1] * len(shape)
    for n, p in zip(mesh_shape, placements):
        if isinstance(p, Shard):
            ways[p.dim] *= n
    return any(s % w for s, w in zip(shape, ways))


def _pad(t: torch.Tensor, shape) -> torch.Tensor:
    """Each simulated rank's piece padded with zeros at its end to ``shape``."""
    pad = lambda x: torch.nn.functional.pad(  # noqa: E731
        x, [q for d in reversed(range(x.ndim)) for q in (0, shape[d] - x.shape[d])]
    )
    return LocalTensor({r: pad(x) for r, x in t._local_tensors.items()})


def _on_rank(t: torch.Tensor, rank: int) -> torch.Tensor:
    """A simulated rank's value (a value every rank holds alike may be one plain tensor)."""
    return t._local_tensors[rank] if isinstance(t, LocalTensor) else t


def _per_rank(mesh, placements, full: torch.Tensor) -> DTensor:
    """``full`` placed as ``placements`` (even shards, Replicate, Partial): a Partial mesh dim holds
    different addends per rank, weighted by the rank's position among the partial mesh dims."""
    partial = [i for i, p in enumerate(placements) if isinstance(p, Partial)]
    total = math.prod(MESH[i] for i in partial)
    locals_ = {}
    for rank, coordinate in enumerate(itertools.product(*map(range, MESH))):
        local = full
        for i, p in enumerate(placements):
            if isinstance(p, Shard):
                local = local.chunk(MESH[i], p.dim)[coordinate[i]]
        index = 0
        for i in partial:
            index = index * MESH[i] + coordinate[i]
        weight = (index + 1) / (total * (total + 1) / 2) if partial else 1.0
        locals_[rank] = (local * weight).clone()
    return DTensor.from_local(
        LocalTensor(locals_), mesh, placements, run_check=False, shape=full.shape, stride=full.stride()
    )


@pytest.mark.parametrize("size, mesh_shape", [(10, (2, 4)), (9, (2, 4)), (197, (2, 4)), (3, (8,)), (7, (4, 2))])
def test_pieces_are_dtensors_uneven_shards(size, mesh_shape):
    """Every rank's rows of an uneven ``Shard(0)`` nested over all mesh dims are where
    ``uneven.pieces`` says (the last ranks hold fewer rows, or none)."""
    mesh = fake_mesh(mesh_shape)
    full = torch.arange(float(size))
    with LocalTensorMode(math.prod(mesh_shape)):
        local = distribute_tensor(full, mesh, (S0,) * len(mesh_shape)).to_local()
    found = [local._local_tensors[r] for r in range(math.prod(mesh_shape))]
    expected = [full[offset : offset + rows] for offset, rows in pieces(size, mesh_shape)]
    assert [len(f) for f in found] == [len(e) for e in expected]
    assert all(torch.equal(f, e) for f, e in zip(found, expected))


@pytest.mark.parametrize(
    "shape, src, dst",
    [
        ((10, 6), (S0, S0), (R, R)),  # two gathers, padding in the middle (5 rows padded to 8 per dp rank)
        ((9, 8), (S0, S0), (R, S1)),  # ranks of the second dp row hold one row each
        ((10, 6), (R, S0), (R, R)),  # one level: the padding is a tail
        ((6, 10), (S1, S1), (R, R)),  # a non-leading dim
        ((9, 8), (S0, S1), (R, S1)),  # only the uneven dim is gathered, the even one stays split
        ((6, 10), (S1, S0), (S0, R)),  # an even dim split over the other mesh dim (6 rows over 4 is not)
        ((10, 6), (P, P), (S0, S0)),  # a gradient reduce-scattered into an uneven parameter
        ((10, 6), (R, R), (S0, S0)),  # chunked by the rank's coordinate
        ((8, 10), (P, S0), (S1, S1)),  # an even shard gathered, then reduce-scattered and chunked unevenly
        ((10, 6), (S1, P), (R, S0)),  # an even shard becomes a replica first, then a chunk
    ],
)
def test_uneven_moves_give_dtensors_values_on_every_rank(shape, src, dst):
    """A move from or to an uneven split on padded shards (the per-rank graph's layout) leaves every
    rank what DTensor's own uneven shard holds (padded alike), for the values a plan moves."""
    mesh = fake_mesh(MESH)
    torch.manual_seed(0)
    full = torch.randn(shape)
    with LocalTensorMode(RANKS):
        if _uneven(shape, src):
            local = _pad(distribute_tensor(full, mesh, src).to_local(), _largest_shard(shape, src))
            value = DTensor.from_local(local, mesh, src, run_check=False, shape=full.shape, stride=full.stride())
        else:
            value = _per_rank(mesh, src, full)
        ours = redistribute(value, dst, mesh_coordinate(mesh)).to_local()
        expected = distribute_tensor(full, mesh, dst).to_local()
        if _uneven(shape, dst):
            expected = _pad(expected, _largest_shard(shape, dst))
    for r in range(RANKS):
        mine, theirs = _on_rank(ours, r), _on_rank(expected, r)
        assert mine.shape == theirs.shape, r
        assert torch.allclose(mine, theirs, rtol=1e-6, atol=1e-6), r


def test_vit_meets_the_readme_parameter_budget_with_uneven_shards():
    """ViT's 10-class head (and 197 positions) on 8 ranks: ``param_fraction=1/8`` means what FSDP
    stores (ceil rows per rank), which a plan meets by splitting the head's bias unevenly; the plan's
    parameter bytes are the sum of its largest shards."""
    mesh = fake_mesh(MESH)
    with torch.device("meta"):
        model = ViT()
    shapes = {fqn: tuple(p.shape) for fqn, p in model.named_parameters()}
    with AutoParallel(model, mesh, lambda: torch.randn(8, 3, 56, 56)) as ap:
        ap.add_memory_constraint(param_fraction=1 / 8)
        plan = ap.optimize_placement()
    uneven = {fqn for fqn, pl in plan.param_placements.items() if _uneven(shapes[fqn], pl)}
    assert uneven & {"pos", "head.weight", "head.bias"}, plan.param_placements
    stored = sum(math.prod(_largest_shard(shapes[f], pl)) * 4 for f, pl in plan.param_placements.items())
    assert plan.memory.param_bytes == stored
    # FSDP's bytes on 8 ranks: each parameter split 8 ways on its best dim, ceil rows per rank
    fsdp = sum(min(math.prod(s) // s[d] * -(-s[d] // 8) for d in range(len(s))) * 4 for s in shapes.values() if s)
    assert stored <= fsdp < sum(math.prod(s) for s in shapes.values()) * 4 / 8 + 8 * len(shapes)


def _plan(mesh, pins=(), param_fraction=None, param_bytes=None):
    with torch.device("meta"):
        model = MLP(32, 30, 10)
    with AutoParallel(model, mesh, input_fn=lambda: torch.randn(16, 32)) as ap:
        ap.add_input_constraints([IO])
        ap.add_output_constraints([IO])
        for target, placements in pins:
            ap.add_node_constraint(target, placements)
        if param_fraction is not None or param_bytes is not None:
            ap.add_memory_constraint(param_fraction=param_fraction, param_bytes=param_bytes)
        plan = ap.optimize_placement()
        pmod = ap.apply_placement(plan)
    return ap, plan, pmod


FSDP_ALL = [("fc*.weight", (S0, S0)), ("fc*.bias", (S0, S0))]
MIXED = [("fc1.weight", (R, S0)), ("fc1.bias", (S0, S0)), ("fc2.weight", (S1, S1)), ("fc2.bias", (R, S0))]
HALF_EVEN = [("fc1.weight", (S0, S1)), ("fc2.weight", (S1, S0)), ("fc2.bias", (S0, S0))]


@pytest.mark.parametrize(
    "pins, fraction",
    [(FSDP_ALL, None), (MIXED, None), (HALF_EVEN, None), ([], 1 / 8)],
    ids=["fsdp", "mixed", "half-even", "budget"],
)
def test_uneven_mlp_trains_like_one_device(pins, fraction):
    """An MLP of 30 hidden units and 10 outputs on 8 simulated ranks, its parameters split unevenly
    (FSDP-style over the whole mesh, one mesh dim, a non-leading dim, or left to the ILP under
    the 1/8 budget): three AdamW steps give the single-device losses and gradients, and the lowered
    graph runs exactly the planned collectives."""
    mesh = fake_mesh(MESH, ("dp", "tp"))
    ref = reference_run("uneven_mlp", batch_rows=8)
    ap, plan, pmod = _plan(mesh, pins, fraction)
    shapes = {fqn: tuple(p.shape) for fqn, p in ref.model.named_parameters()}
    assert any(_uneven(shapes[f], pl) for f, pl in plan.param_placements.items()), plan.param_placements
    with LocalTensorMode(RANKS):
        result = parallel_run(mesh, pmod, ref, compiled=False, plain=lambda t: t._local_tensors[0])
        for fqn, p in pmod.named_parameters():  # each rank holds DTensor's own (unpadded) piece
            expected = distribute_tensor(torch.zeros(shapes[fqn]), mesh, p.placements).to_local()
            assert all(p.to_local()._local_tensors[r].shape == expected._local_tensors[r].shape for r in range(8))
    check_run(result | {"ref_losses": ref.losses} | graph_report(ap.applied_plan, ap.lowered))


def test_to_empty_gives_each_rank_its_own_piece():
    """``to_empty`` on 8 simulated ranks: an unevenly split parameter's local storage has each rank's
    own rows (10 rows over 2x4: 2, 2, 1, 0 per dp row), not one rank's shape everywhere."""
    mesh = fake_mesh(MESH, ("dp", "tp"))
    _, plan, pmod = _plan(mesh, FSDP_ALL)
    with LocalTensorMode(RANKS):
        pmod.to_empty(device="cpu")
        rows = [pmod.fc2.bias.to_local()._local_tensors[r].shape[0] for r in range(RANKS)]
    assert plan.param_placements["fc2.bias"] == (S0, S0)
    assert rows == [2, 2, 1, 0, 2, 2, 1, 0]


def test_too_small_parameter_budget_names_the_largest_parameters_and_the_least_budget():
    """``param_bytes`` below what any plan stores: the error lists the largest parameters at their
    smallest shards (largest first) and the least budget, which then plans."""
    mesh = fake_mesh(MESH)
    shapes = {"fc1.weight": (30, 32), "fc1.bias": (30,), "fc2.weight": (10, 30), "fc2.bias": (10,)}
    # each parameter's smallest largest-shard over every Replicate/Shard placement on the mesh
    options = lambda s: [R, *[Shard(d) for d in range(len(s))]]  # noqa: E731
    least = {
        f: min(math.prod(_largest_shard(s, pl)) * 4 for pl in itertools.product(options(s), repeat=2))
        for f, s in shapes.items()
    }
    smallest = sum(least.values())
    with pytest.raises(InfeasiblePlanError) as info:
        _plan(mesh, param_bytes=smallest // 2)
    message = str(info.value)
    assert info.value.smallest_param_bytes == smallest
    assert f"parameter bytes per device <= {smallest // 2}" in message
    assert f"Raise param_bytes to at least {smallest}" in message
    order = sorted(shapes, key=lambda f: (-least[f], f))
    lines = [line.strip() for line in message.splitlines() if line.startswith("  ")]
    assert [line.split()[0] for line in lines] == order
    assert lines[0].startswith(f"fc1.weight (30, 32) float32: {least['fc1.weight']} bytes as ")
    _, plan, _ = _plan(mesh, param_bytes=smallest)
    assert plan.memory.param_bytes == smallest


def test_a_parameter_split_that_shrinks_nothing_is_refused():
    """ViT's class token (1, 1, 32): splitting its size-1 dim over 2 ranks stores as much as keeping
    it whole, so the pin says so; an uneven split that does shrink the shard (the 10-class bias over
    4 ranks) is taken."""
    mesh = fake_mesh(MESH)
    with torch.device("meta"):
        model = ViT()
    with AutoParallel(model, mesh, lambda: torch.randn(8, 3, 56, 56)) as ap:
        with pytest.raises(ConstraintError, match=r"dim 0 of shape \(1, 1, 32\) \(size 1\) split over mesh dims 0"):
            ap.add_node_constraint("cls", (S0, R))
        ap.add_node_constraint("head.bias", (R, S0))


def _gloo_worker(rank: int, configs: list) -> list:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    results = []
    for pins, compiled in configs:
        ref = reference_run("uneven_mlp")
        plan, lowered, pmod = plan_and_apply(mesh, "uneven_mlp", pins)
        run = parallel_run(mesh, pmod, ref, compiled)
        results.append(run | {"ref_losses": ref.losses} | graph_report(plan, lowered))
    return results


@pytest.mark.slow
def test_uneven_mlp_on_gloo():
    """The uneven MLP on a 2x2 gloo mesh (4 processes, each with its own rows of every uneven
    parameter, 30 hidden units over 4 ranks being 8, 7, 8, 7), eager and Inductor-compiled."""
    configs = [(FSDP_ALL, False), (MIXED, False), (FSDP_ALL, True)]
    results = run_gloo(_gloo_worker, 4, configs)
    for rank_results in results:
        assert len(rank_results) == len(configs)
        for r in rank_results:
            check_run(r)
