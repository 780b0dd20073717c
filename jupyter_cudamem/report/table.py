"""The history of measured cells as a table (HTML and text), bounded unless the whole is asked for.

A day of every-cell mode is 10,000 cells; printing all of them put a megabyte of text and another of HTML
into the notebook file. By default the table shows the latest cells and one summary line for the rest,
so its size does not depend on the history's length.

Columns are specs (``Column``): a header, how to read the value from a record and one of its devices, and
an alignment. The text and the HTML are both built from ``COLUMNS``, so a new per-record figure is one
more ``Column`` there (or in the ``columns`` argument), never a change to the rendering.
"""

from __future__ import annotations

import html
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..history import CellRecord
from ..measure import DeviceMeasurement
from ..units import format_bytes, format_seconds
from .text import TextReport

# The latest cells the default view shows. Enough to see the last stretch of work on one screen; with a
# source head capped at 60 characters the table stays under ~10 KB of HTML whatever the history holds.
DEFAULT_SHOWN_CELLS = 20


@dataclass(frozen=True)
class Column:
    """One column: ``value(record, device)`` is the cell's text (``device`` is None for a record that
    touched no device); ``align`` is "left" or "right"."""

    header: str
    value: Callable[[CellRecord, DeviceMeasurement | None], str]
    align: str = "right"


def _bytes(read: Callable[[DeviceMeasurement], int | None], signed: bool = False) -> Callable[..., str]:
    def value(record: CellRecord, device: DeviceMeasurement | None) -> str:
        return "" if device is None else format_bytes(read(device), signed=signed)

    return value


def _growing(record: CellRecord, device: DeviceMeasurement | None) -> str:
    """A cell run again that left memory again: its growth per run and how many runs (``repeats.run_growth``)."""
    growth = record.growth
    return "" if growth is None else f"{format_bytes(growth.per_run_bytes, signed=True)}/run ×{growth.runs}"


def _source(record: CellRecord, device: DeviceMeasurement | None) -> str:
    error = record.measurement.error
    return record.source_head + (f" ({error})" if error else "")


COLUMNS: tuple[Column, ...] = (
    Column("cell", lambda record, device: record.label, "left"),
    Column("source", _source, "left"),
    Column("device", lambda record, device: "" if device is None else device.device.label, "left"),
    Column("peak", _bytes(lambda device: device.peak_allocated_bytes)),
    Column("Δ allocated", _bytes(lambda device: device.allocated_delta_bytes, signed=True)),
    Column("Δ reserved", _bytes(lambda device: device.reserved_delta_bytes, signed=True)),
    Column("Δ NVML", _bytes(lambda device: device.nvml_used_delta_bytes, signed=True)),
    Column("time", lambda record, device: format_seconds(record.measurement.wall_s)),
    Column("growing", _growing),
)


@dataclass(frozen=True)
class Summary:
    """The cells a bounded table leaves out, in one line: how many, which, the highest peak, failures."""

    cells: int
    first_label: str
    last_label: str
    peak_bytes: int | None
    peak_label: str
    peak_device: str
    failed: int
    out_of_memory: int
    wall_s: float

    @classmethod
    def of(cls, records: Sequence[CellRecord]) -> Summary:
        peak_bytes: int | None = None
        peak_label = peak_device = ""
        failed = out_of_memory = 0
        wall_s = 0.0
        for record in records:
            measurement = record.measurement
            wall_s += measurement.wall_s
            if measurement.error:
                failed += 1
                out_of_memory += measurement.error == "OutOfMemoryError"
            for device in measurement.devices:
                peak = device.peak_allocated_bytes
                if peak is not None and (peak_bytes is None or peak > peak_bytes):
                    peak_bytes, peak_label, peak_device = peak, record.label, device.device.label
        first, last = (records[0].label, records[-1].label) if records else ("", "")
        return cls(len(records), first, last, peak_bytes, peak_label, peak_device, failed, out_of_memory, wall_s)

    def text(self) -> str:
        parts = [f"{self.cells:,} earlier cells ({self.first_label} to {self.last_label}) not shown"]
        if self.peak_bytes is not None:
            parts.append(f"highest peak {format_bytes(self.peak_bytes)} in {self.peak_label} on {self.peak_device}")
        if self.failed:
            oom = f" ({self.out_of_memory:,} out of memory)" if self.out_of_memory else ""
            parts.append(f"{self.failed:,} failed{oom}")
        parts.append(f"{format_seconds(self.wall_s)} of cell time")
        return "… " + "; ".join(parts)


HINT = "%cudamem_history --all shows every cell, --last N or --cells 5-9 some, -o the records for pandas"


class HistoryTable(TextReport):
    """A view of history records; ``display()`` it or print it.

    ``shown`` caps the cells listed (the latest ones; None lists all), the rest become one summary line.
    """

    def __init__(
        self,
        records: Sequence[CellRecord],
        shown: int | None = DEFAULT_SHOWN_CELLS,
        columns: Sequence[Column] = COLUMNS,
    ):
        self.records = records
        self.columns = tuple(columns)
        hidden = 0 if shown is None else max(len(records) - shown, 0)
        self.summary = Summary.of(records[:hidden]) if hidden else None
        self.shown_records = records[hidden:]

    def rows(self) -> list[tuple[str, ...]]:
        """The text of each listed row: one per cell and device."""
        rows = []
        for record in self.shown_records:
            for device in record.measurement.devices or (None,):
                rows.append(tuple(column.value(record, device) for column in self.columns))
        return rows

    def text(self) -> str:
        rows = self.rows()
        if not rows:
            return "cudamem history is empty: measure cells with %%cudamem or %cudamem on"
        headers = tuple(column.header for column in self.columns)
        widths = [max(len(header), *(len(row[i]) for row in rows)) for i, header in enumerate(headers)]

        def line(row: tuple[str, ...]) -> str:
            cells = (
                value.ljust(width) if column.align == "left" else value.rjust(width)
                for value, width, column in zip(row, widths, self.columns)
            )
            return "  ".join(cells).rstrip()

        lines = [line(headers), line(tuple("-" * width for width in widths))]
        if self.summary is not None:
            lines.append(self.summary.text())
        lines.extend(line(row) for row in rows)
        if self.summary is not None:
            lines.append(f"({HINT})")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        rows = self.rows()
        if not rows:
            return f"<div>{html.escape(self.text())}</div>"
        # Alignment by class and one style block (as pandas does), not a style attribute on every cell:
        # the whole table asked for with --all stays about as small as its text.
        left = [' class="l"' if column.align == "left" else "" for column in self.columns]
        head = "".join(f"<th{cls}>{html.escape(column.header)}</th>" for column, cls in zip(self.columns, left))
        body = []
        if self.summary is not None:
            body.append(
                f'<tr class="cudamem-history-summary"><td class="l" colspan="{len(self.columns)}">'
                f"<i>{html.escape(self.summary.text())}</i></td></tr>"
            )
        for row in rows:
            body.append(
                "<tr>" + "".join(f"<td{cls}>{html.escape(value)}</td>" for value, cls in zip(row, left)) + "</tr>"
            )
        caption = ""
        if self.summary is not None:
            caption = f'<caption style="caption-side:bottom;text-align:left">{html.escape(HINT)}</caption>'
        return (
            f"<style>{_STYLE}</style>"
            f'<table class="cudamem-history" style="white-space:nowrap">{caption}'
            f"<thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"
        )


_STYLE = (
    "table.cudamem-history th, table.cudamem-history td {text-align:right} table.cudamem-history .l {text-align:left}"
)
