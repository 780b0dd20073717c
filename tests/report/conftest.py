from __future__ import annotations

from tests import history_day
import pytest

from jupyter_cudamem.history import CellRecord


@pytest.fixture(scope="session")
def day() -> list[CellRecord]:
    """100,000 distinct every-cell records (about 3 s to build), shared by the history views' tests."""
    return list(history_day.cells(100_000))
