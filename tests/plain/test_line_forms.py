"""Class 4 of issue 11: line forms and files. A mode word with more after it or a typo gets one line
saying what to type; a statement's `{x}`/`$x` are left as written; --save creates folders and says in
one line when it cannot write."""

from __future__ import annotations

import os

import pytest
from IPython.core.error import UsageError

MODES = ("on", "off", "status")
TYPOS = ("ON", "Off", "STATUS", "Status", "stauts", "stat", "of", "onn", "statu", "offf")
EXTRAS = ("extra", "now please", "1", "--quiet", "on", "-q")


def one_line(shell, line):
    result = shell.run_cell(line, store_history=True)
    assert isinstance(result.error_in_exec, UsageError), (line, result.error_in_exec)
    message = str(result.error_in_exec)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("extra", EXTRAS)
def test_a_mode_word_with_more_after_it_says_what_to_type(shell, mode, extra, capsys):
    message = one_line(shell, f"%cudamem {mode} {extra}")
    assert f"type %cudamem {mode}" in message
    assert "Traceback" not in capsys.readouterr().out


@pytest.mark.parametrize("typo", TYPOS)
def test_a_mode_typo_says_what_to_type(shell, typo):
    message = one_line(shell, f"%cudamem {typo}")
    assert "type %cudamem " in message and f"{typo!r} is not defined" in message


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("options", ("-q", "--device 0", "-o --no-reset-peak"))
def test_a_mode_with_options_says_they_take_none(shell, mode, options):
    message = one_line(shell, f"%cudamem {options} {mode}")
    assert f"type %cudamem {mode} (no options)" in message


@pytest.mark.parametrize("name", ("ON", "stat", "Status"))
def test_a_name_the_user_defined_is_measured(shell, name):
    shell.user_ns[name] = 5
    try:
        assert shell.run_cell(f"%cudamem -q {name}", store_history=True).success
    finally:
        del shell.user_ns[name]


STATEMENTS = (
    ("s = '{x}'", "{x}"),
    ("s = '$x'", "$x"),
    ("s = '{x} and $x'", "{x} and $x"),
    ("s = f'{x}'", "5"),  # the user's own f-string still works
    ("s = '$$x'", "$$x"),
    ("s = '{{x}}'", "{{x}}"),
    ("s = '{x!r:>4}'", "{x!r:>4}"),
)


@pytest.mark.parametrize("statement, stored", STATEMENTS)
@pytest.mark.parametrize("options", ("", "-q", "-q --no-reset-peak", "--device=0 -q"))
def test_a_statement_is_not_expanded(shell, statement, stored, options):
    shell.user_ns["x"] = 5
    assert shell.run_cell(f"%cudamem {options} {statement}", store_history=True).success
    assert shell.user_ns["s"] == stored


def test_the_parser_owns_the_option_list(shell):
    from jupyter_cudamem.magics.options import OptionSplitter

    magic = shell.magics_manager.magics["line"]["cudamem"]
    splitter = OptionSplitter(magic.parser)
    assert all(splitter.takes_value(option) for option in ("--device", "-d", "--limit", "-l"))
    assert not any(splitter.takes_value(option) for option in ("--quiet", "-q", "-o", "--unknown"))
    assert splitter.split("-q --limit 2GiB x = f(-1)") == ("-q --limit 2GiB", "x = f(-1)")
    assert splitter.split("-q --limit=2GiB -d 0 x = f(-1)") == ("-q --limit=2GiB -d 0", "x = f(-1)")


@pytest.mark.parametrize("suffix", (".csv", ".json"))
@pytest.mark.parametrize("depth", (1, 3))
def test_save_creates_missing_folders_for_records_and_plots_alike(shell, tmp_path, suffix, depth, capsys):
    shell.run_cell("%%cudamem -q\nm.allocate(0, GiB)", store_history=True)
    folder = tmp_path.joinpath(*[f"d{i}" for i in range(depth)])
    for line, path in (
        (f"--save {folder / ('records' + suffix)}", folder / ("records" + suffix)),
        (f"--plot --save {folder / 'plot.svg'}", folder / "plot.svg"),
    ):
        result = shell.run_cell(f"%cudamem_history {line}", store_history=True)
        assert result.success, result.error_in_exec
        assert path.exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write anywhere")
@pytest.mark.parametrize("line", ("--save {}/x/records.csv", "--plot --save {}/x/plot.png"))
def test_an_unwritable_path_is_one_line(shell, tmp_path, line):
    shell.run_cell("%%cudamem -q\nm.allocate(0, GiB)", store_history=True)
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        message = one_line(shell, "%cudamem_history " + line.format(locked))
        assert "cannot write" in message
    finally:
        locked.chmod(0o700)


@pytest.mark.parametrize("line", ("--save {}/records.csv", "--plot --save {}/plot.png"))
def test_a_path_through_a_file_is_one_line(shell, tmp_path, line):
    shell.run_cell("%%cudamem -q\nm.allocate(0, GiB)", store_history=True)
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    message = one_line(shell, "%cudamem_history " + line.format(blocker))
    assert "cannot write" in message and "choose --save" in message
