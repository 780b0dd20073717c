"""Moving what holds GPU memory to the host and back: the only code that calls torch for it
(``oomfix.leftovers`` decides what to set aside and when; ``%%cudamem_plan`` sets aside the same way).

A ``TorchMover`` is the ``leftovers.Mover`` for PyTorch: tensors are copied to the host, modules moved
in place (as ``module.cpu()`` does), and optimizers' state moved in place.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any


class TorchMover:
    """PyTorch tensors (copied to the host), modules (moved in place, as ``module.cpu()`` does) and
    optimizers (their state moved in place: a cell that builds its model and optimizer binds both again,
    and an optimizer's state, Adam's two moments, is twice its parameters).

    ``tensors_only`` moves tensors and nothing else: a module or an optimizer moved in place is seen on the
    host by whatever else refers to it (a list of models, an optimizer), so a caller that must leave the
    cell's objects as they were keeps them bound instead (``to_host`` answers ``None``).
    """

    def __init__(self, tensors_only: bool = False):
        self.tensors_only = tensors_only

    def holds_gpu(self, value: object) -> bool:
        if getattr(value, "is_cuda", False) is True:
            return True
        if _optimizer_state(value) is not None:
            return any(getattr(t, "is_cuda", False) for t in _state_tensors(value))
        parameters = getattr(value, "parameters", None)
        if callable(parameters) and hasattr(value, "to"):
            try:
                return any(getattr(p, "is_cuda", False) for p in parameters())
            except Exception:
                return False
        return False

    def to_host(self, value: object) -> tuple[object, Callable[[], object]] | None:
        if self.tensors_only and getattr(value, "is_cuda", False) is not True:
            return None
        import torch

        if isinstance(value, torch.Tensor) and value.is_cuda:
            device = value.device
            host = value.detach().to("cpu")
            requires_grad = value.requires_grad and value.is_leaf

            def back() -> object:
                moved = host.to(device)
                return moved.requires_grad_(True) if requires_grad else moved

            return host, back
        if isinstance(value, torch.nn.Module):
            devices = {p.device for p in value.parameters()} | {b.device for b in value.buffers()}
            cuda = [d for d in devices if d.type == "cuda"]
            if len(cuda) != 1 or len(devices) != 1:
                return None  # spread over devices: moving it back could not restore it exactly
            device = cuda[0]
            value.to("cpu")
            return value, lambda: value.to(device)
        if isinstance(value, torch.optim.Optimizer):
            return _move_optimizer_state(value)
        return None


def _optimizer_state(value: object) -> Any:
    state = getattr(value, "state", None)
    return state if isinstance(state, Mapping) and hasattr(value, "param_groups") else None


def _state_tensors(value: object) -> list[Any]:
    state = _optimizer_state(value)
    if state is None:
        return []
    return [t for entry in state.values() if isinstance(entry, Mapping) for t in entry.values()]


def _move_optimizer_state(optimizer: Any) -> tuple[object, Callable[[], object]] | None:
    """Move each CUDA tensor of ``optimizer.state`` to the host in place; give back moves them back."""
    moved: list[tuple[dict[Any, Any], Any, Any]] = []  # (state entry, key, device)
    for entry in optimizer.state.values():
        if not isinstance(entry, dict):
            return None
        for key, tensor in entry.items():
            if getattr(tensor, "is_cuda", False):
                moved.append((entry, key, tensor.device))
    for entry, key, _ in moved:
        entry[key] = entry[key].detach().to("cpu")

    def back() -> object:
        for entry, key, device in moved:
            entry[key] = entry[key].to(device)
        return optimizer

    return optimizer, back
