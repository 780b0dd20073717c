"""Count the tensors a cell makes, by what they are for, to say what filled its peak (``breakdown``).

PyTorch's ``torch.distributed._tools.mem_tracker.MemTracker`` does this kind of tagging, but stops a
cell that runs its model twice (``NotImplementedError: MemTracker does not support memory tracking for
multiple iterative calls``: any training loop), tags every tensor made in the optimizer's step as
optimizer state (a foreach step's temporary copies included), keeps no bytes per module at the peak,
and needs ``torch.distributed``. So this tracker is our own, built from the same public pieces, all in
torch 2.1 and later: a ``TorchDispatchMode`` sees every tensor an operation returns; global module
hooks say which module's forward is running; optimizer step hooks say when a step runs; autograd's
graph task id says when backward runs; a post-accumulate-grad hook on each parameter says when a
gradient lands in ``.grad``. Tensors are followed through weak references to their storages, keyed by
address: nothing is kept alive.

A tensor is classified when it is made (forward with autograd on: activation; forward without
autograd, backward, the optimizer's step: temporary; elsewhere: other) and reclassified when it turns
out to be a parameter, a gradient or optimizer state. The tensors alive at the tracker's highest point
are remembered as records (not tensors), so a later reclassification (the state an optimizer's first
step made) counts at the peak too.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..breakdown import Category, Phase, TrackedPeak

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle

CUDA_BLOCK_BYTES = 512
"""The caching allocator rounds every request up to a multiple of 512 bytes; counting storages the
same way makes the tracker's figures comparable to the allocator's."""


def _rounded(nbytes: int, device_type: str) -> int:
    if device_type != "cuda":
        return nbytes
    return -(-nbytes // CUDA_BLOCK_BYTES) * CUDA_BLOCK_BYTES


def _in_backward() -> bool:
    task = getattr(torch._C, "_current_graph_task_id", None)
    if task is not None:
        return bool(task() != -1)
    return torch._C._current_autograd_node() is not None


@dataclass
class _Held:
    """One live storage: its size, and what it is for (changed when it turns out to be a gradient...)."""

    nbytes: int
    category: Category
    module: str
    device: str
    reference: weakref.ref[torch.UntypedStorage] | None = None


def _tensors(value: object) -> Iterator[torch.Tensor]:
    """The tensors in an operation's result (a tensor, or tuples and lists of them)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``(parameter, state tensor)`` for each tensor in an optimizer's state."""
    for parameter, state in list(getattr(optimizer, "state", {}).items()):
        if isinstance(state, Mapping):
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    yield parameter, value


def namespace_objects(
    namespace: Mapping[str, object],
) -> tuple[dict[int, str], list[torch.nn.Module], list[torch.optim.Optimizer]]:
    """The models and optimizers bound to names: ``({id(model): name}, models, optimizers)``."""
    names: dict[int, str] = {}
    models: list[torch.nn.Module] = []
    optimizers: list[torch.optim.Optimizer] = []
    for name, value in list(namespace.items()):
        if name.startswith("_"):
            continue
        if isinstance(value, torch.nn.Module):
            names.setdefault(id(value), name)
            models.append(value)
        elif isinstance(value, torch.optim.Optimizer):
            optimizers.append(value)
    return names, models, optimizers


def _storage_bytes(tensor: object, seen: set[int], device_type: str) -> int:
    """numel x element size of ``tensor`` on ``device_type``, once per storage (tied weights once)."""
    if not isinstance(tensor, torch.Tensor) or tensor.device.type != device_type:
        return 0
    try:
        address = tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return 0
    if address in seen:
        return 0
    seen.add(address)
    return int(tensor.numel()) * int(tensor.element_size())


def model_state_bytes(models: Iterable[torch.nn.Module], optimizers: Iterable[torch.optim.Optimizer],
                      device_type: str = "cuda") -> dict[Category, int]:
    """numel x element size of the parameters and buffers, gradients and optimizer state of ``models`` and
    ``optimizers`` on ``device_type``: what they hold between steps, read from the objects themselves.
    Readable after an out-of-memory error, when no tracker ran."""
    seen: set[int] = set()
    totals = {Category.PARAMETERS: 0, Category.GRADIENTS: 0, Category.OPTIMIZER_STATE: 0}
    parameters: list[torch.Tensor] = []
    for model in models:
        for tensor in list(model.parameters()) + list(model.buffers()):
            totals[Category.PARAMETERS] += _storage_bytes(tensor, seen, device_type)
            parameters.append(tensor)
    for optimizer in optimizers:
        for group in getattr(optimizer, "param_groups", ()):
            for tensor in group.get("params", ()):
                totals[Category.PARAMETERS] += _storage_bytes(tensor, seen, device_type)
                parameters.append(tensor)
    for parameter in parameters:
        totals[Category.GRADIENTS] += _storage_bytes(getattr(parameter, "grad", None), seen, device_type)
    for optimizer in optimizers:
        for _, tensor in _optimizer_tensors(optimizer):
            totals[Category.OPTIMIZER_STATE] += _storage_bytes(tensor, seen, device_type)
    return totals


def _guarded(method: Callable[..., None]) -> Callable[..., None]:
    """Run a hook or the per-operation count without ever raising into the user's code: the first failure
    stops the tracker (``failure`` says why) and the cell goes on untouched."""

    def guarded(self: "PeakTracker", *args: object, **kwargs: object) -> None:
        if self.failure is not None:
            return
        try:
            method(self, *args, **kwargs)
        except Exception as error:  # noqa: BLE001  a bug of ours must not cost the user the cell
            self.failure = f"{type(error).__name__}: {error}"

    guarded.__name__ = method.__name__
    guarded.__doc__ = method.__doc__
    return guarded


class _Mode(TorchDispatchMode):
    """Hands every tensor an operation returns to the tracker."""

    def __init__(self, tracker: "PeakTracker"):
        super().__init__()
        self.tracker = tracker

    def __torch_dispatch__(self, func: Callable[..., object], types: tuple[type, ...], args: tuple[object, ...] = (),
                           kwargs: dict[str, object] | None = None) -> object:
        result = func(*args, **(kwargs or {}))
        self.tracker._made(result)
        return result


class PeakTracker:
    """A context manager around a cell's body: on exit, ``peaks()`` says what filled each device's peak.

    ``namespace`` is where the cell's models and optimizers live (the user's namespace): those bound
    there when the cell starts are counted from the start, and models, optimizers and names made during
    the cell are found as they run and at the end. ``device_type`` is "cuda" in a notebook; the tests
    track "cpu".
    """

    def __init__(self, namespace: Mapping[str, object], device_type: str = "cuda"):
        self.namespace = namespace
        self.device_type = device_type
        self._live: dict[str, dict[int, _Held]] = {}
        self._held: dict[str, dict[tuple[Category, str], int]] = {}
        self._total: dict[str, int] = {}
        self._peak: dict[str, int] = {}
        self._peak_phase: dict[str, Phase] = {}
        self._peak_records: dict[str, list[_Held]] = {}
        self._peak_pending: set[str] = set()
        self._forward_depth = 0
        self._labels: list[str] = []  # the module label of each forward running, innermost last
        self._child_label: weakref.WeakKeyDictionary[torch.nn.Module, str] = weakref.WeakKeyDictionary()
        self._roots: weakref.WeakKeyDictionary[torch.nn.Module, str] = weakref.WeakKeyDictionary()
        self._parameter_label: dict[int, str] = {}
        # Tensors compare elementwise: a WeakKeyDictionary would call ``==`` on two parameters; keyed by id.
        self._grad_hooked: dict[int, RemovableHandle] = {}
        self._optimizers: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self._in_step = 0
        self._closing = False  # on exit, storages never seen are left out (they may not have existed at the peak)
        self._handles: list[RemovableHandle] = []
        self._start_total: dict[str, int] = {}
        self._mode: _Mode | None = None
        self._result: dict[str, TrackedPeak] | None = None
        self.failure: str | None = None  # why the tracker stopped counting, if it did

    # -- bookkeeping ----------------------------------------------------------------------------
    def _category(self) -> tuple[Category, str]:
        label = self._labels[-1] if self._labels else ""
        if self._in_step:
            return Category.TEMPORARIES, ""
        if _in_backward():
            # Forward code run during backward is activation checkpointing recomputing what it dropped.
            return (Category.ACTIVATIONS, label) if self._forward_depth else (Category.TEMPORARIES, "")
        if self._forward_depth:
            return (Category.ACTIVATIONS if torch.is_grad_enabled() else Category.TEMPORARIES), label
        return Category.OTHER, ""

    def _phase(self) -> Phase:
        if self._in_step:
            return Phase.OPTIMIZER_STEP
        if _in_backward():
            return Phase.BACKWARD
        return Phase.FORWARD if self._forward_depth else Phase.OUTSIDE

    def _storage(self, tensor: torch.Tensor) -> tuple[torch.UntypedStorage, int, str] | None:
        if tensor.device.type != self.device_type:
            return None
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError, TypeError):  # sparse, nested, meta and friends
            return None
        address = storage.data_ptr()
        if not address:
            return None
        return storage, address, str(tensor.device)

    @_guarded
    def _made(self, result: object) -> None:
        category: tuple[Category, str] | None = None
        for tensor in _tensors(result):
            found = self._storage(tensor)
            if found is None or found[1] in self._live.get(found[2], {}):
                continue  # a view of a storage already counted, or an input returned as it was
            if category is None:
                category = self._category()
            self._add(found, *category)

    def _add(self, found: tuple[torch.UntypedStorage, int, str], category: Category, module: str) -> _Held:
        storage, address, device = found
        held = _Held(_rounded(int(storage.nbytes()), self.device_type), category, module, device)
        held.reference = weakref.ref(storage, partial(self._freed, address, held))
        self._live.setdefault(device, {})[address] = held
        counts = self._held.setdefault(device, {})
        counts[(category, module)] = counts.get((category, module), 0) + held.nbytes
        total = self._total.get(device, 0) + held.nbytes
        self._total[device] = total
        if total > self._peak.get(device, -1):
            self._peak[device] = total
            self._peak_phase[device] = self._phase()
            self._peak_pending.add(device)
        return held

    @_guarded
    def _freed(self, address: int, held: _Held, _reference: object) -> None:
        live = self._live.get(held.device, {})
        if live.get(address) is not held:
            return
        if held.device in self._peak_pending:
            # The first free after a new highest point: what is alive now is what was alive then.
            self._peak_records[held.device] = list(live.copy().values())
            self._peak_pending.discard(held.device)
        del live[address]
        counts = self._held[held.device]
        counts[(held.category, held.module)] -= held.nbytes
        self._total[held.device] -= held.nbytes

    def _retag(self, tensor: object, category: Category, module: str) -> None:
        """Say what a storage is for, counting it from now on if it was made before the tracker looked."""
        if not isinstance(tensor, torch.Tensor):
            return
        found = self._storage(tensor)
        if found is None:
            return
        held = self._live.get(found[2], {}).get(found[1])
        if held is None:
            if not self._closing:
                self._add(found, category, module)
            return
        if (held.category, held.module) == (category, module):
            return
        counts = self._held[held.device]
        counts[(held.category, held.module)] -= held.nbytes
        held.category, held.module = category, module
        counts[(category, module)] = counts.get((category, module), 0) + held.nbytes

    # -- models and optimizers --------------------------------------------------------------------
    def _model_name(self, model: torch.nn.Module) -> str:
        for name, value in list(self.namespace.items()):
            if value is model and not name.startswith("_"):
                return name
        return type(model).__name__

    def _adopt(self, model: torch.nn.Module, name: str | None = None) -> None:
        """Label a model's top-level children and count its parameters, buffers and gradients."""
        inner = getattr(model, "_orig_mod", None)  # torch.compile's wrapper: the model it wraps holds the tensors
        if isinstance(inner, torch.nn.Module):
            self._roots.setdefault(model, name or self._model_name(model))
            self._adopt(inner, self._roots.get(inner) or self._roots[model])
            return
        if model in self._roots:
            return
        root = name or self._model_name(model)
        self._roots[model] = root
        for child_name, child in model.named_children():
            label = f"{root}.{child_name}"
            self._child_label.setdefault(child, label)
            self._label_tensors(child, self._child_label[child])
        self._label_tensors(model, root, recurse=False)

    def _label_tensors(self, module: torch.nn.Module, label: str, recurse: bool = True) -> None:
        for parameter in module.parameters(recurse=recurse):
            owner = self._parameter_label.setdefault(id(parameter), label)  # the first model to claim it names it
            self._retag(parameter, Category.PARAMETERS, owner)
            if parameter.grad is not None:
                self._retag(parameter.grad, Category.GRADIENTS, owner)
            if parameter.requires_grad and id(parameter) not in self._grad_hooked and hasattr(
                parameter, "register_post_accumulate_grad_hook"
            ):
                self._grad_hooked[id(parameter)] = parameter.register_post_accumulate_grad_hook(
                    partial(self._gradient_landed, owner)
                )
        for buffer in module.buffers(recurse=recurse):
            self._retag(buffer, Category.PARAMETERS, label)

    @_guarded
    def _gradient_landed(self, label: str, parameter: torch.Tensor) -> None:
        if parameter.grad is not None:
            self._retag(parameter.grad, Category.GRADIENTS, label)

    def _adopt_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        self._optimizers.add(optimizer)
        for parameter, tensor in _optimizer_tensors(optimizer):
            self._retag(tensor, Category.OPTIMIZER_STATE, self._parameter_label.get(id(parameter), ""))

    # -- hooks ------------------------------------------------------------------------------------
    @_guarded
    def _forward_pre(self, module: torch.nn.Module, _inputs: object) -> None:
        if not self._forward_depth and module not in self._child_label:
            self._adopt(module)
        self._forward_depth += 1
        label = self._child_label.get(module) or self._roots.get(module)
        self._labels.append(label if label is not None else (self._labels[-1] if self._labels else ""))

    @_guarded
    def _forward_post(self, _module: torch.nn.Module, _inputs: object, _outputs: object) -> None:
        self._forward_depth = max(self._forward_depth - 1, 0)
        if self._labels:
            self._labels.pop()

    @_guarded
    def _step_pre(self, _optimizer: torch.optim.Optimizer, _args: object, _kwargs: object) -> None:
        self._in_step += 1

    @_guarded
    def _step_post(self, optimizer: torch.optim.Optimizer, _args: object, _kwargs: object) -> None:
        self._in_step = max(self._in_step - 1, 0)
        self._adopt_optimizer(optimizer)

    @_guarded
    def _adopt_namespace(self, closing: bool = False) -> None:
        """The models and optimizers bound to names: counted from the start as the cell starts; at its end,
        what the cell bound (a model built and never run, an optimizer never stepped) is known, and
        reclassifying its records reaches the peak's records too."""
        names, models, optimizers = namespace_objects(self.namespace)
        for model in models:
            if model not in self._child_label:
                self._adopt(model, names[id(model)])
        if closing:
            for root in list(self._roots.keys()):
                for parameter in root.parameters():
                    if parameter.grad is not None:
                        label = self._parameter_label.get(id(parameter), "")
                        self._retag(parameter.grad, Category.GRADIENTS, label)
        for optimizer in optimizers + list(self._optimizers):
            self._adopt_optimizer(optimizer)

    def __enter__(self) -> "PeakTracker":
        from torch.nn.modules import module as nn_module
        from torch.optim import optimizer as optim_module

        self._adopt_namespace()
        try:
            post = nn_module.register_module_forward_hook(self._forward_post, always_call=True)
        except TypeError:  # torch before 2.2 has no always_call
            post = nn_module.register_module_forward_hook(self._forward_post)
        self._handles = [
            nn_module.register_module_forward_pre_hook(self._forward_pre),
            post,
            optim_module.register_optimizer_step_pre_hook(self._step_pre),
            optim_module.register_optimizer_step_post_hook(self._step_post),
        ]
        self._start_total = dict(self._total)
        self._mode = _Mode(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        mode, self._mode = self._mode, None
        if mode is not None:
            mode.__exit__(None, None, None)
        for handle in self._handles + list(self._grad_hooked.values()):
            handle.remove()
        self._handles = []
        self._grad_hooked = {}
        self._closing = True
        self._adopt_namespace(closing=True)
        for device in list(self._peak_pending):
            self._peak_records[device] = list(self._live.get(device, {}).values())
        self._peak_pending.clear()
        if self.failure is None:
            self._result = self._peaks()
        # A weak reference that dies before its storage never calls back: nothing runs for this cell's
        # tensors once it is over, and the records the peak keeps are plain sizes.
        for live in self._live.values():
            for held in live.values():
                held.reference = None
        self._live = {}
        self._peak_records = {}

    def peaks(self) -> dict[str, TrackedPeak]:
        """What was alive at each device's highest tracked point, by category and module (bytes)."""
        if self.failure is not None:
            raise RuntimeError(f"the tracker stopped while the cell ran: {self.failure}")
        if self._result is None:
            raise RuntimeError("the tracker has not finished: read peaks() after the cell")
        return self._result

    def _peaks(self) -> dict[str, TrackedPeak]:
        models = list(self._roots.keys())
        optimizers = list(self._optimizers)
        expected = model_state_bytes(models, optimizers, self.device_type)
        result: dict[str, TrackedPeak] = {}
        for device, records in self._peak_records.items():
            held: dict[tuple[Category, str], int] = {}
            for record in records:
                key = (record.category, record.module)
                held[key] = held.get(key, 0) + record.nbytes
            result[device] = TrackedPeak(
                device=device,
                held=held,
                phase=self._peak_phase.get(device, Phase.OUTSIDE),
                expected=expected,
                models=tuple(self._roots.values()),
                tracked_at_start=self._start_total.get(device, 0),
            )
        return result
