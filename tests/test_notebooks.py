"""The tutorial notebooks: valid, and their non-GPU cells run anywhere (cells tagged ``gpu`` need CUDA)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))


def _tags(cell) -> list[str]:
    return list(cell.get("metadata", {}).get("tags", []))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_is_valid(path):
    notebook = nbformat.read(path, as_version=4)
    nbformat.validate(notebook)
    assert notebook.cells[0].cell_type == "markdown" and notebook.cells[0].source.startswith("#")
    sources = "\n".join(cell.source for cell in notebook.cells if cell.cell_type == "code")
    assert "jupyter_cudamem" in sources


@pytest.mark.notebook
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_non_gpu_cells_run(path, monkeypatch, tmp_path):
    notebook = nbformat.read(path, as_version=4)
    notebook.cells = [cell for cell in notebook.cells if cell.cell_type == "code" and "gpu" not in _tags(cell)]
    for cell in notebook.cells:
        cell.outputs = []
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    client = nbclient.NotebookClient(notebook, kernel_name="python3", timeout=120, resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    errors = [
        (cell.source.splitlines()[0], output.ename)
        for cell in notebook.cells
        for output in cell.outputs
        if output.output_type == "error" and "raises-exception" not in _tags(cell)
    ]
    assert errors == []
