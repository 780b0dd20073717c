"""A real kernel driven by nbclient runs a notebook using every part of ``%%cudamem``."""

from __future__ import annotations

import pytest

from tests.notebook_runner import html_of, json_line, run_cells, text_of

pytestmark = [pytest.mark.gpu, pytest.mark.notebook]


def test_notebook_uses_all_of_cudamem(tmp_path):
    cells = [
        "%load_ext jupyter_cudamem\nimport torch, json\nx0 = torch.zeros(1, device='cuda')",
        "%%cudamem\ntemporary = torch.ones(256 * 1024**2, device='cuda'); del temporary\n'done'",
        "%cudamem on",
        "kept = torch.empty(512 * 1024**2, dtype=torch.uint8, device='cuda')",
        "%cudamem off",
        "%%cudamem --limit 2GiB\nbig = torch.empty(3 * 1024**3, dtype=torch.uint8, device='cuda')",
        "%%cudamem --trace -v\nfirst = torch.empty(64 * 1024**2, dtype=torch.uint8, device='cuda')\n"
        "second = torch.empty(256 * 1024**2, dtype=torch.uint8, device='cuda')",
        "%cudamem_history",
        "records = %cudamem_history -o\nprint('RESULT ' + json.dumps(records))",
        "%cudamem_history --plot",
    ]
    notebook = run_cells(cells, allow_errors_in={5}, save_to=tmp_path / "cudamem.ipynb")
    out = notebook.cells
    assert "'done'" in text_of(out[1]) and "<table>" in html_of(out[1]) and "1.00 GiB" in text_of(out[1])
    every_cell_line = text_of(out[3])
    assert every_cell_line.startswith("cudamem [") and "Δalloc +512.00 MiB" in every_cell_line
    assert "OutOfMemoryError" in text_of(out[5]) and "capped at 2.00 GiB" in text_of(out[5])
    assert "256.00 MiB" in text_of(out[6]) and "second = torch.empty" in text_of(out[6])
    records = json_line(out[8])
    assert [r["error"] for r in records] == [None, None, "OutOfMemoryError", None]
    assert records[0]["peak_above_start_bytes"] == 1024**3
    assert any(o.output_type == "display_data" and "image/png" in o.data for o in out[9].outputs)
