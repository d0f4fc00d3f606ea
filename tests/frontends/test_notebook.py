"""examples/notebook.ipynb runs top to bottom on CPU with the default model."""

from __future__ import annotations

from pathlib import Path

import pytest

NOTEBOOK = Path(__file__).resolve().parents[2] / "examples" / "notebook.ipynb"


@pytest.mark.slow
def test_notebook_executes(smollm2, tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    model, _ = smollm2
    # the kernel loads the default model from the cache the fixture built (no second GGUF load),
    # with one thread: the runs are small, and a busy 2-core machine punishes OpenMP waits
    monkeypatch.setenv("PAGED_HF_CACHE", str(Path(model.name_or_path).parent.parent))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbclient.NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "Paris" in text and "after cancel(): 0" in text
    assert any("image/png" in o.get("data", {}) for o in outputs)  # the plot
    assert any(
        "generation_finish_reason" in o.get("data", {}).get("text/html", "") for o in outputs
    )
