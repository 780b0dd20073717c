"""The live monitor on a real GPU: the poller against real NVML, and in a real kernel (nbclient)
the panel keeps recording while the next cell allocates 4 GiB in steps.

Run on the GPU machine: ``python3 -m pytest -q -m gpu tests/gpu/test_monitor_gpu.py``.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from tests.notebook_runner import run_cell_outputs, stdout_json

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA device (torch.cuda.is_available() is False)"
    ),
]

REPO = Path(__file__).resolve().parents[2]
GiB = 1024**3
MiB = 1024**2


def wait_for(condition, timeout_s: float = 5.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.02)
    return condition()


def test_poller_reads_real_nvml_and_sees_a_1_gib_allocation():
    from jupyter_cudamem.hardware import default_hardware
    from jupyter_cudamem.monitor.poller import THREAD_NAME, Poller
    from jupyter_cudamem.sources.nvml import shared_session

    torch.ones(1, device="cuda")
    torch.cuda.synchronize()
    # Earlier tests in this process leave blocks in PyTorch's cache; a new 1 GiB tensor could reuse
    # them and never reach the driver. Return them so the allocation below is a real cudaMalloc.
    torch.cuda.empty_cache()
    hardware = default_hardware()
    assert hardware.nvml is shared_session()  # the monitor uses the process-wide session
    poller = Poller(hardware, interval_s=0.05, devices=[torch.cuda.current_device()])
    assert poller.start()
    block = None
    try:
        time.sleep(0.3)
        (row,) = poller.state().devices
        assert row.device.label == f"cuda:{torch.cuda.current_device()}"
        assert row.device.nvml_index is not None
        before = row.latest
        assert before is not None
        assert before.total_bytes == hardware.nvml.memory(row.device.nvml_index).total_bytes
        assert before.utilization_percent is not None and 0 <= before.utilization_percent <= 100
        block = torch.empty(GiB, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()

        def risen():
            latest = poller.state().devices[0].latest
            return latest if latest.used_bytes - before.used_bytes >= 0.95 * GiB else None

        after = wait_for(risen)
        assert after is not None, "NVML never showed the 1 GiB allocation"
        assert abs(after.used_bytes - before.used_bytes - GiB) <= 0.05 * GiB
        if before.process_bytes is not None:  # NVML sees this process on the GPU machine
            assert abs(after.process_bytes - before.process_bytes - GiB) <= 0.05 * GiB
        assert poller.state().error is None
        assert poller.state().devices[0].peak_used_bytes >= after.used_bytes
    finally:
        poller.stop()
        del block
        torch.cuda.empty_cache()
    assert poller.thread is not None and not poller.thread.is_alive()
    import threading

    assert THREAD_NAME not in [t.name for t in threading.enumerate()]


SETUP = """\
import json, threading, time
import torch
warm = torch.ones(1, device="cuda"); torch.cuda.synchronize()
%load_ext jupyter_cudamem
%cudamem_monitor --interval 0.1"""

ALLOCATE = """\
from jupyter_cudamem.magics import loaded
from jupyter_cudamem.magics.monitor import CudaMemMonitor
from jupyter_cudamem.sources.nvml import shared_session
monitor_magics = loaded(get_ipython()).get(CudaMemMonitor)
poller = monitor_magics.poller
index = poller.state().devices[torch.cuda.current_device()].device.nvml_index
updates_before = monitor_magics.view.updates_sent
started = time.time()
time.sleep(0.5)
blocks = []
for _ in range(8):  # 4 GiB in 512 MiB steps over ~3 s
    blocks.append(torch.empty(512 * 1024**2, dtype=torch.uint8, device="cuda"))
    torch.cuda.synchronize()
    time.sleep(0.4)
time.sleep(0.5)
ended = time.time()
samples = [(s.time_s, s.used_bytes, s.process_bytes) for s in poller.history(index) if started <= s.time_s <= ended]
print(json.dumps({"started": started, "ended": ended, "samples": samples,
                  "view": type(monitor_magics.view).__name__,
                  "updates": monitor_magics.view.updates_sent - updates_before,
                  "error": poller.state().error, "running": poller.running,
                  "shared_nvml": monitor_magics.hardware.nvml is shared_session()}))"""

UNLOAD = """\
%unload_ext jupyter_cudamem
print(json.dumps([t.name for t in threading.enumerate() if t.is_alive()]))"""


@pytest.mark.notebook
def test_monitor_records_4_gib_rising_while_the_next_cell_runs():
    setup, allocate, unload = run_cell_outputs([SETUP, ALLOCATE, UNLOAD], timeout=120)

    panels = [o for o in setup if o.get("output_type") == "display_data"]
    assert panels and "application/vnd.jupyter.widget-view+json" in panels[0]["data"]
    assert not [o for o in setup + allocate + unload if o.get("output_type") == "error"]

    result = stdout_json(allocate)
    assert result["view"] == "WidgetView" and result["running"] and result["error"] is None
    assert result["shared_nvml"] is True
    samples = result["samples"]
    # Read every 0.1 s through a ~4.7 s cell, by the thread, while the cell was running.
    assert len(samples) >= 30, samples
    assert all(result["started"] <= t <= result["ended"] for t, _, _ in samples)
    used = [u for _, u, _ in samples]
    rise = max(used) - used[0]
    assert abs(rise - 4 * GiB) <= 0.05 * 4 * GiB, f"rose by {rise / GiB:.3f} GiB"
    levels = sorted({round((u - used[0]) / (512 * MiB)) for u in used})
    assert len(levels) >= 7, f"steps seen: {levels}"  # the climb was seen step by step, not at the end
    own = [p for _, _, p in samples if p is not None]
    if own:
        assert abs(max(own) - own[0] - 4 * GiB) <= 0.05 * 4 * GiB
    assert result["updates"] >= 7  # and the panel was sent those steps

    assert "cudamem-monitor" not in stdout_json(unload)
