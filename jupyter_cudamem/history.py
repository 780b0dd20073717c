"""The record of measured cells, for tables, plots and export.

A record is flat and JSON-friendly (one row per cell and device) so ``pandas.DataFrame(records)``
loads it as is.
"""

from __future__ import annotations

import csv
import itertools
import json
import re
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from .errors import CudaMemError
from .repeats import RunGrowth
from .measure import Measurement
from .units import whole_number

SOURCE_HEAD_CHARS = 60


@lru_cache(maxsize=256)  # as ``repeats.source_key``: the same cells, measured again and again
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

    ``source_key`` identifies the cell's source (``repeats.source_key``), so a cell run again is
    recognised; ``growth`` is set when this run left memory again (``repeats.run_growth``).
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

    def rows(self) -> list[dict[str, str | int | float | None]]:
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
    """Measured cells in order, bounded so a kernel left running for days stays small.

    A deque drops the oldest record in O(1) when full, so adding stays as cheap at 100,000 records as at 10.
    """

    def __init__(self, max_records: int = 10_000):
        self._records: deque[CellRecord] = deque(maxlen=max(max_records, 1))

    @property
    def max_records(self) -> int:
        return self._records.maxlen or 1

    @max_records.setter
    def max_records(self, value: int) -> None:
        """Resize, keeping the newest records that fit."""
        self._records = deque(self._records, maxlen=max(value, 1))

    def add(self, record: CellRecord) -> None:
        self._records.append(record)

    def clear(self) -> None:
        self._records.clear()

    def __len__(self) -> int:
        return len(self._records)

    def __iter__(self) -> Iterator[CellRecord]:
        return iter(list(self._records))

    def __reversed__(self) -> Iterator[CellRecord]:
        """Newest first, without copying the records (read after every measured cell)."""
        return reversed(self._records)

    @property
    def records(self) -> list[CellRecord]:
        return list(self._records)

    def select(self, cells: str | None = None, last: int | None = None) -> list[CellRecord]:
        """The records of the cells in ``cells`` (``"5-9 12 20-"``, see ``CellRanges``), then the latest ``last``."""
        records: list[CellRecord] | deque[CellRecord] = self._records
        if cells is not None:
            ranges = CellRanges.parse(cells)
            records = [record for record in records if ranges.contains(record.execution_count)]
        if last is not None:
            if last < 1:
                raise CudaMemError(f"--last takes a number of cells of 1 or more, got {last}")
            records = list(itertools.islice(records, max(len(records) - last, 0), None))
        return list(records)

    def to_records(self) -> list[dict[str, str | int | float | None]]:
        """Flat rows (one per cell and device) for ``pandas.DataFrame(history.to_records())``."""
        return flat_rows(self._records)

    def save(self, path: str | Path) -> SavedRecords:
        return save_records(self._records, path)


def flat_rows(records: Iterable[CellRecord]) -> list[dict[str, str | int | float | None]]:
    """One flat dict per cell and device, sizes in bytes: what ``pandas.DataFrame`` loads as is."""
    return [row for record in records for row in record.rows()]


@dataclass(frozen=True)
class SavedRecords:
    """What ``--save`` wrote: said in one line, never followed by the table itself."""

    path: Path
    rows: int
    cells: int

    def __str__(self) -> str:
        return f"cudamem history: {self.cells:,} cells ({self.rows:,} rows) saved to {self.path}"


def save_records(records: Iterable[CellRecord], path: str | Path) -> SavedRecords:
    """Write the records' flat rows to ``.csv`` or ``.json``, chosen by the file's extension."""
    target = Path(path)
    suffix = target.suffix.lower()
    if suffix not in (".csv", ".json"):
        raise CudaMemError(f"cannot save history as {target.suffix or 'a file without extension'}: use .csv or .json")
    cells = list(records)
    rows = flat_rows(cells)
    if suffix == ".json":
        target.write_text(json.dumps(rows, indent=1))
    else:
        columns: dict[str, None] = {}
        for row in rows:
            columns.update(dict.fromkeys(row))
        with target.open("w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(columns))
            writer.writeheader()
            writer.writerows(rows)
    return SavedRecords(target, len(rows), len(cells))


@dataclass(frozen=True)
class CellRanges:
    """Cell numbers (``In [N]``) written as IPython's ``%history`` writes them: ``5``, ``5-9`` (both ends
    included), ``20-`` (from 20 on), several separated by spaces or commas."""

    spans: tuple[tuple[int, int | None], ...]  # (first, last) with last None for "no end"
    text: str

    @classmethod
    def parse(cls, text: str) -> CellRanges:
        tokens = [token for token in re.split(r"[\s,]+", text.strip()) if token]
        spans: list[tuple[int, int | None]] = []
        for token in tokens:
            match = _CELL_RANGE.match(token)
            first = whole_number(match.group(1)) if match else None
            end = match.group(3) if match else None  # "" for "20-": no end
            last = whole_number(end) if end else None
            if match is None or first is None or (end and last is None):
                raise CudaMemError(
                    f"--cells takes cell numbers such as 12, 5-9 (both included) or 20- (from 20 on); got {token!r}"
                )
            if match.group(2) is None:
                last = first
            if last is not None and last < first:
                raise CudaMemError(f"--cells {token}: the range ends before it starts; write {last}-{first}")
            spans.append((first, last))
        if any(not part.strip() for part in text.strip().split(",")) and text.strip():
            # After the items are read: the line it suggests must be one that works.
            written = ",".join(part.strip() for part in text.split(",") if part.strip())
            raise CudaMemError(f"--cells {text.strip()}: an empty item between commas; write --cells {written}")
        if not spans:
            raise CudaMemError("--cells takes cell numbers such as 12, 5-9 (both included) or 20- (from 20 on)")
        return cls(tuple(spans), text.strip())

    def contains(self, number: int | None) -> bool:
        if number is None:
            return False
        return any(first <= number and (last is None or number <= last) for first, last in self.spans)


_CELL_RANGE = re.compile(r"^([0-9]+)(-([0-9]*))?$")  # ASCII digits: ``\d`` is any script's
