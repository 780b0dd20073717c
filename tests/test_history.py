import csv
import json

import pytest

from jupyter_cudamem.errors import CudaMemError
from jupyter_cudamem.history import CellRecord, History, source_head
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
    rows = json.loads(history.save(tmp_path / "h.json").read_text())
    assert rows[0]["execution_count"] == 7
    with (history.save(tmp_path / "h.csv")).open() as handle:
        [row] = list(csv.DictReader(handle))
    assert int(row["peak_above_start_bytes"]) == GiB
    with pytest.raises(CudaMemError, match="use .csv or .json"):
        history.save(tmp_path / "h.xlsx")
