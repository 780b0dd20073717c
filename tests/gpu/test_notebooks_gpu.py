"""Every tutorial notebook, top to bottom, in a real kernel on the GPU.

Set ``CUDAMEM_EXECUTED_DIR`` to keep the executed notebooks (with their outputs) there.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.notebook]

REPO = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))
FIVE_MINUTES = 300


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs_on_the_gpu(path, monkeypatch):
    import nbformat
    from nbclient import NotebookClient

    notebook = nbformat.read(path, as_version=4)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    client = NotebookClient(notebook, kernel_name="python3", timeout=FIVE_MINUTES, resources={"metadata": {"path": str(path.parent)}})
    started = time.monotonic()
    target = os.environ.get("CUDAMEM_EXECUTED_DIR")
    try:
        client.execute()
    finally:  # a failed run is kept too: its outputs say why
        if target:
            Path(target).mkdir(parents=True, exist_ok=True)
            nbformat.write(notebook, Path(target) / path.name)
    elapsed = time.monotonic() - started
    unexpected = [
        cell.source.splitlines()[0]
        for cell in notebook.cells
        if cell.cell_type == "code"
        and "raises-exception" not in cell.metadata.get("tags", [])
        and any(output.output_type == "error" for output in cell.outputs)
    ]
    assert unexpected == []
    assert elapsed < FIVE_MINUTES, f"{path.name} took {elapsed:.0f} s"
