"""What keeps CUDA memory alive: the user's variables and what IPython holds, each with its bytes.

Every root (a variable, or a reference IPython keeps) is walked through containers, object
attributes, modules' parameters/buffers/gradients, optimizers' state, exceptions, tracebacks and
function frames' locals, and the CUDA storages it reaches are counted once each (by
``untyped_storage().data_ptr()``: a view and its base share one storage). The walk never follows a
module-level frame's namespace (that is the user namespace itself), modules, classes or functions, and
stops after a fixed number of objects per root so a huge object graph cannot stall the kernel.

Tensor recognition goes through a ``TensorProbe``, so tests pass fake tensor, module and optimizer
types and no code here needs CUDA or even torch.
"""

from __future__ import annotations

import re
import sys
import types
import warnings
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ..units import format_bytes

# Names IPython itself puts in the user namespace: its output cache and input history are reported
# under their own holders (from ``ipython_state.ipython_references``), the rest hold no tensors.
_IPYTHON_NAMES = frozenset(
    {"_", "__", "___", "_i", "_ii", "_iii", "_ih", "_oh", "_dh", "In", "Out", "exit", "quit", "get_ipython"}
)
_IPYTHON_NAME_PATTERN = re.compile(r"^_i?\d+$|^__\w+__$")

_ATOMS = (str, bytes, bytearray, int, float, complex, bool, type(None), range, memoryview)
_OPAQUE = (
    types.ModuleType,
    type,
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MethodType,
    types.CodeType,
    types.GeneratorType,
    types.CoroutineType,
)
# Objects of these packages are the machinery around the user, not the user's data; walking them
# would lead back into the shell and its namespaces.
_MACHINERY_PREFIXES = ("IPython.", "ipykernel.", "traitlets.", "zmq.", "tornado.", "jupyter_client.", "asyncio.")

_WALK_LIMIT = 200_000  # objects queued per root


@dataclass(frozen=True)
class Holder:
    """One name through which CUDA memory is reachable.

    ``cuda_bytes`` counts each storage reachable through it once. ``exclusive_bytes`` is the part no
    other root reaches: for a user variable, storages no other user variable reaches (what
    ``--del NAME`` plus the cleanup would free); for what IPython holds, storages no user variable
    reaches (what the cleanup frees). ``kind`` is ``"tensor"``, ``"module"``, ``"optimizer"``,
    ``"gradient"``, ``"object"`` (a container or object reaching tensors), ``"ipython"`` (output
    cache, execution result) or ``"traceback"`` (exceptions, tracebacks and their frames).
    """

    name: str
    kind: str
    cuda_bytes: int
    user_variable: bool
    exclusive_bytes: int = 0
    tensor_count: int = 0
    detail: str = ""

    def describe(self) -> str:
        """One line: name, size and what makes it up."""
        extra = f" ({self.detail})" if self.detail else ""
        return f"{self.name}: {format_bytes(self.cuda_bytes)}{extra}"


class Holders(list[Holder]):
    """The largest holders, plus totals that per-holder figures cannot give (they overlap).

    ``namespace_bytes``: CUDA bytes reachable from the user's variables; ``ipython_only_bytes``:
    bytes reachable only through what IPython keeps (what releasing it frees); ``cache_only_bytes``:
    the part of those reachable through IPython's output cache and last result (kind ``"ipython"``),
    as opposed to the failed cell's own exception and traceback frames (kind ``"traceback"``).
    """

    namespace_bytes: int = 0
    ipython_only_bytes: int = 0
    cache_only_bytes: int = 0


@dataclass(frozen=True)
class TensorProbe:
    """How to recognise tensors, modules and optimizers, by type; their API is used duck-typed.

    A tensor needs ``is_cuda``, ``untyped_storage()`` (with ``data_ptr()`` and ``nbytes()``) and
    ``grad``; a module ``parameters()`` and ``buffers()``; an optimizer a ``state`` mapping.
    """

    tensor_types: tuple[type, ...]
    module_types: tuple[type, ...] = ()
    optimizer_types: tuple[type, ...] = ()

    def is_tensor(self, obj: Any) -> bool:
        return isinstance(obj, self.tensor_types)

    def cuda_storage(self, tensor: Any) -> tuple[Any, int] | None:
        """``(key, bytes)`` of a CUDA tensor's storage, the key equal for tensors sharing it; else ``None``."""
        if not getattr(tensor, "is_cuda", False):
            return None
        try:
            storage = tensor.untyped_storage()
            return ("storage", int(storage.data_ptr())), int(storage.nbytes())
        except Exception:  # sparse and other layouts without one storage
            try:
                return ("tensor", id(tensor)), int(tensor.element_size()) * int(tensor.nelement())
            except Exception:
                return None


def default_probe() -> TensorProbe | None:
    """PyTorch's types, or ``None`` when torch was never imported (then nothing can hold CUDA tensors)."""
    torch = sys.modules.get("torch")
    if torch is None or not hasattr(torch, "Tensor"):
        return None
    nn = getattr(torch, "nn", None)
    optim = getattr(torch, "optim", None)
    module_types = (nn.Module,) if nn is not None and hasattr(nn, "Module") else ()
    optimizer_types = (optim.Optimizer,) if optim is not None and hasattr(optim, "Optimizer") else ()
    return TensorProbe((torch.Tensor,), module_types, optimizer_types)


@dataclass
class _Reach:
    """Storages reached from one root, each with the category it was first reached as."""

    storages: dict[Any, tuple[int, str]]

    @property
    def total(self) -> int:
        return sum(size for size, _ in self.storages.values())

    def by_category(self) -> dict[str, int]:
        sums: dict[str, int] = {}
        for size, category in self.storages.values():
            sums[category] = sums.get(category, 0) + size
        return sums


def _is_machinery(obj: Any) -> bool:
    module = getattr(type(obj), "__module__", "") or ""
    return module.startswith(_MACHINERY_PREFIXES)


def _walk(root: Any, probe: TensorProbe, skip_ids: frozenset[int], follow_grad: bool = True) -> _Reach:
    storages: dict[Any, tuple[int, str]] = {}
    seen: set[int] = set()
    pending: deque[tuple[Any, str, bool]] = deque([(root, "tensors", True)])
    budget = [_WALK_LIMIT]  # objects that may still be queued from this root
    while pending:
        obj, category, is_root = pending.popleft()
        if id(obj) in seen or id(obj) in skip_ids:
            continue
        seen.add(id(obj))
        try:
            _visit(obj, category, is_root, probe, storages, pending, follow_grad, budget)
        except Exception:  # an object that cannot be inspected holds nothing we can name
            continue
    return _Reach(storages)


def _visit(
    obj: Any,
    category: str,
    is_root: bool,
    probe: TensorProbe,
    storages: dict[Any, tuple[int, str]],
    pending: deque[tuple[Any, str, bool]],
    follow_grad: bool,
    budget: list[int],
) -> None:
    def push(items: Iterable[Any], as_category: str = category) -> None:
        # Atoms (numbers, strings) cannot hold tensors: never queued, so a list of a million floats
        # costs one pass over it; everything else counts against the root's budget.
        for item in items:
            if budget[0] <= 0:
                return
            if not isinstance(item, _ATOMS):
                budget[0] -= 1
                pending.append((item, as_category, False))

    if probe.is_tensor(obj):
        found = probe.cuda_storage(obj)
        if found is not None and found[0] not in storages:
            storages[found[0]] = (found[1], category)
        if follow_grad or not is_root:
            grad = getattr(obj, "grad", None)
            if grad is not None:
                push([grad], "gradients")
        return
    if isinstance(obj, probe.module_types):
        parameters = list(obj.parameters())
        push(parameters, "parameters")
        push([p.grad for p in parameters if getattr(p, "grad", None) is not None], "gradients")
        push(obj.buffers(), "buffers")
        push(vars(obj).values(), "other tensors")
        return
    if isinstance(obj, probe.optimizer_types):
        # Only the state: the parameters in ``param_groups`` belong to the model.
        push(getattr(obj, "state", {}).values(), "state")
        return
    if isinstance(obj, dict):
        push(obj.values())
        return
    if isinstance(obj, (list, tuple, set, frozenset, deque)):
        push(obj)
        return
    if isinstance(obj, types.TracebackType):
        push([obj.tb_frame, obj.tb_next])
        return
    if isinstance(obj, types.FrameType):
        # A module-level frame's locals are its globals: the user namespace, reported name by name.
        if obj.f_code.co_name != "<module>" and obj.f_locals is not obj.f_globals:
            push(obj.f_locals.values())
        return
    if isinstance(obj, BaseException):
        push([obj.__traceback__, obj.__cause__, obj.__context__, *obj.args])
        push(getattr(obj, "__dict__", {}).values())
        return
    if isinstance(obj, _OPAQUE) or (not is_root and _is_machinery(obj)):
        return
    attributes = getattr(obj, "__dict__", None)
    if isinstance(attributes, dict):
        push(attributes.values())
    for klass in type(obj).__mro__:
        slots = klass.__dict__.get("__slots__", ())
        for slot in (slots,) if isinstance(slots, str) else slots:
            if slot not in ("__dict__", "__weakref__") and hasattr(obj, slot):
                push([getattr(obj, slot)])


def _is_user_name(name: str, value: Any) -> bool:
    """A variable of the user's own: not IPython's names, and not a handle on the machinery
    (``ip = get_ipython()`` reaches every namespace; our own recorder or results are not the user's data)."""
    if name in _IPYTHON_NAMES or _IPYTHON_NAME_PATTERN.match(name):
        return False
    if isinstance(value, _OPAQUE) or _is_machinery(value):
        return False
    return not (getattr(type(value), "__module__", "") or "").startswith("jupyter_cudamem.")


def _root_kind(value: Any, probe: TensorProbe) -> str:
    if probe.is_tensor(value):
        return "tensor"
    if isinstance(value, probe.module_types):
        return "module"
    if isinstance(value, probe.optimizer_types):
        return "optimizer"
    if isinstance(value, (BaseException, types.TracebackType, types.FrameType)):
        return "traceback"
    return "object"


def _detail(kind: str, value: Any, reach: _Reach) -> str:
    count = len(reach.storages)
    if kind == "module":
        parts = reach.by_category()
        named = [
            f"{label} {format_bytes(parts[label])}"
            for label in ("parameters", "gradients", "buffers", "other tensors")
            if parts.get(label)
        ]
        return ", ".join(named)
    if kind == "optimizer":
        return f"{count} state tensor{'s' if count != 1 else ''}"
    if kind in ("tensor", "gradient"):
        shape = getattr(value, "shape", None)
        dtype = getattr(value, "dtype", None)
        text = ", ".join(str(x) for x in (tuple(shape) if shape is not None else None, dtype) if x is not None)
        return text
    noun = type(value).__name__
    return f"{noun} reaching {count} CUDA storage{'s' if count != 1 else ''}"


def find_holders(
    namespace: dict[str, Any],
    ipython_refs: dict[str, Any],
    top: int = 10,
    probe: TensorProbe | None = None,
) -> Holders:
    """The ``top`` largest holders of CUDA memory, largest first; holders of nothing are left out.

    ``namespace`` is the user's namespace (IPython's own names in it are skipped: they are reported
    through ``ipython_refs``, which maps a description such as ``"Out[3]"`` or ``"sys.last_value"`` to
    the object IPython keeps). ``probe`` defaults to PyTorch's types; without torch imported there is
    nothing to find. Warnings raised while inspecting objects (torch.distributed deprecations) are
    silenced.
    """
    probe = probe if probe is not None else default_probe()
    result = Holders()
    if probe is None:
        return result
    skip = frozenset({id(namespace), id(ipython_refs)})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        roots: list[tuple[str, str, Any, bool, _Reach]] = []
        for name, value in list(namespace.items()):
            if not _is_user_name(name, value):
                continue
            kind = _root_kind(value, probe)
            roots.append((name, kind, value, True, _walk(value, probe, skip, follow_grad=False)))
            grad = getattr(value, "grad", None) if kind == "tensor" else None
            if grad is not None and probe.is_tensor(grad):
                roots.append((f"{name}.grad", "gradient", grad, True, _walk(grad, probe, skip)))
        grouped: dict[int, tuple[list[str], Any]] = {}
        for name, value in ipython_refs.items():
            if value is None or isinstance(value, _ATOMS):
                continue
            grouped.setdefault(id(value), ([], value))[0].append(name)
        for names, value in grouped.values():
            kind = "traceback" if _root_kind(value, probe) == "traceback" else "ipython"
            roots.append((" / ".join(names), kind, value, False, _walk(value, probe, skip)))

    user_reach: dict[Any, int] = {}  # storage -> how many user roots reach it
    for _, _, _, is_user, reach in roots:
        if is_user:
            for key in reach.storages:
                user_reach[key] = user_reach.get(key, 0) + 1
    namespace_storages = {
        key: size for *_, is_user, reach in roots if is_user for key, (size, _) in reach.storages.items()
    }
    ipython_only = {
        key: size
        for *_, is_user, reach in roots
        if not is_user
        for key, (size, _) in reach.storages.items()
        if key not in user_reach
    }

    cache_only = {
        key: size
        for _, kind, _, is_user, reach in roots
        if kind == "ipython"
        for key, (size, _) in reach.storages.items()
        if key not in user_reach
    }

    holders = []
    for name, kind, value, is_user, reach in roots:
        total = reach.total
        if total == 0:
            continue
        if is_user:
            exclusive = sum(size for key, (size, _) in reach.storages.items() if user_reach[key] == 1)
        else:
            exclusive = sum(size for key, (size, _) in reach.storages.items() if key not in user_reach)
        label = f"{name} ({type(value).__name__} state)" if kind == "optimizer" else name
        holders.append(
            Holder(
                name=label,
                kind=kind,
                cuda_bytes=total,
                user_variable=is_user,
                exclusive_bytes=exclusive,
                tensor_count=len(reach.storages),
                detail=_detail(kind, value, reach) if kind not in ("ipython", "traceback") else "",
            )
        )
    holders.sort(key=lambda h: (-h.cuda_bytes, not h.user_variable, h.name))
    result.extend(holders[: max(top, 0)])
    result.namespace_bytes = sum(namespace_storages.values())
    result.ipython_only_bytes = sum(ipython_only.values())
    result.cache_only_bytes = sum(cache_only.values())
    return result


def reaches_cuda(obj: Any, probe: TensorProbe | None = None) -> bool:
    """Whether any CUDA storage is reachable through ``obj`` (by the same walk as ``find_holders``)."""
    probe = probe if probe is not None else default_probe()
    if probe is None or obj is None or isinstance(obj, _ATOMS):
        return False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return bool(_walk(obj, probe, frozenset()).storages)
