"""``notebooks/explore_placements.ipynb`` is stored without outputs and runs top to bottom."""

import re
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks/explore_placements.ipynb"
MESHES = ("128", "16x8", "32x4", "8x16")


@pytest.mark.slow  # ~60 s: it plans LLaMA-3 8B eight times over; the default suite plans 8B in test_readme
def test_notebook_runs_top_to_bottom(tmp_path):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(not c.outputs and c.execution_count is None for c in code), "store the notebook without outputs"
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    text = "\n".join(o.get("text", "") for c in code for o in c.outputs if o.output_type == "stream")
    images = sum("image/png" in o.get("data", {}) for c in code for o in c.outputs)
    assert not [o for c in code for o in c.outputs if o.output_type == "error"]
    assert images == 4  # cost breakdown, parameter memory, three plans, mesh sweep (two panels, one figure)
    assert "autoplan plan on mesh (dp=2, tp=4)" in text and "layers.*.attention.wq.weight" in text
    assert "chosen" in text and "parameters placed differently" in text
    # the mixture of experts' section: the MoE block's styles and explain's expert lines
    assert "MoE block per mesh dim: (" in text
    assert re.search(r"^experts of layers\.\d+\.feed_forward: expert-parallel degree \d+", text, re.M)
    assert re.search(r"^  into and out of its experts' matmuls per step: ", text, re.M)
    # each stacked cost bar is the step's estimate: communication under compute is drawn beside it
    stacks = re.findall(r"^(.+): stacked bar ([\d.]+) ms, estimated step ([\d.]+) ms$", text, re.M)
    assert [name for name, _, _ in stacks] == ["autoplan 16x8", "autoplan", "FSDP only", "FSDP + TP"]
    assert all(bar == step for _, bar, step in stacks), stacks
    # the sweep's memory panel: the estimated peak per device, which the mesh changes (the parameter
    # bytes are 1/128 of the model on every mesh)
    peaks = {m: float(re.search(rf"^ *{m}: .* ms, peak ([\d.]+) GiB, collectives", text, re.M)[1]) for m in MESHES}
    assert len(set(peaks.values())) > 1, peaks
