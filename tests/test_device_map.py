from jupyter_cudamem.hardware import DeviceMap, match_devices, normalize_uuid, visible_gpus
from jupyter_cudamem.sources.base import GpuIdentity, TorchDevice

from tests.fakes import FakeAllocator, FakeGpu, FakeMachine, FakeNvml
import pytest

# Nothing here runs a library whose version `make test-min` changes (tests/versioned.py).
pytestmark = pytest.mark.dependency_free

GiB = 1024**3


def _gpus(n):
    return [
        GpuIdentity(i, f"GPU{i}", f"GPU-{i}{i}{i}{i}aaaa-0000-0000-0000-00000000000{i}", f"00000000:0{i + 1}:00.0", 80 * GiB)
        for i in range(n)
    ]


def test_uuid_normalisation_ignores_prefix_and_case():
    assert normalize_uuid("GPU-ABCD-1") == normalize_uuid("abcd-1") == "abcd-1"
    assert normalize_uuid(None) is None


def test_visible_gpus_by_ordinal_and_uuid_prefix():
    gpus = _gpus(4)
    assert [g.nvml_index for g in visible_gpus(gpus, None)] == [0, 1, 2, 3]
    assert [g.nvml_index for g in visible_gpus(gpus, "2,0")] == [2, 0]
    assert [g.nvml_index for g in visible_gpus(gpus, "GPU-3333")] == [3]
    # CUDA stops at the first entry it cannot resolve.
    assert [g.nvml_index for g in visible_gpus(gpus, "1,9,2")] == [1]
    assert visible_gpus(gpus, "") == []
    assert [g.nvml_index for g in visible_gpus(gpus, "1,-1,2")] == [1]  # -1 hides the rest, as in CUDA
    # A digit that is not ASCII (which str.isdigit takes and int refuses) is an entry CUDA cannot resolve.
    assert [g.nvml_index for g in visible_gpus(gpus, "0,²,1")] == [0]


def test_cuda_visible_devices_1_maps_cuda0_to_nvml_1_by_uuid():
    gpus = _gpus(2)
    torch_devices = [TorchDevice(0, "GPU1", 80 * GiB, uuid="1111aaaa-0000-0000-0000-000000000001")]
    [device] = match_devices(torch_devices, gpus, "1")
    assert device.torch_index == 0 and device.nvml_index == 1
    assert device.label == "cuda:0"


def test_uuid_wins_over_position_even_when_order_differs():
    gpus = _gpus(3)
    # CUDA's default order is "fastest first": cuda:0 may be NVML's GPU 2.
    torch_devices = [
        TorchDevice(0, "GPU2", 80 * GiB, uuid="2222aaaa-0000-0000-0000-000000000002"),
        TorchDevice(1, "GPU0", 80 * GiB, uuid="0000aaaa-0000-0000-0000-000000000000"),
    ]
    mapped = match_devices(torch_devices, gpus, None)
    assert [(d.torch_index, d.nvml_index) for d in mapped] == [(0, 2), (1, 0)]


def test_pci_bus_id_is_the_fallback_without_uuid():
    gpus = _gpus(3)
    torch_devices = [TorchDevice(0, "GPU1", 80 * GiB, pci_bus_id="00000000:02:00.0")]
    assert match_devices(torch_devices, gpus, None)[0].nvml_index == 1


def test_position_through_cuda_visible_devices_as_last_resort():
    gpus = _gpus(3)
    torch_devices = [TorchDevice(0, "GPU2", 80 * GiB)]
    assert match_devices(torch_devices, gpus, "2")[0].nvml_index == 2


def test_unmatched_device_keeps_no_nvml_index():
    torch_devices = [TorchDevice(0, "X", 80 * GiB, uuid="ffff")]
    assert match_devices(torch_devices, _gpus(1), None)[0].nvml_index is None


def test_device_map_does_not_ask_torch_before_cuda_is_initialised():
    machine = FakeMachine([FakeGpu(uuid="GPU-a"), FakeGpu(uuid="GPU-b")])
    allocator = FakeAllocator(machine, visible=[1], initialized=False)
    device_map = DeviceMap(allocator, FakeNvml(machine), environ={"CUDA_VISIBLE_DEVICES": "1"})
    [device] = device_map.devices()
    assert device.torch_index is None and device.nvml_index == 1
    assert device.label == "GPU 1"
    allocator.initialized = True
    [device] = device_map.devices()
    assert (device.torch_index, device.nvml_index) == (0, 1)


def test_device_map_without_nvml_still_lists_torch_devices():
    machine = FakeMachine([FakeGpu()])
    device_map = DeviceMap(FakeAllocator(machine), FakeNvml(machine, failure="no driver"), environ={})
    [device] = device_map.devices()
    assert device.torch_index == 0 and device.nvml_index is None
