"""Text and HTML renderings of measurements, and matplotlib figures of the history."""

from .cell import CellReport, one_line
from .table import HistoryTable

__all__ = ["CellReport", "HistoryTable", "one_line"]
