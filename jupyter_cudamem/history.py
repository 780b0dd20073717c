"""The record of measured cells, for tables, plots and export.

A record is flat and JSON-friendly (one row per cell and device) so ``pandas.DataFrame(records)``
loads it as is.
"""

from __future__ import annotations

import csv
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import CudaMemError
from .growth import RunGrowth
from .measure import Measurement

SOURCE_HEAD_CHARS = 60


def source_head(source: str) -> str:
    """The first meaningful line of a cell, shortened, to name it in tables."""
    for line in source.splitlines():
        stripped = line.strip()
        if stripped and not stripped.startswith("#") and not stripped.startswith("%%cudamem"):
            return stripped if len(stripped) <= SOURCE_HEAD_CHARS else stripped[: SOURCE_HEAD_CHARS - 1] + "…"
    return ""


@dataclass(frozen=True)
class CellRecord:
    """One measured cell: where it ran, what it was, and its measurement.

    ``source_key`` identifies the cell's source (``growth.source_key``), so a cell run again is
    recognised; ``growth`` is set when this run left memory again (``growth.run_growth``).
    """

    execution_count: int | None
    source_head: str
    measurement: Measurement
    finished_at: float = field(default_factory=time.time)
    source_key: str = ""
    growth: RunGrowth | None = None

    @property
    def label(self) -> str:
        return f"[{self.execution_count}]" if self.execution_count is not None else "[?]"

    def rows(self) -> list[dict[str, Any]]:
        """One flat row per device (a single row with no device fields when none was touched)."""
        base = {
            "execution_count": self.execution_count,
            "source": self.source_head,
            "finished_at": self.finished_at,
            "wall_s": self.measurement.wall_s,
            "error": self.measurement.error,
            "limit_bytes": self.measurement.limit_bytes,
            "growth_per_run_bytes": None if self.growth is None else self.growth.per_run_bytes,
            "growing_runs": None if self.growth is None else self.growth.runs,
        }
        if not self.measurement.devices:
            return [dict(base, device=None)]
        rows = []
        for device in self.measurement.devices:
            after = device.after.allocator
            rows.append(
                dict(
                    base,
                    device=device.device.label,
                    device_name=device.device.name,
                    peak_allocated_bytes=device.peak_allocated_bytes,
                    peak_above_start_bytes=device.peak_above_start_bytes,
                    allocated_delta_bytes=device.allocated_delta_bytes,
                    reserved_delta_bytes=device.reserved_delta_bytes,
                    allocated_after_bytes=None if after is None else after.allocated_bytes,
                    reserved_after_bytes=None if after is None else after.reserved_bytes,
                    nvml_used_delta_bytes=device.nvml_used_delta_bytes,
                    outside_pytorch_delta_bytes=device.outside_pytorch_delta_bytes,
                    free_after_bytes=device.free_after_bytes,
                    total_bytes=device.total_bytes,
                )
            )
        return rows


class History:
    """Measured cells in order, bounded so a kernel left running for days stays small."""

    def __init__(self, max_records: int = 10_000):
        self.max_records = max_records
        self._records: list[CellRecord] = []

    def add(self, record: CellRecord) -> None:
        self._records.append(record)
        if len(self._records) > self.max_records:
            del self._records[: len(self._records) - self.max_records]

    def clear(self) -> None:
        self._records.clear()

    def __len__(self) -> int:
        return len(self._records)

    def __iter__(self):
        return iter(list(self._records))

    @property
    def records(self) -> list[CellRecord]:
        return list(self._records)

    def to_records(self) -> list[dict[str, Any]]:
        """Flat rows (one per cell and device) for ``pandas.DataFrame(history.to_records())``."""
        return [row for record in self._records for row in record.rows()]

    def save(self, path: str | Path) -> Path:
        """Write the rows to ``.csv`` or ``.json``, chosen by the file's extension."""
        target = Path(path)
        rows = self.to_records()
        if target.suffix.lower() == ".json":
            target.write_text(json.dumps(rows, indent=1))
        elif target.suffix.lower() == ".csv":
            columns: list[str] = []
            for row in rows:
                columns.extend(key for key in row if key not in columns)
            with target.open("w", newline="") as handle:
                writer = csv.DictWriter(handle, fieldnames=columns)
                writer.writeheader()
                writer.writerows(rows)
        else:
            raise CudaMemError(f"cannot save history as {target.suffix or 'a file without extension'}: use .csv or .json")
        return target
