"""The monitor in a real kernel (nbclient), over fake hardware: the panel is a widget, it keeps
updating from its thread while the next cell runs, and ``%unload_ext`` leaves no thread."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from tests.notebook_runner import run_cell_outputs, stdout_json

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

REPO = Path(__file__).resolve().parents[2]
GiB = 1024**3

SETUP = """\
import json, threading, time
from jupyter_cudamem.hardware import Hardware
import jupyter_cudamem.magics as cudamem_magics
from tests.fakes import FakeAllocator, FakeMachine, FakeNvml, GiB
machine = FakeMachine()
machine.allocate(0, 0)  # this process has a CUDA context already, as after `import torch` and a first tensor
cudamem_magics.load(get_ipython(), Hardware(allocator=FakeAllocator(machine), nvml=FakeNvml(machine),
                                            pid=machine.pid, pid_exists=lambda pid: True))
%load_ext jupyter_cudamem
%cudamem_monitor --interval 0.05"""

ALLOCATE = """\
from jupyter_cudamem.magics import loaded
from jupyter_cudamem.magics.monitor import CudaMemMonitor
monitor_magics = loaded(get_ipython()).get(CudaMemMonitor)
updates_before = monitor_magics.view.updates_sent
started = time.time()
time.sleep(0.3)
for _ in range(8):
    machine.allocate(0, GiB // 2)
    time.sleep(0.25)
time.sleep(0.3)
ended = time.time()
samples = [(s.time_s, s.used_bytes) for s in monitor_magics.poller.history(0) if started <= s.time_s <= ended]
print(json.dumps({"started": started, "ended": ended, "samples": samples,
                  "view": type(monitor_magics.view).__name__,
                  "updates": monitor_magics.view.updates_sent - updates_before}))"""

UNLOAD = """\
%unload_ext jupyter_cudamem
print(json.dumps([t.name for t in threading.enumerate() if t.is_alive()]))"""


@pytest.mark.notebook
def test_panel_keeps_updating_while_the_next_cell_runs():
    setup, allocate, unload = run_cell_outputs([SETUP, ALLOCATE, UNLOAD], timeout=60)

    (panel,) = [o for o in setup if o.get("output_type") == "display_data"]
    assert "application/vnd.jupyter.widget-view+json" in panel["data"]
    assert panel["data"]["text/plain"].startswith("cudamem monitor (every 50 ms): cuda:0")

    result = stdout_json(allocate)
    assert result["view"] == "WidgetView"
    samples = result["samples"]
    assert len(samples) >= 20  # read every 50 ms across a ~2.6 s cell
    assert all(result["started"] <= t <= result["ended"] for t, _ in samples)
    used = [u for _, u in samples]
    assert used == sorted(used)
    assert used[-1] - used[0] == 4 * GiB
    assert len(set(used)) >= 8  # each step was seen while the cell was still running
    assert result["updates"] >= 8  # and the panel was sent each of them

    assert "cudamem-monitor" not in stdout_json(unload)


KEEP_RUNNING = """\
from jupyter_cudamem.magics import loaded
from jupyter_cudamem.magics.monitor import CudaMemMonitor
poller = loaded(get_ipython()).get(CudaMemMonitor).poller
def record_stop(state, path={path!r}):
    if not state.running:
        with open(path, "w") as file:
            file.write(f"stopped: {{state.stop_reason}}")
poller.subscribe(record_stop)
print(json.dumps(poller.running))"""


@pytest.mark.notebook
def test_kernel_shutdown_stops_the_poller(tmp_path):
    # No %unload_ext: the notebook ends with the monitor running and nbclient shuts the kernel down.
    marker = tmp_path / "stopped.txt"
    _setup, keep = run_cell_outputs([SETUP, KEEP_RUNNING.format(path=str(marker))], timeout=60)
    assert stdout_json(keep) is True
    deadline = time.monotonic() + 10
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert marker.read_text() == "stopped: interpreter exit"
