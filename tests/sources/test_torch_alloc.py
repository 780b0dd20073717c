"""``TorchAllocator`` on whatever torch this machine has; the GPU paths run in tests/gpu."""

import types

import pytest
import torch

from jupyter_cudamem.sources.torch_alloc import TorchAllocator, _pci_bus_id


@pytest.mark.skipif(torch.cuda.is_available(), reason="this torch sees a CUDA device: test_status_is_none_with_cuda")
def test_status_says_why_without_cuda():
    status = TorchAllocator().status()
    assert status is not None
    assert torch.__version__ in status and "sees no CUDA device" in status


@pytest.mark.gpu
def test_status_is_none_with_cuda():
    assert TorchAllocator().status() is None


def test_not_initialised_means_nothing_is_read():
    if torch.cuda.is_initialized():
        pytest.skip("an earlier test in this process initialised CUDA (the GPU suite does)")
    allocator = TorchAllocator()
    assert allocator.is_initialized() is False
    allocator.empty_cache()  # must not initialise CUDA
    assert not torch.cuda.is_initialized()


def test_pci_bus_id_in_nvml_form():
    props = types.SimpleNamespace(pci_bus_id=0x1A, pci_device_id=0, pci_domain_id=0)
    assert _pci_bus_id(props) == "00000000:1a:00.0"
    assert _pci_bus_id(types.SimpleNamespace()) is None
