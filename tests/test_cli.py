"""The ``autoplan`` command: plan (a named model or a user factory), show, explain and diff."""

import dataclasses
import logging
import re
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import init_fake_world
from models import MLP
from torch.distributed.tensor import Replicate, Shard

from autoplan import Plan
from autoplan.cli import main
from autoplan.plan import placements_str

WO = "layers.*.attention.wo.weight"


def mlp_factory():
    """A user factory as ``autoplan plan --model test_cli:mlp_factory`` calls it."""
    with torch.device("meta"):
        model = MLP(32, 64, 32)
    return model, lambda: torch.randn(8, 32)


def capped_mlp_factory():
    """An MLP whose estimated peak a cap at 35% of the free plan's can still meet, in a few rounds."""
    with torch.device("meta"):
        model = MLP(64, 128, 64)
    return model, lambda: torch.randn(64, 64)


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    init_fake_world()  # the shared 128-rank fake world: the command's meshes live inside it
    out = tmp_path_factory.mktemp("cli")
    argv = ["plan", "--model", "llama3-debug", "--mesh", "2x4", "--seq", "32", "--batch", "8"]
    assert main([*argv, "-o", str(out / "free.json")]) == 0
    # pinned to a split the free plan did not choose, so that the diff has moves to list
    chosen = {p for f, p in Plan.from_json(out / "free.json").param_placements.items() if f.endswith("wo.weight")}
    pin = (Shard(0), Shard(0)) if (Shard(1), Shard(0)) in chosen else (Shard(1), Shard(0))
    text = placements_str(pin)
    assert main([*argv, "--pin", f"{WO}={text}", "-o", str(out / "pinned.json")]) == 0
    return out / "free.json", out / "pinned.json", pin, text


def test_plan_writes_a_plan_that_loads(plans, capsys):
    free, pinned = (Plan.from_json(p) for p in plans[:2])
    assert free.mesh_shape == pinned.mesh_shape == (2, 4)
    wo = [p for f, p in pinned.param_placements.items() if f.endswith("attention.wo.weight")]
    assert len(wo) == 2 and all(p == plans[2] for p in wo)
    # the default parameter budget is 1/ranks: every parameter is split
    assert all(any(isinstance(x, Shard) for x in p) for p in free.param_placements.values())
    assert main(["show", str(plans[0])]) == 0
    assert capsys.readouterr().out.strip() == free.summary()


def test_explain_and_diff(plans, capsys):
    assert main(["explain", str(plans[0]), "layers.*.attention.wo"]) == 0
    text = capsys.readouterr().out
    assert "in layers.0.attention.wo [forward]" in text and "chosen" in text
    assert main(["diff", *map(str, plans[:2])]) == 0
    text = capsys.readouterr().out
    free, pinned = (Plan.from_json(p).param_placements for p in plans[:2])
    moved = [f for f in free if f.endswith("attention.wo.weight") and free[f] != pinned[f]]
    # equally cheap placements may differ between the free plan's layers: each move is listed once
    counts = re.findall(rf"{re.escape(WO)} +\S+ -> {re.escape(plans[3])}  x(\d+)", text)
    assert moved and sum(map(int, counts)) == len(moved)
    with pytest.raises(SystemExit, match="no node or module 'layers.*.attn'"):
        main(["explain", str(plans[0]), "layers.*.attn"])
    assert "warning" not in text  # one model on one mesh


def test_explain_a_module_shows_its_compute_and_moves_unless_all(plans, capsys):
    """Of a module, the ops that compute and the data moved into its views (the parameter gathers);
    ``--all`` (``all_ops=True``) lists every view and alias too."""
    assert main(["explain", str(plans[0]), "layers.*.attention"]) == 0
    short = capsys.readouterr().out
    assert main(["explain", str(plans[0]), "layers.*.attention", "--all"]) == 0
    full = capsys.readouterr().out
    heads = lambda text: re.findall(r"^\w+: (.+) in \S+ \[\w*\] \(rule: ", text, re.M)  # noqa: E731
    assert {"aten.mm.default", "aten._scaled_dot_product_flash_attention.default"} <= set(heads(short))
    assert not {"aten.alias.default", "aten.view.default", "aten.t.default"} & set(heads(short))
    assert {"aten.alias.default", "aten.view.default", "aten.t.default"} <= set(heads(full))
    left_out = len(heads(full)) - len(heads(short))
    assert f"({left_out} views, aliases and tuple items left out: explain(..., all_ops=True) or --all)" in short
    moves = short[short.index("moves into the views and aliases left out") :].splitlines()[1:-1]
    assert moves and all(re.search(r" <- \w+: \S+ -> \S+, (all_gather|all_reduce|reduce_scatter)", m) for m in moves)
    assert "left out" not in full
    plan = Plan.from_json(plans[0])
    alias = next(n.name for n in plan.nodes.values() if n.op == "aten.alias.default")
    assert plan.explain(alias).startswith(f"{alias}: aten.alias.default")  # a node asked for by name shows


def test_diff_warns_when_the_plans_are_not_of_one_model_and_mesh(plans, tmp_path, capsys):
    init_fake_world()
    mlp = tmp_path / "mlp.json"
    assert main(["plan", "--model", "test_cli:mlp_factory", "--mesh", "4", "--inputs", "S(0)", "-o", str(mlp)]) == 0
    capsys.readouterr()
    assert main(["diff", str(plans[0]), str(mlp)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert (
        lines[0]
        == "warning: mesh (dp=2, tp=4) in the first plan, (dp=4) in the second: placements differ for that reason alone"
    )
    assert re.fullmatch(r"warning: another model: \d+ parameters, buffers or inputs differ, e\.g\. .*", lines[1])
    assert lines[2].startswith("cost (ms)")
    # the same tensors, another program: the ops tell
    free = Plan.from_json(plans[0])
    mm = next(k for k, n in free.nodes.items() if n.op == "aten.mm.default")
    other = dataclasses.replace(
        free, nodes={**free.nodes, mm: dataclasses.replace(free.nodes[mm], op="aten.bmm.default")}
    )
    assert free.diff(other).unlike == (f"another graph: 1 nodes are in one plan only or run another op, e.g. {mm}",)
    assert free.diff(dataclasses.replace(free, device="a100")).unlike == (
        f"priced for {free.device} in the first plan, a100 in the second",
    )


def test_cap_bounds_the_estimated_peak_and_the_solve_logs_its_rounds(tmp_path, caplog):
    init_fake_world()
    argv = ["plan", "--model", "test_cli:capped_mlp_factory", "--mesh", "4", "--inputs", "S(0)", "--outputs", "S(0)"]
    argv += ["--param-fraction", "0"]
    assert main([*argv, "-o", str(tmp_path / "free.json")]) == 0
    free = Plan.from_json(tmp_path / "free.json")
    cap = 0.35 * free.memory.peak_bytes
    assert main([*argv, "--cap", repr(cap / 2**30), "-o", str(tmp_path / "capped.json")]) == 0
    capped = Plan.from_json(tmp_path / "capped.json")
    assert capped.memory.peak_bytes <= cap < free.memory.peak_bytes
    rounds = [r.getMessage() for r in caplog.records if ", round " in r.getMessage()]
    pattern = (
        r"main solve, round (\d) of at most 5: incumbent \d+\.\d{3} ms per step, gap \d+\.\d\d%, estimated peak"
        r" [\d.]+ MiB (over|within) the cap of [\d.]+ MiB, \d+\.\d s elapsed"
    )
    found = [re.fullmatch(pattern, m) for m in rounds]
    assert len(found) > 1 and all(found), rounds  # the first plans were over the cap: more rounds
    assert [int(m.group(1)) for m in found] == list(range(1, len(found) + 1))
    assert [m.group(2) for m in found] == ["over"] * (len(found) - 1) + ["within"]
    with pytest.raises(
        SystemExit, match=r"(?s)autoplan plan: .*estimated peak bytes per device <= 1024.*smallest estimated peak"
    ):
        main([*argv, "--cap", repr(1024 / 2**30)])
    with pytest.raises(SystemExit, match="--cap is the estimated peak per device in GiB, a positive number; got -1"):
        main([*argv, "--cap", "-1"])


def test_the_solver_log_shows_at_vv_only(capfd):
    """``-v`` logs autoplan's phases; ``-vv`` sets the ``autoplan`` logger to DEBUG, and the solver
    prints its own log (to the process's standard output, as HiGHS writes it)."""
    init_fake_world()
    argv = ["plan", "--model", "test_cli:mlp_factory", "--mesh", "4", "--inputs", "S(0)", "--param-fraction", "0"]
    assert main([*argv, "-v"]) == 0
    assert "Solving" not in capfd.readouterr().out
    try:
        assert main([*argv, "-vv"]) == 0
    finally:
        logging.getLogger("autoplan").setLevel(logging.NOTSET)
    assert re.search(r"^Solving (LP|MIP) ", capfd.readouterr().out, re.M)


def test_a_factory_module_in_the_current_folder_is_found(tmp_path, monkeypatch):
    """``autoplan plan --model mymodule:factory`` run where ``mymodule.py`` is: the installed command's
    path holds its own folder, not the user's."""
    init_fake_world()
    (tmp_path / "cwd_factory_model.py").write_text(
        textwrap.dedent(
            """
            import torch

            def build():
                with torch.device("meta"):
                    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
                return model, lambda: torch.randn(8, 16)
            """
        )
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    try:
        assert main(["plan", "--model", "cwd_factory_model:build", "--mesh", "4", "-o", "plan.json"]) == 0
    finally:
        sys.modules.pop("cwd_factory_model", None)
    assert Plan.from_json(tmp_path / "plan.json").mesh_shape == (4,)
    with pytest.raises(SystemExit, match=f"No module named 'no_such_model' \\(looked in the current folder {tmp_path}"):
        main(["plan", "--model", "no_such_model:build", "--mesh", "4"])


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

    from autoplan.trace.tracing import trace_joint

    terminal = io.StringIO()
    terminal.isatty = lambda: True
    monkeypatch.setattr(sys, "stderr", terminal)
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    trace_joint(model, lambda: torch.randn(2, 4))
    assert re.search(r"autoplan: tracing: \d+ module calls", terminal.getvalue())


def test_a_factory_takes_the_batch_it_is_given_or_says_it_does_not():
    """``bench validate --batch`` passes ``batch=`` to a factory; one without it is named."""
    from autoplan.bench.workloads import load_factory

    model, input_fn = load_factory("autoplan.bench.models.mlp:factory", batch=64)
    assert input_fn().shape == (64, 512) and sum(p.numel() for p in model.parameters()) == 4 * 3 * 512 * 2048
    with pytest.raises(ValueError, match="'test_cli:mlp_factory' does not take batch"):
        load_factory("test_cli:mlp_factory", batch=64)
