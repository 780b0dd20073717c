"""Cleanup in a real InteractiveShell over the fake machine: released, deleted on request, measured."""

from __future__ import annotations

import sys

import pytest
from IPython.core.interactiveshell import InteractiveShell

from jupyter_cudamem.hardware import Hardware
from jupyter_cudamem.oomfix.cleanup import cleanup
from jupyter_cudamem.attribution.holders import reaches_cuda
from tests.fakes import GiB, MiB, FakeAllocator, FakeMachine, FakeNvml, fake_probe

CELL = """
from tests.fakes import FakeTensor, GiB, MiB
model = FakeTensor(512 * MiB, machine=machine)
spare = FakeTensor(1 * GiB, machine=machine)
def f():
    big = FakeTensor(4 * GiB, machine=machine)
    raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
"""


def holds_fake_cuda(obj: object) -> bool:
    return reaches_cuda(obj, fake_probe())


@pytest.fixture
def setup():
    machine = FakeMachine()
    hardware = Hardware(
        allocator=FakeAllocator(machine), nvml=FakeNvml(machine), pid=machine.pid, pid_exists=lambda p: True
    )
    shell = InteractiveShell.instance()
    shell.reset(new_session=False)
    shell.user_ns["machine"] = machine
    shell.run_cell(CELL, store_history=True)
    yield shell, hardware, machine
    shell.reset(new_session=False)
    for name in ("last_exc", "last_value", "last_traceback", "last_type"):
        if hasattr(sys, name):
            delattr(sys, name)


def test_frees_what_the_failed_cell_left_and_measures_it(setup) -> None:
    shell, hardware, machine = setup
    shell.run_cell("f()", store_history=True)
    shell.run_cell("FakeTensor(256 * MiB, machine=machine)", store_history=True)  # kept in Out
    gpu = machine.gpus[0]
    assert gpu.allocated == (512 + 1024 + 4096 + 256) * MiB
    result = cleanup(shell, hardware, holds_cuda=holds_fake_cuda)
    assert result.freed_bytes == (4096 + 256) * MiB
    assert gpu.allocated == (512 + 1024) * MiB
    assert result.freed_reserved_bytes == (4096 + 256) * MiB  # empty_cache returned it
    assert result.deleted == ()
    assert any("f()" in line for line in result.cleared)
    assert "model" in shell.user_ns and "spare" in shell.user_ns
    assert result.before[0].allocated_bytes - result.after[0].allocated_bytes == result.freed_bytes
    assert "freed 4.25 GiB allocated" in result.text()


def test_delete_names_on_request(setup) -> None:
    shell, hardware, machine = setup
    shell.run_cell("spare", store_history=True)  # Out holds it too: del_var must drop that as well
    result = cleanup(shell, hardware, delete_names=("spare",), holds_cuda=lambda obj: False)
    assert result.deleted == ("spare",)
    assert "spare" not in shell.user_ns
    assert result.freed_bytes == 1 * GiB
    assert machine.gpus[0].allocated == 512 * MiB


def test_without_a_gpu_nothing_is_measured(setup) -> None:
    shell, _, machine = setup
    hardware = Hardware(
        allocator=FakeAllocator(machine, status="PyTorch sees no CUDA device"),
        nvml=FakeNvml(machine, failure="no driver"),
        pid=machine.pid,
        pid_exists=lambda p: True,
    )
    shell.run_cell("f()", store_history=True)
    result = cleanup(shell, hardware, holds_cuda=holds_fake_cuda)
    assert result.freed_bytes is None and result.freed_reserved_bytes is None
    assert result.cleared  # released all the same
    assert "not measured" in result.text()


def test_cuda_not_initialised_reads_nothing(setup) -> None:
    shell, _, machine = setup
    allocator = FakeAllocator(machine, initialized=False)
    hardware = Hardware(allocator=allocator, nvml=FakeNvml(machine), pid=machine.pid, pid_exists=lambda p: True)
    result = cleanup(shell, hardware)
    assert result.freed_bytes == 0
    assert not any(call.startswith("read") for call in allocator.calls)
