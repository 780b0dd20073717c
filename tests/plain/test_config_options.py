"""Class 5 of issue 11: every ``%config`` option is checked when it is set, with one line naming the
option and what it takes, and a refused value leaves the option as it was; valid values apply at once."""

from __future__ import annotations

import logging

import pytest

import jupyter_cudamem.magics as magics
from jupyter_cudamem.magics.cudamem import CudaMem
from jupyter_cudamem.magics.engines import CudaMemEngines
from jupyter_cudamem.magics.monitor import CudaMemMonitor
from jupyter_cudamem.magics.oomfix import OomFix
from jupyter_cudamem.magics.plan import CudaMemPlan

BAD = {
    "CudaMem.auto_threshold": ("'10XB'", "'-1MiB'", "-5", "'lots'", "'1.5.5GiB'", "'MiB'", "True", "[1]", "1.5",
                               "10**400", "'1e400GiB'", "'off'", "'none'"),
    "CudaMem.attribute_threshold": ("'10XB'", "-1", "'some'", "'1 2'", "None", "{}", "False", "10**400"),
    "CudaMem.history_size": ("0", "-3", "'ten'", "1.5", "None", "10**30", "True"),
    "CudaMem.cards": ("{'X': -1}", "{'X': 'lots'}", "{'X': True}", "{'X': {'gib': 3}}", "{'': 3}",
                      "{'X': float('nan')}", "{'X': float('inf')}", "{'X': 0}", "{'Small': 0.5}", "{'X': '512MiB'}",
                      "{'X': 1e308}", "{'X': {'memory': float('nan')}}", "{'X': 10**400}", "{'X': '9' * 400 + 'GiB'}"),
    "CudaMem.trace_max_entries": ("0", "-1", "'x'", "10**30"),
    "CudaMem.trace_dir": ("''", "'   '", "5"),
    "CudaMem.reset_peak": ("'yes'", "2", "None"),
    "CudaMem.process_memory": ("'no'", "[]"),
    "OomFix.max_tries": ("0", "-2", "'x'", "True", "None", "10**400"),
    "OomFix.strategies": ("'halve'", "'batch,nope'", "'cleanup;batch'", "5"),
    "OomFix.margin": ("-0.1", "1.0", "1.5", "float('nan')", "float('inf')", "'x'", "10**400"),
    "OomFix.autocast": ("'maybe'",),
    "OomFix.confirm": ("'sure'",),
    "CudaMemMonitor.interval_s": ("0", "-1", "0.01", "float('nan')", "float('inf')", "'fast'", "10**400"),
    "CudaMemMonitor.history_s": ("0", "-60", "float('nan')", "1e12", "'long'", "10**400"),
    "CudaMemMonitor.max_updates_per_s": ("0", "-1", "float('inf')", "10**400"),
    "CudaMemMonitor.alert_fraction": ("-0.1", "1.01", "2", "float('nan')", "'red'", "-10**400"),
    "CudaMemMonitor.use_widgets": ("'no'",),
    "CudaMemEngines.timeout_s": ("0", "-1", "float('inf')", "1e308", "float('nan')", "10**400"),
    "CudaMemEngines.interval_s": ("0", "1e10", "float('inf')", "float('nan')", "10**400"),
    "CudaMemPlan.margin": ("-1", "1", "5", "float('nan')", "'x'", "10**400"),
    "CudaMemPlan.calibrated_margin": ("-0.1", "1.0", "float('inf')", "7", "10**400"),
}
GOOD = {
    "CudaMem.auto_threshold": (("'10MB'", "10MB"), ("0", 0), ("'2 GiB'", "2 GiB"), ("4096", 4096)),
    "CudaMem.attribute_threshold": (("'off'", "off"), ("0", 0), ("'64MiB'", "64MiB")),
    "CudaMem.history_size": (("3", 3),),
    "CudaMem.cards": (("{'Mine': 12, 'T4': None}", {"Mine": 12, "T4": None}), ("{'Least': 1}", {"Least": 1})),
    "CudaMemEngines.timeout_s": (("3600", 3600.0),),
    "OomFix.max_tries": (("5", 5),),
    "OomFix.strategies": (("'batch,autocast'", "batch,autocast"), ("'all'", "all")),
    "OomFix.margin": (("0", 0.0), ("0.5", 0.5)),
    "CudaMemMonitor.interval_s": (("0.2", 0.2),),
    "CudaMemMonitor.alert_fraction": (("0.5", 0.5), ("1", 1.0), ("0", 0.0)),
}
KINDS = {"CudaMem": CudaMem, "OomFix": OomFix, "CudaMemMonitor": CudaMemMonitor, "CudaMemEngines": CudaMemEngines,
         "CudaMemPlan": CudaMemPlan}
CASES = [(option, value) for option, values in BAD.items() for value in values]


def test_count():
    assert len(CASES) >= 60  # the closing note reports this count


def _instance(shell, option):
    return magics.loaded(shell).get(KINDS[option.split(".")[0]])


@pytest.mark.parametrize("option, value", CASES)
def test_a_bad_value_is_refused_in_one_line_and_changes_nothing(shell, caplog, capsys, option, value):
    instance = _instance(shell, option)
    name = option.split(".")[1]
    before = getattr(instance, name)
    with caplog.at_level(logging.ERROR):
        shell.run_cell(f"%config {option} = {value}", store_history=True)
    messages = [record.getMessage() for record in caplog.records if record.levelno >= logging.ERROR]
    assert len(messages) == 1 and "\n" not in messages[0].strip(), messages
    assert name in messages[0]
    assert getattr(instance, name) == before or (before != before)  # nan is never equal to itself
    assert "Traceback" not in capsys.readouterr().out
    # What the option steers still works: no failure later, as with '10XB' before.
    assert shell.run_cell("%cudamem status", store_history=True).success


@pytest.mark.parametrize("option, value, expected", [(o, v, e) for o, pairs in GOOD.items() for v, e in pairs])
def test_a_good_value_applies_at_once(shell, option, value, expected):
    shell.run_cell(f"%config {option} = {value}", store_history=True)
    assert getattr(_instance(shell, option), option.split(".")[1]) == expected


def test_history_size_resizes_the_history_at_once(shell):
    for _ in range(5):
        shell.run_cell("%%cudamem -q\nm.allocate(0, GiB)", store_history=True)
    shell.run_cell("%config CudaMem.history_size = 2", store_history=True)
    assert len(_instance(shell, "CudaMem.history_size").history) == 2


def test_a_threshold_in_decimal_units_is_used_by_every_cell_mode(shell, capsys):
    shell.run_cell("%config CudaMem.auto_threshold = '10XB'", store_history=True)
    for line in ("%cudamem on", "%cudamem status", "%cudamem off"):
        assert shell.run_cell(line, store_history=True).success
    assert "unknown size unit" not in capsys.readouterr().err


@pytest.mark.parametrize("interval", (0, -1, 0.01))
def test_monitor_from_python_names_its_argument(shell, interval):
    from IPython.core.error import UsageError

    from jupyter_cudamem import monitor

    with pytest.raises(UsageError) as error:  # IPython shows it as one line in a cell
        monitor(interval_s=interval)
    assert str(error.value).startswith("interval_s takes seconds") and "--interval" not in str(error.value)
