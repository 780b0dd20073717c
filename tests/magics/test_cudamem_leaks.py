"""``%%cudamem`` and the every-cell mode name what a cell left behind (real shell, fake hardware and
fake tensors allocated on the fake machine)."""

from __future__ import annotations

import re

import pytest
from tests.fakes import FakeTensor, MiB, fake_probe

from jupyter_cudamem import magics


@pytest.fixture
def leaky(shell):
    """The shell with fake tensors recognised, ``FakeTensor`` and ``MiB`` in its namespace."""
    magics.loaded(shell).magics[0].probe = fake_probe()
    shell.run_line_magic("config", "CudaMem.verbose = True")  # these tests read the holders' section
    shell.user_ns.update(FakeTensor=FakeTensor, MiB=MiB)
    yield shell
    for name in ("losses", "cache", "kept", "f", "FakeTensor", "MiB", "records"):
        shell.user_ns.pop(name, None)
    shell.run_line_magic("reset", "-f out")


def test_the_report_names_who_holds_what_the_cell_left(leaky, capsys):
    leaky.run_cell("losses = []")
    leaky.run_cell("%%cudamem\nfor _ in range(40):\n    losses.append(FakeTensor(2 * MiB, machine=m))")
    out = capsys.readouterr().out
    assert "left behind: 80.00 MiB still allocated after the cell; 80.00 MiB attributed" in out
    assert "result  80.00 MiB  losses: list of 40 tensors" in out
    assert "losses gained 40 tensors in this cell" in out
    assert "left 80.00 MiB allocated" not in out  # the section replaces the generic hint


def test_a_value_kept_by_the_output_cache_is_named(leaky, capsys):
    leaky.run_cell("%%cudamem\nFakeTensor(100 * MiB, machine=m)")
    out = capsys.readouterr().out
    assert "leak   100.00 MiB  Out[" in out and "kept by IPython's output cache" in out
    assert "%reset -f out" in out


def test_a_failed_cells_traceback_is_named(leaky, capsys):
    leaky.run_cell("%%cudamem\ndef f():\n    big = FakeTensor(100 * MiB, machine=m)\n    raise ValueError('boom')\nf()")
    captured = capsys.readouterr()
    assert "ValueError: boom" in re.sub(r"\x1b\[[0-9;]*m", "", captured.out + captured.err)
    assert "kept by the failed cell's traceback" in captured.out
    assert "100.00 MiB" in captured.out
    assert "the cell's exception: the cell's exception" not in captured.out  # a name is said once


def test_the_threshold_is_configurable_and_can_be_turned_off(leaky, capsys, caplog):
    leaky.run_line_magic("config", "CudaMem.attribute_threshold = '1GiB'")
    leaky.run_cell("%%cudamem\nkept = FakeTensor(100 * MiB, machine=m)")
    assert "left behind" not in capsys.readouterr().out
    leaky.run_line_magic("config", "CudaMem.attribute_threshold = 'off'")
    leaky.run_cell("%%cudamem\ncache = [FakeTensor(2000 * MiB, machine=m)]")
    out = capsys.readouterr().out
    assert "left behind" not in out and "%config CudaMem.attribute_threshold" in out  # the hint says how
    leaky.run_line_magic("config", "CudaMem.attribute_threshold = 'lots'")  # refused when set, in one line
    assert "CudaMem.attribute_threshold takes a size such as" in caplog.text and "'lots'" in caplog.text
    assert leaky.run_cell("%%cudamem\nx = 1").success  # the setting before it holds
    assert "Traceback" not in capsys.readouterr().err


def test_every_cell_mode_names_leftovers_and_flags_a_growing_cell(leaky, capsys):
    leaky.run_cell("losses = []")
    leaky.run_cell("%cudamem on")
    for _ in range(3):
        leaky.run_cell("for _ in range(40):\n    losses.append(FakeTensor(2 * MiB, machine=m))")
    leaky.run_cell("%cudamem off")
    out = capsys.readouterr().out
    assert out.count("  left 80.00 MiB: result losses 80.00 MiB (data)") == 3
    assert "growing: each run of this cell leaves about +80.00 MiB more allocated (2 runs" in out
    assert "(3 runs: +80.00 MiB, +80.00 MiB, +80.00 MiB)" in out
    # As short as %%cudamem's three lines or shorter: each cell's line, what it left, whether it grows.
    lines = [line for line in out.splitlines() if not line.startswith("cudamem every-cell mode")]
    per_cell = "\n".join(lines).split("cudamem [")[1:]
    assert len(per_cell) == 3 and [len(block.splitlines()) for block in per_cell] == [2, 3, 3]
    leaky.run_cell("records = %cudamem_history -o")
    assert [r["growing_runs"] for r in leaky.user_ns["records"]][-3:] == [None, 2, 3]
    leaky.run_cell("%cudamem_history")
    assert "+80.00 MiB/run ×3" in capsys.readouterr().out


def test_trace_reports_growth_per_iteration_at_the_line_that_keeps_it(leaky, tmp_path, capsys):
    allocator = magics.loaded(leaky).hardware.allocator
    frames = [{"filename": "/home/me/train.py", "line": 12, "name": "step"}]
    allocator.trace_entries = [
        {"action": "alloc", "addr": index, "size": 4 * MiB, "frames": frames} for index in range(30)
    ]
    leaky.run_line_magic("config", f"CudaMem.trace_dir = {str(tmp_path)!r}")
    leaky.run_cell("%%cudamem --trace\nm.allocate(0, 120 * MiB)")
    out = capsys.readouterr().out
    assert "grew in a loop: about +4.00 MiB per iteration over 30 iterations (120.00 MiB kept): " in out
    assert "/home/me/train.py line 12 in step" in out


def test_reset_out_frees_a_value_the_magic_displayed(leaky, machine):
    """Notebook 02: ``%reset -f out`` after a ``%%cudamem`` cell that ended in a tensor must free it; the next
    cell starts without it (the magic keeps no reference of its own to the value it displayed)."""
    import gc

    before = machine.gpus[0].allocated
    leaky.run_cell("%%cudamem\nFakeTensor(128 * MiB, machine=m)", store_history=True)
    assert machine.gpus[0].allocated == before + 128 * MiB  # Out[N] keeps it, as in a plain cell
    leaky.run_cell("%reset -f out", store_history=True)
    leaky.run_cell("1 + 1", store_history=True)
    gc.collect()
    assert machine.gpus[0].allocated == before
    leaky.run_cell("2 + 2", store_history=True)
    assert leaky.user_ns["_"] == 4  # IPython's `_` follows the displayed values again


def test_reset_out_frees_a_plain_cells_value_too_and_unload_stops_it(leaky, machine):
    """IPython's own ``%reset -f out`` leaves ``_`` alive in its hidden namespace after a plain cell too."""
    import gc

    from jupyter_cudamem import magics as extension_magics

    before = machine.gpus[0].allocated
    leaky.run_cell("FakeTensor(64 * MiB, machine=m)", store_history=True)
    leaky.run_cell("%reset -f out", store_history=True)
    gc.collect()
    assert machine.gpus[0].allocated == before
    callbacks = leaky.events.callbacks["post_run_cell"]
    ours = extension_magics.loaded(leaky).after_cell
    assert ours in callbacks
    extension_magics.unload(leaky)
    assert ours not in leaky.events.callbacks["post_run_cell"]
