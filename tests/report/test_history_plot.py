"""The history plot: one size at any history length, bins that keep every extreme, flags that show."""

from __future__ import annotations

import math
import struct

import pytest

from jupyter_cudamem.errors import CudaMemError
from jupyter_cudamem.history import CellRecord
from jupyter_cudamem.measure import Meter
from jupyter_cudamem.report.plot import (
    FIGURE_SIZE_IN,
    MAX_BARS,
    MAX_BINS,
    PNG_DPI,
    Flag,
    HistoryPlot,
    bin_history,
    history_figure,
)

GiB = 1024**3


def _png_size(png: bytes) -> tuple[int, int]:
    assert png.startswith(b"\x89PNG")
    return struct.unpack(">II", png[16:24])


def _peaks(record: CellRecord) -> list[int]:
    return [d.peak_allocated_bytes for d in record.measurement.devices if d.peak_allocated_bytes is not None]


@pytest.mark.parametrize("count", [10, 1_000, 100_000])
def test_figure_keeps_one_size_and_a_bounded_number_of_points(day, count):
    plot = HistoryPlot(day[:count])
    assert _png_size(plot.png()) == (FIGURE_SIZE_IN[0] * PNG_DPI, FIGURE_SIZE_IN[1] * PNG_DPI)
    [axes] = plot.figure().axes
    points = sum(len(line.get_xdata()) for line in axes.get_lines())
    assert points <= 3 * MAX_BINS  # peak line, allocated-after line, flags: never one per cell


def test_bins_keep_the_lowest_and_highest_peak_of_their_cells(day):
    records = day[:10_000]
    binned = bin_history(records, max_bins=MAX_BINS)
    assert binned.cells_per_bin == math.ceil(10_000 / MAX_BINS) and binned.bins <= MAX_BINS
    [series] = binned.devices
    for index in range(binned.bins):
        members = records[index * binned.cells_per_bin : (index + 1) * binned.cells_per_bin]
        peaks = [peak for record in members for peak in _peaks(record)]
        if peaks:  # cells without a reading stand at what was left allocated, so they can only widen the band
            assert series.peak_high[index] >= max(peaks)
            assert series.peak_low[index] <= min(peaks)
    highest = max(peak for record in records for peak in _peaks(record))
    assert max(series.peak_high) == highest  # the one highest cell survives the binning


def test_a_cell_that_touched_no_device_stands_at_what_was_left_allocated(machine, hardware):
    meter = Meter(hardware)
    records = []
    for number, size in enumerate([2 * GiB, 0, 0, GiB], start=1):
        baseline = meter.start()
        if size:
            machine.allocate(0, size)
        records.append(CellRecord(number, "cell", meter.stop(baseline)))
    assert [len(r.measurement.devices) for r in records] == [1, 0, 0, 1]
    [series] = bin_history(records, max_bins=10).devices
    assert series.peak_high == [2 * GiB, 2 * GiB, 2 * GiB, 3 * GiB]
    assert series.allocated_after_high == [2 * GiB, 2 * GiB, 2 * GiB, 3 * GiB]


def test_one_out_of_memory_cell_among_many_is_marked(day):
    records = day[:50_000]
    failures = [position for position, record in enumerate(records) if record.measurement.error == "OutOfMemoryError"]
    binned = bin_history(records)
    assert binned.flagged_bins["out of memory"] == sorted({p // binned.cells_per_bin for p in failures})
    # The figure draws them as markers in a row along the top, named in the legend.
    figure = history_figure(records)
    assert "out of memory" in [text.get_text() for text in figure.axes[0].get_legend().get_texts()]


def test_more_flags_are_specs(day):
    even = Flag("even cell", lambda record: record.execution_count % 2 == 0, "o", "#2ca02c")
    binned = bin_history(day[:100], max_bins=10, flags=(even,))
    assert binned.flagged_bins == {"even cell": list(range(10))}


def test_few_cells_are_labelled_bars_many_are_labelled_by_cell_number(day):
    few = history_figure(day[:MAX_BARS]).axes[0]
    assert len(few.patches) == MAX_BARS
    assert [label.get_text() for label in few.get_xticklabels()] == [f"[{n}]" for n in range(1, MAX_BARS + 1)]
    many = history_figure(day[:20_000]).axes[0]
    many.figure.canvas.draw()
    labels = [label.get_text() for label in many.get_xticklabels() if label.get_text()]
    assert 3 <= len(labels) <= 10 and all(label.startswith("[") and label.endswith("]") for label in labels)
    assert "20,000 cells, [1] to [20000]" in many.get_title()


def test_save_png_svg_and_refuses_other_formats(day, tmp_path):
    plot = HistoryPlot(day[:500])
    assert plot.save(tmp_path / "h.png") == f"cudamem history plot of 500 cells saved to {tmp_path / 'h.png'}"
    assert (tmp_path / "h.png").read_bytes() == plot.png()
    plot.save(tmp_path / "h.svg")
    assert (tmp_path / "h.svg").read_text().lstrip().startswith("<?xml")
    with pytest.raises(CudaMemError, match="use .png, .svg or .pdf"):
        plot.save(tmp_path / "h.jpeg")


def test_terminals_get_a_line_of_text(day):
    assert repr(HistoryPlot(day[:30])) == (
        "cudamem history plot: 30 cells, [1] to [30] (a figure: shown in notebooks; save it with --save FILE.png)"
    )


def test_nothing_to_plot_is_a_clear_error():
    with pytest.raises(CudaMemError, match="nothing to plot"):
        HistoryPlot([])


def _rgba(artist) -> tuple[float, ...]:
    """The colour an element is drawn in, alpha applied, for a bar, a band or a line alike."""
    from matplotlib.colors import to_rgba
    from matplotlib.lines import Line2D

    if isinstance(artist, Line2D):
        return tuple(round(v, 3) for v in to_rgba(artist.get_color(), artist.get_alpha()))
    face = artist.get_facecolor()
    face = face[0] if getattr(face, "ndim", 1) == 2 else face  # a band's collection: one row per polygon
    return tuple(round(float(v), 3) for v in face)


def _legend_matches_drawn(figure) -> list[tuple[str, tuple[float, ...]]]:
    """The legend's (label, colour) entries, after checking each is a drawn bar, band or line and back."""
    [axes] = figure.axes
    drawn = [(c.get_label(), _rgba(c.patches[0])) for c in axes.containers]
    drawn += [(line.get_label(), _rgba(line)) for line in axes.get_lines()]
    drawn += [(band.get_label(), _rgba(band)) for band in axes.collections]
    legend = axes.get_legend()
    entries = [(text.get_text(), _rgba(handle)) for text, handle in zip(legend.get_texts(), legend.legend_handles)]
    assert sorted(entries) == sorted(entry for entry in drawn if not entry[0].startswith("_"))
    return entries


def test_every_legend_entry_is_a_drawn_bar_band_or_line_in_its_colour(day, machine):
    from tests.fakes import FakeAllocator, FakeGpu, FakeMachine, FakeNvml
    from jupyter_cudamem.hardware import Hardware

    two = FakeMachine(gpus=[FakeGpu(), FakeGpu()])
    meter = Meter(Hardware(FakeAllocator(two), FakeNvml(two), pid=two.pid, pid_exists=lambda pid: True))
    records = []
    for number, (first, second) in enumerate([(GiB, 0), (0, 2 * GiB), (GiB, GiB)], start=1):
        baseline = meter.start()
        two.allocate(0, first)
        two.allocate(1, second)
        records.append(CellRecord(number, "cell", meter.stop(baseline)))
    bars = _legend_matches_drawn(history_figure(records))
    # Two devices as bars: each device's bar and its allocated-after line, in the device's colour (C0, C1).
    assert [label for label, _ in bars] == [
        "cuda:0 peak allocated", "cuda:0 allocated after", "cuda:1 peak allocated", "cuda:1 allocated after"]
    assert bars[0][1] == (0.122, 0.467, 0.706, 0.85) and bars[1][1] == (0.122, 0.467, 0.706, 1.0)
    # Many cells as lines, a band of the peaks in each step, and the flags' markers.
    steps = _legend_matches_drawn(history_figure(day[:5_000]))
    assert {"cuda:0 range of peaks", "cuda:0 peak allocated", "cuda:0 allocated after", "out of memory"} <= {
        label for label, _ in steps}
