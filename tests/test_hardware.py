"""``Hardware.capped``: the one way PyTorch is capped for a while and put back (``--limit``, ``%oomfix``'s reruns
under a cell's cap, the plan's calibration on a smaller card)."""

from __future__ import annotations

import pytest

from jupyter_cudamem.errors import CudaMemError
from jupyter_cudamem.hardware import Hardware

from tests.fakes import FakeAllocator, FakeGpu, FakeMachine, FakeNvml, GiB

# Nothing here runs a library whose version `make test-min` changes (tests/versioned.py).
pytestmark = pytest.mark.dependency_free


class _CapUnreadable(FakeAllocator):
    """A PyTorch that cannot report its cap (before ``get_per_process_memory_fraction``)."""

    def memory_fraction(self, index: int) -> float | None:
        return None


def _hardware(machine: FakeMachine, allocator: FakeAllocator | None = None) -> Hardware:
    return Hardware(allocator=allocator or FakeAllocator(machine), nvml=FakeNvml(machine), pid=machine.pid,
                    pid_exists=lambda pid: True)


def test_a_cap_never_loosens_one_already_set_and_is_put_back():
    machine = FakeMachine([FakeGpu(total_bytes=80 * GiB, fraction=0.5)])
    hardware = _hardware(machine)
    with hardware.capped(20 * GiB, [0]) as capped:
        assert capped == [0] and machine.gpus[0].fraction == 0.25  # 20 of 80 GiB
    assert machine.gpus[0].fraction == 0.5
    with hardware.capped(60 * GiB, [0]):
        assert machine.gpus[0].fraction == 0.5  # 60 GiB is above the 40 GiB already set
    with hardware.capped(60 * GiB, [0], keep_tighter=False):
        assert machine.gpus[0].fraction == 0.75
    assert machine.gpus[0].fraction == 0.5


def test_the_cap_is_put_back_on_every_device_when_the_block_fails():
    machine = FakeMachine([FakeGpu(total_bytes=40 * GiB), FakeGpu(total_bytes=40 * GiB, fraction=0.75)])
    hardware = _hardware(machine)
    with pytest.raises(ZeroDivisionError), hardware.capped(10 * GiB, [0, 1]):
        assert [gpu.fraction for gpu in machine.gpus] == [0.25, 0.25]
        1 / 0
    assert [gpu.fraction for gpu in machine.gpus] == [1.0, 0.75]


def test_a_cap_that_cannot_be_read_counts_as_none_or_leaves_the_device_alone():
    machine = FakeMachine([FakeGpu(total_bytes=80 * GiB, fraction=0.5)])
    hardware = _hardware(machine, _CapUnreadable(machine))
    with hardware.capped(20 * GiB, [0], unread_fraction=None) as capped:
        assert capped == [] and machine.gpus[0].fraction == 0.5
    with hardware.capped(20 * GiB, [0]) as capped:
        assert capped == [0] and machine.gpus[0].fraction == 0.25
    assert machine.gpus[0].fraction == 1.0  # what an unreadable cap counted as


def test_limit_plays_a_smaller_card_and_refuses_a_larger_one():
    machine = FakeMachine([FakeGpu(total_bytes=80 * GiB, fraction=0.25)])
    hardware = _hardware(machine)
    with hardware.pytorch_capped(40 * GiB) as limit:
        assert limit == 40 * GiB and machine.gpus[0].fraction == 0.5  # exactly the card asked for
    assert machine.gpus[0].fraction == 0.25
    with pytest.raises(CudaMemError, match="is more than cuda:0 has"), hardware.pytorch_capped(100 * GiB):
        pass
    assert machine.gpus[0].fraction == 0.25


def test_no_limit_or_no_pytorch_cuda_caps_nothing():
    machine = FakeMachine([FakeGpu(total_bytes=80 * GiB, fraction=0.5)])
    with _hardware(machine).capped(None, [0]) as capped:
        assert capped == [] and machine.gpus[0].fraction == 0.5
    unavailable = _hardware(machine, FakeAllocator(machine, status="PyTorch is not installed"))
    with unavailable.capped(20 * GiB, [0]) as capped:
        assert capped == [] and machine.gpus[0].fraction == 0.5
    assert machine.gpus[0].fraction == 0.5
