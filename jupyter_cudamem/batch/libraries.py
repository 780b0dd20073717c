"""Recognising the objects a batch size hides in, by shape, never by importing their libraries.

PyTorch's ``DataLoader``, Hugging Face's ``Trainer``/``TrainingArguments``, Lightning's datamodules
and modules, OmegaConf's ``DictConfig``, ``argparse.Namespace``, dataclasses and plain classes used as
configs. transformers, lightning and omegaconf are not dependencies: a class is recognised by the
names in its MRO and the attributes it has, so subclasses and look-alikes are recognised too.
Reading a value through a path is here as well: it is the one place that touches user objects.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import types
from collections.abc import Iterator, Mapping
from typing import Any, TypeGuard

from .knobs import ObjectPath, Step
from .names import batch_like

_MISSING = object()


def class_names(obj: object) -> set[str]:
    """The names of ``obj``'s classes, and of the class it claims to be: accelerate's prepared loaders are
    wrappers whose ``__class__`` says ``DataLoader``."""
    names = {cls.__name__ for cls in type(obj).__mro__}
    try:
        claimed = obj.__class__
    except Exception:  # noqa: BLE001  a __class__ property of user code that raises claims nothing
        return names
    if claimed is not type(obj) and isinstance(claimed, type):
        names |= {cls.__name__ for cls in claimed.__mro__}
    return names


def _from_notebook(obj: object) -> bool:
    return getattr(obj, "__module__", None) == "__main__"


def is_user_function(obj: object) -> TypeGuard[types.FunctionType]:
    """A function defined in the notebook (whose source is in the input history)."""
    return isinstance(obj, types.FunctionType) and _from_notebook(obj)


def is_user_class(obj: object) -> TypeGuard[type]:
    return isinstance(obj, type) and _from_notebook(obj)


# -- reading a path ------------------------------------------------------------------------------------
def resolve(namespace: Mapping[str, object], path: ObjectPath) -> Any:
    """The value at ``path``, or ``_MISSING`` (see ``found``) when a step does not lead anywhere."""
    value = namespace.get(path.root, _MISSING)
    for step in path.steps:
        if value is _MISSING:
            break
        value = step_into(value, step)
    return value


def found(value: object) -> bool:
    return value is not _MISSING


def step_into(value: Any, step: Step) -> object:
    try:
        if step.key:
            if isinstance(value, Mapping) or _is_dictconfig(value):
                return value[step.name] if step.name in value else _MISSING
            if (
                isinstance(value, (list, tuple))
                and isinstance(step.name, int)
                and -len(value) <= step.name < len(value)
            ):
                return value[step.name]
            return _MISSING
        if not isinstance(step.name, str):
            return _MISSING
        return getattr(value, step.name, _MISSING)
    except Exception:  # a property or __getitem__ of user code that raises: nothing there for us
        return _MISSING


# -- configs --------------------------------------------------------------------------------------------
def _is_dictconfig(obj: object) -> bool:
    return bool({"DictConfig", "EasyDict", "AttrDict", "Box", "ConfigDict"} & class_names(obj))


def is_config_like(obj: object) -> bool:
    """A container of settings: a dict, a namespace, a dataclass, an OmegaConf-style config, a class of constants."""
    if isinstance(obj, Mapping) or _is_dictconfig(obj):
        return True
    if isinstance(obj, types.SimpleNamespace) or "Namespace" in class_names(obj):
        return True
    if dataclasses.is_dataclass(obj):
        return True
    return is_user_class(obj) and not callable(getattr(obj, "forward", None))


def config_fields(obj: Any) -> Iterator[tuple[Step, object]]:
    """The (step, value) pairs a config holds, for scanning it for a batch size."""
    try:
        if isinstance(obj, Mapping) or _is_dictconfig(obj):
            for key in list(obj.keys())[:500]:
                if isinstance(key, str):
                    yield Step(key, key=True), obj[key]
            return
        if isinstance(obj, type):
            items = [(k, v) for k, v in vars(obj).items() if not k.startswith("_")]
        elif dataclasses.is_dataclass(obj):
            items = [(f.name, getattr(obj, f.name, None)) for f in dataclasses.fields(obj)]
        else:
            items = [(k, v) for k, v in vars(obj).items() if not k.startswith("_")]
    except Exception:
        return
    for name, value in items[:500]:
        yield Step(name), value


def batch_fields(obj: object, path: ObjectPath, depth: int = 2) -> Iterator[tuple[ObjectPath, int]]:
    """Every int field named like a batch size in a config and the configs inside it."""
    for step, value in config_fields(obj):
        child = path.child(step)
        if type(value) is int and batch_like(str(step.name)):
            yield child, value
        elif depth > 1 and is_config_like(value) and not isinstance(value, type):
            yield from batch_fields(value, child, depth - 1)


def settable(parent: object, step: Step) -> bool:
    """Whether ``parent``'s field can be assigned (not a read-only property)."""
    if step.key:
        return True
    attribute = getattr(type(parent), str(step.name), None)
    return not (isinstance(attribute, property) and attribute.fset is None)


# -- callables with bound arguments ----------------------------------------------------------------------
def bound_arguments(obj: object) -> dict[str, tuple[object, int | None]]:
    """The arguments a ``functools.partial`` binds, by the parameter of its function they fill: each value
    and its position among the partial's ``args`` (``None`` for a keyword). Empty for anything else."""
    if not isinstance(obj, functools.partial):
        return {}
    arguments: dict[str, tuple[object, int | None]] = {name: (value, None) for name, value in obj.keywords.items()}
    try:
        parameters = list(inspect.signature(obj.func).parameters.values())
    except (TypeError, ValueError):
        return arguments
    positional = [p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    for index, (name, value) in enumerate(zip(positional, obj.args)):
        arguments.setdefault(name, (value, index))
    return arguments


# -- PyTorch's DataLoader ----------------------------------------------------------------------------
def is_dataloader(obj: object) -> bool:
    return "DataLoader" in class_names(obj) and all(hasattr(obj, a) for a in ("dataset", "batch_sampler"))


def wrapped_loader(loader: object) -> object:
    """The DataLoader inside a wrapper that stands for it (accelerate's ``DataLoaderShard``, which
    ``Accelerator.prepare`` returns), or ``None`` for a loader that is itself a DataLoader."""
    inner = getattr(loader, "__dict__", {}).get("base_dataloader")
    return inner if inner is not None and type(loader) is not type(inner) and is_dataloader(inner) else None


def loader_problem(loader: object) -> str | None:
    """Why a loader's batch size cannot be changed by rebuilding it, or ``None`` when it can."""
    if getattr(loader, "batch_size", None) is not None:
        return None
    batch_sampler = getattr(loader, "batch_sampler", None)
    if batch_sampler is None:
        return "it was built with batch_size=None: the dataset returns whole batches"
    if type(batch_sampler).__name__ == "BatchSampler" and type(getattr(batch_sampler, "batch_size", None)) is int:
        return None  # a stock BatchSampler passed as batch_sampler= can be rebuilt the same way
    return (
        f"it batches with a custom batch_sampler ({type(batch_sampler).__name__}): the batch size is "
        "that sampler's to change"
    )


def loader_batch_size(loader: object) -> int | None:
    size = getattr(loader, "batch_size", None)
    if type(size) is int:
        return size
    size = getattr(getattr(loader, "batch_sampler", None), "batch_size", None)
    return size if type(size) is int else None


# -- Hugging Face ----------------------------------------------------------------------------------------
def is_training_arguments(obj: object) -> bool:
    return any(name.endswith("TrainingArguments") for name in class_names(obj)) and hasattr(
        obj, "per_device_train_batch_size"
    )


def is_hf_trainer(obj: object) -> bool:
    """A ``transformers.Trainer``, a subclass or a look-alike: a ``*Trainer`` whose ``args`` are ``TrainingArguments``."""
    return any(name.endswith("Trainer") for name in class_names(obj)) and is_training_arguments(
        getattr(obj, "args", None)
    )


# -- Lightning -----------------------------------------------------------------------------------------
def is_lightning_holder(obj: object) -> bool:
    """A Lightning datamodule or module (or a look-alike: builds its own loaders, keeps a batch size)."""
    names = class_names(obj)
    if {"LightningDataModule", "LightningModule"} & names:
        return True
    return callable(getattr(obj, "train_dataloader", None)) and bool(lightning_batch_paths(obj, ObjectPath("x")))


def lightning_batch_paths(obj: object, path: ObjectPath) -> list[tuple[ObjectPath, int]]:
    """Where a Lightning object keeps ``batch_size``: the attribute and its ``hparams``, as Lightning's own
    batch-size finder changes both."""
    holders: list[tuple[ObjectPath, int]] = []
    for name in ("batch_size", "train_batch_size"):
        value = getattr(obj, name, None) if not isinstance(getattr(type(obj), name, None), property) else None
        if type(value) is int:
            holders.append((path.attribute(name), value))
        hparams = getattr(obj, "hparams", None)
        if hparams is not None:
            inner = (
                step_into(hparams, Step(name, key=True))
                if isinstance(hparams, Mapping)
                else step_into(hparams, Step(name))
            )
            if type(inner) is int:
                step = Step(name, key=isinstance(hparams, Mapping))
                holders.append((path.attribute("hparams").child(step), inner))
        if holders:
            break
    return holders


# -- models ---------------------------------------------------------------------------------------------
def is_module(obj: object) -> bool:
    return callable(getattr(obj, "modules", None)) and callable(getattr(obj, "forward", None))


# PyTorch's layers that take (sequence, batch, features) unless built with ``batch_first=True``.
SEQUENCE_FIRST_CLASSES = frozenset(
    {
        "RNNBase",
        "RNN",
        "LSTM",
        "GRU",
        "MultiheadAttention",
        "Transformer",
        "TransformerEncoderLayer",
        "TransformerDecoderLayer",
    }
)


def sequence_first(model: Any) -> bool:
    """Whether a model takes sequence-first input (an RNN or Transformer without ``batch_first``)."""
    try:
        for module in list(model.modules())[:2000]:
            if SEQUENCE_FIRST_CLASSES & class_names(module) and getattr(module, "batch_first", True) is False:
                return True
    except Exception:
        return False
    return False
