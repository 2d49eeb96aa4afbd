"""The README's main job, ``examples/example_llama3.py``: its default plan, and ``--execute``."""

import re
import subprocess
import sys
from pathlib import Path

from autoplan import Plan

EXAMPLE = Path(__file__).resolve().parents[1] / "examples/example_llama3.py"


def _run(*args: str, cwd: Path) -> str:
    done = subprocess.run([sys.executable, str(EXAMPLE), *args], capture_output=True, text=True, timeout=900, cwd=cwd)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_default_plans_llama3_8b_for_128_gpus(tmp_path):
    out = _run(cwd=tmp_path)
    assert "autoplan plan on mesh (dp=16, tp=8)" in out and "layers.*.attention.wq.weight" in out
    plan = Plan.from_json(tmp_path / "llama3_8b_16x8.json")
    assert plan.mesh_shape == (16, 8) and len(plan.param_placements) == 2 + 9 * 32 + 1
    assert plan.memory.param_bytes <= 8.1e9 * 2 / 128  # the 1/128 parameter budget held


def test_execute_matches_single_device(tmp_path):
    out = _run("--model", "debug", "--mesh", "2x2", "--batch", "8", "--seq-len", "32", "--execute", cwd=tmp_path)
    rows = re.findall(r"^\s+(\d)\s+([0-9.]+)\s+([0-9.]+)\s+\S+$", out, re.M)
    assert len(rows) == 5, out
    for _, parallel, single in rows:
        assert abs(float(parallel) - float(single)) <= 1e-5 * float(single)
    assert "losses match single-device" in out
