"""The history table: bounded by default whatever the history holds, whole on request, columns as specs."""

from __future__ import annotations

import re

import pytest

from jupyter_cudamem.history import CellRecord
from jupyter_cudamem.report.table import COLUMNS, DEFAULT_SHOWN_CELLS, Column, HistoryTable, Summary

# Nothing here runs a library whose version `make test-min` changes (tests/versioned.py).
pytestmark = pytest.mark.dependency_free

GiB = 1024**3


def _listed_cells(text: str) -> list[int]:
    return [int(number) for number in re.findall(r"^\[(\d+)\]", text, flags=re.MULTILINE)]


@pytest.mark.parametrize("count", [10_000, 100_000])
def test_default_table_is_bounded_in_text_and_html(day, count):
    table = HistoryTable(day[:count])
    text, markup = table.text(), table._repr_html_()
    assert len(text.encode()) < 6_000 and len(markup.encode()) < 12_000
    assert _listed_cells(text) == list(range(count - DEFAULT_SHOWN_CELLS + 1, count + 1))
    assert f"{count - DEFAULT_SHOWN_CELLS:,} earlier cells ([1] to [{count - DEFAULT_SHOWN_CELLS}]) not shown" in text
    assert markup.count("<tr>") == len(table.rows()) + 1  # the header row and the listed rows
    assert "cudamem-history-summary" in markup and "--all" in markup


def test_the_bound_does_not_grow_with_the_history(day):
    sizes = [len(HistoryTable(day[:count])._repr_html_()) for count in (1_000, 10_000, 100_000)]
    assert max(sizes) - min(sizes) < 200  # only the numbers in the summary line get longer


def test_all_lists_every_cell(day):
    records = day[:3_000]
    table = HistoryTable(records, shown=None)
    assert table.summary is None
    assert _listed_cells(table.text()) == list(range(1, 3_001))
    assert len(table.rows()) == sum(max(len(record.measurement.devices), 1) for record in records)


def test_summary_names_the_highest_peak_failures_and_span(day):
    hidden = day[:5_000]
    summary = Summary.of(hidden)
    peaks = [(d.peak_allocated_bytes, r.label) for r in hidden for d in r.measurement.devices]
    highest, label = max(peaks, key=lambda item: item[0])
    assert (summary.cells, summary.first_label, summary.last_label) == (5_000, "[1]", "[5000]")
    assert (summary.peak_bytes, summary.peak_label, summary.peak_device) == (highest, label, "cuda:0")
    failed = [r for r in hidden if r.measurement.error]
    assert summary.failed == len(failed) > 0
    assert summary.out_of_memory == sum(r.measurement.error == "OutOfMemoryError" for r in failed)
    assert f"{summary.failed:,} failed ({summary.out_of_memory:,} out of memory)" in summary.text()


def test_a_short_history_is_listed_whole_without_a_summary(day):
    table = HistoryTable(day[:5])
    assert table.summary is None
    assert "not shown" not in table.text() and "cudamem-history-summary" not in table._repr_html_()


def test_an_added_column_shows_in_text_and_html(day):
    """A per-record figure (such as a flag for cells that grow again when rerun) is one more Column."""
    wall = Column("even?", lambda record, device: "yes" if record.execution_count % 2 == 0 else "", "left")
    table = HistoryTable(day[:30], columns=(*COLUMNS, wall))
    header = table.text().splitlines()[0]
    assert header.rstrip().endswith("even?")
    assert '<th class="l">even?</th>' in table._repr_html_()
    assert all(row[-1] == ("yes" if int(row[0][1:-1]) % 2 == 0 else "") for row in table.rows())


def test_source_and_errors_are_escaped_in_html(machine, hardware):
    from jupyter_cudamem.measure import Meter

    meter = Meter(hardware)
    baseline = meter.start()
    machine.allocate(0, GiB)
    record = CellRecord(3, "x = '<b>' & y", meter.stop(baseline, error="ValueError"))
    markup = HistoryTable([record])._repr_html_()
    assert "x = &#x27;&lt;b&gt;&#x27; &amp; y (ValueError)" in markup


def test_empty_history_says_how_to_fill_it():
    assert "%cudamem on" in HistoryTable([]).text()
