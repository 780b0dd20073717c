"""Every tutorial notebook, top to bottom, in a real kernel on the GPU.

A cell tagged ``raises-exception`` may fail (nbclient goes on past it); any other error stops the notebook and
fails the test. ``CUDAMEM_WRITE_BACK=1`` saves each executed notebook over its source in ``notebooks/`` (what
gets committed; run ``tests/test_notebook_outputs.py`` after it); ``CUDAMEM_EXECUTED_DIR=dir`` saves them in
``dir`` instead. A failed run is saved too: its outputs say why.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.notebook_runner import EXPECTED_ERROR_TAG, REPO, execute_notebook, tags

pytestmark = [pytest.mark.gpu, pytest.mark.notebook]

NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))
CELL_TIMEOUT_S = 300
NOTEBOOK_BUDGET_S = 90  # each tutorial should run top to bottom in about a minute and a half on one GPU


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs_on_the_gpu(path):
    import nbformat

    notebook, error, seconds = execute_notebook(path, timeout=CELL_TIMEOUT_S)
    if os.environ.get("CUDAMEM_WRITE_BACK"):
        nbformat.write(notebook, path)
    elif os.environ.get("CUDAMEM_EXECUTED_DIR"):
        target = Path(os.environ["CUDAMEM_EXECUTED_DIR"])
        target.mkdir(parents=True, exist_ok=True)
        nbformat.write(notebook, target / path.name)
    assert error is None, f"{path.name} stopped at an unexpected error:\n{error}"
    unexpected = [
        cell.source.splitlines()[0]
        for cell in notebook.cells
        if cell.cell_type == "code"
        and EXPECTED_ERROR_TAG not in tags(cell)
        and any(output.output_type == "error" for output in cell.outputs)
    ]
    assert unexpected == []
    assert seconds < NOTEBOOK_BUDGET_S, f"{path.name} took {seconds:.0f} s"
