import pytest

from jupyter_cudamem.errors import CudaMemError
from jupyter_cudamem.hardware import Hardware
from jupyter_cudamem.measure import Meter

from tests.fakes import FakeAllocator, FakeGpu, FakeMachine, FakeNvml

# Nothing here runs a library whose version `make test-min` changes (tests/versioned.py).
pytestmark = pytest.mark.dependency_free

GiB = 1024**3
MiB = 1024**2


def _hardware(machine, **nvml_options):
    return Hardware(FakeAllocator(machine), FakeNvml(machine, **nvml_options), pid=machine.pid, pid_exists=lambda p: True)


def test_peak_and_deltas_of_a_temporary(machine, hardware):
    machine.allocate(0, 1 * GiB)  # held before the block
    meter = Meter(hardware)
    baseline = meter.start()
    machine.allocate(0, 2 * GiB)
    machine.free(0, 2 * GiB)
    [device] = meter.stop(baseline).devices
    assert device.peak_allocated_bytes == 3 * GiB
    assert device.peak_above_start_bytes == 2 * GiB
    assert device.allocated_delta_bytes == 0
    assert device.reserved_delta_bytes == 2 * GiB
    assert device.nvml_used_delta_bytes == 2 * GiB
    assert device.outside_pytorch_delta_bytes == 0
    assert device.peak_is_block_peak


def test_counters_are_read_after_synchronize_and_peak_is_reset(machine, hardware):
    meter = Meter(hardware)
    meter.stop(meter.start())
    calls = hardware.allocator.calls
    assert calls.index("synchronize:0") < calls.index("read:0") < calls.index("reset_peak:0")
    assert calls[-2:] == ["synchronize:0", "read:0"]


def test_no_reset_keeps_earlier_peak_and_says_so(machine, hardware):
    machine.allocate(0, 4 * GiB)
    machine.free(0, 4 * GiB)
    meter = Meter(hardware, reset_peak=False)
    baseline = meter.start()
    machine.allocate(0, 1 * GiB)
    [device] = meter.stop(baseline).devices
    assert device.peak_allocated_bytes == 4 * GiB
    assert not device.peak_is_block_peak
    assert "reset_peak:0" not in hardware.allocator.calls


def test_memory_outside_pytorch_shows_in_nvml_only(machine, hardware):
    meter = Meter(hardware)
    machine.gpus[0].has_context = True
    baseline = meter.start()
    machine.gpus[0].outside_bytes += 1 * GiB  # CuPy, say
    [device] = meter.stop(baseline).devices
    assert device.allocated_delta_bytes == 0 and device.peak_above_start_bytes == 0
    assert device.outside_pytorch_delta_bytes == 1 * GiB
    assert device.touched


def test_other_processes_do_not_count_when_per_process_memory_is_known(machine, hardware):
    machine.gpus[0].has_context = True
    meter = Meter(hardware)
    baseline = meter.start()
    machine.gpus[0].other_process_bytes += 3 * GiB
    measurement = meter.stop(baseline)
    assert measurement.devices == ()  # nothing of ours moved


def test_first_cuda_use_inside_the_block(machine):
    allocator = FakeAllocator(machine, initialized=False)
    hardware = Hardware(allocator, FakeNvml(machine), pid=machine.pid, pid_exists=lambda p: True)
    meter = Meter(hardware)
    baseline = meter.start()
    assert "reset_peak:0" not in allocator.calls
    allocator.initialized = True
    machine.allocate(0, 1 * GiB)
    [device] = meter.stop(baseline).devices
    assert device.before.allocator.allocated_bytes == 0
    assert device.peak_above_start_bytes == 1 * GiB
    assert device.process_delta_bytes == 512 * MiB + 1 * GiB  # context + pool
    assert device.outside_pytorch_delta_bytes == 512 * MiB
    assert device.peak_is_block_peak


def test_multi_gpu_reports_each_touched_device(machine):
    machine = FakeMachine([FakeGpu(uuid="GPU-a"), FakeGpu(uuid="GPU-b"), FakeGpu(uuid="GPU-c")])
    hardware = _hardware(machine)
    meter = Meter(hardware)
    baseline = meter.start()
    machine.allocate(0, 1 * GiB)
    machine.allocate(2, 2 * GiB)
    measured = meter.stop(baseline).devices
    assert [(d.device.label, d.peak_above_start_bytes) for d in measured] == [("cuda:0", GiB), ("cuda:2", 2 * GiB)]


def test_requested_devices_are_reported_even_untouched(machine):
    machine = FakeMachine([FakeGpu(uuid="GPU-a"), FakeGpu(uuid="GPU-b")])
    meter = Meter(_hardware(machine), devices=[1])
    measured = meter.stop(meter.start()).devices
    assert [d.device.label for d in measured] == ["cuda:1"]


def test_bad_device_is_a_one_line_error(hardware):
    with pytest.raises(CudaMemError, match=r"no CUDA device 7: this process sees 1 \(cuda:0\)"):
        Meter(hardware, devices=[7]).check_devices()


def test_no_gpu_at_all_measures_nothing_and_says_why(machine):
    allocator = FakeAllocator(machine, status="PyTorch 2.13.0+cpu (a CPU-only build) sees no CUDA device")
    hardware = Hardware(allocator, FakeNvml(machine, failure="NVML library not found"), pid=machine.pid)
    meter = Meter(hardware)
    measurement = meter.stop(meter.start())
    assert measurement.devices == ()
    assert len(measurement.unavailable) == 2


def test_nvml_missing_leaves_allocator_figures(machine):
    hardware = _hardware(machine, failure="NVML library not found")
    meter = Meter(hardware)
    baseline = meter.start()
    machine.allocate(0, GiB)
    [device] = meter.stop(baseline).devices
    assert device.peak_above_start_bytes == GiB
    assert device.nvml_used_delta_bytes is None and device.outside_pytorch_delta_bytes is None


def test_per_process_memory_unknown_in_containers(machine):
    machine.gpus[0].has_context = True
    machine.gpus[0].other_process_bytes = GiB
    # NVML lists host PIDs: ours is absent and another listed PID does not exist in our namespace.
    hardware = Hardware(FakeAllocator(machine), FakeNvml(machine), pid=1, pid_exists=lambda pid: pid == 1)
    assert hardware.own_process_bytes(0) is None
    meter = Meter(hardware)
    baseline = meter.start()
    machine.allocate(0, GiB)
    [device] = meter.stop(baseline).devices
    assert device.process_delta_bytes is None
    assert device.nvml_used_delta_bytes == GiB  # falls back to the whole device


def test_a_failed_block_records_the_error_and_what_it_allocated(machine, hardware):
    meter = Meter(hardware)
    baseline = meter.start()
    machine.allocate(0, GiB)
    measurement = meter.stop(baseline, error="ZeroDivisionError")
    assert measurement.error == "ZeroDivisionError"
    assert measurement.devices[0].allocated_delta_bytes == GiB


def test_failed_block_reports_devices_even_untouched(machine, hardware):
    meter = Meter(hardware)
    measurement = meter.stop(meter.start(), error="OutOfMemoryError")
    assert [d.device.label for d in measurement.devices] == ["cuda:0"]


def test_touched_is_read_from_the_samples_as_from_the_figures():
    # ``Meter.stop`` decides from the samples (``_touched``) before it asks the cap and makes the measurement:
    # the same answer as the figures' definition, over every kind of sample each source can give.
    import itertools

    from jupyter_cudamem.hardware import Device
    from jupyter_cudamem.measure import NVML_NOISE_BYTES, DeviceMeasurement, DeviceSample
    from jupyter_cudamem.sources.base import AllocatorReading, NvmlMemory

    def by_figures(d: DeviceMeasurement) -> bool:
        return bool(d.peak_above_start_bytes or d.allocated_delta_bytes or d.reserved_delta_bytes
                    or d.process_delta_bytes
                    or (d.before.process_bytes is None and abs(d.nvml_used_delta_bytes or 0) > NVML_NOISE_BYTES))

    device = Device(0, 0, "Fake", None, 80 * GiB)
    start = AllocatorReading(GiB, 2 * GiB, GiB, 2 * GiB)
    ends = [None, start, AllocatorReading(GiB + 1, 2 * GiB, GiB + 1, 2 * GiB), AllocatorReading(GiB, 3 * GiB, GiB, 3 * GiB)]
    used = [None, NvmlMemory(4 * GiB, 76 * GiB, 80 * GiB), NvmlMemory(4 * GiB + MiB, 76 * GiB, 80 * GiB),
            NvmlMemory(5 * GiB, 75 * GiB, 80 * GiB)]
    for before_alloc, after_alloc, peak, before_nvml, after_nvml, before_process, after_process in itertools.product(
            [None, start], ends, [None, GiB - 1, GiB, GiB + 1], used[:2], used, [None, 3 * GiB], [None, 3 * GiB, 4 * GiB]):
        before = DeviceSample(before_alloc, before_nvml, before_process)
        after = DeviceSample(after_alloc, after_nvml, after_process)
        measured = DeviceMeasurement(device, before, after, peak, None, True)
        assert measured.touched == by_figures(measured), (before, after, peak)
