"""``NvmlSession`` against a stand-in ``pynvml`` module (the real one needs a driver)."""

from __future__ import annotations

import sys
import threading
import time
import types

import pytest

from jupyter_cudamem.errors import CudaMemError
from jupyter_cudamem.sources.nvml import NvmlSession

GiB = 1024**3


def _fake_pynvml(fail_init: str | None = None, v2: bool = True):
    module = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    for name in ("NVMLError_LibraryNotFound", "NVMLError_DriverNotLoaded", "NVMLError_NoPermission", "NVMLError_NotSupported"):
        setattr(module, name, type(name, (NVMLError,), {}))
    module.NVMLError = NVMLError
    module.nvmlMemory_v2 = 0x02000028 if v2 else None
    if not v2:
        del module.nvmlMemory_v2
    module.log = []
    module.gate = threading.Event()
    module.gate.set()

    def init():
        module.log.append("init")
        if fail_init:
            raise getattr(module, fail_init)()

    module.nvmlInit = init
    module.nvmlShutdown = lambda: module.log.append("shutdown")
    module.nvmlDeviceGetCount = lambda: 2
    module.nvmlDeviceGetHandleByIndex = lambda i: f"handle{i}"
    module.nvmlDeviceGetName = lambda h: b"NVIDIA H100 80GB HBM3"
    module.nvmlDeviceGetUUID = lambda h: f"GPU-{h[-1]}"
    module.nvmlDeviceGetPciInfo = lambda h: types.SimpleNamespace(busId=f"00000000:0{h[-1]}:00.0")

    def memory(handle, version=None):
        module.gate.wait()
        module.log.append(("memory", version))
        return types.SimpleNamespace(used=GiB, free=79 * GiB, total=80 * GiB)

    module.nvmlDeviceGetMemoryInfo = memory
    module.nvmlDeviceGetComputeRunningProcesses = lambda h: [
        types.SimpleNamespace(pid=10, usedGpuMemory=GiB),
        types.SimpleNamespace(pid=11, usedGpuMemory=(1 << 64) - 1),
        types.SimpleNamespace(pid=12, usedGpuMemory=None),
    ]
    module.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=37, memory=5)
    return module


@pytest.fixture
def fake_pynvml(monkeypatch):
    module = _fake_pynvml()
    monkeypatch.setitem(sys.modules, "pynvml", module)
    return module


def test_initialises_once_lazily(fake_pynvml):
    session = NvmlSession()
    assert fake_pynvml.log == []
    assert session.status() is None
    session.memory(0)
    session.devices()
    assert fake_pynvml.log.count("init") == 1


def test_devices_identity(fake_pynvml):
    [first, second] = NvmlSession().devices()
    assert (first.nvml_index, first.name, first.uuid, first.pci_bus_id, first.total_bytes) == (
        0, "NVIDIA H100 80GB HBM3", "GPU-0", "00000000:00:00.0", 80 * GiB,
    )
    assert second.uuid == "GPU-1"


def test_memory_asks_for_v2_and_falls_back_to_v1(monkeypatch):
    module = _fake_pynvml(v2=False)
    monkeypatch.setitem(sys.modules, "pynvml", module)
    memory = NvmlSession().memory(0)
    assert memory.used_bytes == GiB and memory.total_bytes == 80 * GiB
    assert ("memory", None) in module.log


def test_process_memory_not_available_becomes_none(fake_pynvml):
    processes = NvmlSession().processes(0)
    assert [(p.pid, p.used_bytes) for p in processes] == [(10, GiB), (11, None), (12, None)]


def test_utilization(fake_pynvml):
    assert NvmlSession().utilization_percent(1) == 37


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        ("NVMLError_LibraryNotFound", "no NVIDIA driver on this machine"),
        ("NVMLError_DriverNotLoaded", "driver is not loaded"),
        ("NVMLError_NoPermission", "refused access"),
    ],
)
def test_init_failures_become_one_line_reasons(monkeypatch, error, expected):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(fail_init=error))
    session = NvmlSession()
    assert expected in session.status()
    with pytest.raises(CudaMemError, match=expected):
        session.memory(0)


def test_missing_package_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    assert "pip install nvidia-ml-py" in NvmlSession().status()


def test_errors_during_a_call_are_translated(fake_pynvml):
    def broken(handle):
        raise fake_pynvml.NVMLError("GPU is lost")

    fake_pynvml.nvmlDeviceGetUtilizationRates = broken
    fake_pynvml.nvmlDeviceGetCount = lambda: (_ for _ in ()).throw(fake_pynvml.NVMLError("GPU is lost"))
    with pytest.raises(CudaMemError, match="NVML failed: GPU is lost"):
        NvmlSession().devices()


def test_close_waits_for_calls_in_flight_before_shutdown(fake_pynvml):
    session = NvmlSession()
    session.status()
    fake_pynvml.gate.clear()
    worker = threading.Thread(target=session.memory, args=(0,))
    worker.start()
    time.sleep(0.05)  # the worker is now inside nvmlDeviceGetMemoryInfo
    closer = threading.Thread(target=session.close)
    closer.start()
    time.sleep(0.05)
    assert "shutdown" not in fake_pynvml.log  # still waiting for the call in flight
    fake_pynvml.gate.set()
    worker.join(2)
    closer.join(2)
    assert fake_pynvml.log[-2:] == [("memory", fake_pynvml.nvmlMemory_v2), "shutdown"]


def test_usable_again_after_close(fake_pynvml):
    session = NvmlSession()
    session.memory(0)
    session.close()
    session.memory(0)
    assert fake_pynvml.log.count("init") == 2
