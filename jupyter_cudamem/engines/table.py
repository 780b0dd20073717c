"""The engines' reports as one table (HTML and text), with the spread between engines and the straggler.

A data-parallel job runs the same cell on every engine; the engine whose peak stands closest to what it
may hold (its card, or its per-process cap) is the one that runs out of memory first when the batch grows,
so the table names it. Engines on one card are told apart by their process ids and NVML's per-process
figures, and a card is named by host and UUID, so rows from several hosts never merge by ``cuda:N``.
"""

from __future__ import annotations

import html
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from ..report.text import TextReport
from ..units import format_bytes, format_seconds
from .records import EngineAnswer, EngineCell, EngineDevice, EngineStatus

UUID_SHOWN_CHARS = 12  # "GPU-8f4a2c1d": enough to tell cards apart in a table; the records keep it whole


def short_uuid(uuid: str | None) -> str:
    if not uuid:
        return "no UUID"
    return uuid if len(uuid) <= UUID_SHOWN_CHARS else uuid[:UUID_SHOWN_CHARS] + "…"


@dataclass(frozen=True)
class Row:
    """One engine and one device of the cell shown (``device`` None: nothing measured to show)."""

    answer: EngineAnswer
    cell: EngineCell | None
    device: EngineDevice | None

    @property
    def host(self) -> str:
        return "" if self.answer.report is None else self.answer.report.identity.host


@dataclass(frozen=True)
class Column:
    header: str
    value: Callable[[Row], str]
    align: str = "right"


def _bytes(read: Callable[[EngineDevice], int | None], signed: bool = False) -> Callable[[Row], str]:
    return lambda row: "" if row.device is None else format_bytes(read(row.device), signed=signed)


def _rank(row: Row) -> str:
    report = row.answer.report
    if report is None or report.identity.rank is None:
        return ""
    return f"{report.identity.rank}/{report.identity.world_size}"


def _device(row: Row) -> str:
    if row.device is None:
        return ""
    return f"{row.device.label} {short_uuid(row.device.uuid)}"


def _cell(row: Row) -> str:
    if row.cell is None:
        answer = row.answer
        if answer.status is EngineStatus.ANSWERED:
            return "no measured cell yet"
        return answer.status.value + (f": {answer.note}" if answer.note else "")
    error = f" ({row.cell.error})" if row.cell.error else ""
    return f"{row.cell.label} {row.cell.source_head}{error}"


def _share(row: Row) -> str:
    device = row.device
    if device is None or device.peak_allocated_bytes is None or not device.limit_bytes:
        return ""
    return f"{device.peak_allocated_bytes / device.limit_bytes:.1%}"


COLUMNS: tuple[Column, ...] = (
    Column("engine", lambda row: str(row.answer.engine_id)),
    Column("host", lambda row: row.host, "left"),
    Column("rank", _rank),
    Column("pid", lambda row: "" if row.answer.report is None else str(row.answer.report.identity.pid)),
    Column("device", _device, "left"),
    Column("cell", _cell, "left"),
    Column("peak", _bytes(lambda d: d.peak_allocated_bytes)),
    Column("of limit", _share),
    Column("peak rise", _bytes(lambda d: d.peak_above_start_bytes, signed=True)),
    Column("Δ allocated", _bytes(lambda d: d.allocated_delta_bytes, signed=True)),
    Column("Δ reserved", _bytes(lambda d: d.reserved_delta_bytes, signed=True)),
    Column("NVML process", _bytes(lambda d: d.process_bytes)),
    Column("outside PyTorch", _bytes(lambda d: d.outside_pytorch_delta_bytes, signed=True)),
    Column("time", lambda row: "" if row.cell is None else format_seconds(row.cell.wall_s)),
)


@dataclass(frozen=True)
class Spread:
    """How far apart the engines' peaks are, and which engine stands closest to its limit (the straggler)."""

    engines: int  # engines with a measured peak
    highest_peak_bytes: int
    lowest_peak_bytes: int
    straggler_engine: int
    straggler_host: str
    straggler_device: str
    straggler_peak_bytes: int
    straggler_limit_bytes: int

    @property
    def spread_bytes(self) -> int:
        return self.highest_peak_bytes - self.lowest_peak_bytes

    @property
    def straggler_share(self) -> float:
        return self.straggler_peak_bytes / self.straggler_limit_bytes if self.straggler_limit_bytes else 0.0

    def text(self) -> str:
        return (
            f"spread over {self.engines} engines: peaks from {format_bytes(self.lowest_peak_bytes)} to "
            f"{format_bytes(self.highest_peak_bytes)} ({format_bytes(self.spread_bytes)} apart); closest to its "
            f"limit: engine {self.straggler_engine} on {self.straggler_host} {self.straggler_device}, "
            f"{format_bytes(self.straggler_peak_bytes)} of {format_bytes(self.straggler_limit_bytes)} "
            f"({self.straggler_share:.1%}), the first to run out of memory as the work grows"
        )


def spread_of(rows: Sequence[Row]) -> Spread | None:
    """The spread of the rows' peaks (``None`` with fewer than two engines measured)."""
    measured = [r for r in rows if r.device is not None and r.device.peak_allocated_bytes is not None]
    if len({r.answer.engine_id for r in measured}) < 2:
        return None
    peaks = [r.device.peak_allocated_bytes for r in measured if r.device and r.device.peak_allocated_bytes is not None]

    def share(row: Row) -> float:
        device = row.device
        assert device is not None and device.peak_allocated_bytes is not None
        return device.peak_allocated_bytes / device.limit_bytes if device.limit_bytes else 0.0

    straggler = max(measured, key=share)
    device = straggler.device
    assert device is not None and device.peak_allocated_bytes is not None
    return Spread(
        engines=len({r.answer.engine_id for r in measured}),
        highest_peak_bytes=max(peaks),
        lowest_peak_bytes=min(peaks),
        straggler_engine=straggler.answer.engine_id,
        straggler_host=straggler.host,
        straggler_device=_device(straggler),
        straggler_peak_bytes=device.peak_allocated_bytes,
        straggler_limit_bytes=device.limit_bytes,
    )


def shared_cards(rows: Sequence[Row]) -> list[str]:
    """One line per card that several engines share (same host, same UUID), with each engine's process."""
    by_card: dict[tuple[str, str], list[Row]] = {}
    for row in rows:
        if row.device is not None and row.device.uuid:
            by_card.setdefault((row.host, row.device.uuid), []).append(row)
    lines = []
    for (host, uuid), sharing in by_card.items():
        engines = sorted({r.answer.engine_id for r in sharing})
        if len(engines) < 2:
            continue
        parts = []
        for r in sorted(sharing, key=lambda r: r.answer.engine_id):
            pid = "" if r.answer.report is None else f" (pid {r.answer.report.identity.pid})"
            held = "n/a" if r.device is None else format_bytes(r.device.process_bytes)
            parts.append(f"engine {r.answer.engine_id}{pid} {held}")
        lines.append(
            f"engines {', '.join(map(str, engines))} share {sharing[0].device.name if sharing[0].device else 'a GPU'} "
            f"{short_uuid(uuid)} on {host}; NVML per process: " + ", ".join(parts)
        )
    return lines


def oomfix_lines(answers: Sequence[EngineAnswer]) -> list[str]:
    """Which engines ran ``%oomfix`` and what each fixed."""
    lines = []
    for answer in answers:
        summary = None if answer.report is None else answer.report.oomfix
        if summary is not None:
            lines.append(f"engine {answer.engine_id}: {summary.headline}")
    return lines


def _grid_text(columns: Sequence[Column], rows: Sequence[tuple[str, ...]]) -> list[str]:
    headers = tuple(column.header for column in columns)
    widths = [max(len(header), *(len(row[i]) for row in rows)) for i, header in enumerate(headers)]

    def line(row: tuple[str, ...]) -> str:
        cells = (
            value.ljust(width) if column.align == "left" else value.rjust(width)
            for value, width, column in zip(row, widths, columns)
        )
        return "  ".join(cells).rstrip()

    return [line(headers), line(tuple("-" * width for width in widths)), *(line(row) for row in rows)]


_STYLE = "table.cudamem-engines th, table.cudamem-engines td {text-align:right} table.cudamem-engines .l {text-align:left}"


def _grid_html(columns: Sequence[Column], rows: Sequence[tuple[str, ...]], marked: Collection[int] = ()) -> str:
    left = [' class="l"' if column.align == "left" else "" for column in columns]
    head = "".join(f"<th{cls}>{html.escape(column.header)}</th>" for column, cls in zip(columns, left))
    body = []
    for index, row in enumerate(rows):
        style = ' style="color:#d62728"' if index in marked else ""
        body.append(f"<tr{style}>" + "".join(f"<td{cls}>{html.escape(v)}</td>" for v, cls in zip(row, left)) + "</tr>")
    return (
        f"<style>{_STYLE}</style><table class=\"cudamem-engines\" style=\"white-space:nowrap\">"
        f"<thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"
    )


class EnginesReport(TextReport):
    """The engines' latest measured cells: the table, the spread, shared cards and ``%oomfix`` outcomes.

    ``answers`` are the plain records (picklable); ``rows()`` flattens them for ``pandas.DataFrame``.
    """

    def __init__(self, answers: Sequence[EngineAnswer]):
        self.answers = tuple(sorted(answers, key=lambda a: a.engine_id))
        self.table_rows = self._rows()
        self.spread = spread_of(self.table_rows)

    def _rows(self) -> list[Row]:
        rows = []
        for answer in self.answers:
            cell = answer.latest
            for device in (cell.devices if cell is not None else ()) or (None,):
                rows.append(Row(answer, cell, device))
        return rows

    def engine(self, engine_id: int) -> EngineAnswer:
        return next(answer for answer in self.answers if answer.engine_id == engine_id)

    def rows(self) -> list[dict[str, str | int | float | None]]:
        """One flat dict per engine and device, sizes in bytes: ``pandas.DataFrame(report.rows())``."""
        flat = []
        for row in self.table_rows:
            identity = None if row.answer.report is None else row.answer.report.identity
            device = row.device
            flat.append(
                {
                    "engine": row.answer.engine_id,
                    "status": row.answer.status.value,
                    "host": None if identity is None else identity.host,
                    "pid": None if identity is None else identity.pid,
                    "rank": None if identity is None else identity.rank,
                    "execution_count": None if row.cell is None else row.cell.execution_count,
                    "source": None if row.cell is None else row.cell.source_head,
                    "error": None if row.cell is None else row.cell.error,
                    "device": None if device is None else device.label,
                    "device_uuid": None if device is None else device.uuid,
                    "peak_allocated_bytes": None if device is None else device.peak_allocated_bytes,
                    "limit_bytes": None if device is None else device.limit_bytes,
                    "peak_above_start_bytes": None if device is None else device.peak_above_start_bytes,
                    "allocated_delta_bytes": None if device is None else device.allocated_delta_bytes,
                    "reserved_delta_bytes": None if device is None else device.reserved_delta_bytes,
                    "process_bytes": None if device is None else device.process_bytes,
                    "outside_pytorch_delta_bytes": None if device is None else device.outside_pytorch_delta_bytes,
                    "wall_s": None if row.cell is None else row.cell.wall_s,
                }
            )
        return flat

    def _cells(self) -> list[tuple[str, ...]]:
        return [tuple(column.value(row) for column in COLUMNS) for row in self.table_rows]

    def _notes(self) -> list[str]:
        notes = []
        if self.spread is not None:
            notes.append(self.spread.text())
        notes.extend(shared_cards(self.table_rows))
        fixes = oomfix_lines(self.answers)
        if fixes:
            notes.append("%oomfix on the engines: " + "; ".join(fixes))
        return notes

    def text(self) -> str:
        if not self.answers:
            return "cudamem engines: no engines to ask"
        lines = ["cudamem engines: the latest measured cell of each engine", *_grid_text(COLUMNS, self._cells())]
        return "\n".join(lines + self._notes())

    def _straggler_rows(self) -> set[int]:
        if self.spread is None:
            return set()
        return {
            index
            for index, row in enumerate(self.table_rows)
            if row.answer.engine_id == self.spread.straggler_engine and _device(row) == self.spread.straggler_device
        }

    def _repr_html_(self) -> str:
        if not self.answers:
            return f"<div>{html.escape(self.text())}</div>"
        notes = "".join(f"<div>{html.escape(note)}</div>" for note in self._notes())
        return _grid_html(COLUMNS, self._cells(), self._straggler_rows()) + notes


HISTORY_COLUMNS: tuple[Column, ...] = (
    Column("engine", lambda row: str(row.answer.engine_id)),
    Column("host", lambda row: row.host, "left"),
    Column("cell", _cell, "left"),
    Column("device", _device, "left"),
    Column("peak", _bytes(lambda d: d.peak_allocated_bytes)),
    Column("Δ allocated", _bytes(lambda d: d.allocated_delta_bytes, signed=True)),
    Column("Δ reserved", _bytes(lambda d: d.reserved_delta_bytes, signed=True)),
    Column("NVML process", _bytes(lambda d: d.process_bytes)),
    Column("time", lambda row: "" if row.cell is None else format_seconds(row.cell.wall_s)),
)


class EnginesHistory(TextReport):
    """Each engine's measured cells (the latest ones each engine sent), engine by engine."""

    def __init__(self, answers: Sequence[EngineAnswer]):
        self.answers = tuple(sorted(answers, key=lambda a: a.engine_id))
        rows: list[Row] = []
        for answer in self.answers:
            cells = () if answer.report is None else answer.report.cells
            if not cells:
                rows.append(Row(answer, None, None))
            for cell in cells:
                for device in cell.devices or (None,):
                    rows.append(Row(answer, cell, device))
        self.table_rows = rows

    def _cells(self) -> list[tuple[str, ...]]:
        return [tuple(column.value(row) for column in HISTORY_COLUMNS) for row in self.table_rows]

    def _notes(self) -> list[str]:
        notes = []
        for answer in self.answers:
            report = answer.report
            if report is not None and report.cells_recorded > len(report.cells):
                notes.append(
                    f"engine {answer.engine_id}: the latest {len(report.cells)} of {report.cells_recorded:,} measured cells"
                )
        return notes

    def text(self) -> str:
        if not self.answers:
            return "cudamem engines: no engines to ask"
        return "\n".join(["cudamem engines: measured cells per engine", *_grid_text(HISTORY_COLUMNS, self._cells()), *self._notes()])

    def _repr_html_(self) -> str:
        if not self.answers:
            return f"<div>{html.escape(self.text())}</div>"
        return _grid_html(HISTORY_COLUMNS, self._cells()) + "".join(f"<div>{html.escape(n)}</div>" for n in self._notes())
