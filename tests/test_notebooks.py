"""Every notebook in notebooks/ runs top to bottom without error."""
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_executes(path, gemma3_path, monkeypatch):
    import nbformat
    from nbclient import NotebookClient
    # the kernel runs in notebooks/: this checkout's llm first, not PyPI's `llm` (a CLI that the
    # hub's model packages pull in), which an editable install's finder would come after
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    assert any("nodes" in "".join(o.get("text", "")) for o in outputs)
    if path.name == "05_vision.ipynb":      # the attention overlays and the logit lens are drawn
        assert sum("image/png" in o.get("data", {}) for o in outputs) == 3


def test_there_is_a_quickstart():
    assert any(p.name == "01_quickstart.ipynb" for p in NOTEBOOKS)
