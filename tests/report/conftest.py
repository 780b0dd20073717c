from __future__ import annotations

import gc

from tests import history_day
import pytest

from jupyter_cudamem.history import CellRecord


@pytest.fixture(scope="session")
def day() -> list[CellRecord]:
    """100,000 distinct every-cell records, shared by the history views' tests. Built with the cyclic
    collector paused, then frozen (as ``tests/conftest.py`` does between modules): they all live to the end,
    and its full passes over a growing heap were half the build."""
    gc.disable()
    try:
        made = list(history_day.cells(100_000))
    finally:
        gc.enable()
    gc.freeze()
    return made
