"""examples/quickstart.ipynb runs top to bottom (fewer steps than a user's run)."""

import json
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

ROOT = Path(__file__).parent.parent


@pytest.mark.slow
@pytest.mark.multiprocess
def test_quickstart_notebook_executes(tmp_path, monkeypatch):
    nb = nbformat.read(ROOT / "examples" / "quickstart.ipynb", as_version=4)
    params = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
    params.source = f'STEPS = 12\nSTEPS_2PROC = 4\nOUT = "{tmp_path}/runs"'
    monkeypatch.setenv("HOME", str(tmp_path))  # the kernel inherits it: nmt's data cache stays private
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(ROOT / "examples")}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "trained on 2 processes" in text and "=>" in text
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(images) == 2  # the curves and the attention alignment
    assert json.loads((tmp_path / "runs" / "two" / "model" / "training.json").read_text())["num_processes"] == 2
