"""The ``autoplan`` command: plan (a named model or a user factory), show, explain and diff."""

import re
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import init_fake_world
from models import MLP
from torch.distributed.tensor import Replicate, Shard

from autoplan import Plan
from autoplan.cli import main

PIN = "layers.*.attention.wo.weight=S(1)S(0)"


def mlp_factory():
    """A user factory as ``autoplan plan --model test_cli:mlp_factory`` calls it."""
    with torch.device("meta"):
        model = MLP(32, 64, 32)
    return model, lambda: torch.randn(8, 32)


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    init_fake_world()  # the shared 128-rank fake world: the command's meshes live inside it
    out = tmp_path_factory.mktemp("cli")
    argv = ["plan", "--model", "llama3-debug", "--mesh", "2x4", "--seq", "32", "--batch", "8"]
    assert main([*argv, "-o", str(out / "free.json")]) == 0
    assert main([*argv, "--pin", PIN, "-o", str(out / "pinned.json")]) == 0
    return out / "free.json", out / "pinned.json"


def test_plan_writes_a_plan_that_loads(plans, capsys):
    free, pinned = (Plan.from_json(p) for p in plans)
    assert free.mesh_shape == pinned.mesh_shape == (2, 4)
    wo = [p for f, p in pinned.param_placements.items() if f.endswith("attention.wo.weight")]
    assert len(wo) == 2 and all(p == (Shard(1), Shard(0)) for p in wo)
    # the default parameter budget is 1/ranks: every parameter is split
    assert all(any(isinstance(x, Shard) for x in p) for p in free.param_placements.values())
    assert main(["show", str(plans[0])]) == 0
    assert capsys.readouterr().out.strip() == free.summary()


def test_explain_and_diff(plans, capsys):
    assert main(["explain", str(plans[0]), "layers.*.attention.wo"]) == 0
    text = capsys.readouterr().out
    assert "in layers.0.attention.wo [forward]" in text and "chosen" in text
    assert main(["diff", *map(str, plans)]) == 0
    text = capsys.readouterr().out
    free, pinned = (Plan.from_json(p).param_placements for p in plans)
    moved = [f for f in free if f.endswith("attention.wo.weight") and free[f] != pinned[f]]
    assert moved and "layers.*.attention.wo.weight" in text and f"-> S(1)S(0)  x{len(moved)}" in text
    with pytest.raises(SystemExit, match="no node or module 'layers.*.attn'"):
        main(["explain", str(plans[0]), "layers.*.attn"])


def test_user_factory_with_placements(tmp_path):
    init_fake_world()
    out = tmp_path / "mlp.json"
    argv = ["plan", "--model", "test_cli:mlp_factory", "--mesh", "4", "--inputs", "S(0)", "--param-fraction", "0"]
    assert main([*argv, "-o", str(out)]) == 0
    plan = Plan.from_json(out)
    inputs = [n for n in plan.nodes.values() if n.rule == "placeholder" and n.outputs[0] == (Shard(0),)]
    assert inputs and plan.mesh_shape == (4,)
    assert all(p == (Replicate(),) for p in plan.param_placements.values())  # no budget: data parallel


@pytest.mark.parametrize(
    "argv, message",
    [
        (["plan", "--mesh", "2y4"], "a mesh is sizes joined by 'x'"),
        (["plan", "--model", "llama3-9b"], "unknown model 'llama3-9b'"),
        (["plan", "--model", "llama3-debug", "--mesh", "2x4", "--inputs", "S(0)X"], "--inputs: expected up to 2"),
        (["plan", "--model", "nosuchmodule:build"], "cannot load model factory"),
        (["show", "/nonexistent/plan.json"], "No such file"),
    ],
)
def test_bad_arguments_name_the_culprit(argv, message):
    init_fake_world()
    with pytest.raises(SystemExit, match=message):
        main(argv)


def test_console_script_is_installed(plans):
    """``pyproject.toml`` declares the command; the README's install puts it on the PATH."""
    assert shutil.which("autoplan"), "the autoplan console script is not installed (pip install -e .)"
    done = subprocess.run(["autoplan", "show", str(plans[0])], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "autoplan plan on mesh (dp=2, tp=4)" in done.stdout


def test_progress_bars_only_on_a_terminal(monkeypatch):
    import io

    from autoplan.progress import progress

    items = [1, 2, 3]
    monkeypatch.setattr(sys, "stderr", io.StringIO())  # a pipe or a log file: no bar, the items as they are
    assert progress(items, "costs") is items
    terminal = io.StringIO()
    terminal.isatty = lambda: True
    monkeypatch.setattr(sys, "stderr", terminal)
    assert list(progress(items, "costs", 3)) == items and "autoplan: costs" in terminal.getvalue()


def test_tracing_counts_module_calls_on_a_terminal(monkeypatch):
    import io

    from autoplan.tracing import trace_joint

    terminal = io.StringIO()
    terminal.isatty = lambda: True
    monkeypatch.setattr(sys, "stderr", terminal)
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    trace_joint(model, lambda: torch.randn(2, 4))
    assert re.search(r"autoplan: tracing: \d+ module calls", terminal.getvalue())
