"""``sources.torch_host``: what the reruns set aside is moved by torch here, and nowhere else."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from jupyter_cudamem.sources.torch_host import TorchMover  # noqa: E402


class _ModuleOnDevice(torch.nn.Module):
    """A module whose parameters say they are on a CUDA device (this machine may have none)."""

    def parameters(self, recurse=True):
        class OnDevice:
            is_cuda = True

        return iter([OnDevice()])


def test_a_module_holds_gpu_memory_but_tensors_only_leaves_it_bound():
    module = _ModuleOnDevice()
    for mover in (TorchMover(), TorchMover(tensors_only=True)):
        assert mover.holds_gpu(module)
    assert TorchMover(tensors_only=True).to_host(module) is None  # moved in place, others would see it moved


def test_host_tensors_hold_no_gpu_memory():
    mover = TorchMover()
    assert not mover.holds_gpu(torch.zeros(3))
    assert not mover.holds_gpu(torch.nn.Linear(2, 2))
    assert mover.to_host(torch.zeros(3)) is None  # nothing on a device to move
