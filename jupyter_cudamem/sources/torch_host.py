"""Moving what holds GPU memory to the host and back: the only code that calls torch for it
(``reruns.set_aside`` decides what to set aside and when; ``%%cudamem_plan`` sets aside the same way).

A ``TorchMover`` is the ``set_aside.Mover`` for PyTorch: tensors are copied to the host, modules moved
in place (as ``module.cpu()`` does), optimizers' state moved in place, and containers of tensors (a
model's output, a batch dict) copied with their tensors on the host.
"""

from __future__ import annotations

import copy
import types
from collections.abc import Callable, Mapping, MutableMapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


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
        if isinstance(value, (Mapping, list, tuple)):
            return any(getattr(t, "is_cuda", False) is True for t in _contained(value))
        if _optimizer_state(value) is not None:
            return any(getattr(t, "is_cuda", False) for t in _state_tensors(value))
        parameters = getattr(value, "parameters", None)
        if callable(parameters) and hasattr(value, "to"):
            try:
                return any(getattr(p, "is_cuda", False) for p in parameters())
            except Exception:
                return False
        return False

    def addresses(self, value: object) -> frozenset[int]:
        """The device addresses of the storages of the CUDA tensors ``value`` holds: itself, a module's
        parameters and buffers, an optimizer's state, the tensors in a container."""
        if _optimizer_state(value) is not None:
            tensors = list(_state_tensors(value))
        elif callable(parameters := getattr(value, "parameters", None)) and callable(buffers := getattr(value, "buffers", None)):
            try:
                tensors = [*parameters(), *buffers()]
            except Exception:  # noqa: BLE001  a user's object that only looks like a module
                return frozenset()
        elif hasattr(value, "is_cuda"):
            tensors = [value]
        else:
            tensors = _contained(value)
        found = set()
        for tensor in tensors:
            try:
                if tensor is not None and tensor.is_cuda:
                    found.add(int(tensor.untyped_storage().data_ptr()))
            except Exception:  # noqa: BLE001  a tensor subclass without a storage: nothing to replay
                continue
        return frozenset(found)

    def grown(self, value: object, from_batch: int, to_batch: int) -> list[list[torch.Tensor]]:
        """Memory that makes the CUDA tensors of ``value`` whose first dimension (or second, of one of
        three or more: a sequence-first RNN's) is ``from_batch`` hold what they would at ``to_batch``:
        for each, a block of the difference, let go with the tensor (``weakref.finalize``) or by clearing
        the list it is in. None where it does not fit (the run then finds out)."""
        import weakref

        import torch

        tensors = [value] if isinstance(value, torch.Tensor) else _contained(value)
        grown: list[list[torch.Tensor]] = []
        for tensor in tensors:
            if not isinstance(tensor, torch.Tensor) or not tensor.is_cuda or tensor.dim() == 0:
                continue
            if tensor.shape[0] != from_batch and not (tensor.dim() >= 3 and tensor.shape[1] == from_batch):
                continue
            extra = tensor.untyped_storage().nbytes() * (to_batch - from_batch) // from_batch
            if extra <= 0:
                continue
            try:
                held = [torch.empty(extra, dtype=torch.uint8, device=tensor.device)]
            except torch.OutOfMemoryError:
                break
            weakref.finalize(tensor, held.clear)
            grown.append(held)
        return grown

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
            return value, lambda: _all_or_nothing(lambda: value.to(device), lambda: value.to("cpu"))
        if isinstance(value, torch.optim.Optimizer):
            return _move_optimizer_state(value)
        if isinstance(value, (MutableMapping, list, tuple)) and not self.tensors_only:
            return _move_container(value)
        return None


# A container is followed this many levels down (a model output's cache, its list of layers, a layer, its
# keys: four), and moved only when it holds at most this many tensors
# (a model's output, a batch dict, a list of a loop's losses; not a dataset in a list).
_CONTAINER_DEPTH = 5
_CONTAINER_TENSORS = 10_000
_CONTAINER_NODES = 100_000


def _plain_attributes(value: object) -> dict[object, object] | None:
    """The attributes of a plain object that may hold tensors (transformers' ``DynamicCache`` in a model's
    output: its layers' keys and values, which reach the failed run's autograd graph); ``None`` for a
    tensor, a module or an optimizer (moved otherwise), a class, a function or a module object."""
    if isinstance(value, (type, types.ModuleType, types.FunctionType, types.MethodType)) or hasattr(value, "is_cuda"):
        return None
    if callable(getattr(value, "parameters", None)) or hasattr(value, "param_groups"):
        return None
    attributes = getattr(value, "__dict__", None)
    return attributes if isinstance(attributes, dict) else None


def _contained(value: object, depth: int = _CONTAINER_DEPTH) -> list[Any]:
    """The tensors inside nested mappings, lists, tuples and plain objects (at most
    ``_CONTAINER_TENSORS + 1``; as many, so "too many", where more than ``_CONTAINER_NODES`` objects
    would have to be looked at)."""
    found: list[Any] = []
    pending = [(value, depth)]
    seen: set[int] = set()
    while pending and len(found) <= _CONTAINER_TENSORS:
        item, left = pending.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        if len(seen) > _CONTAINER_NODES:
            return found + [None] * (_CONTAINER_TENSORS + 1 - len(found))
        if hasattr(item, "is_cuda") and hasattr(item, "detach"):
            found.append(item)
        elif left > 0:
            pending += [(child, left - 1) for child in (_movable_children(item) or {}).values()]
    return found


def _move_container(value: object) -> tuple[object, Callable[[], object]] | None:
    """A model's output (``transformers``' ``ModelOutput`` is a dict), a batch dict, a list of losses: a
    copy whose CUDA tensors are on the host, detached (what they free is the failed run's autograd graph
    too; no rerun reads it back). The container itself is never changed: another name that refers to it
    sees it as it was (and keeps its memory)."""
    if len(_contained(value)) > _CONTAINER_TENSORS:
        return None
    return _move(value, _CONTAINER_DEPTH)


def _move(item: Any, depth: int) -> tuple[object, Callable[[], object]] | None:
    """``(a copy of item with its CUDA tensors on the host, give back)``; ``None`` when nothing in it is
    on a GPU. ``give back()`` makes another copy, the tensors on their devices again."""
    if getattr(item, "is_cuda", False) is True and hasattr(item, "detach"):
        device, host = item.device, item.detach().to("cpu")
        return host, lambda: host.to(device)
    if depth <= 0:
        return None
    children = _movable_children(item)
    if children is None:
        return None
    moved = {key: _move(child, depth - 1) for key, child in children.items()}
    backs = {key: entry[1] for key, entry in moved.items() if entry is not None}
    if not backs:
        return None
    try:
        host = _with(item, {key: entry[0] for key, entry in moved.items() if entry is not None})
    except Exception:  # noqa: BLE001  a container or object that cannot be copied is left bound
        return None
    return host, lambda: _with(host, {key: back() for key, back in backs.items()})


def _movable_children(item: object) -> dict[object, object] | None:
    """A mapping's items, a list's or tuple's by index, a plain object's attributes (``_plain_attributes``);
    ``None`` for anything else. (A read-only mapping is listed too: what it holds is seen, but copying it
    with its tensors replaced fails, so it is left bound.)"""
    if isinstance(item, Mapping):
        return dict(item.items())
    if isinstance(item, (list, tuple)):
        return dict(enumerate(item))
    attributes = _plain_attributes(item)
    return None if attributes is None else dict(attributes)


def _with(item: Any, replaced: Mapping[object, object]) -> object:
    """A shallow copy of a mapping, list, tuple or plain object with the items (attributes) under
    ``replaced``'s keys replaced."""
    if isinstance(item, tuple):
        items = [replaced.get(index, child) for index, child in enumerate(item)]
        return _rebuilt_tuple(item, items)
    copied = copy.copy(item)
    if isinstance(item, (MutableMapping, list)):
        for key, value in replaced.items():
            copied[key] = value
    else:
        vars(copied).update(replaced)
    return copied


def _rebuilt_tuple(original: tuple[object, ...], items: list[object]) -> tuple[object, ...]:
    make = getattr(type(original), "_make", None)  # a namedtuple
    return make(items) if callable(make) else (tuple(items) if type(original) is tuple else type(original)(items))


def _optimizer_state(value: object) -> Mapping[object, object] | None:
    state = getattr(value, "state", None)
    return state if isinstance(state, Mapping) and hasattr(value, "param_groups") else None


def _state_tensors(value: object) -> list[Any]:
    state = _optimizer_state(value)
    if state is None:
        return []
    return [t for entry in state.values() if isinstance(entry, Mapping) for t in entry.values()]


def _move_optimizer_state(optimizer: torch.optim.Optimizer) -> tuple[object, Callable[[], object]] | None:
    """Move each CUDA tensor of ``optimizer.state`` to the host in place; give back moves them back."""
    moved: list[tuple[dict[object, Any], object, torch.device]] = []  # (state entry, key, device)
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

    def to_host() -> None:
        for entry, key, _ in moved:
            entry[key] = entry[key].to("cpu")

    return optimizer, lambda: _all_or_nothing(back, to_host)


def _all_or_nothing(move: Callable[[], object], undo: Callable[[], object]) -> object:
    """``move()``; where it fails half-way (out of memory on the device), ``undo()`` puts everything back on
    the host before the error is raised: a module or optimizer is never left half on each."""
    try:
        return move()
    except BaseException:
        undo()
        raise
