"""``examples/example_llama3.py``, the README's main job: the mesh it picks, its errors, and ``--execute``."""

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

from autoplan import Plan

EXAMPLE = Path(__file__).resolve().parents[1] / "examples/example_llama3.py"


def _run(*args: str, cwd: Path) -> str:
    done = subprocess.run([sys.executable, str(EXAMPLE), *args], capture_output=True, text=True, timeout=900, cwd=cwd)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def _example():
    spec = importlib.util.spec_from_file_location("example_llama3", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_debug_plans_on_a_mesh_it_fits_without_mesh(tmp_path, monkeypatch, capsys):
    """Without --mesh, ``debug`` plans on 2x2: it is too small to be worth splitting over 16x8.
    (The default run, 8B on 16x8, is the README's main job: tests/test_readme.py runs it.)"""
    monkeypatch.chdir(tmp_path)
    assert _example().main(["--model", "debug", "--batch", "8", "--seq-len", "32"]) == 0
    assert "plan written to llama3_debug_2x2.json" in capsys.readouterr().out
    assert Plan.from_json(tmp_path / "llama3_debug_2x2.json").mesh_shape == (2, 2)


def test_a_plan_that_cannot_be_made_is_one_message(tmp_path, monkeypatch, capsys):
    """An error autoplan raises while planning (here: a budget no plan meets, as the planner reports it)
    ends the example with that one message and exit status 1, no traceback."""
    from solvers import InfeasibleError

    example = _example()
    monkeypatch.chdir(tmp_path)

    def infeasible(*args, **kwargs):
        raise InfeasibleError(["memory constraint"], "Conflicting constraints: memory constraint: <= 1 byte")

    monkeypatch.setattr(example, "plan_llama", infeasible)
    try:
        example.main(["--model", "debug", "--mesh", "2x2", "--batch", "8", "--seq-len", "32"])
    except SystemExit as e:
        message = str(e.code)
    assert message == (
        "example_llama3.py: planning debug on mesh 2x2 failed: Conflicting constraints: memory constraint: <= 1 byte"
    )
    assert not list(tmp_path.iterdir())  # no plan written


@pytest.mark.slow  # ~70 s of 4 gloo processes; the default suite runs plans on gloo in test_runtime_gloo
def test_execute_matches_single_device(tmp_path):
    out = _run("--model", "debug", "--mesh", "2x2", "--batch", "8", "--seq-len", "32", "--execute", cwd=tmp_path)
    rows = re.findall(r"^\s+(\d)\s+([0-9.]+)\s+([0-9.]+)\s+\S+$", out, re.M)
    assert len(rows) == 5, out
    for _, parallel, single in rows:
        assert abs(float(parallel) - float(single)) <= 1e-5 * float(single)
    assert "losses match single-device" in out
