import csv
import json
import re

import pytest

from jupyter_cudamem.errors import CudaMemError
from jupyter_cudamem.history import CellRanges, CellRecord, History, source_head
from jupyter_cudamem.measure import Meter

GiB = 1024**3


def _record(machine, hardware, count, size):
    meter = Meter(hardware)
    baseline = meter.start()
    machine.allocate(0, size)
    return CellRecord(count, f"x{count} = alloc({size})", meter.stop(baseline))


def test_source_head_skips_magic_comments_and_blank_lines():
    assert source_head("%%cudamem -o\n\n# setup\nmodel = Net()\nmore") == "model = Net()"
    assert source_head("x" * 100).endswith("…") and len(source_head("x" * 100)) == 60


def test_records_are_flat_rows_pandas_can_load(machine, hardware):
    pandas = pytest.importorskip("pandas")
    history = History()
    history.add(_record(machine, hardware, 1, GiB))
    history.add(_record(machine, hardware, 2, 2 * GiB))
    frame = pandas.DataFrame(history.to_records())
    assert list(frame["execution_count"]) == [1, 2]
    assert list(frame["peak_above_start_bytes"]) == [GiB, 2 * GiB]
    assert list(frame["device"]) == ["cuda:0", "cuda:0"]


def test_history_is_bounded(machine, hardware):
    history = History(max_records=3)
    for count in range(5):
        history.add(_record(machine, hardware, count, 1))
    assert [r.execution_count for r in history] == [2, 3, 4]


def test_save_csv_and_json(tmp_path, machine, hardware):
    history = History()
    history.add(_record(machine, hardware, 7, GiB))
    saved = history.save(tmp_path / "h.json")
    assert (saved.rows, saved.cells) == (1, 1) and "1 cells (1 rows) saved to" in str(saved)
    rows = json.loads(saved.path.read_text())
    assert rows[0]["execution_count"] == 7
    with history.save(tmp_path / "h.csv").path.open() as handle:
        [row] = list(csv.DictReader(handle))
    assert int(row["peak_above_start_bytes"]) == GiB
    with pytest.raises(CudaMemError, match="use .csv or .json"):
        history.save(tmp_path / "h.xlsx")


def test_select_by_cell_ranges_then_the_latest(machine, hardware):
    history = History()
    for count in [1, 2, 3, 5, 8, 13, None]:
        history.add(_record(machine, hardware, count, 1))
    numbers = lambda records: [r.execution_count for r in records]
    assert numbers(history.select()) == [1, 2, 3, 5, 8, 13, None]
    assert numbers(history.select(cells="2-5")) == [2, 3, 5]
    assert numbers(history.select(cells="1, 8-")) == [1, 8, 13]  # a cell without a number is in no range
    assert numbers(history.select(last=2)) == [13, None]
    assert numbers(history.select(cells="1-8", last=2)) == [5, 8]
    assert numbers(history.select(last=100)) == [1, 2, 3, 5, 8, 13, None]


@pytest.mark.parametrize(
    "text, message",
    [("9-5", "ends before it starts; write 5-9"), ("5:9", "got '5:9'"), ("-5", "got '-5'"), (" ", "such as 12")],
)
def test_bad_cell_ranges_say_what_to_write(text, message):
    with pytest.raises(CudaMemError, match=re.escape(message)):
        CellRanges.parse(text)


def test_resizing_keeps_the_newest(machine, hardware):
    history = History(max_records=5)
    for count in range(5):
        history.add(_record(machine, hardware, count, 1))
    history.max_records = 2
    assert [r.execution_count for r in history] == [3, 4]
    history.max_records = 4
    history.add(_record(machine, hardware, 5, 1))
    assert [r.execution_count for r in history] == [3, 4, 5]
