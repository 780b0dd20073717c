"""The driver's text-only way to the finder until it changes knobs where they live
(jupyter_cudamem/oomfix/rewrite.py)."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, TensorDataset

from jupyter_cudamem.oomfix.rewrite import find_batch, rewrite_batch


def test_numbers_in_the_cell_and_variables_are_set_by_the_cell_text():
    finding = find_batch("batch_size = 512\nx = torch.randn(batch_size, 8)\n")
    assert finding.chosen.describe() == "batch_size = 512 (line 1)"
    assert rewrite_batch(finding, 100).startswith("batch_size = 100\n")
    finding = find_batch("x = torch.randn(bs, 8)\nmodel(x)\n", {"bs": 64, "torch": torch, "model": None})
    assert rewrite_batch(finding, 16).splitlines()[0] == "bs = 16  # set by %oomfix, was 64"


def test_knobs_living_in_objects_are_shown_but_not_chosen():
    loader = DataLoader(TensorDataset(torch.zeros(8, 1)), batch_size=4)
    finding = find_batch("for (x,) in loader:\n    model(x)\n", {"loader": loader, "model": None})
    assert finding.chosen is None
    assert "lives outside the cell's text" in finding.summary() and "loader.batch_size = 4" in finding.summary()
