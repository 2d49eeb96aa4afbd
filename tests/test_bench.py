"""``python -m autoplan.bench overhead``: rank 0's planned program runs for real next to the plain model."""

import json
import math

import pytest
import torch
from conftest import init_fake_world

from autoplan.bench import main
from autoplan.bench.collective_free import collective_free
from autoplan.cost.devices import CPU_GLOO

c10d = torch.ops._c10d_functional


def _graph(dtype: torch.dtype) -> torch.fx.GraphModule:
    """x -> all-gather over 4 ranks -> wait -> all-reduce -> wait, with the shapes lowering records."""
    g = torch.fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = torch.empty(2, 3, dtype=dtype, device="meta")
    gathered = g.call_function(c10d.all_gather_into_tensor.default, (x, 4, "group"))
    waited = g.call_function(c10d.wait_tensor.default, (gathered,))
    reduced = g.call_function(c10d.all_reduce.default, (waited, "sum", "group"))
    out = g.call_function(c10d.wait_tensor.default, (reduced,))
    for n in (gathered, waited, reduced, out):
        n.meta["val"] = torch.empty(8, 3, dtype=dtype, device="meta")
    g.output(out)
    return torch.fx.GraphModule(torch.nn.Module(), g)


def test_collective_free_graph_keeps_shapes_and_runs_no_collective():
    for dtype in (torch.float32, torch.int64):
        gm = _graph(dtype)
        free, replaced = collective_free(gm)
        assert replaced == {"all_gather_into_tensor": 1, "all_reduce": 1, "wait_tensor": 2}
        assert not [n for n in free.graph.nodes if getattr(n.target, "namespace", None) == "_c10d_functional"]
        out = free(torch.ones(2, 3, dtype=dtype))
        assert out.shape == (8, 3) and out.dtype == dtype
        if not dtype.is_floating_point:  # gathered indices stay valid: zeros
            assert bool((out == 0).all())
        # the original graph is untouched
        assert sum(getattr(n.target, "namespace", None) == "_c10d_functional" for n in gm.graph.nodes) == 4


@pytest.mark.slow  # ~50 s under two workers: keeps the README's test command under 10 minutes
def test_overhead_on_llama_debug(tmp_path, capsys):
    init_fake_world()  # never shrink the shared fake world: meshes and groups made earlier must stay valid
    out = tmp_path / "overhead.json"
    argv = ["overhead", "--model", "llama3-debug", "--mesh", "2x4", "--dtype", "float32"]
    assert main([*argv, "--seq", "32", "--batch", "2", "--steps", "2", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert (r["mesh"], r["local_batch"], r["global_batch"], r["seq"], r["layers"]) == ([2, 4], 2, 4, 32, 2)
    assert r["device_profile"] == CPU_GLOO.name  # timed on the CPU, so priced for it
    for name in ("planned", "plain"):
        p = r[name]
        assert len(p["step_s"]["all"]) == 2 and all(t > 0 for t in p["step_s"]["all"])
        assert len(p["step_cpu_s"]["all"]) == 2 and all(t > 0 for t in p["step_cpu_s"]["all"])
        assert p["kernels"] > 0 and p["dispatched_kernels"] > 0
        assert p["ops"]["aten.mm"] > 0  # both really ran the model's matmuls
        assert p["peak_bytes"] > p["resident_bytes"] > 0
    # parameters split 8 ways: the planned rank keeps far less than the plain model
    assert r["planned"]["resident_bytes"] < r["plain"]["resident_bytes"] / 4
    # the plan's collectives ran as free stand-ins, none through the process group
    made_free = r["collectives_made_free"]
    assert sum(made_free["forward"].values()) + sum(made_free["backward"].values()) > 0
    assert not any(k.startswith("_c10d_functional") for k in r["planned"]["ops"])
    assert all(math.isfinite(v) and v > 0 for v in r["ratios"].values())
    assert set(r["ratios"]) >= {"step_time", "step_cpu_time", "kernels", "peak_memory"}
    assert "ratios planned/plain" in capsys.readouterr().out
    # --planned-only (a model whose plain copy does not fit the host): the planned program alone
    assert main([*argv, "--seq", "32", "--steps", "1", "--planned-only", "--json", str(out)]) == 0
    alone = json.loads(out.read_text())
    assert "plain" not in alone and "ratios" not in alone
    assert alone["planned"]["ops"]["aten.mm"] > 0 and len(alone["planned"]["step_s"]["all"]) == 1


@pytest.mark.slow
def test_overhead_compiled_on_llama_debug(tmp_path):
    """With --compile the planned graphs (collectives made free first) run through regional
    Inductor and the plain model through torch.compile; Inductor's C++ kernels are counted."""
    init_fake_world()  # never shrink the shared fake world: meshes and groups made earlier must stay valid
    out = tmp_path / "overhead.json"
    argv = ["overhead", "--model", "llama3-debug", "--mesh", "8", "--dtype", "float32", "--seq", "32"]
    assert main([*argv, "--steps", "1", "--compile", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["compile"]
    for name in ("planned", "plain"):
        assert r[name]["kernels"] > 0 and r[name]["compile_s"] > 0
        assert "ops" not in r[name]  # a dispatch mode would run compiled code eagerly: not counted that way
    assert all(math.isfinite(v) and v > 0 for v in r["ratios"].values())
