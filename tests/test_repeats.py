"""Across runs: a cell run again that leaves memory again is flagged as growing, in the records, the
history table and the plot."""

from __future__ import annotations

from jupyter_cudamem.repeats import GROWTH_MIN_BYTES, run_growth, source_key
from jupyter_cudamem.history import CellRecord, History
from jupyter_cudamem.measure import Meter
from jupyter_cudamem.report.plot import history_figure
from jupyter_cudamem.report.table import HistoryTable

MiB = 1024**2
LEAKY = "for _ in range(40):\n    losses.append(model(x).sum())"


def _run(machine, hardware, history, source, left, freed=0):
    """Measure a 'cell' that allocates ``left`` and keeps it (freeing ``freed`` of earlier memory)."""
    meter = Meter(hardware)
    baseline = meter.start()
    machine.allocate(0, left)
    machine.free(0, freed)
    measurement = meter.stop(baseline)
    key = source_key(source)
    record = CellRecord(
        len(history), source, measurement, source_key=key, growth=run_growth(history.records, key, measurement)
    )
    history.add(record)
    return record


def test_a_cell_leaving_memory_again_is_growing_from_its_second_run(machine, hardware):
    history = History()
    first = _run(machine, hardware, history, LEAKY, 420 * MiB)
    assert first.growth is None  # a first run may build something that stays
    _run(machine, hardware, history, "model = Net()", 300 * MiB)  # other cells in between do not matter
    second = _run(machine, hardware, history, LEAKY + "\n", 430 * MiB)  # trailing whitespace: the same cell
    third = _run(machine, hardware, history, LEAKY, 410 * MiB)
    assert second.growth is not None and second.growth.runs == 2
    assert third.growth.runs == 3 and third.growth.per_run_bytes == 420 * MiB
    assert third.growth.left_bytes == (420 * MiB, 430 * MiB, 410 * MiB)
    assert "each run of this cell leaves about +420.00 MiB" in third.growth.describe()


def test_a_cell_that_replaces_what_it_made_is_not_growing(machine, hardware):
    history = History()
    _run(machine, hardware, history, "model = Net().cuda()", 300 * MiB)
    again = _run(machine, hardware, history, "model = Net().cuda()", 300 * MiB, freed=300 * MiB)
    assert again.growth is None
    small = _run(machine, hardware, history, "model = Net().cuda()", GROWTH_MIN_BYTES - 1)
    assert small.growth is None


def test_a_streak_ends_at_a_run_that_left_nothing(machine, hardware):
    history = History()
    _run(machine, hardware, history, LEAKY, 100 * MiB)
    _run(machine, hardware, history, LEAKY, 0)
    assert _run(machine, hardware, history, LEAKY, 100 * MiB).growth is None
    assert _run(machine, hardware, history, LEAKY, 100 * MiB).growth.runs == 2


def test_table_column_plot_mark_and_records_show_growth(machine, hardware):
    history = History()
    for _ in range(3):
        _run(machine, hardware, history, LEAKY, 64 * MiB)
    rows = HistoryTable(history.records).rows()
    assert [row[-1] for row in rows] == ["", "+64.00 MiB/run ×2", "+64.00 MiB/run ×3"]
    assert "growing" in HistoryTable(history.records).text().splitlines()[0]
    assert "+64.00 MiB/run ×3" in HistoryTable(history.records)._repr_html_()
    records = history.to_records()
    assert [r["growth_per_run_bytes"] for r in records] == [None, 64 * MiB, 64 * MiB]
    assert [r["growing_runs"] for r in records] == [None, 2, 3]
    figure = history_figure(history.records)
    axes = figure.axes[0]
    assert [t.get_text() for t in axes.texts] == ["+64.00 MiB/run", "+64.00 MiB/run"]
    assert "growing (left memory again)" in [t.get_text() for t in axes.get_legend().get_texts()]
