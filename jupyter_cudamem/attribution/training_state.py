"""What a training step holds whatever its batch, read from the models and optimizers in the namespace
(``growth.FixedMemory``): before any rerun, so that the batch search knows which bytes do not grow.

Read duck-typed through a ``TensorProbe`` (no torch import here; tests pass CPU tensors with a probe
that counts them). Modules and optimizers are found among the namespace's values and one level into
plain containers (a dict of models, a list of optimizers). Bytes are counted once per storage.

What the first optimizer step creates, per parameter that has no state yet (PyTorch's optimizers
create their state lazily in ``step()``): Adam, AdamW, Adamax, NAdam and RAdam two tensors of the
parameter's shape and dtype (three with ``amsgrad``), SGD one where it has momentum, RMSprop one plus
one for momentum plus one when centered, Adadelta two; Adagrad makes its state at construction. An
optimizer of another class is taken as Adam-like.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping
from typing import Any

from ..growth import FixedMemory
from .probe import StorageKey, TensorProbe

_STATE_TENSORS = {"Adam": 2, "AdamW": 2, "Adamax": 2, "NAdam": 2, "RAdam": 2, "Adadelta": 2, "Adagrad": 0,
                  "SparseAdam": 2, "LBFGS": 0}


def _state_tensors(optimizer: object, group: Mapping[str, object]) -> int:
    """How many tensors of a parameter's size the optimizer's first step creates for one parameter."""
    name = type(optimizer).__name__
    if name == "SGD":
        return 1 if group.get("momentum") else 0
    if name == "RMSprop":
        return 1 + bool(group.get("momentum")) + bool(group.get("centered"))
    return _STATE_TENSORS.get(name, 2) + bool(group.get("amsgrad"))


def _values(namespace: Mapping[str, object]) -> Iterator[tuple[str, object]]:
    for name, value in namespace.items():
        if name.startswith("_"):
            continue
        yield name, value
        if isinstance(value, dict):
            yield from ((name, item) for item in list(value.values())[:64])
        elif isinstance(value, (list, tuple)):
            yield from ((name, item) for item in value[:64])


def _nbytes(tensor: Any) -> int:
    try:
        return int(tensor.numel()) * int(tensor.element_size())
    except Exception:  # noqa: BLE001  a tensor-like without them counts nothing
        return 0


def fixed_memory(namespace: Mapping[str, object], rebuilt: Collection[str], probe: TensorProbe | None,
                 trains: bool = True, read: Collection[int] | None = None) -> FixedMemory | None:
    """The batch-independent part of the step a cell runs, above what will be allocated when it reruns.

    ``rebuilt``: the names the cell binds again (set aside before each rerun, so its models' parameters
    are allocated by the rerun); ``trains``: whether the cell trains (``cell.traits``), so gradients and
    optimizer state are created; ``read``: the ids of the parameters and optimizers the cell reads
    (``reruns.model_state.training_state``), so a model it never touches (a list of layers kept aside)
    makes no gradients and no state (``None``: all of them). ``None`` where no model or optimizer on the
    device is found."""
    if probe is None or not (probe.module_types or probe.optimizer_types):
        return None
    seen: set[int] = set()
    counted: set[StorageKey] = set()
    graded: set[int] = set()  # parameters whose gradient is counted (two models may share them)
    parameters_bytes = gradients_bytes = state_bytes = 0
    sizes: set[int] = set()
    gradient_sizes: list[int] = []
    trainable_sizes: list[int] = []
    state_sizes: list[int] = []
    built_sizes: list[int] = []
    found = False

    def storage(tensor: object) -> tuple[StorageKey, int] | None:
        found = probe.device_storage(tensor)
        if found is None or found[0] in counted:
            return None
        counted.add(found[0])
        return found

    modules: list[tuple[str, Any]] = []
    optimizers: list[tuple[str, Any]] = []
    for name, value in _values(namespace):
        if id(value) in seen:
            continue
        if probe.module_types and isinstance(value, probe.module_types):
            seen.add(id(value))
            modules.append((name, value))
        elif probe.optimizer_types and isinstance(value, probe.optimizer_types):
            seen.add(id(value))
            optimizers.append((name, value))
    for name, module in modules:
        try:
            parameters = list(module.parameters())
            buffers = list(module.buffers())
        except Exception:  # noqa: BLE001  a module that cannot list its tensors is skipped
            continue
        shared: dict[StorageKey, int] = {}  # storages holding several of the module's parameters: their sizes
        for tensor in parameters + buffers:
            if not probe.on_device(tensor):
                continue
            found = True
            size = _nbytes(tensor)
            sizes.update((size, size // 2))  # and the half-precision copy autocast makes
            whole = probe.device_storage(tensor)
            if whole is not None and whole[1] > size:
                # A parameter in a storage larger than itself: cuDNN's RNNs keep their weights in one flat
                # buffer, and their backward pass makes the gradients as one too.
                sizes.add(whole[1])
                if getattr(tensor, "requires_grad", False):
                    shared[whole[0]] = whole[1]
            held = storage(tensor)
            if held is not None and name in rebuilt:
                parameters_bytes += held[1]
                built_sizes.append(size)
        if trains:
            for parameter in parameters:
                if id(parameter) in graded or not probe.on_device(parameter):
                    continue
                graded.add(id(parameter))
                # A model the cell builds again starts each rerun without gradients, whatever the failed
                # run's model holds; one built earlier keeps what the failed run left (held at the start).
                fresh = name in rebuilt or getattr(parameter, "grad", None) is None
                touched = name in rebuilt or read is None or id(parameter) in read
                if getattr(parameter, "requires_grad", False) and touched:
                    trainable_sizes.append(_nbytes(parameter))
                    if fresh:
                        gradients_bytes += _nbytes(parameter)
                        gradient_sizes.append(_nbytes(parameter))
            trainable_sizes.extend(shared.values())  # a flat buffer's gradient, made whole by its backward
    for name, optimizer in optimizers:
        try:
            groups = list(optimizer.param_groups)
            state = optimizer.state
        except Exception:  # noqa: BLE001
            continue
        if not (name in rebuilt or read is None or id(optimizer) in read):
            continue  # an optimizer the cell never steps makes no state
        for group in groups:
            per_parameter = _state_tensors(optimizer, group)
            for parameter in group.get("params", ()):
                if not probe.on_device(parameter):
                    continue
                found = True
                sizes.add(_nbytes(parameter))
                # An optimizer the cell builds again starts each rerun with no state, whatever the failed
                # run's one made before it failed.
                if trains and (name in rebuilt or not state.get(parameter)):
                    state_bytes += per_parameter * _nbytes(parameter)
                    state_sizes.extend([_nbytes(parameter)] * per_parameter)
    if not found:
        return None
    return FixedMemory(parameters_bytes, gradients_bytes, state_bytes, frozenset(s for s in sizes if s > 0),
                       gradient_sizes=tuple(gradient_sizes), trainable_sizes=tuple(trainable_sizes),
                       state_sizes=tuple(state_sizes),
                       built_sizes=tuple(built_sizes), trains=trains and bool(gradient_sizes or optimizers))
