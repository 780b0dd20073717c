"""``%cudamem_history``: a bounded table by default, --all, --last, --cells, one line after --save, the plot."""

from __future__ import annotations

import json
import re

from tests import history_day
import pytest
from IPython.core.error import UsageError

from jupyter_cudamem import magics
from jupyter_cudamem.report.table import DEFAULT_SHOWN_CELLS


@pytest.fixture
def filled(shell):
    """The shell with 1,000 every-cell records in its history."""
    history = magics.loaded(shell).magics[0].history
    for record in history_day.cells(1_000):
        history.add(record)
    return shell


def _listed(out: str) -> list[int]:
    return [int(number) for number in re.findall(r"^\[(\d+)\]", out, flags=re.MULTILINE)]


def test_default_lists_the_latest_cells_and_sums_up_the_rest(filled, capsys):
    filled.run_cell("%cudamem_history")
    out = capsys.readouterr().out
    assert _listed(out) == list(range(1_001 - DEFAULT_SHOWN_CELLS, 1_001))
    assert f"{1_000 - DEFAULT_SHOWN_CELLS:,} earlier cells" in out and "--all" in out


def test_all_last_and_cells_pick_what_is_listed(filled, capsys):
    filled.run_cell("%cudamem_history --all")
    assert _listed(capsys.readouterr().out) == list(range(1, 1_001))
    filled.run_cell("%cudamem_history --last 3")
    assert _listed(capsys.readouterr().out) == [998, 999, 1_000]
    filled.run_cell("%cudamem_history --cells 5-9,12 --all")
    assert _listed(capsys.readouterr().out) == [5, 6, 7, 8, 9, 12]
    filled.run_cell("%cudamem_history --cells 100- --last 2")
    assert _listed(capsys.readouterr().out) == [999, 1_000]


def test_save_says_one_line_and_writes_the_selection(filled, capsys, tmp_path):
    target = tmp_path / "cells.json"
    filled.run_cell(f"%cudamem_history --cells 1-50 --save {target}")
    out = capsys.readouterr().out
    rows = json.loads(target.read_text())
    assert {row["execution_count"] for row in rows} == set(range(1, 51))
    assert out == f"cudamem history: 50 cells ({len(rows)} rows) saved to {target}\n"


@pytest.mark.parametrize("line", ['--save ""', "--save ''", "--save '  '", '--plot --save ""'])
def test_save_with_an_empty_path_is_refused(filled, capsys, line):
    result = filled.run_cell(f"%cudamem_history {line}")
    assert isinstance(result.error_in_exec, UsageError)
    message = str(result.error_in_exec)
    assert "--save takes a file" in message and "empty" in message and "\n" not in message
    assert "[1000]" not in capsys.readouterr().out  # nothing shown instead


@pytest.mark.parametrize("below", ["cells.csv", "runs/cells.csv"])
def test_save_below_a_file_says_which_is_not_a_folder(filled, capsys, tmp_path, below):
    blocker = tmp_path / "notes.txt"
    blocker.write_text("mine")
    target = blocker / below
    result = filled.run_cell(f"%cudamem_history --save {target}")
    assert isinstance(result.error_in_exec, UsageError)
    message = str(result.error_in_exec)
    assert message.startswith(f"cannot write {str(target)!r}: {str(blocker)!r} is not a folder"), message
    assert "\n" not in message and blocker.read_text() == "mine"


def test_output_shows_the_table_and_returns_the_selected_rows(filled, capsys):
    filled.run_cell("rows = %cudamem_history -o --last 10")
    assert [row["execution_count"] for row in filled.user_ns["rows"]][-1] == 1_000
    assert {row["execution_count"] for row in filled.user_ns["rows"]} == set(range(991, 1_001))
    out = capsys.readouterr().out
    assert "[1000]" in out and "[990]" not in out  # the table of the same selection, as without -o
    filled.run_cell("nothing = %cudamem_history --last 10")
    assert filled.user_ns["nothing"] is None


def test_plot_saves_in_one_line_and_shows_text_in_a_terminal(filled, capsys, tmp_path):
    target = tmp_path / "cells.png"
    result = filled.run_cell(f"%cudamem_history --plot --last 500 --save {target}")
    assert result.success
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"cudamem history plot of 500 cells saved to {target}"
    assert out[1].startswith("cudamem history plot: 500 cells, [501] to [1000]")
    assert target.read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize(
    "line, message",
    [
        ("--cells 9-5", "--cells 9-5: the range ends before it starts; write 5-9"),
        ("--cells five", "--cells takes cell numbers such as 12, 5-9"),
        ("--last 0", "argument --last: takes a number of cells, a whole number from 1"),
        ("--save cells.xlsx", "use .csv or .json"),
        ("--plot --save cells.bmp", "use .png, .svg or .pdf"),
        ("--cells 2000- --plot", "no measured cell in --cells 2000-; the history holds 1,000 cells, [1] to [1000]"),
        ("--cells 50000", "no measured cell in --cells 50000; the history holds 1,000 cells, [1] to [1000]"),
        ("--cells 5-9,,12", "--cells 5-9,,12: an empty item between commas; write --cells 5-9,12"),
        ("--cells 5-9,", "--cells 5-9,: an empty item between commas; write --cells 5-9"),
        # An item that is no cell number is named first: the empty item's suggestion would not work either.
        ("--cells cleanup,,batch", "got 'cleanup'"),
    ],
)
def test_bad_options_are_one_line_errors(filled, capsys, line, message):
    result = filled.run_cell(f"%cudamem_history {line}")
    assert not result.success
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_help_documents_the_options(shell):
    doc = shell.find_line_magic("cudamem_history").__doc__
    for option in ("--plot", "--save", "--all", "--last", "--cells", "--clear", "-o"):
        assert option in doc
