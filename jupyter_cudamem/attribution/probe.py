"""How tensors, modules, optimizers, autograd graphs and module hooks are recognised and read.

Everything is duck-typed behind a ``TensorProbe`` so the walk needs neither CUDA nor torch: tests pass
fake types, or real CPU tensors with ``on_device`` saying that CPU tensors count.

**Autograd graphs.** A tensor computed with gradients enabled keeps its ``grad_fn``, and each node of
that graph keeps what its backward needs (the *saved tensors*: activations, inputs) until a backward
pass through it frees them. PyTorch exposes them per node as ``_raw_saved_<name>`` (a ``SavedTensor``)
next to ``_saved_<name>`` (the unpacked tensor); custom ``autograd.Function`` nodes expose
``_raw_saved_tensors`` and keep whatever else ``forward`` stored on ``ctx`` in their ``__dict__``. The
graph goes on through ``next_functions``. We read a saved tensor through ``SavedTensor.data`` where
PyTorch has it (2.4 and later): that returns what is stored without running an unpack hook, which
matters because ``torch.utils.checkpoint`` recomputes the forward in its unpack hook and
``save_on_cpu`` copies back to the GPU in its. Where ``data`` is missing (older PyTorch) we unpack
through ``_saved_<name>`` as torchviz does, except in graphs that contain a non-reentrant checkpoint
(``_NoopSaveInputsBackward``): there the saved tensors are not read at all.
"""

from __future__ import annotations

import functools
import sys
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

StorageKey = tuple[str, int]
"""Equal for tensors that share one storage: ``("storage", address)``, or ``("tensor", id)`` without one."""

_RAW_PREFIX = "_raw_saved_"
# Node types whose saved tensors sit behind unpack hooks that recompute (non-reentrant checkpoint).
_HOOKED_GRAPH_MARKERS = frozenset({"_NoopSaveInputsBackward"})
# Attributes of a module's __dict__ that are its own machinery, walked on purpose or not at all.
_MODULE_MACHINERY = frozenset(
    {"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set", "training", "_is_full_backward_hook"}
)
HOOK_KINDS = {
    "_forward_hooks": "forward hook",
    "_forward_pre_hooks": "forward pre-hook",
    "_backward_hooks": "backward hook",
    "_backward_pre_hooks": "backward pre-hook",
}


def _is_cuda(tensor: object) -> bool:
    return bool(getattr(tensor, "is_cuda", False))


@dataclass(frozen=True)
class TensorProbe:
    """How to recognise tensors, modules and optimizers, by type; their API is used duck-typed.

    A tensor needs ``untyped_storage()`` (with ``data_ptr()`` and ``nbytes()``), ``grad`` and, for its
    graph, ``grad_fn``; a module ``parameters()``, ``buffers()`` and ``named_modules()`` (or
    ``_modules``); an optimizer a ``state`` mapping. ``on_device`` says which tensors count: CUDA
    tensors by default.
    """

    tensor_types: tuple[type, ...]
    module_types: tuple[type, ...] = ()
    optimizer_types: tuple[type, ...] = ()
    on_device: Callable[[object], bool] = _is_cuda
    # Where PyTorch has it (``torch._C._storage_address``): the address of a tensor's storage object, a
    # key for "the same storage" that costs a third of ``untyped_storage().data_ptr()`` (which makes a
    # Python storage object per call); a walk reads it for every tensor of the namespace.
    storage_address: Callable[[object], int] | None = None

    def is_tensor(self, obj: object) -> bool:
        return isinstance(obj, self.tensor_types)

    def device_storage(self, tensor: Any) -> tuple[StorageKey, int] | None:
        """``(key, bytes)`` of a counted tensor's storage, the key equal for tensors sharing it; else ``None``."""
        if not self.on_device(tensor):
            return None
        try:
            storage = tensor.untyped_storage()
            if self.storage_address is not None:
                return ("storage", int(self.storage_address(tensor))), int(storage.nbytes())
            return ("storage", int(storage.data_ptr())), int(storage.nbytes())
        except Exception:  # sparse and other layouts without one storage
            try:
                return ("tensor", id(tensor)), int(tensor.element_size()) * int(tensor.nelement())
            except Exception:
                return None

    def storage_key(self, tensor: Any) -> StorageKey | None:
        """``device_storage``'s key alone (what a walk that only asks *which* storages needs), or ``None``."""
        if not self.on_device(tensor):
            return None
        try:
            if self.storage_address is not None:
                return ("storage", int(self.storage_address(tensor)))
            return ("storage", int(tensor.untyped_storage().data_ptr()))
        except Exception:
            found = self.device_storage(tensor)
            return found[0] if found is not None else None

    # Older name, kept for callers that still say CUDA.
    cuda_storage = device_storage


_made: tuple[types.ModuleType | None, TensorProbe | None] = (None, None)  # (torch's module, its probe): made once, asked each cell


def default_probe() -> TensorProbe | None:
    """PyTorch's types, or ``None`` when torch was never imported (then nothing can hold CUDA tensors)."""
    global _made
    torch = sys.modules.get("torch")
    if torch is None or not hasattr(torch, "Tensor"):
        return None
    if _made[0] is torch:
        return _made[1]
    probe = _torch_probe(torch)
    if probe.module_types and probe.optimizer_types:  # kept once torch is imported whole
        _made = (torch, probe)
    return probe


def _torch_probe(torch: types.ModuleType) -> TensorProbe:
    nn = getattr(torch, "nn", None)
    optim = getattr(torch, "optim", None)
    module_types = (nn.Module,) if nn is not None and hasattr(nn, "Module") else ()
    optimizer_types = (optim.Optimizer,) if optim is not None and hasattr(optim, "Optimizer") else ()
    address = getattr(getattr(torch, "_C", None), "_storage_address", None)
    return TensorProbe((torch.Tensor,), module_types, optimizer_types, storage_address=address)


# -- autograd graphs ----------------------------------------------------------------------------
def grad_fn_of(tensor: object) -> object:
    """The node that made ``tensor`` (``None`` for leaves, tensors made without gradients, and fakes)."""
    try:
        return getattr(tensor, "grad_fn", None)
    except Exception:
        return None


def grad_of(tensor: object) -> object:
    """A tensor's ``.grad``; read only where PyTorch fills it (leaves, ``retain_grad()``), since reading
    it on other tensors costs a warning each time."""
    try:
        if getattr(tensor, "is_leaf", True) or getattr(tensor, "retains_grad", False):
            return getattr(tensor, "grad", None)
    except Exception:
        pass
    return None


def next_nodes(node: Any) -> Iterator[object]:
    try:
        edges = node.next_functions
    except Exception:
        return
    for edge in edges or ():
        child = edge[0] if isinstance(edge, tuple) else edge
        if child is not None:
            yield child


_SAVED_NAMES: dict[type, tuple[str, ...]] = {}


def _saved_names(node_type: type) -> tuple[str, ...]:
    """The saved-tensor slots of a node type (``mat1`` for ``_raw_saved_mat1``); one ``dir()`` per type
    (node types are a fixed set of PyTorch's classes and the custom Functions defined)."""
    names = _SAVED_NAMES.get(node_type)
    if names is None:
        names = tuple(name[len(_RAW_PREFIX) :] for name in dir(node_type) if name.startswith(_RAW_PREFIX))
        _SAVED_NAMES[node_type] = names
    return names


def graph_is_hooked(nodes: list[object]) -> bool:
    """Whether unpacking saved tensors in this graph could run a checkpoint's recomputation."""
    return any(type(node).__name__ in _HOOKED_GRAPH_MARKERS for node in nodes)


def saved_by(node: object, may_unpack: bool) -> Iterator[object]:
    """What ``node`` keeps for its backward: saved tensors (or what a pack hook made of them) and, for
    a custom ``autograd.Function``, the other objects ``forward`` put on ``ctx``.

    Nothing is unpacked through a hook; with ``may_unpack`` False (old PyTorch, hooked graph) saved
    tensors that cannot be read without unpacking are skipped.
    """
    for name in _saved_names(type(node)):
        try:
            raw = getattr(node, _RAW_PREFIX + name)
        except Exception:  # released by a backward pass, or not readable here
            continue
        items = raw if isinstance(raw, (tuple, list)) else (raw,)
        for position, item in enumerate(items):
            if item is None:
                continue
            if hasattr(type(item), "data") and hasattr(type(item), "unpack_hook"):
                try:
                    data = item.data  # the tensor, or what a pack hook returned; never runs the unpack hook
                except Exception:
                    continue
                if data is not None:
                    yield data
            elif may_unpack:
                yield from _unpacked(node, name, position, isinstance(raw, (tuple, list)))
    attributes = getattr(node, "__dict__", None)
    if isinstance(attributes, dict):  # ctx.x = tensor in a custom Function's forward
        yield from attributes.values()


def _unpacked(node: Any, name: str, position: int, many: bool) -> Iterator[object]:
    try:
        value = node.saved_tensors if name == "tensors" else getattr(node, "_saved_" + name)
    except Exception:  # freed by backward: PyTorch raises instead of returning nothing
        return
    if many and isinstance(value, (tuple, list)):
        if position < len(value):
            yield value[position]
    elif value is not None:
        yield value


# -- module hooks -------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModuleHook:
    """One hook registered on a module: where, which kind, the callable, and what it keeps.

    ``captured`` are the objects the hook can store into: its closure's cells, the instance of a bound
    method, a ``functools.partial``'s arguments, a callable object itself. ``global_names`` are the
    module-level names its code refers to (a hook appending to a notebook list ``acts`` names ``acts``).
    """

    module_path: str
    kind: str
    name: str
    hook: object
    captured: tuple[object, ...]
    global_names: frozenset[str]

    def describe(self) -> str:
        return f"{self.kind} {self.name} on {self.module_path}"


def _submodules(module: object, path: str) -> Iterator[tuple[str, object]]:
    named = getattr(module, "named_modules", None)
    if callable(named):
        try:
            for name, sub in named():
                yield (f"{path}.{name}" if name else path), sub
            return
        except Exception:
            pass
    yield path, module
    children = getattr(module, "_modules", None)
    if isinstance(children, dict):
        for name, child in children.items():
            if child is not None:
                yield from _submodules(child, f"{path}.{name}")


def _hook_target(hook: object) -> tuple[object, tuple[object, ...]]:
    """The function behind a hook and the objects it captured."""
    captured: list[object] = []
    function = hook
    for _ in range(4):  # partial(partial(f, a), b) and bound methods of partials, a few levels deep
        if isinstance(function, functools.partial):
            captured.extend(function.args)
            captured.extend(function.keywords.values())
            function = function.func
        elif isinstance(function, types.MethodType):
            captured.append(function.__self__)
            function = function.__func__
        else:
            break
    if isinstance(function, types.FunctionType):
        for cell in function.__closure__ or ():
            try:
                captured.append(cell.cell_contents)
            except ValueError:  # an empty cell
                continue
    elif not isinstance(function, (types.BuiltinFunctionType, type)):
        captured.append(function)  # a callable object keeps its state on itself
    return function, tuple(captured)


def _global_names(function: object) -> frozenset[str]:
    code = getattr(function, "__code__", None)
    if code is None:
        return frozenset()
    names = set(code.co_names)
    for constant in code.co_consts:  # nested functions and comprehensions inside the hook
        if isinstance(constant, types.CodeType):
            names.update(constant.co_names)
    return frozenset(names)


def module_hooks(module: object, path: str) -> list[ModuleHook]:
    """Every forward/backward hook on ``module`` and its submodules, with what each captured."""
    found: list[ModuleHook] = []
    for sub_path, sub in _submodules(module, path):
        attributes = getattr(sub, "__dict__", {})
        for attribute, kind in HOOK_KINDS.items():
            registry = attributes.get(attribute)
            if not isinstance(registry, dict):
                continue
            for hook in list(registry.values()):
                function, captured = _hook_target(hook)
                name = getattr(function, "__qualname__", None) or type(function).__name__
                found.append(ModuleHook(sub_path, kind, str(name), hook, captured, _global_names(function)))
    return found


def module_attributes(module: object, path: str) -> Iterator[tuple[str, object]]:
    """``(path, value)`` of what the module and its submodules keep as plain attributes (``self.cache``)."""
    for sub_path, sub in _submodules(module, path):
        attributes = getattr(sub, "__dict__", {})
        for name, value in list(attributes.items()):
            if name in _MODULE_MACHINERY or name in HOOK_KINDS or name.endswith("_hooks") or "hooks_" in name:
                continue
            yield f"{sub_path}.{name}", value
