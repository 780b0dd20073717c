"""The history of measured cells as a table (HTML and text)."""

from __future__ import annotations

import html

from ..history import CellRecord
from ..units import format_bytes, format_seconds
from .text import TextReport

_COLUMNS = ("cell", "source", "device", "peak", "Δ allocated", "Δ reserved", "Δ NVML", "time", "growing")


def _cells(record: CellRecord) -> list[tuple[str, ...]]:
    measurement = record.measurement
    status = f" ({measurement.error})" if measurement.error else ""
    growth = record.growth
    growing = "" if growth is None else f"{format_bytes(growth.per_run_bytes, signed=True)}/run ×{growth.runs}"
    if not measurement.devices:
        wall = format_seconds(measurement.wall_s)
        return [(record.label, record.source_head + status, "", "", "", "", "", wall, growing)]
    return [
        (
            record.label,
            record.source_head + status,
            device.device.label,
            format_bytes(device.peak_allocated_bytes),
            format_bytes(device.allocated_delta_bytes, signed=True),
            format_bytes(device.reserved_delta_bytes, signed=True),
            format_bytes(device.nvml_used_delta_bytes, signed=True),
            format_seconds(measurement.wall_s),
            growing,
        )
        for device in measurement.devices
    ]


class HistoryTable(TextReport):
    """A view of history records; ``display()`` it or print it."""

    def __init__(self, records: list[CellRecord]):
        self.records = records

    def rows(self) -> list[tuple[str, ...]]:
        return [row for record in self.records for row in _cells(record)]

    def text(self) -> str:
        rows = self.rows()
        if not rows:
            return "cudamem history is empty: measure cells with %%cudamem or %cudamem on"
        widths = [max(len(column), *(len(row[i]) for row in rows)) for i, column in enumerate(_COLUMNS)]
        def fmt(row: tuple[str, ...]) -> str:
            return "  ".join(value.ljust(widths[i]) if i < 3 else value.rjust(widths[i]) for i, value in enumerate(row)).rstrip()
        return "\n".join([fmt(_COLUMNS), fmt(tuple("-" * w for w in widths)), *(fmt(row) for row in rows)])

    def _repr_html_(self) -> str:
        rows = self.rows()
        if not rows:
            return f"<div>{html.escape(self.text())}</div>"
        head = "".join(f"<th>{html.escape(c)}</th>" for c in _COLUMNS)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(v)}</td>" for v in row) + "</tr>" for row in rows)
        return f'<table class="cudamem-history" style="white-space:nowrap"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'
