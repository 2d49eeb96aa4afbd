"""The training example runs under torchrun (4 gloo ranks on CPU) and its loss goes down."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # by default test_examples trains on 4 gloo processes (spawned, not torchrun)
def test_torchrun_training_example():
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=4",
        str(ROOT / "examples/train_llama3_debug.py"),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"step \d+: local loss ([0-9.]+)", done.stdout)]
    assert len(losses) == 3 and losses[2] < losses[0]
