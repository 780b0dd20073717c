"""``%%cudamem`` and friends in a real InteractiveShell over fake hardware."""

from __future__ import annotations

import re

import pytest

from jupyter_cudamem import magics
from jupyter_cudamem.hardware import Hardware
from jupyter_cudamem.report import CellReport

from tests.fakes import FakeAllocator, FakeMachine, FakeNvml, fake_probe

GiB = 1024**3


def cudamem(shell):
    return magics.loaded(shell).magics[0]


def test_cell_reports_peak_and_displays_last_value_first(shell, machine, capsys):
    result = shell.run_cell("%%cudamem\nm.allocate(0, 2 * GiB); m.free(0, GiB)\n'value'")
    assert result.success
    out = capsys.readouterr().out
    assert out.index("'value'") < out.index("peak 2.00 GiB")
    assert "2.00 GiB" in out and "+1.00 GiB" in out
    [record] = cudamem(shell).history.records
    assert record.measurement.devices[0].peak_above_start_bytes == 2 * GiB


def test_the_report_shown_is_the_bundle_ipythons_formatters_make_of_it(shell):
    from IPython.utils.capture import capture_output

    formatter = shell.display_formatter
    before = list(formatter.active_types)
    try:
        for active, types in ((["text/plain"], {"text/plain"}), (list(formatter.formatters), {"text/plain", "text/html"})):
            formatter.active_types = active  # a terminal's, then a notebook's
            with capture_output() as captured:
                shell.run_cell("report = %cudamem -o m.allocate(0, 2 * GiB); m.free(0, GiB)")
            [shown] = captured.outputs
            formatted, metadata = formatter.format(shell.user_ns["report"])
            assert set(formatted) == types and not metadata
            assert shown.data == formatted and "+2.00 GiB above start" in shown.data["text/plain"]
    finally:
        formatter.active_types = before


def test_trailing_semicolon_hides_the_value(shell, capsys):
    shell.run_cell("%%cudamem\n'hidden';")
    assert "'hidden'" not in capsys.readouterr().out


def test_ipython_syntax_runs_inside_the_cell(shell, capsys):
    result = shell.run_cell("%%cudamem\n%env CUDAMEM_TEST_VAR=42\nfiles = !echo hello\nfiles[0]")
    assert result.success
    assert "'hello'" in capsys.readouterr().out
    import os

    assert os.environ.pop("CUDAMEM_TEST_VAR") == "42"


def test_user_error_keeps_its_traceback_and_is_reported(shell, machine, capsys):
    result = shell.run_cell("%%cudamem\nm.allocate(0, GiB)\nraise ValueError('boom')")
    assert isinstance(result.error_in_exec, ValueError)
    out = re.sub(r"\x1b\[[0-9;]*m", "", capsys.readouterr().out)  # colours, where the shell has them
    assert "failed with ValueError" in out and "+1.00 GiB" in out
    assert "ValueError: boom" in out  # the user's traceback is printed
    assert cudamem(shell).history.records[-1].measurement.error == "ValueError"


def test_keyboard_interrupt_is_measured_then_reraised(shell, capsys):
    result = shell.run_cell("%%cudamem\nm.allocate(0, GiB)\nraise KeyboardInterrupt")
    assert isinstance(result.error_in_exec, KeyboardInterrupt)
    assert "failed with KeyboardInterrupt" in capsys.readouterr().out


def test_line_form_with_output_option_shows_the_report_and_returns_it(shell, machine, capsys):
    shell.run_cell("r = %cudamem -o m.allocate(0, GiB)")
    report = shell.user_ns["r"]
    assert isinstance(report, CellReport)
    assert report.peak_allocated_bytes == GiB
    assert "peak 1.00 GiB" in repr(report) and "<table>" in report._repr_html_()
    assert capsys.readouterr().out.count("peak 1.00 GiB") == 1  # shown once; the assignment shows no Out


def test_output_option_with_quiet_returns_the_report_only(shell, machine, capsys):
    shell.run_cell("r = %cudamem -q -o m.allocate(0, GiB)")
    assert shell.user_ns["r"].peak_allocated_bytes == GiB
    assert "peak" not in capsys.readouterr().out


def test_without_output_option_nothing_is_returned(shell, machine, capsys):
    shell.run_cell("r = %cudamem m.allocate(0, GiB)")
    assert shell.user_ns["r"] is None
    assert "peak 1.00 GiB" in capsys.readouterr().out


@pytest.mark.parametrize("options", ["", "-q"])
@pytest.mark.parametrize("cell", ["y = %s 6*7", "%s 6*7", "%s 6*7;", "y = %s 6*7;", "y = %s x = 6*7", "%s x = 1; x + 1"])
def test_the_line_form_returns_the_value_and_shows_out_as_time_does(shell, capsys, cell, options):
    """``%time`` returns the expression's value: bound by an assignment, shown as ``Out`` only where IPython shows
    the magic's result (no assignment, no trailing ``;``)."""
    def run(magic: str) -> tuple[object, list[str]]:
        shell.user_ns.pop("y", None)
        shell.run_cell(cell % magic, store_history=True)
        out = capsys.readouterr().out
        return shell.user_ns.get("y"), re.findall(r"^Out\[\d+\]: (.*)$", out, flags=re.MULTILINE)

    assert run(f"%cudamem {options}".strip()) == run("%time")


def test_quiet_records_without_showing(shell, capsys):
    shell.run_cell("%%cudamem --quiet\nm.allocate(0, GiB)")
    assert "peak" not in capsys.readouterr().out
    assert len(cudamem(shell).history) == 1


def test_limit_caps_during_the_cell_and_restores_after(shell, machine):
    result = shell.run_cell("%%cudamem --limit 2GiB\nseen = m.gpus[0].fraction\nm.allocate(0, 3 * GiB)")
    assert result.error_in_exec is not None and "out of memory" in str(result.error_in_exec)
    assert shell.user_ns["seen"] == pytest.approx(2 / 80)
    assert machine.gpus[0].fraction == 1.0
    assert cudamem(shell).history.records[-1].measurement.limit_bytes == 2 * GiB


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("--limit abc", "not a size: 'abc'"),
        ("--limit 200GiB", "is more than cuda:0 has"),
        ("--device 7", "no CUDA device 7"),
        ("--device zero", "--device takes CUDA device numbers"),
        ("--bogus", "unrecognized arguments"),
    ],
)
def test_bad_arguments_are_one_line_and_the_cell_does_not_run(shell, capsys, line, message):
    shell.user_ns.pop("ran", None)
    result = shell.run_cell(f"%%cudamem {line}\nran = True")
    assert not result.success
    assert "ran" not in shell.user_ns
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err


@pytest.mark.parametrize(("line", "unknown"), [("--bogus", "--bogus"), ("-x", "-x"), ("-q --bogus", "--bogus"),
                                               ("-x + 1", "-x"), ("--bogus -q y = 1", "--bogus")])
def test_an_unknown_option_of_the_line_form_is_named_in_one_line(shell, line, unknown):
    """Unlike ``%time -x``, which runs ``-x``: a mistyped option must not run as code. A statement that starts
    with ``-`` goes in parentheses."""
    shell.user_ns.update(x=3, y=None)
    result = shell.run_cell(f"%cudamem {line}", store_history=True)
    message = str(result.error_in_exec)
    assert type(result.error_in_exec).__name__ == "UsageError" and "\n" not in message
    assert f"unrecognized arguments: {unknown}" in message and f"%cudamem ({unknown})" in message
    assert shell.user_ns["y"] is None
    assert shell.run_cell("y = %cudamem -q (-x)", store_history=True).success and shell.user_ns["y"] == -3


def test_trace_names_the_users_line_and_saves_a_snapshot(shell, tmp_path, capsys):
    allocator = magics.loaded(shell).hardware.allocator
    allocator.trace_entries = [
        {"action": "alloc", "addr": 1, "size": GiB, "frames": [{"filename": "/home/me/step.py", "line": 7, "name": "step"}]}
    ]
    shell.run_line_magic("config", f"CudaMem.trace_dir = {str(tmp_path)!r}")
    shell.run_cell("%%cudamem --trace -v\nm.allocate(0, GiB)")
    out = capsys.readouterr().out
    assert "/home/me/step.py line 7 in step" in out
    assert "memory_viz" in out
    assert list(tmp_path.glob("cell*.pickle"))
    assert not allocator.tracing


def test_every_cell_mode_on_and_off(shell, machine, capsys):
    shell.run_cell("%cudamem on")
    shell.run_cell("%cudamem on")  # a second 'on' must not register twice
    shell.run_cell("m.allocate(0, GiB)")
    shell.run_cell("x = 1")  # no GPU activity: no line
    shell.run_cell("%cudamem off")
    shell.run_cell("m.allocate(0, GiB)")
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("cudamem [")]
    assert len(lines) == 1 and "Δalloc +1.00 GiB" in lines[0]
    assert "every-cell mode off" in out
    # The cells run while on were recorded; the one after 'off' was not.
    assert [r.source_head for r in cudamem(shell).history.records] == ["m.allocate(0, GiB)", "x = 1"]


def test_every_cell_threshold_is_configurable(shell, capsys):
    shell.run_line_magic("config", 'CudaMem.auto_threshold = "2GiB"')
    shell.run_cell("%cudamem on")
    shell.run_cell("m.allocate(0, GiB)")
    shell.run_cell("m.allocate(0, 3 * GiB)")
    shell.run_cell("%cudamem off")
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("cudamem [")]
    assert len(lines) == 1 and "+3.00 GiB" in lines[0]


def test_a_setting_changed_between_cells_applies_from_the_next_cell(shell, capsys):
    # The settings are kept from cell to cell: a change through %config must still reach the next cell.
    shell.run_cell("%cudamem on")
    shell.run_cell("m.allocate(0, GiB)")
    shell.run_line_magic("config", 'CudaMem.auto_threshold = "2GiB"')
    shell.run_cell("m.allocate(0, GiB)")
    shell.run_line_magic("config", 'CudaMem.auto_threshold = "1MiB"')
    shell.run_cell("m.allocate(0, 2 * GiB)")
    shell.run_cell("%cudamem off")
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("cudamem [")]
    assert len(lines) == 2 and "+1.00 GiB" in lines[0] and "+2.00 GiB" in lines[1]


def test_every_cell_mode_reports_failed_cells(shell, capsys):
    shell.run_cell("%cudamem on")
    shell.run_cell("m.allocate(0, GiB); 1/0")
    shell.run_cell("%cudamem off")
    assert "failed: ZeroDivisionError" in capsys.readouterr().out


def test_reset_peak_can_be_turned_off(shell, machine):
    shell.run_line_magic("config", "CudaMem.reset_peak = False")
    allocator = magics.loaded(shell).hardware.allocator
    shell.run_cell("%%cudamem\nm.allocate(0, GiB)")
    assert not any(call.startswith("reset_peak") for call in allocator.calls)
    shell.run_cell("%%cudamem --quiet\nx = 1")
    shell.run_line_magic("config", "CudaMem.reset_peak = True")


def test_history_table_records_save_plot_and_clear(shell, tmp_path, capsys):
    shell.run_cell("%%cudamem --quiet\nm.allocate(0, GiB)")
    shell.run_cell("%%cudamem --quiet\nm.allocate(0, 2 * GiB)")
    shell.run_cell("%cudamem_history")
    out = capsys.readouterr().out
    assert "m.allocate(0, 2 * GiB)" in out and "peak" in out
    shell.run_cell("records = %cudamem_history -o")
    assert [r["peak_above_start_bytes"] for r in shell.user_ns["records"]] == [GiB, 2 * GiB]
    shell.run_cell(f"%cudamem_history --save {tmp_path / 'h.csv'}")
    assert (tmp_path / "h.csv").read_text().count("\n") == 3
    shell.run_cell(f"%cudamem_history --plot --save {tmp_path / 'p.png'}")
    assert (tmp_path / "p.png").read_bytes().startswith(b"\x89PNG")
    capsys.readouterr()
    refused = shell.run_cell("%cudamem_history --clear --last 1")  # clears all or nothing: never 'the last'
    assert not refused.success and len(cudamem(shell).history) == 2
    assert "--clear forgets every measured cell: it takes no --last (nothing was cleared)" in capsys.readouterr().err
    shell.run_cell("%cudamem_history --clear")
    assert len(cudamem(shell).history) == 0


def test_plot_of_an_empty_history_is_a_one_line_error(shell, capsys):
    result = shell.run_cell("%cudamem_history --plot")
    assert not result.success
    assert "nothing to plot" in capsys.readouterr().err


def test_help_documents_the_options(shell):
    doc = shell.find_cell_magic("cudamem").__doc__
    for option in ("--device", "--quiet", "-o", "--limit", "--trace", "--no-reset-peak", "%cudamem on"):
        assert option in doc


def test_unload_removes_magics_callbacks_and_configurables(shell):
    shell.run_cell("%cudamem on")
    instance = cudamem(shell)
    magics.unload(shell)
    assert shell.find_cell_magic("cudamem") is None
    assert shell.find_line_magic("cudamem_history") is None
    assert instance not in shell.configurables
    assert instance.every_cell.pre_run_cell not in shell.events.callbacks["pre_run_cell"]
    assert instance.every_cell.post_run_cell not in shell.events.callbacks["post_run_cell"]


def test_unload_leaves_the_shells_events_as_loading_found_them(ip, hardware):
    magics.unload(ip)
    before = {event: list(callbacks) for event, callbacks in ip.events.callbacks.items()}
    magics.load(ip, hardware).magics[0].probe = fake_probe()
    ip.run_cell("%%cudamem -q\nx = 1")  # the kept fingerprints follow every cell from here on
    assert cudamem(ip).attribution.tracked is not None
    for cell in ("%cudamem on", "y = 2", "%cudamem off"):
        ip.run_cell(cell)
    magics.unload(ip)
    assert {event: list(callbacks) for event, callbacks in ip.events.callbacks.items()} == before


def test_no_gpu_runs_the_cell_and_says_what_it_cannot_measure(ip, capsys):
    machine = FakeMachine()
    hardware = Hardware(
        FakeAllocator(machine, status="PyTorch 2.13.0+cpu (a CPU-only build) sees no CUDA device"),
        FakeNvml(machine, failure="NVML library (libnvidia-ml.so) not found: no NVIDIA driver on this machine"),
    )
    magics.unload(ip)
    magics.load(ip, hardware)
    try:
        result = ip.run_cell("%%cudamem --device 0\nran_on_cpu = 1 + 1")
        assert result.success and ip.user_ns["ran_on_cpu"] == 2
        out = capsys.readouterr().out
        assert out.splitlines()[1:3] == [
            "Not measured: PyTorch 2.13.0+cpu (a CPU-only build) sees no CUDA device; NVML library (libnvidia-ml.so) "
            "not found: no NVIDIA driver on this machine",
            "Nothing measured: the cell ran as a plain cell",
        ]
        # As %%oomfix and %%cudamem_plan without a GPU: the body runs, one line says what it runs without.
        ip.user_ns.pop("x", None)
        result = ip.run_cell("%%cudamem --limit 1GiB\nx = 1")
        assert result.success and ip.user_ns["x"] == 1
        assert capsys.readouterr().err.splitlines() == [
            "cudamem: --limit needs PyTorch with a CUDA device (PyTorch 2.13.0+cpu (a CPU-only build) sees no CUDA "
            "device); the cell runs without it"
        ]
    finally:
        magics.unload(ip)


def test_real_sources_on_this_machine_load_and_run(ip):
    """Whatever this machine has, the real extension loads, the cell runs and unloading removes the magic."""
    ip.run_line_magic("load_ext", "jupyter_cudamem")
    try:
        result = ip.run_cell("%%cudamem\nplain = sum(range(10))")
        assert result.success and ip.user_ns["plain"] == 45
    finally:
        ip.run_line_magic("unload_ext", "jupyter_cudamem")
    assert ip.find_cell_magic("cudamem") is None


def test_real_sources_without_a_gpu_say_what_is_not_measured(ip, capsys):
    """On CI (no GPU, no driver) the cell still runs, and its report says what it could not measure."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device, so the cell is measured (tests/gpu checks what it shows)")
    ip.run_line_magic("load_ext", "jupyter_cudamem")
    try:
        result = ip.run_cell("%%cudamem\nplain = sum(range(10))")
        assert result.success and ip.user_ns["plain"] == 45
        assert "not measured: " in capsys.readouterr().out.lower()
    finally:
        ip.run_line_magic("unload_ext", "jupyter_cudamem")


def test_every_cell_mode_measures_only_the_outermost_of_nested_cells(shell, capsys):
    """%oomfix reruns cells through shell.run_cell: they belong to the cell that ran them."""
    shell.run_cell("%cudamem on")
    shell.run_cell("m.allocate(0, GiB)\nget_ipython().run_cell('m.allocate(0, 2 * GiB)')\nget_ipython().run_cell('')")
    shell.run_cell("%cudamem off")
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("cudamem [")]
    assert len(lines) == 1 and "Δalloc +3.00 GiB" in lines[0]
    records = cudamem(shell).history.records
    assert [r.source_head for r in records] == ["m.allocate(0, GiB)"]


def test_options_expand_from_the_namespace_but_the_code_does_not(shell):
    """``%%cudamem --limit {cap}`` takes the user's value; the measured code keeps ``{x}`` as written."""

    shell.user_ns["cap"] = "1GiB"
    shell.user_ns["x"] = 5
    result = shell.run_cell("%%cudamem -q --limit {cap}\ns = '{x}'")
    assert result.success, result.error_in_exec
    assert shell.user_ns["s"] == "{x}"


def test_verbose_flag_and_setting_show_the_figures_the_three_lines_leave_out(shell, machine, capsys):
    machine.allocate(0, 0)  # the CUDA context first, or the first cell's finding names it
    shell.run_cell("%%cudamem\nm.allocate(0, GiB); m.free(0, GiB)")
    short = capsys.readouterr().out
    assert len(short.splitlines()) == 4 and "peak allocated" not in short and "--verbose" in short
    shell.run_cell("%%cudamem -v\nm.allocate(0, GiB); m.free(0, GiB)")
    full = capsys.readouterr().out
    assert full.splitlines()[2] == short.splitlines()[2] and "peak allocated" in full and "free at end" in full
    shell.run_line_magic("config", "CudaMem.verbose = True")
    try:
        shell.run_cell("r = %cudamem -o m.allocate(0, GiB); m.free(0, GiB)")
        assert "Δ reserved" in capsys.readouterr().out and shell.user_ns["r"].verbose
    finally:
        shell.run_line_magic("config", "CudaMem.verbose = False")


def _reads_of(shell, source):
    allocator = magics.loaded(shell).hardware.allocator
    allocator.calls.clear()
    shell.run_cell(source)
    return [call for call in allocator.calls if call.startswith("read")]


def test_a_cell_that_is_the_magic_starts_from_the_reading_taken_as_the_cell_started(shell, machine):
    # One read as each cell starts (kept for %oomfix) is the measurement's start too: two reads a cell, not three.
    shell.run_cell("%%cudamem --quiet\nx = 1")
    assert _reads_of(shell, "%%cudamem --quiet\nm.allocate(0, GiB)") == ["read:0", "read:0"]
    assert cudamem(shell).history.records[-1].measurement.devices[0].allocated_delta_bytes == GiB
    # After a cell not measured, what it left counts towards the attribution's guard, from the same reading:
    # 1 GiB is past the guard, so every name is fingerprinted again.
    tracked = cudamem(shell).attribution.tracked
    walks = tracked.full_walks
    shell.run_cell("m.allocate(0, GiB)")
    assert _reads_of(shell, "%%cudamem --quiet\nx = 3") == ["read:0", "read:0"]
    assert tracked.full_walks == walks + 1
    shell.run_cell("%cudamem on")
    shell.run_cell("x = 2")
    assert _reads_of(shell, "m.allocate(0, GiB)") == ["read:0", "read:0"]
    assert cudamem(shell).history.records[-1].measurement.devices[0].allocated_delta_bytes == GiB


@pytest.mark.parametrize("every_cell", [False, True], ids=["cell_magic", "every_cell"])
def test_a_measured_cell_reads_each_source_once_at_each_end(shell, machine, every_cell):
    # Per device and cell: PyTorch's counters as it starts (read for %oomfix, the measurement's start too) and
    # as it ends, a synchronization before each, one peak reset; NVML's memory at each end, and its process
    # list only after the device's used memory moved (our own memory cannot move without it).
    hardware = magics.loaded(shell).hardware
    allocator, nvml = hardware.allocator, hardware.nvml
    wrap = "" if every_cell else "%%cudamem --quiet\n"
    if every_cell:
        shell.run_cell("%cudamem on")
    shell.run_cell(wrap + "x = 1")
    for cell, nvml_calls in (("x = 2", 2), ("m.allocate(0, GiB)", 3), ("x = 3", 2)):
        allocator.calls.clear()
        nvml.calls = 0
        shell.run_cell(wrap + cell)
        assert sorted(allocator.calls) == ["read:0", "read:0", "reset_peak:0", "synchronize:0", "synchronize:0"]
        assert nvml.calls == nvml_calls, cell
    allocated, after = (record.measurement for record in cudamem(shell).history.records[-2:])
    assert allocated.devices[0].process_delta_bytes == GiB + 512 * 1024**2  # and the CUDA context, made then
    assert after.devices == ()  # nothing moved: no device to report


def test_a_magic_run_after_code_of_its_own_cell_reads_its_own_start(shell, machine):
    # The cell's start reading is older than what the cell's first line allocated: not the magic's start.
    shell.run_cell("m.allocate(0, GiB)\nget_ipython().run_cell_magic('cudamem', '--quiet --device 0', 'x = 1')")
    assert cudamem(shell).history.records[-1].measurement.devices[0].allocated_delta_bytes == 0
    shell.run_cell("m.allocate(0, GiB)\n%cudamem --quiet --device 0 x = 1")
    assert cudamem(shell).history.records[-1].measurement.devices[0].allocated_delta_bytes == 0
