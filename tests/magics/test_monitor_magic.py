"""``%cudamem_monitor`` in a real ``InteractiveShell``: one poller per shell, stop/restart,
``%unload_ext`` leaves no thread, one-line argument errors, traitlets configuration, no-GPU line,
and ``monitor()`` from Python."""

from __future__ import annotations

import threading
import time

import pytest
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell
from IPython.utils.capture import capture_output

from jupyter_cudamem import magics
from jupyter_cudamem.hardware import Hardware
from jupyter_cudamem.magics.monitor import CudaMemMonitor
from jupyter_cudamem.monitor.poller import THREAD_NAME
from jupyter_cudamem.monitor.snapshot import Snapshot
from jupyter_cudamem.monitor.widget import TextView, WidgetView
from tests.fakes import FakeAllocator, FakeGpu, FakeMachine, FakeNvml, GiB

NO_DRIVER = "NVML library (libnvidia-ml.so) not found: no NVIDIA driver on this machine"


def our_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == THREAD_NAME and t.is_alive()]


class Loaded:
    """A shell with the extension loaded over fake hardware, as ``%load_ext`` would leave it."""

    def __init__(self, shell: InteractiveShell, hardware: Hardware, machine: FakeMachine):
        self.shell, self.hardware, self.machine = shell, hardware, machine

    @property
    def magics(self) -> CudaMemMonitor:
        extension = magics.loaded(self.shell)
        assert extension is not None
        found = extension.get(CudaMemMonitor)
        assert isinstance(found, CudaMemMonitor)
        return found

    def line(self, text: str):
        return self.shell.run_line_magic("cudamem_monitor", text)


def _load(machine: FakeMachine, nvml: FakeNvml, **allocator: object) -> Loaded:
    shell = InteractiveShell.instance()
    if "jupyter_cudamem" in shell.extension_manager.loaded:
        shell.run_line_magic("unload_ext", "jupyter_cudamem")
    magics.unload(shell)
    hardware = Hardware(
        allocator=FakeAllocator(machine, **allocator),  # type: ignore[arg-type]
        nvml=nvml,
        pid=machine.pid,
        pid_exists=lambda pid: True,
    )
    magics.load(shell, hardware)
    shell.run_line_magic("load_ext", "jupyter_cudamem")  # the extension manager now knows it is loaded
    return Loaded(shell, hardware, machine)


def _unload(loaded: Loaded) -> None:
    shell = loaded.shell
    if "jupyter_cudamem" in shell.extension_manager.loaded:
        shell.run_line_magic("unload_ext", "jupyter_cudamem")
    magics.unload(shell)
    shell.config.pop("CudaMemMonitor", None)  # %config lives on in the shared test shell


@pytest.fixture
def loaded():
    machine = FakeMachine([FakeGpu(uuid="GPU-a", pci_bus_id="0:1:0"), FakeGpu(uuid="GPU-b", pci_bus_id="0:2:0")])
    result = _load(machine, FakeNvml(machine))
    yield result
    _unload(result)
    assert our_threads() == []


@pytest.fixture
def no_gpu():
    machine = FakeMachine()
    result = _load(machine, FakeNvml(machine, failure=NO_DRIVER), status="PyTorch sees no CUDA device")
    yield result
    _unload(result)


def test_start_shows_one_line_in_a_plain_shell_and_runs_one_thread(loaded):
    with capture_output() as captured:
        assert loaded.line("--interval 0.05") is None
    (output,) = captured.outputs
    line = output.data["text/plain"]
    assert "\n" not in line and "IntProgress" not in line and "Widget" not in line
    assert line.startswith("cudamem monitor (every 50 ms): cuda:0 ") and " | cuda:1 " in line
    assert len(our_threads()) == 1
    assert isinstance(loaded.magics.view, TextView)


def test_a_second_monitor_starts_no_second_poller(loaded):
    loaded.line("--interval 0.05")
    poller, thread = loaded.magics.poller, loaded.magics.poller.thread
    loaded.line("")
    loaded.line("--interval 0.1")
    assert loaded.magics.poller is poller and poller.thread is thread
    assert our_threads() == [thread]
    assert poller.interval_s == 0.1


def test_stop_and_restart(loaded, capsys):
    loaded.line("--interval 0.05")
    first = loaded.magics.poller.thread
    capsys.readouterr()
    loaded.line("stop")
    assert our_threads() == [] and not first.is_alive()
    loaded.line("stop")  # stopping twice only says it is not running
    said = capsys.readouterr()
    # Answers to what was asked, on stdout: stderr is red in JupyterLab, for errors.
    assert "monitor stopped" in said.out and "the monitor is not running" in said.out and said.err == ""
    loaded.line("--interval 0.05")
    assert len(our_threads()) == 1 and our_threads()[0] is not first


def test_unload_ext_stops_the_thread_and_closes_nvml(loaded):
    loaded.line("--interval 0.05")
    assert len(our_threads()) == 1
    loaded.shell.run_line_magic("unload_ext", "jupyter_cudamem")
    assert our_threads() == []
    assert loaded.hardware.nvml.closed
    assert "cudamem_monitor" not in loaded.shell.magics_manager.magics["line"]


@pytest.mark.parametrize(
    ("line", "says"),
    [
        ("bogus", "invalid choice: 'bogus'"),
        ("--interval abc", "argument --interval: takes seconds between two readings, a number in digits 0-9 such "
                           "as 0.5 or 2; got 'abc'"),
        ("--interval 0", "--interval takes seconds between readings, at least 0.05 and at most 3600; got 0"),
        ("--interval 1e10", "--interval takes seconds between readings, at least 0.05 and at most 3600; got 1e+10"),
        ("--history -5", "--history takes a positive number of seconds of history; got -5"),
        ("--interval 0.05 --history 1e9", "raise the interval or shorten the history"),
        ("--devices x", "--devices takes CUDA device numbers separated by commas, such as --devices 0,1; got 'x'"),
        ("--devices 0,7", "no cuda:7 here; this process sees cuda:0, cuda:1"),
        ("stop --interval 1", "'stop' takes no options"),
        ("snapshot", "nothing recorded yet: start the monitor with %cudamem_monitor"),
        ("--frobnicate", "unrecognized arguments: --frobnicate"),
    ],
)
def test_bad_arguments_are_one_line_usage_errors(loaded, line, says):
    with pytest.raises(UsageError) as raised:
        loaded.line(line)
    message = str(raised.value)
    assert says in message and "\n" not in message
    assert our_threads() == []


def test_magic_documents_itself():
    doc = CudaMemMonitor.cudamem_monitor.__doc__
    for option in ("--interval SECONDS", "--devices 0,1", "--history SECONDS", "{start,stop,snapshot}"):
        assert option in doc


def test_devices_option_watches_only_those(loaded):
    loaded.line("--interval 0.05 --devices 1")
    assert [row.device.label for row in loaded.magics.poller.state().devices] == ["cuda:1"]


def test_config_sets_defaults_and_changes_a_running_monitor(loaded):
    shell = loaded.shell
    shell.run_line_magic("config", "CudaMemMonitor.interval_s = 0.2")
    shell.run_line_magic("config", "CudaMemMonitor.history_s = 60")
    loaded.line("")
    poller = loaded.magics.poller
    assert (poller.interval_s, poller.history_s) == (0.2, 60.0)
    shell.run_line_magic("config", "CudaMemMonitor.interval_s = 0.05")
    assert poller.interval_s == 0.05
    shell.run_line_magic("config", "CudaMemMonitor.max_updates_per_s = 2")
    assert poller.max_updates_per_s == 2
    before = len(poller.history(0))
    time.sleep(0.3)
    assert len(poller.history(0)) >= before + 3


def test_config_alert_fraction_recolours_the_panel(loaded, monkeypatch):
    monkeypatch.setattr(loaded.shell, "kernel", object(), raising=False)  # as in a Jupyter kernel
    loaded.machine.allocate(0, 20 * GiB)
    with capture_output():
        loaded.line("--interval 0.05")
    view = loaded.magics.view
    assert isinstance(view, WidgetView)
    assert 'data-alert="true"' not in view.body.value
    loaded.shell.run_line_magic("config", "CudaMemMonitor.alert_fraction = 0.2")
    assert 'data-alert="true"' in view.body.value


def test_a_newer_panel_takes_over_from_the_older_one(loaded, monkeypatch):
    monkeypatch.setattr(loaded.shell, "kernel", object(), raising=False)
    with capture_output():
        loaded.line("--interval 0.05")
        old = loaded.magics.view
        loaded.line("")
    new = loaded.magics.view
    assert new is not old
    frozen = old.body.value
    loaded.machine.allocate(0, 5 * GiB)
    deadline = time.monotonic() + 3
    while "5.50 GiB" not in new.body.value and time.monotonic() < deadline:
        time.sleep(0.02)
    assert "5.50 GiB" in new.body.value and old.body.value == frozen


def test_snapshot_returns_the_recorded_history(loaded):
    loaded.line("--interval 0.05")
    loaded.machine.allocate(0, 2 * GiB)
    time.sleep(0.2)
    snapshot = loaded.line("snapshot")
    assert isinstance(snapshot, Snapshot)
    used = [s.used_bytes for s in snapshot.devices[0].samples]
    assert used[0] == 0 and used[-1] == 2 * GiB + 512 * 1024**2
    loaded.line("stop")
    assert isinstance(loaded.line("snapshot"), Snapshot)  # still there after stop


def test_no_gpu_says_so_in_one_line_and_starts_nothing(no_gpu):
    with capture_output() as captured:
        no_gpu.line("")
    (output,) = captured.outputs
    line = output.data["text/plain"]
    assert line == f"cudamem monitor: no GPU to monitor: PyTorch sees no CUDA device; {NO_DRIVER}"
    assert our_threads() == []
    with pytest.raises(UsageError, match="nothing recorded yet"):
        no_gpu.line("snapshot")
    no_gpu.shell.run_line_magic("unload_ext", "jupyter_cudamem")


def test_monitor_function_drives_the_same_poller(loaded):
    from jupyter_cudamem import monitor

    monitor(interval_s=0.05)
    poller = loaded.magics.poller
    assert poller is not None and poller.running and len(our_threads()) == 1
    loaded.line("")
    assert loaded.magics.poller is poller and len(our_threads()) == 1
    monitor("stop")
    assert our_threads() == []


def test_the_monitor_module_itself_can_be_called():
    # `from jupyter_cudamem import monitor; monitor()`, as the issue writes it.
    machine = FakeMachine()
    result = _load(machine, FakeNvml(machine))
    try:
        from jupyter_cudamem import monitor

        with capture_output():
            monitor(interval_s=0.05, devices=[0])
        assert len(our_threads()) == 1
        assert isinstance(monitor("snapshot"), Snapshot)
        with pytest.raises(Exception, match="unknown monitor action 'pause'"):
            monitor("pause")
    finally:
        _unload(result)
    assert our_threads() == []


def test_monitor_function_loads_the_extension_when_needed(monkeypatch):
    shell = InteractiveShell.instance()
    if "jupyter_cudamem" in shell.extension_manager.loaded:
        shell.run_line_magic("unload_ext", "jupyter_cudamem")
    magics.unload(shell)
    machine = FakeMachine()
    hardware = Hardware(
        allocator=FakeAllocator(machine), nvml=FakeNvml(machine), pid=machine.pid, pid_exists=lambda p: True
    )
    monkeypatch.setattr(magics, "default_hardware", lambda: hardware)
    from jupyter_cudamem import monitor

    try:
        with capture_output():
            monitor(interval_s=0.05)
        assert "jupyter_cudamem" in shell.extension_manager.loaded
        assert len(our_threads()) == 1
    finally:
        shell.run_line_magic("unload_ext", "jupyter_cudamem")
    assert our_threads() == [] and hardware.nvml.closed


@pytest.mark.parametrize(
    ("call", "says"),
    [
        (lambda m: m("bogus"), "unknown monitor action 'bogus'; use one of"),
        (lambda m: m(interval_s=0), "interval_s takes seconds between readings, at least 0.05 and at most 3600; got 0"),
        (lambda m: m(interval=0), "monitor(): got an unexpected keyword argument 'interval'; it takes monitor(action, "),
        (lambda m: m("start", 5), "monitor(): too many positional arguments"),
        (lambda m: m(interval_s=1e10), "at most 3600; got 1e+10"),
        (lambda m: m(interval_s="fast"), "interval_s takes a number of seconds; got 'fast'"),
        (lambda m: m(history_s=[600]), "history_s takes a number of seconds; got [600]"),
    ],
)
def test_monitor_function_errors_are_one_line_in_a_cell(loaded, call, says, capsys):
    """``monitor(...)`` with a wrong argument, called in a cell: IPython shows one line, none of our frames."""
    from jupyter_cudamem import monitor

    loaded.shell.user_ns["_call"], loaded.shell.user_ns["_monitor"] = call, monitor
    result = loaded.shell.run_cell("_call(_monitor)")
    assert isinstance(result.error_in_exec, UsageError)
    message = str(result.error_in_exec)
    assert says in message and "\n" not in message
    shown = capsys.readouterr()
    assert "Traceback" not in shown.out + shown.err and "jupyter_cudamem" not in shown.out + shown.err
    assert our_threads() == []


def test_a_poller_whose_wait_fails_keeps_running(loaded, monkeypatch):
    """Whatever goes wrong in the thread's loop (here the wait itself, as an interval too long for
    ``Event.wait`` made it fail), it is recorded and the loop goes on: nothing is raised into a cell."""
    errors = []
    monkeypatch.setattr(threading, "excepthook", lambda args: errors.append(args))
    real_wait = threading.Event.wait
    failed = []

    def wait(self, timeout=None):
        if threading.current_thread().name == THREAD_NAME and not failed:
            failed.append(timeout)
            raise OverflowError("timeout value is too large")
        return real_wait(self, timeout)

    monkeypatch.setattr(threading.Event, "wait", wait)
    monkeypatch.setattr("jupyter_cudamem.monitor.poller.MAX_INTERVAL_S", 0.05)  # the backoff stays short
    loaded.line("--interval 0.05")
    poller = loaded.magics.poller
    deadline = time.monotonic() + 5
    while not any(poller.histories().values()) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert failed and poller.running and errors == []
    assert any(poller.histories().values())  # it read the devices after the failed wait
    loaded.line("stop")
