"""The poller: readings, bounded history, change-only and rate-limited notification, back-off,
and a thread that starts, stops, restarts and never raises."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from jupyter_cudamem.errors import CudaMemError
from jupyter_cudamem.hardware import Hardware
from jupyter_cudamem.monitor.poller import (
    MAX_SAMPLES_PER_DEVICE,
    PROCESS_NOT_AVAILABLE,
    THREAD_NAME,
    MonitorState,
    Poller,
    stop_all,
)
from tests.fakes import FakeAllocator, FakeClock, FakeGpu, FakeMachine, FakeNvml, FlakyNvml, GiB, MiB

REPO = Path(__file__).resolve().parents[2]


def make_hardware(machine: FakeMachine, nvml: FakeNvml | None = None, **allocator: object) -> Hardware:
    return Hardware(
        allocator=FakeAllocator(machine, **allocator),  # type: ignore[arg-type]
        nvml=nvml or FakeNvml(machine),
        pid=machine.pid,
        pid_exists=lambda pid: True,
    )


def our_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == THREAD_NAME and t.is_alive()]


def wait_until(condition, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return condition()


@pytest.fixture
def machine() -> FakeMachine:
    return FakeMachine()


@pytest.fixture
def clocks() -> tuple[FakeClock, FakeClock]:
    return FakeClock(), FakeClock(start=50.0)


def driven_poller(hardware: Hardware, clocks: tuple[FakeClock, FakeClock], **options: object) -> Poller:
    """A poller whose ticks the test calls itself, on fake clocks."""
    clock, monotonic = clocks
    return Poller(hardware, clock=clock, monotonic=monotonic, **options)  # type: ignore[arg-type]


def test_a_tick_reads_used_total_own_share_and_utilization(machine, clocks):
    machine.allocate(0, 2 * GiB)
    machine.gpus[0].other_process_bytes = 3 * GiB
    machine.gpus[0].utilization = 37
    poller = driven_poller(make_hardware(machine), clocks)
    assert poller.tick() == pytest.approx(1.0)
    (row,) = poller.state().devices
    gpu = machine.gpus[0]
    assert row.latest is not None
    assert row.latest.used_bytes == gpu.context_bytes + 2 * GiB + 3 * GiB
    assert row.latest.process_bytes == gpu.context_bytes + 2 * GiB
    assert row.latest.total_bytes == 80 * GiB
    assert row.latest.utilization_percent == 37
    assert row.latest.time_s == clocks[0].now
    assert row.note is None


def test_process_share_that_nvml_cannot_map_is_said_not_guessed(machine, clocks):
    machine.allocate(0, GiB)
    poller = driven_poller(make_hardware(machine, FakeNvml(machine, processes_visible=False)), clocks)
    poller.tick()
    (row,) = poller.state().devices
    assert row.latest is not None and row.latest.process_bytes is None
    assert row.note == PROCESS_NOT_AVAILABLE


def test_history_is_a_ring_buffer_bounded_by_history_over_interval(machine, clocks):
    poller = driven_poller(make_hardware(machine), clocks, interval_s=0.1, history_s=1.0)
    for step in range(100):
        clocks[0].advance(0.1)
        machine.gpus[0].utilization = step
        poller.tick()
    samples = poller.history(0)
    assert len(samples) == 11  # 1 s of history at 0.1 s, both ends included
    assert [s.utilization_percent for s in samples] == list(range(89, 100))
    poller.reconfigure(history_s=0.5)
    assert [s.utilization_percent for s in poller.history(0)] == list(range(94, 100))


def test_a_history_that_would_outgrow_the_cap_is_refused(machine):
    with pytest.raises(CudaMemError, match="raise the interval or shorten the history"):
        Poller(make_hardware(machine), interval_s=0.1, history_s=0.1 * (MAX_SAMPLES_PER_DEVICE + 1))
    with pytest.raises(CudaMemError, match="at least"):
        Poller(make_hardware(machine), interval_s=0.0)


def test_peak_since_start_is_kept_and_reset_by_a_restart(machine, clocks):
    poller = driven_poller(make_hardware(machine), clocks, interval_s=0.05)
    machine.allocate(0, 10 * GiB)
    poller.tick()
    high = poller.state().devices[0].latest.used_bytes
    machine.free(0, 8 * GiB)
    machine.empty_cache()
    clocks[0].advance(1)
    poller.tick()
    row = poller.state().devices[0]
    assert row.latest.used_bytes == high - 8 * GiB
    assert row.peak_used_bytes == high
    assert row.peak_time_s == clocks[0].now - 1
    assert poller.start()
    try:
        assert poller.state().devices[0].peak_used_bytes == high - 8 * GiB
    finally:
        poller.stop()


def test_listeners_hear_only_of_changes_in_what_is_shown(machine, clocks):
    poller = driven_poller(make_hardware(machine), clocks)
    heard: list[MonitorState] = []
    poller.subscribe(heard.append)
    for _ in range(5):
        clocks[1].advance(1.0)
        poller.tick()
    assert len(heard) == 1
    machine.allocate(0, 512 * MiB)
    clocks[1].advance(1.0)
    poller.tick()
    assert len(heard) == 2
    machine.allocate(0, 100 * 1024)  # below the MiB the panel shows
    clocks[1].advance(1.0)
    poller.tick()
    assert len(heard) == 2
    machine.gpus[0].utilization = 50
    clocks[1].advance(1.0)
    poller.tick()
    assert len(heard) == 3 and heard[-1].devices[0].latest.utilization_percent == 50


def test_fast_polling_is_rate_limited_and_the_last_change_still_arrives(machine, clocks):
    poller = driven_poller(make_hardware(machine), clocks, interval_s=0.05, max_updates_per_s=4)
    heard: list[MonitorState] = []
    poller.subscribe(heard.append)
    delays = []
    for _ in range(40):  # 2 s of changes every 50 ms
        machine.allocate(0, GiB)
        delays.append(poller.tick())
        clocks[1].advance(0.05)
    assert len(heard) <= 2 * 4 + 1
    assert len(heard) >= 2 * 4 - 1
    assert poller.notifications == len(heard)
    # A held-back change shortens the wait to when the limit allows it, never lengthens it.
    assert all(0 <= delay <= 0.05 for delay in delays)
    clocks[1].advance(0.25)
    poller.tick()
    assert heard[-1].devices[0].latest.used_bytes == poller.state().devices[0].latest.used_bytes


def test_errors_back_off_are_shown_and_clear_on_recovery(machine, clocks):
    nvml = FakeNvml(machine)
    poller = driven_poller(make_hardware(machine, nvml), clocks, interval_s=1.0, max_backoff_s=5.0)
    heard: list[MonitorState] = []
    poller.subscribe(heard.append)
    poller.tick()  # mid-run: the device list is known
    nvml.raise_next = 4
    delays = []
    for _ in range(4):
        clocks[1].advance(10)
        delays.append(poller.tick())
    assert delays == [2.0, 4.0, 5.0, 5.0]
    assert poller.state().error == "NVML failed: Unknown Error"
    assert heard and heard[-1].error == "NVML failed: Unknown Error"
    clocks[1].advance(10)
    assert poller.tick() == 1.0
    assert poller.state().error is None
    assert heard[-1].error is None


def test_an_unexpected_exception_while_reading_is_recorded_not_raised(machine, clocks):
    nvml = FlakyNvml(machine, errors=[RuntimeError("driver went away")])
    poller = driven_poller(make_hardware(machine, nvml), clocks)
    assert poller.tick() == 2.0
    assert poller.state().error == "RuntimeError: driver went away"


def test_a_failing_listener_is_detached_and_polling_goes_on(machine, clocks):
    poller = driven_poller(make_hardware(machine), clocks)
    calls = []

    def broken(state):
        calls.append(state)
        raise ValueError("comm closed")

    poller.subscribe(broken)
    heard = []
    poller.subscribe(heard.append)
    poller.tick()
    machine.allocate(0, GiB)
    clocks[1].advance(1)
    poller.tick()
    assert len(calls) == 1 and len(heard) == 2


def test_devices_select_by_cuda_number(clocks):
    machine = FakeMachine([FakeGpu(uuid="GPU-a", pci_bus_id="0:1:0"), FakeGpu(uuid="GPU-b", pci_bus_id="0:2:0")])
    machine.allocate(1, GiB)
    poller = driven_poller(make_hardware(machine), clocks, devices=[1])
    poller.tick()
    assert [row.device.label for row in poller.state().devices] == ["cuda:1"]
    assert list(poller.histories()) == [1]
    poller.select(None)
    poller.tick()
    assert [row.device.label for row in poller.state().devices] == ["cuda:0", "cuda:1"]


def test_thread_starts_stops_restarts_and_stays_one(machine):
    poller = Poller(make_hardware(machine), interval_s=0.05)
    assert poller.start()
    first = poller.thread
    assert first is not None and first.daemon and first.name == THREAD_NAME
    assert poller.start()  # a second start starts nothing
    assert poller.thread is first and len(our_threads()) == 1
    assert wait_until(lambda: len(poller.history(0)) >= 3)
    poller.stop()
    assert not first.is_alive() and not poller.running and our_threads() == []
    assert poller.state().running is False
    count = len(poller.history(0))
    time.sleep(0.15)
    assert len(poller.history(0)) == count  # nothing reads after stop
    assert poller.start()
    second = poller.thread
    assert second is not first and second.is_alive() and len(our_threads()) == 1
    assert len(poller.history(0)) < count  # a restart starts a new history
    poller.stop()
    assert our_threads() == []


def test_nvml_errors_on_the_thread_never_reach_the_kernel(machine, monkeypatch):
    escaped = []
    monkeypatch.setattr(threading, "excepthook", lambda args: escaped.append(args))
    nvml = FlakyNvml(machine, errors=[RuntimeError("boom"), CudaMemError("NVML failed: GPU is lost")] * 3)
    poller = Poller(make_hardware(machine, nvml), interval_s=0.05, max_backoff_s=0.1)
    heard: list[MonitorState] = []
    poller.subscribe(heard.append)
    assert poller.start()
    try:
        assert wait_until(lambda: not nvml.errors and poller.state().error is None and poller.history(0))
        assert poller.running
        assert any(state.error == "RuntimeError: boom" for state in heard)
        assert any(state.error == "NVML failed: GPU is lost" for state in heard)
    finally:
        poller.stop()
    assert escaped == []


def test_a_new_interval_applies_at_once(machine):
    poller = Poller(make_hardware(machine), interval_s=30.0)
    assert poller.start()
    try:
        assert len(poller.history(0)) == 1
        poller.reconfigure(interval_s=0.05)
        assert wait_until(lambda: len(poller.history(0)) >= 4, timeout_s=2.0)
    finally:
        poller.stop()


def test_stop_from_a_listener_on_the_thread_does_not_deadlock(machine):
    poller = Poller(make_hardware(machine), interval_s=0.05)

    def stop_on_allocation(state):
        if state.devices and state.devices[0].latest.used_bytes > GiB:
            poller.stop(reason="listener")

    poller.subscribe(stop_on_allocation)
    assert poller.start()
    machine.allocate(0, 2 * GiB)
    assert wait_until(lambda: our_threads() == [])
    assert poller.state().stop_reason == "listener"


def test_no_gpu_starts_no_thread_and_says_why_in_one_line(machine):
    hardware = make_hardware(
        machine,
        FakeNvml(machine, failure="NVML library (libnvidia-ml.so) not found: no NVIDIA driver on this machine"),
        status="PyTorch 2.13 (a CPU-only build) sees no CUDA device, so allocator figures are not measured",
    )
    poller = Poller(hardware)
    heard: list[MonitorState] = []
    poller.subscribe(heard.append)
    assert poller.start() is False
    assert poller.thread is None and our_threads() == []
    reason = poller.state().unavailable
    assert reason is not None and "\n" not in reason
    assert reason.startswith("no GPU to monitor: ")
    assert "no NVIDIA driver" in reason and "CPU-only build" in reason
    assert heard and heard[-1].unavailable == reason
    poller.stop()  # stopping what never ran is harmless


def test_stop_all_stops_every_running_poller(machine):
    pollers = [Poller(make_hardware(machine), interval_s=0.05) for _ in range(2)]
    for poller in pollers:
        assert poller.start()
    stop_all("test")
    assert our_threads() == []
    assert all(p.state().stop_reason == "test" for p in pollers)


def test_interpreter_exit_stops_and_joins_the_thread():
    # A daemon thread is simply frozen at exit unless someone stops it; the atexit hook must
    # stop and join it, which the final "stopped" notification proves.
    script = textwrap.dedent(
        """
        from jupyter_cudamem.hardware import Hardware
        from jupyter_cudamem.monitor.poller import Poller
        from tests.fakes import FakeAllocator, FakeMachine, FakeNvml

        machine = FakeMachine()
        hardware = Hardware(allocator=FakeAllocator(machine), nvml=FakeNvml(machine), pid=machine.pid,
                            pid_exists=lambda pid: True)
        poller = Poller(hardware, interval_s=0.05)
        poller.subscribe(lambda state: print("final:", state.stop_reason, flush=True) if not state.running else None)
        assert poller.start()
        print("started", flush=True)
        """
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["started", "final: interpreter exit"]


def test_even_a_bug_in_the_poller_itself_stays_on_its_thread(machine, monkeypatch):
    escaped = []
    monkeypatch.setattr(threading, "excepthook", lambda args: escaped.append(args))
    poller = Poller(make_hardware(machine), interval_s=0.05, max_backoff_s=0.05)
    assert poller.start()
    try:
        monkeypatch.setattr("jupyter_cudamem.monitor.notify.shown_key", lambda state: 1 / 0)
        assert wait_until(lambda: poller.state().error is not None)
        assert poller.state().error.startswith("internal error in the monitor")
        assert poller.running
    finally:
        monkeypatch.undo()
        poller.stop()
    assert escaped == []
