"""Matplotlib figures of the history, built without pyplot so no global figure state is touched.

The figure has one size whatever the history holds. Up to ``MAX_BARS`` cells each gets a labelled bar;
beyond that the cells are binned by their position, at most ``MAX_BINS`` bins, and each bin is drawn as
the range of its cells' peaks (a band from the lowest to the highest) with the highest as a line: at the
figure's width two bins share a pixel column at most, so nothing is lost that the screen could have shown,
and drawing costs the same at 100,000 cells as at 1,000. Only the aggregation reads every record.

Marks for individual cells (out of memory now) are specs in ``FLAGS``: a label, which records it marks, a
marker and a colour. A bin holding a flagged cell carries the mark, so one failure among 100,000 cells
still shows.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..collector import collector_paused
from ..errors import CudaMemError
from ..history import CellRecord
from ..units import GiB, KiB, MiB, format_bytes
from .text import TextReport

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

# Fixed size: 9 x 3.6 inches is 900 x 360 pixels at the 100 dpi we render at, about 650 of them for the
# plotting area once the axis labels and the legend on the right have theirs.
FIGURE_SIZE_IN = (9.0, 3.6)
PNG_DPI = 100
# Up to this many cells, one bar each with its In [N] under it; more bars than this get too thin to label.
MAX_BARS = 40
# Bins across ~650 pixels: two pixel columns per bin keep a single spike visible, and no bin is finer
# than the screen can show.
MAX_BINS = 300

SAVE_FORMATS = ("png", "svg", "pdf")
_UNITS = (("GiB", GiB), ("MiB", MiB), ("KiB", KiB), ("B", 1))


@dataclass(frozen=True)
class Flag:
    """A mark for cells ``applies`` picks out, drawn over the bin that holds them; where each cell has a bar
    of its own, ``note(record)`` (if given) is written beside its mark."""

    label: str
    applies: Callable[[CellRecord], bool]
    marker: str
    color: str
    note: Callable[[CellRecord], str] | None = None


def _growth_note(record: CellRecord) -> str:
    growth = record.growth
    return "" if growth is None else f"{format_bytes(growth.per_run_bytes, signed=True)}/run"


FLAGS: tuple[Flag, ...] = (
    Flag("out of memory", lambda record: record.measurement.error == "OutOfMemoryError", "X", "#d62728"),
    Flag("growing (left memory again)", lambda record: record.growth is not None, "^", "#9467bd", _growth_note),
)


@dataclass
class DeviceSeries:
    """One device's values per bin, in bytes; NaN where no cell of the bin measured this device."""

    label: str
    peak_low: list[float]
    peak_high: list[float]
    allocated_after_high: list[float]


@dataclass
class BinnedHistory:
    """The records reduced to at most ``max_bins`` bins of ``cells_per_bin`` consecutive cells each."""

    cells: int
    cells_per_bin: int
    devices: list[DeviceSeries]
    flagged_bins: dict[str, list[int]] = field(default_factory=dict)

    @property
    def bins(self) -> int:
        return math.ceil(self.cells / self.cells_per_bin) if self.cells else 0

    def bin_center(self, index: int) -> float:
        """The bin's middle on the axis of record positions (0 is the first record)."""
        first = index * self.cells_per_bin
        last = min(first + self.cells_per_bin, self.cells) - 1
        return (first + last) / 2


def bin_history(
    records: Sequence[CellRecord], max_bins: int = MAX_BINS, flags: Sequence[Flag] = FLAGS
) -> BinnedHistory:
    """Lowest and highest peak and highest allocated-after per bin and device, and the bins each flag marks.

    A cell that did not touch a device has no reading of it: what was allocated there stayed as the last
    reading left it, so that value stands for the cell's peak and allocated-after (every-cell mode records
    only the devices a cell touched, and most cells touch none). This loop is the only part of a plot whose
    cost grows with the history: about 1-2 µs a record.
    """
    cells = len(records)
    per_bin = max(1, math.ceil(cells / max(max_bins, 1)))
    bins = math.ceil(cells / per_bin) if cells else 0
    tracks: dict[str, _Track] = {}
    labels: dict[int, str] = {}  # id(Device) -> label: records share their Device objects
    flagged: dict[str, list[int]] = {flag.label: [] for flag in flags}
    for position, record in enumerate(records):
        index = position // per_bin
        devices = record.measurement.devices
        for device in devices:
            peak = device.peak_allocated_bytes
            if peak is None:
                continue
            label = labels.get(id(device.device))
            if label is None:
                label = labels[id(device.device)] = device.device.label
            track = tracks.get(label)
            if track is None:
                track = tracks[label] = _Track(bins)
            reading = device.after.allocator
            track.add(index, float(peak), float(reading.allocated_bytes) if reading is not None else math.nan)
            track.seen_at = position
        for track in tracks.values():
            if track.seen_at != position and not math.isnan(track.held):
                track.add(index, track.held, track.held)
        for flag in flags:
            marked = flagged[flag.label]
            if (not marked or marked[-1] != index) and flag.applies(record):
                marked.append(index)

    series = [
        DeviceSeries(label, _finite(track.low), _finite(track.high), _finite(track.after))
        for label, track in sorted(tracks.items())
    ]
    return BinnedHistory(cells, per_bin, series, flagged)


def _finite(values: list[float]) -> list[float]:
    """``values`` with the infinities a bin starts from (a bin no reading reached) as NaN."""
    return [value if math.isfinite(value) else math.nan for value in values]


class _Track:
    """One device's running extremes per bin while ``bin_history`` reads the records."""

    __slots__ = ("after", "held", "high", "low", "seen_at")

    def __init__(self, bins: int):
        self.low = [math.inf] * bins
        self.high = [-math.inf] * bins
        self.after = [-math.inf] * bins
        self.held = math.nan  # allocated after this device's last reading
        self.seen_at = -1

    def add(self, index: int, peak: float, left: float) -> None:
        if peak < self.low[index]:
            self.low[index] = peak
        if peak > self.high[index]:
            self.high[index] = peak
        if left > self.after[index]:
            self.after[index] = left
        self.held = left


def _unit(largest_bytes: float) -> tuple[str, int]:
    for name, size in _UNITS:
        if largest_bytes >= size:
            return name, size
    return _UNITS[0]


def _draw_flags(
    axes: Axes,
    drawn: list[Any],
    binned: BinnedHistory,
    centers: list[float],
    records: Sequence[CellRecord] | None,
    flags: Sequence[Flag],
) -> int:
    """Draw each flag's marks in a row of its own along the top edge (axes coordinates), clear of the data,
    adding them to ``drawn``; with ``records`` (one cell per bin: bars) each mark carries its flag's note.
    Returns the number of rows drawn."""
    rows = 0
    for flag in flags:
        marked = binned.flagged_bins.get(flag.label) or []
        if not marked:
            continue
        drawn += axes.plot(
            [centers[index] for index in marked],
            [0.97 - 0.06 * rows] * len(marked),
            transform=axes.get_xaxis_transform(),
            linestyle="none",
            marker=flag.marker,
            color=flag.color,
            markersize=6,
            clip_on=False,
            label=flag.label,
        )
        if records is not None and flag.note is not None:
            for index in marked:
                axes.annotate(
                    flag.note(records[index]), (centers[index], 0.97 - 0.06 * rows),
                    xycoords=axes.get_xaxis_transform(), xytext=(5, -3), textcoords="offset points",
                    fontsize=7, color=flag.color, clip_on=False,
                )
        rows += 1
    return rows


def history_figure(records: Sequence[CellRecord], flags: Sequence[Flag] = FLAGS) -> Figure:
    """Each cell's peak allocated and what it left allocated, per device, in a figure of fixed size."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    binned = bin_history(records, MAX_BARS if len(records) <= MAX_BARS else MAX_BINS, flags)
    if not binned.devices:
        raise CudaMemError("nothing to plot: no measured cell used PyTorch's allocator yet")
    largest = max(value for series in binned.devices for value in series.peak_high if not math.isnan(value))
    unit, scale = _unit(largest)

    # Fixed margins rather than constrained layout: the size never changes, and solving the layout took a
    # third of the time of a whole plot.
    figure = Figure(figsize=FIGURE_SIZE_IN)
    figure.subplots_adjust(left=0.07, right=0.79, bottom=0.14, top=0.9)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    centers = [binned.bin_center(index) for index in range(binned.bins)]
    as_bars = len(records) <= MAX_BARS
    width = 0.8 / len(binned.devices)
    # The legend is the drawn elements themselves, labelled, in the order drawn (device by device): each
    # entry is a bar, band or line of the figure in its own colour and alpha.
    drawn: list[Any] = []
    for number, series in enumerate(binned.devices):
        color = f"C{number % 10}"
        high = [value / scale for value in series.peak_high]
        after = [value / scale for value in series.allocated_after_high]
        peak_label, after_label = f"{series.label} peak allocated", f"{series.label} allocated after"
        if as_bars:
            xs = [x + number * width - 0.4 + width / 2 for x in centers]
            drawn.append(axes.bar(xs, high, width=width, color=color, alpha=0.85, label=peak_label))
            drawn += axes.plot(xs, after, marker="o", markersize=3, linestyle="--", linewidth=1, color=color, label=after_label)
        else:
            if binned.cells_per_bin > 1:
                low = [value / scale for value in series.peak_low]
                drawn.append(axes.fill_between(centers, low, high, step="mid", color=color, alpha=0.25, linewidth=0,
                                               label=f"{series.label} range of peaks"))
            drawn += axes.plot(centers, high, drawstyle="steps-mid", linewidth=1.2, color=color, label=peak_label)
            drawn += axes.plot(centers, after, drawstyle="steps-mid", linestyle="--", linewidth=1, color=color, label=after_label)
    rows = _draw_flags(axes, drawn, binned, centers, records if as_bars else None, flags)

    def cell_label(x: float, _position: int | None = None) -> str:
        index = round(x)
        return records[index].label if 0 <= index < len(records) and abs(x - index) < 0.01 else ""

    if as_bars:
        rotated = len(records) > 12
        axes.set_xticks(centers, [record.label for record in records], rotation=45 if rotated else 0)
        if rotated:
            figure.subplots_adjust(bottom=0.22)
    else:
        axes.xaxis.set_major_locator(MaxNLocator(nbins=8, integer=True))
        axes.xaxis.set_major_formatter(FuncFormatter(cell_label))
        axes.set_xlim(-0.5, len(records) - 0.5)
    top = largest / scale if largest > 0 else 1.0
    axes.set_ylim(0, top * (1.12 + 0.06 * rows))  # headroom for the rows of flags
    axes.set_xlabel("cell")
    axes.set_ylabel(unit)
    span = f"{len(records):,} cells, {records[0].label} to {records[-1].label}"
    if binned.cells_per_bin > 1:
        span += f"; {binned.cells_per_bin:,} cells per step"
    axes.set_title(f"GPU memory per cell ({span})", fontsize=10)
    axes.legend(handles=drawn, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0, fontsize="small")
    return figure




def figure_png(figure: Figure, dpi: int = PNG_DPI) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=dpi)
    return buffer.getvalue()


class HistoryPlot(TextReport):
    """The history figure as a displayable object: a PNG in notebooks, a line of text in terminals."""

    def __init__(self, records: Sequence[CellRecord], flags: Sequence[Flag] = FLAGS):
        self.records = records
        self.flags = tuple(flags)
        self._png: bytes | None = None
        if not any(
            device.peak_allocated_bytes is not None for record in records for device in record.measurement.devices
        ):
            raise CudaMemError("nothing to plot: no measured cell used PyTorch's allocator yet")

    def figure(self) -> Figure:
        return history_figure(self.records, self.flags)

    def png(self) -> bytes:
        if self._png is None:
            with collector_paused():
                self._png = figure_png(self.figure())
        return self._png

    def _repr_png_(self) -> bytes:
        return self.png()

    def save(self, path: str | Path) -> str:
        """Write the figure to ``path`` (.png, .svg or .pdf, by its extension) and say so in one line."""
        target = Path(path)
        kind = target.suffix.lower().lstrip(".")
        if kind not in SAVE_FORMATS:
            raise CudaMemError(
                f"cannot save the plot as {target.suffix or 'a file without extension'}: use .png, .svg or .pdf"
            )
        if kind == "png":
            target.write_bytes(self.png())
        else:
            self.figure().savefig(target, format=kind)
        return f"cudamem history plot of {len(self.records):,} cells saved to {target}"

    def text(self) -> str:
        if not self.records:
            return "cudamem history plot: no cells"
        return (
            f"cudamem history plot: {len(self.records):,} cells, {self.records[0].label} to {self.records[-1].label} "
            "(a figure: shown in notebooks; save it with --save FILE.png)"
        )
