"""Plans are deterministic: the same model, mesh and constraints give byte-identical plan JSON in
separate processes (each with its own hash seed and RNG state), two at a time."""

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

HERE = Path(__file__).parent


def _plan(i: int, out: Path) -> str:
    env = os.environ | {"PYTHONHASHSEED": str(1000 + i), "PYTHONPATH": str(HERE)}
    done = subprocess.run(
        [sys.executable, str(HERE / "plan_in_process.py"), str(i), str(out / f"plan{i}.json")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return (out / f"plan{i}.json").read_text()


@pytest.mark.slow  # ~29 s: five planning processes
def test_five_processes_write_the_same_plan_bytes(tmp_path):
    with ThreadPoolExecutor(2) as pool:
        texts = list(pool.map(lambda i: _plan(i, tmp_path), range(5)))
    assert texts[0].startswith("{") and '"param_placements"' in texts[0]
    assert all(t == texts[0] for t in texts[1:]), [i for i, t in enumerate(texts) if t != texts[0]]
