"""Test only: jupyter_cudamem on an ipyparallel engine over the fake machine of ``tests/fakes.py``.

Engines are processes of their own, so a test cannot hand them its fixtures. A test that starts a cluster
puts the checkout on the engines' ``PYTHONPATH``; a cell run there with ``%px`` then imports this module
(``from tests import engine_fakes``) and calls ``install()``, which loads the extension over a fake card
instead of PyTorch and NVML. Every engine gets the same card (one UUID) with its own process id, as
engines sharing one GPU are.
"""

from __future__ import annotations

import os

from tests.fakes import FakeAllocator, FakeGpu, FakeMachine, FakeNvml

SHARED_UUID = "GPU-5ca1ab1e-0000-4000-8000-000000000001"


def install(shell, total_gib: int = 80) -> FakeMachine:
    from jupyter_cudamem import magics
    from jupyter_cudamem.hardware import Hardware

    machine = FakeMachine([FakeGpu(uuid=SHARED_UUID, total_bytes=total_gib * 1024**3)], pid=os.getpid())
    hardware = Hardware(
        allocator=FakeAllocator(machine), nvml=FakeNvml(machine), pid=machine.pid, pid_exists=lambda pid: True
    )
    magics.unload(shell)
    magics.load(shell, hardware)
    return machine


def engine_id(shell) -> int:
    return shell.kernel.engine_id


def own_last_cell():
    """Run on an engine: its own last measured cell, read from its own history (not through our records)."""
    from IPython import get_ipython

    from jupyter_cudamem.magics import loaded
    from jupyter_cudamem.magics.cudamem import CudaMem

    record = loaded(get_ipython()).get(CudaMem).history.records[-1]
    device = record.measurement.devices[0]
    return {
        "pid": os.getpid(),
        "peak": device.peak_allocated_bytes,
        "allocated_delta": device.allocated_delta_bytes,
        "reserved_delta": device.reserved_delta_bytes,
        "process": device.after.process_bytes,
        "execution_count": record.execution_count,
    }


def feeds():
    """Run on an engine: the channels its engines monitor feeds, and whether its monitor's poller runs."""
    from IPython import get_ipython

    from jupyter_cudamem.magics import loaded
    from jupyter_cudamem.magics.engines import CudaMemEngines
    from jupyter_cudamem.magics.monitor import CudaMemMonitor

    extension = loaded(get_ipython())
    poller = extension.get(CudaMemMonitor).poller
    return sorted(extension.get(CudaMemEngines).feeds), poller is not None and poller.running
