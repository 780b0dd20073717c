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


class _Fake:
    """A tensor that says whether it is on a CUDA device; ``to`` the other side gives its twin there."""

    device = "cuda:0"

    def __init__(self, value, is_cuda):
        self.value, self.is_cuda = value, is_cuda

    def detach(self):
        return self

    def to(self, device):
        assert device == ("cpu" if self.is_cuda else "cuda:0")
        return _Fake(self.value, not self.is_cuda)


def _FakeCuda(value):
    return _Fake(value, True)


class _ModelOutput(dict):
    """Like transformers' ModelOutput: a dict subclass a model returns (loss, logits, hidden states)."""


def _on_devices(value):
    if isinstance(value, dict):
        return {k: _on_devices(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_on_devices(v) for v in value) if not hasattr(value, "_fields") else tuple(
            _on_devices(v) for v in value)
    return ("_FakeCuda" if value.is_cuda else "_FakeHost", value.value) if isinstance(value, _Fake) else value


def test_a_model_output_goes_to_the_host_as_a_copy_and_comes_back_whole():
    from collections import namedtuple

    Pair = namedtuple("Pair", "keys values")
    out = _ModelOutput(loss=_FakeCuda(1), logits=_FakeCuda(2),
                       past=(Pair(_FakeCuda(3), _FakeCuda(4)),), hidden=[_FakeCuda(5), "text"], steps=7)
    mover = TorchMover()
    assert mover.holds_gpu(out)
    host, back = mover.to_host(out)
    # The copy holds host tensors only, of the same types; the user's object is untouched.
    assert type(host) is _ModelOutput and host is not out
    assert _on_devices(host) == {"loss": ("_FakeHost", 1), "logits": ("_FakeHost", 2),
                                 "past": ((("_FakeHost", 3), ("_FakeHost", 4)),),
                                 "hidden": [("_FakeHost", 5), "text"], "steps": 7}
    assert isinstance(host["past"][0], Pair)
    assert _on_devices(out)["loss"] == ("_FakeCuda", 1) and out["hidden"][0].is_cuda
    assert not mover.holds_gpu(host)
    given = back()
    assert type(given) is _ModelOutput and isinstance(given["past"][0], Pair)
    assert _on_devices(given) == {"loss": ("_FakeCuda", 1), "logits": ("_FakeCuda", 2),
                                  "past": ((("_FakeCuda", 3), ("_FakeCuda", 4)),),
                                  "hidden": [("_FakeCuda", 5), "text"], "steps": 7}


def test_containers_without_gpu_tensors_or_too_many_of_them_are_left_bound():
    mover = TorchMover()
    assert not mover.holds_gpu({"x": _Fake(1, False), "n": 3}) and mover.to_host([_Fake(1, False)]) is None
    assert TorchMover(tensors_only=True).to_host({"loss": _FakeCuda(1)}) is None  # the plan keeps objects bound
    from jupyter_cudamem.sources import torch_host

    many = [_FakeCuda(i) for i in range(torch_host._CONTAINER_TENSORS + 1)]
    assert mover.holds_gpu(many) and mover.to_host(many) is None
    deep = [[[[[[_FakeCuda(1)]]]]]]  # below the depth followed
    assert not mover.holds_gpu(deep)


class _Layer:
    def __init__(self, keys, values):
        self.keys, self.values = keys, values


class _Cache:
    """Like transformers' DynamicCache: a plain object whose layers hold the attention keys and values."""

    def __init__(self, layers):
        self.layers = layers


def test_a_cache_object_inside_a_model_output_goes_to_the_host_too():
    # Left on the GPU, the cache's keys and values (made in the forward pass) keep the failed run's whole
    # autograd graph alive: on an H100 a Llama fine-tune's set-aside output still held 3.2 GiB.
    cache = _Cache([_Layer(_FakeCuda(1), _FakeCuda(2)), _Layer(_FakeCuda(3), _FakeCuda(4))])
    out = _ModelOutput(loss=_FakeCuda(0), past_key_values=cache)
    host, back = TorchMover().to_host(out)
    moved = host["past_key_values"]
    assert moved is not cache and type(moved) is _Cache
    assert [(layer.keys.is_cuda, layer.values.is_cuda) for layer in moved.layers] == [(False, False)] * 2
    assert cache.layers[0].keys.is_cuda  # the user's object is untouched
    given = back()["past_key_values"]
    assert [(layer.keys.value, layer.values.value, layer.keys.is_cuda) for layer in given.layers] == [
        (1, 2, True), (3, 4, True)]


def test_modules_inside_a_container_are_not_copied_and_big_object_graphs_are_left_bound():
    from jupyter_cudamem.sources import torch_host

    module = _ModuleOnDevice()
    assert torch_host._plain_attributes(module) is None
    wide = {"objects": [_Layer(i, i) for i in range(torch_host._CONTAINER_NODES)], "x": _FakeCuda(1)}
    assert TorchMover().to_host(wide) is None
