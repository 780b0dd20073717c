"""What a training cell changes in PyTorch objects, copied to the host and put back: the only code that
calls torch for it (``reruns.model_state`` decides what to copy and when).

A copy is exact: parameters and ``.grad`` (``None`` stays ``None``), buffers (BatchNorm's running
statistics and its step counter), an optimizer's whole ``state_dict`` (moments, step counts, each
group's learning rate), an LR scheduler's and a GradScaler's, and the random number generators a
rerun draws from (dropout masks, ``randn`` inputs, a shuffling DataLoader).
"""

from __future__ import annotations

import copy
import importlib
import random
import sys
from collections.abc import Callable
from enum import Enum
from types import ModuleType
from typing import TYPE_CHECKING, Any, TypedDict, TypeGuard

if TYPE_CHECKING:
    import torch


class SavedOptimizer(TypedDict):
    """An optimizer's ``state_dict`` with each state tensor as ``(host copy, its device)``."""

    state: dict[int, dict[str, object]]
    param_groups: list[dict[str, Any]]


class SavedRandomState(TypedDict, total=False):
    """The generators' states; torch's and NumPy's only where they were imported."""

    python: tuple[object, ...]
    torch: torch.Tensor
    cuda: list[torch.Tensor]
    numpy: object


class StateKind(Enum):
    """The PyTorch objects whose state a training step changes."""

    MODULE = "module"
    LEAF_TENSOR = "leaf tensor"  # a tensor that requires grad and that no op produced: trained by hand
    OPTIMIZER = "optimizer"
    SCHEDULER = "LR scheduler"
    GRAD_SCALER = "GradScaler"


def _torch() -> Any:
    return sys.modules.get("torch")


def _classes(torch: ModuleType) -> list[tuple[StateKind, tuple[type, ...]]]:
    """Each kind's classes in this torch (the scheduler base was ``_LRScheduler`` before 2.0; the
    GradScaler lived in ``torch.cuda.amp`` before 2.3)."""
    schedulers = tuple(
        c for c in (getattr(torch.optim.lr_scheduler, n, None) for n in ("LRScheduler", "_LRScheduler",
                                                                          "ReduceLROnPlateau"))
        if isinstance(c, type)
    )
    scalers = tuple(
        c for c in (getattr(getattr(torch, "amp", None), "GradScaler", None),
                    getattr(getattr(torch.cuda, "amp", None), "GradScaler", None))
        if isinstance(c, type)
    )
    return [(StateKind.MODULE, (torch.nn.Module,)), (StateKind.OPTIMIZER, (torch.optim.Optimizer,)),
            (StateKind.SCHEDULER, schedulers), (StateKind.GRAD_SCALER, scalers)]


def kind_of(value: object) -> StateKind | None:
    """The kind of training state ``value`` is, ``None`` for anything else (and when torch is not imported:
    then nothing in the namespace is a torch object)."""
    torch = _torch()
    if torch is None:
        return None
    if isinstance(value, torch.Tensor):
        return StateKind.LEAF_TENSOR if value.requires_grad and value.is_leaf else None
    for kind, classes in _classes(torch):
        if classes and isinstance(value, classes):
            return kind
    return None


def is_tensor(value: object) -> TypeGuard[torch.Tensor]:
    torch = _torch()
    return torch is not None and isinstance(value, torch.Tensor)


def module_tensors(module: torch.nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``(parameters, buffers)`` of a module and its submodules, each once."""
    return list(module.parameters()), [b for b in module.buffers() if b is not None]


def optimizer_parameters(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def scheduler_optimizer(scheduler: object) -> object:
    return getattr(scheduler, "optimizer", None)


def tensor_bytes(tensor: torch.Tensor) -> int:
    return int(tensor.nelement()) * int(tensor.element_size())


def parameter_bytes(parameter: torch.Tensor) -> int:
    """A parameter's data and its ``.grad``: what its host copy takes."""
    grad = parameter.grad
    return tensor_bytes(parameter) + (0 if grad is None else tensor_bytes(grad))


def optimizer_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(tensor_bytes(v) for entry in optimizer.state.values() if isinstance(entry, dict)
               for v in entry.values() if is_tensor(v))


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    # copy=True: a CPU tensor's ``.to("cpu")`` is the tensor itself, and the copy must not follow it.
    return tensor.detach().to("cpu", copy=True)


def save_parameter(parameter: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    grad = parameter.grad
    return _to_host(parameter), None if grad is None else _to_host(grad)


def restore_parameter(parameter: torch.Tensor, saved: tuple[torch.Tensor, torch.Tensor | None], keep_memory: bool = False) -> None:
    """``keep_memory``: a ``.grad`` the copy lacks is zeroed in place rather than dropped, so the memory a
    run's backward made stays held as at the start of the cell's next run. Zero is what a step adds its
    gradient to, as to ``None``, and ``zero_grad()`` lets it go as it would the real one."""
    torch = _torch()
    data, grad = saved
    with torch.no_grad():
        parameter.copy_(data)
        if grad is None and keep_memory and parameter.grad is not None and not parameter.grad.is_sparse:
            parameter.grad.zero_()
        elif grad is None:
            parameter.grad = None
        elif parameter.grad is not None and parameter.grad.shape == grad.shape and not parameter.grad.is_sparse:
            parameter.grad.copy_(grad)
        else:
            parameter.grad = grad.to(parameter.device, copy=True)


def save_buffer(buffer: torch.Tensor) -> torch.Tensor:
    return _to_host(buffer)


def restore_buffer(buffer: torch.Tensor, saved: torch.Tensor) -> None:
    torch = _torch()
    with torch.no_grad():
        buffer.copy_(saved)


def save_optimizer(optimizer: torch.optim.Optimizer) -> SavedOptimizer:
    """The optimizer's ``state_dict`` with each state tensor copied to the host beside its device."""
    state_dict = optimizer.state_dict()
    state = {
        key: {name: (_to_host(value), value.device) if is_tensor(value) else copy.deepcopy(value)
              for name, value in entry.items()}
        for key, entry in state_dict["state"].items()
    }
    return {"state": state, "param_groups": copy.deepcopy(state_dict["param_groups"])}


def restore_optimizer(optimizer: torch.optim.Optimizer, saved: SavedOptimizer, keep_memory: bool = False) -> HeldUntilStep | None:
    """Fresh tensors each time (``load_state_dict`` keeps a tensor already on the right device as it is,
    so loading the saved copy itself would let the next step change the copy).

    ``keep_memory``: the state tensors of parameters the copy has no state for (the moments a first step
    made) stay allocated, unused, until the optimizer's next step begins, when the step makes them anew:
    the cell's next run holds them through its forward and backward passes. Returns what lets them go
    sooner (``None`` when nothing is held)."""
    held: list[torch.Tensor] = []
    if keep_memory:
        saved_keys = set(saved["state"])
        for index, parameter in enumerate(optimizer_parameters(optimizer)):
            entry = optimizer.state.get(parameter)
            if index not in saved_keys and isinstance(entry, dict):
                held.extend(v for v in entry.values() if is_tensor(v))
    state = {
        key: {name: value[0].to(value[1], copy=True) if isinstance(value, tuple) and len(value) == 2
              and is_tensor(value[0]) else copy.deepcopy(value) for name, value in entry.items()}
        for key, entry in saved["state"].items()
    }
    optimizer.state.clear()  # the current moments go before the saved ones arrive: no second copy on the GPU
    optimizer.load_state_dict({"state": state, "param_groups": copy.deepcopy(saved["param_groups"])})
    return HeldUntilStep(optimizer, held) if held else None


class HeldUntilStep:
    """Tensors kept alive until an optimizer's next ``step()`` begins. ``release()`` lets them go sooner
    and removes the hook (never from inside a step: the hook only drops the tensors, as torch iterates
    its hooks while calling them).

    The hook is torch's global step pre-hook, matched on the optimizer's ``state`` dict: a wrapper
    (accelerate's ``AcceleratedOptimizer``) subclasses ``Optimizer`` without its hooks and steps the
    optimizer it wraps, whose ``state`` it shares."""

    def __init__(self, optimizer: torch.optim.Optimizer, held: list[torch.Tensor]):
        self._held = held
        state = optimizer.state

        def release_on_step(stepping: object, *_: object) -> None:
            if getattr(stepping, "state", None) is state:
                self._held.clear()

        hooks = importlib.import_module("torch.optim.optimizer")  # not an attribute of torch.optim in every torch
        self._handle = hooks.register_optimizer_step_pre_hook(release_on_step)

    @property
    def holding(self) -> bool:
        return bool(self._held)

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(self._held)

    def release(self) -> None:
        self._held.clear()
        self._handle.remove()


def save_scheduler(scheduler: torch.optim.lr_scheduler.LRScheduler) -> dict[str, object]:
    return copy.deepcopy(scheduler.state_dict())


def restore_scheduler(scheduler: torch.optim.lr_scheduler.LRScheduler, saved: dict[str, object]) -> None:
    scheduler.load_state_dict(copy.deepcopy(saved))


def save_grad_scaler(scaler: torch.amp.GradScaler) -> dict[str, object]:
    return copy.deepcopy(scaler.state_dict())


def restore_grad_scaler(scaler: torch.amp.GradScaler, saved: dict[str, object]) -> None:
    if saved:
        scaler.load_state_dict(copy.deepcopy(saved))
    # A try that failed between ``unscale_`` and ``update`` leaves the optimizer marked unscaled, and the
    # next ``unscale_`` would refuse: a fresh step starts with no per-optimizer record, as after ``update``.
    per_optimizer = getattr(scaler, "_per_optimizer_states", None)
    if isinstance(per_optimizer, dict):
        per_optimizer.clear()


def save_random_state() -> SavedRandomState:
    """torch's CPU and CUDA generators, Python's ``random`` and NumPy's global one (when imported)."""
    torch = _torch()
    saved: SavedRandomState = {"python": random.getstate()}
    if torch is not None:
        saved["torch"] = torch.get_rng_state()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            saved["cuda"] = torch.cuda.get_rng_state_all()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        saved["numpy"] = numpy.random.get_state()
    return saved


def restore_random_state(saved: SavedRandomState) -> None:
    torch = _torch()
    random.setstate(saved["python"])
    if torch is not None and "torch" in saved:
        torch.set_rng_state(saved["torch"])
        if "cuda" in saved:
            torch.cuda.set_rng_state_all(saved["cuda"])
    numpy = sys.modules.get("numpy")
    if numpy is not None and "numpy" in saved:
        numpy.random.set_state(saved["numpy"])


def carry_thread_state() -> Callable[[], None]:
    """A function that gives the calling thread's torch state to another thread: the current CUDA device
    and whether gradients are enabled are per thread (a body run in a worker thread must see the
    device the notebook set with ``torch.cuda.set_device`` and a ``torch.set_grad_enabled(False)``)."""
    torch = _torch()
    if torch is None:
        return lambda: None
    grad_enabled = torch.is_grad_enabled()
    device = torch.cuda.current_device() if torch.cuda.is_available() and torch.cuda.is_initialized() else None

    def apply() -> None:
        torch.set_grad_enabled(grad_enabled)
        if device is not None:
            torch.cuda.set_device(device)

    return apply
