"""How every magic of ours reads its option line (jupyter_cudamem/magics/options.py ``parse_line``): quoted
values unquoted as a shell does, and numbers people type checked once (``units.number_in``,
``units.whole_number``): a bad one is a one-line error, never a traceback from our code."""

from __future__ import annotations

import logging

import pytest
from IPython.core.error import UsageError

from jupyter_cudamem import magics
from jupyter_cudamem.magics.options import split_line

USES_THE_GPU = "m.allocate(0, GiB)\nm.free(0, GiB)"  # a fixed-size cell: one run plans it


@pytest.mark.parametrize("line, words", [
    ('--cards "RTX 4090"', ["--cards", "RTX 4090"]),
    ("--cards 'RTX 4090',T4", ["--cards", "RTX 4090,T4"]),
    ("--strategy 'batch, autocast' -y", ["--strategy", "batch, autocast", "-y"]),
    ("--save C:\\runs\\cells.csv", ["--save", "C:\\runs\\cells.csv"]),  # a Windows path keeps its backslashes
    ("  -q   --limit=2GiB ", ["-q", "--limit=2GiB"]),
    ("", []),
])
def test_a_line_is_split_as_a_shell_splits_it(line, words):
    assert split_line(line) == words


def test_an_open_quote_is_one_line(shell):
    result = shell.run_cell("%%cudamem --device '0\nx = 1", store_history=True)
    assert isinstance(result.error_in_exec, UsageError)
    assert "quote is not closed" in str(result.error_in_exec) and "\n" not in str(result.error_in_exec)


@pytest.mark.parametrize("header", ['%%cudamem_plan -o --cards "RTX 4090"', "%%cudamem_plan -o --cards 'RTX 4090'"])
def test_a_quoted_card_name_is_the_card(shell, header):
    shell.user_ns.pop("x", None)
    result = shell.run_cell(f"{header}\n{USES_THE_GPU}", store_history=True)
    assert result.success, result.error_in_exec
    assert [card.name for card in result.result.cards] == ["RTX 4090"]


def test_a_card_of_our_own_with_a_space_in_its_name(shell):
    shell.run_cell("%config CudaMem.cards = {'My Card': 48}", store_history=True)
    result = shell.run_cell(f"%%cudamem_plan -o --cards \"My Card\",'RTX 4090'\n{USES_THE_GPU}", store_history=True)
    assert result.success, result.error_in_exec
    assert [card.name for card in result.result.cards] == ["My Card", "RTX 4090"]


def test_a_quoted_strategy_list(shell):
    shell.user_ns.pop("x", None)
    assert shell.run_cell("%%oomfix --yes --strategy 'batch, autocast'\nx = 1", store_history=True).success
    assert shell.user_ns["x"] == 1
    result = shell.run_cell("%%oomfix --yes --strategy 'bogus, batch'\nx = 2", store_history=True)
    assert isinstance(result.error_in_exec, UsageError) and shell.user_ns["x"] == 1  # refused before it ran
    assert "unknown strategy 'bogus'" in str(result.error_in_exec)


def test_a_quoted_size_in_the_line_form(shell):
    shell.user_ns.pop("x", None)
    result = shell.run_cell('%cudamem -q --limit "2 GiB" x = 1', store_history=True)
    assert result.success, result.error_in_exec
    assert shell.user_ns["x"] == 1


@pytest.mark.parametrize("cell", [
    "%%cudamem -d ²\nx = 1",
    "%%cudamem --device 0,²\nx = 1",
    "%%cudamem -d ١\nx = 1",  # an Arabic-Indic one, which int() would take
    "%cudamem -d ² x = 1",
    "%cudamem_monitor --devices ²",
    "%cudamem_monitor --devices 1_0",
])
def test_a_device_that_is_not_ascii_digits_is_one_line(shell, cell):
    shell.user_ns.pop("x", None)
    result = shell.run_cell(cell, store_history=True)
    assert isinstance(result.error_in_exec, UsageError), result.error_in_exec
    assert "takes CUDA device numbers" in str(result.error_in_exec) and "\n" not in str(result.error_in_exec)
    assert "x" not in shell.user_ns


@pytest.mark.parametrize("cell, option", [
    ("%cudamem_history --last ²", "--last"),
    ("%cudamem_history --last ٣", "--last"),  # Arabic-Indic, fullwidth and a digit group: int() takes them all
    ("%cudamem_history --last ３", "--last"),
    ("%cudamem_history --last 1_0", "--last"),
    ("%cudamem_history --last 99999999999", "--last"),
    ("%cudamem_history --cells ３", "--cells"),
    ("%cudamem_history --cells 1-٣", "--cells"),
    ("%cudamem_history --cells " + "1" * 5000, "--cells"),  # past what int() converts from text
    ("%oomfix --max-tries ３", "--max-tries"),
    ("%%oomfix --max-tries ٣\nx = 1", "--max-tries"),
    ("%%cudamem_plan --small ３\nx = 1", "--small"),
    ("%cudamem_engines --history --last ３", "--last"),
    ("%cudamem_monitor --interval １", "--interval"),  # numbers too: float() takes the same
    ("%cudamem_monitor --interval ١", "--interval"),
    ("%cudamem_monitor --history 1_0", "--history"),
    ("%cudamem_engines --timeout ３", "--timeout"),
    ("%cudamem_engines monitor --interval ０.５", "--interval"),
    ("%%cudamem_plan --margin ０.１\nx = 1", "--margin"),
])
def test_a_count_or_number_that_is_not_ascii_digits_is_one_line(shell, cell, option):
    shell.user_ns.pop("x", None)
    result = shell.run_cell(cell, store_history=True)
    assert isinstance(result.error_in_exec, UsageError), result.error_in_exec
    message = str(result.error_in_exec)
    assert option in message and "\n" not in message
    assert "x" not in shell.user_ns


def test_a_count_in_ascii_digits_is_taken(shell):
    assert shell.run_cell("%cudamem_history --last 3 --cells 1-20", store_history=True).success


@pytest.mark.parametrize("typed, usage", [
    ("%oomfix", "%oomfix"), ("%%oomfix", "%%oomfix"), ("%%cudamem_plan", "%%cudamem_plan"),
    ("%cudamem", "%cudamem"), ("%%cudamem", "%cudamem"),  # one function for both forms, as IPython's %%time
    ("%cudamem_history", "%cudamem_history"),
])
def test_help_shows_the_magic_as_it_is_typed(shell, capsys, typed, usage):
    capsys.readouterr()
    shell.run_cell(f"{typed}?")
    shown = capsys.readouterr().out
    assert f"::\n\n  {usage} [" in shown, shown[:300]


def test_cards_out_of_range_are_refused_when_set_and_the_plan_still_runs(shell):
    shell.user_ns.pop("x", None)
    for value in ("float('nan')", "float('inf')", "0.5", "-1", "'512MiB'", "1e308"):
        shell.run_cell(f"%config CudaMem.cards = {{'X': {value}}}", store_history=True)
    result = shell.run_cell(f"%%cudamem_plan -o --cards X\n{USES_THE_GPU}", store_history=True)
    assert isinstance(result.error_in_exec, UsageError)  # X was never added: it is not in the table
    assert "'X' is not in the table" in str(result.error_in_exec)
    assert shell.run_cell(f"%%cudamem_plan -o\n{USES_THE_GPU}", store_history=True).success


@pytest.mark.parametrize("value", ["10**400", "-10**400", "{'memory': 10**400}", "'9' * 400 + 'GiB'",
                                   "'1' + '0' * 300 + 'PiB'"])
def test_a_card_past_what_a_float_holds_is_refused_naming_the_setting_and_its_range(shell, caplog, value):
    from jupyter_cudamem.capacity.cards import MAX_CARD_GIB, MIN_CARD_GIB

    with caplog.at_level(logging.ERROR):
        shell.run_cell(f"%config CudaMem.cards = {{'X': {value}}}", store_history=True)
    [message] = [record.getMessage() for record in caplog.records if record.levelno >= logging.ERROR]
    assert message.startswith("CudaMem.cards['X']") and "\n" not in message, message
    assert f"from {MIN_CARD_GIB:g} to {MAX_CARD_GIB:g}" in message, message
    assert "X" not in magics.loaded(shell).magics[0].cards


def test_a_card_whose_room_is_all_taken_outside_pytorch_draws(shell, machine):
    """A card of 1 GiB (the least the table takes) on a machine whose CUDA context and libraries hold 2 GiB:
    it leaves PyTorch nothing, and the figure leaves it out instead of dividing by its zero."""
    pytest.importorskip("matplotlib")
    machine.gpus[0].context_bytes = 2 * 1024**3
    shell.run_cell("%config CudaMem.cards = {'Tiny': 1, 'Tinier': '1GiB'}", store_history=True)
    result = shell.run_cell(f"%%cudamem_plan -o --cards Tiny,Tinier,T4\n{USES_THE_GPU}", store_history=True)
    assert result.success, result.error_in_exec
    plan = result.result
    assert [card.usable_bytes for card in plan.cards][:2] == [0, 0]
    from jupyter_cudamem.capacity.figure import plan_png

    assert plan_png(plan).startswith(b"\x89PNG")
