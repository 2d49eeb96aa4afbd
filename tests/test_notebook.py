"""``notebooks/explore_placements.ipynb`` is stored without outputs and runs top to bottom."""

from pathlib import Path

import nbformat
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks/explore_placements.ipynb"


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
    for mesh in ("128", "16x8", "32x4", "8x16"):
        assert f"{mesh:>6}: " in text
