"""The bounded walk from one root to the device storages it keeps alive.

A root (a variable, a reference IPython keeps) is walked breadth first through containers, object
attributes, modules (parameters, gradients, buffers, plain attributes and what their hooks captured),
optimizers' state, exceptions, tracebacks and function frames' locals, functions' default arguments
and closure cells (``callbacks.append(lambda x, t=t: ...)``, a nested ``def`` using a tensor of the
enclosing one: named ``callbacks[0].__defaults__[0]``, ``f.__closure__[0].cell_contents``), bound
methods' objects and ``functools.partial``'s arguments, and
tensors' autograd graphs (see ``probe``). Each storage is counted once (by
``TensorProbe.storage_key``: a view and its base share one), with the category it was first reached
as and the first two steps of the path to it.

Bounds: the walk never enters a module-level frame's namespace (that is the user namespace itself),
Python modules, classes, a function's globals or code (only its defaults and closure cells), nor
objects of IPython, ipykernel and the like (they lead back to the shell); and it stops after
``WALK_LIMIT`` objects per root, so a huge object graph cannot stall the kernel. Atoms (numbers,
strings) are never queued: a list of a million floats costs one pass over it.
"""

from __future__ import annotations

import types
from collections import deque
from collections.abc import Callable
from functools import cache, partial
from itertools import chain, compress, repeat
from operator import attrgetter, eq, is_, is_not, itemgetter, methodcaller, ne, not_
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeVar

from .probe import (
    ModuleHook,
    _is_cuda,
    TensorProbe,
    grad_fn_of,
    grad_of,
    graph_is_hooked,
    module_attributes,
    module_hooks,
    next_nodes,
    saved_by,
)

WALK_LIMIT = 200_000  # objects queued per root

# What a storage was first reached as.
TENSORS = "tensors"
PARAMETERS = "parameters"
GRADIENTS = "gradients"
BUFFERS = "buffers"
MODULE_ATTRIBUTES = "other tensors"
STATE = "state"
GRAPH = "autograd graph"
HOOKS = "hooks"

# A path step: (ITEM, index or key, position), (ATTRIBUTE, name, -1) or (HOOK, description, -1).
ITEM, ATTRIBUTE, HOOK = 0, 1, 2
NO_GRAPH, WITH_GRAPH, GRAPH_SCALAR = 0, 1, 2
PATH_STEPS = 2

ATOMS = (str, bytes, bytearray, int, float, complex, bool, type(None), range, memoryview)
OPAQUE = (
    types.ModuleType,
    type,
    types.FunctionType,  # below a root, walked for what it keeps (``function_captures``)
    types.BuiltinFunctionType,
    types.MethodType,  # likewise
    types.CodeType,
    types.GeneratorType,
    types.CoroutineType,
)
# Objects of these packages are the machinery around the user, not the user's data; walking them
# would lead back into the shell and its namespaces.
MACHINERY_PREFIXES = ("IPython.", "ipykernel.", "traitlets.", "zmq.", "tornado.", "jupyter_client.", "asyncio.")

Step = tuple[int, Any, int]


class Hit(NamedTuple):
    """One storage as reached from a root: its size, category, and where under the root.

    ``position`` is the index of the root's own item it hangs under (a list's index, a dict's
    insertion position), -1 when the root is not a sequence or mapping; ``path`` the first steps;
    ``owner`` the index of the root it was reached from (in a walk of several roots). A named tuple:
    the walk makes one per storage, and tuples are the cheapest to make.
    """

    nbytes: int
    category: str
    position: int
    path: tuple[Step, ...]
    graph: int = NO_GRAPH  # for a tensor met outside graphs: whether it carries one (GRAPH_SCALAR: a loss, a metric)
    owner: int = 0


@dataclass
class Reach:
    """Storages reached from one root (or several), and counts of the tensors met on the way.

    ``late`` holds, in a walk of several roots with ``defer_hidden``, the storages met only through
    what modules keep out of sight (hooks' captures, plain attributes), after everything else.
    """

    storages: dict[Any, Hit] = field(default_factory=dict)
    tensors: int = 0  # tensors holding a counted storage, met outside graphs
    graph_tensors: int = 0  # of those, how many carry an autograd graph
    scalar_graph_tensors: int = 0  # of those, how many are single numbers (a loss, a metric)
    hooks: list[ModuleHook] = field(default_factory=list)
    truncated: bool = False
    late: dict[Any, Hit] = field(default_factory=dict)
    # In a walk of several roots: every storage reached outside what modules keep out of sight,
    # including those a keys-only pass met without making a ``Hit`` (see ``walk_together``).
    reached: set[Any] = field(default_factory=set)

    @property
    def total(self) -> int:
        return sum(hit.nbytes for hit in self.storages.values())

    def by_category(self) -> dict[str, int]:
        sums: dict[str, int] = {}
        for hit in self.storages.values():
            sums[hit.category] = sums.get(hit.category, 0) + hit.nbytes
        return sums


def _numel(tensor: Any) -> int | None:
    try:
        return int(tensor.numel())
    except Exception:
        shape = getattr(tensor, "shape", None)
        if shape is None:
            return None
        count = 1
        for size in shape:
            count *= int(size)
        return count


# What the walk does with an object, decided once per type (isinstance chains cost more than the walk).
TENSOR_CODE, MODULE_CODE, OPTIMIZER_CODE, MAPPING_CODE, SEQUENCE_CODE, SET_CODE = range(6)
TRACEBACK_CODE, FRAME_CODE, EXCEPTION_CODE, OPAQUE_CODE, MACHINERY_CODE, OBJECT_CODE = range(6, 12)
FUNCTION_CODE = 12
_TENSOR, _MODULE, _OPTIMIZER, _MAPPING, _SEQUENCE, _SET = range(6)
_TRACEBACK, _FRAME, _EXCEPTION, _OPAQUE, _MACHINERY, _OBJECT = range(6, 12)  # the same codes, short
_FUNCTION = FUNCTION_CODE
ATOM_TYPES = frozenset(ATOMS)


R = TypeVar("R")
_MEMO_LIMIT = 8192  # distinct types remembered; past it the memo starts again (classes redefined in a loop)


class _TypeMemo(dict):
    """A dict from type to ``function(type)``, filled on first use; called like the function. Calling
    it is ``dict.__getitem__`` (C, with ``__missing__`` only for a type not seen yet), a fraction of
    the cost of a Python wrapper: it runs once per name of a namespace, before every cell."""

    def __init__(self, function: Callable[[type], Any]) -> None:
        super().__init__()
        self.function = function

    def __missing__(self, kind: type) -> Any:
        if len(self) >= _MEMO_LIMIT:
            self.clear()
        found = self[kind] = self.function(kind)
        return found

    __call__ = dict.__getitem__


def memo_by_type(function: Callable[[type], R]) -> Callable[[type], R]:
    """``function`` computed once per type (an ``lru_cache`` that type checkers accept for types)."""
    return _TypeMemo(function)


_CODES: dict[tuple[type, tuple[type, ...], tuple[type, ...], tuple[type, ...]], int] = {}


def type_code(kind: type, probe: TensorProbe) -> int:
    """What the walk does with objects of this type (one of the ``*_CODE`` constants), cached."""
    key = (kind, probe.tensor_types, probe.module_types, probe.optimizer_types)
    code = _CODES.get(key)
    if code is None:
        if len(_CODES) >= _MEMO_LIMIT:
            _CODES.clear()
        code = _CODES[key] = _type_code(*key)
    return code


def _type_code(
    kind: type, tensor_types: tuple[type, ...], module_types: tuple[type, ...], optimizer_types: tuple[type, ...]
) -> int:
    if issubclass(kind, tensor_types):
        return _TENSOR
    if module_types and issubclass(kind, module_types):
        return _MODULE
    if optimizer_types and issubclass(kind, optimizer_types):
        return _OPTIMIZER
    if issubclass(kind, _CALLABLES_KEEPING):
        return _FUNCTION
    for code, bases in (
        (_MAPPING, dict),
        (_SEQUENCE, (list, tuple, deque)),
        (_SET, (set, frozenset)),
        (_TRACEBACK, types.TracebackType),
        (_FRAME, types.FrameType),
        (_EXCEPTION, BaseException),
        (_OPAQUE, OPAQUE),
    ):
        if issubclass(kind, bases):
            return code
    module = getattr(kind, "__module__", "") or ""
    return _MACHINERY if module.startswith(MACHINERY_PREFIXES) else _OBJECT


@memo_by_type
def _slots_of(kind: type) -> tuple[str, ...]:
    names: list[str] = []
    for klass in kind.__mro__:
        slots = klass.__dict__.get("__slots__", ())
        for slot in (slots,) if isinstance(slots, str) else slots:
            if slot not in ("__dict__", "__weakref__") and slot not in names:
                names.append(slot)
    return tuple(names)


_DIRECT, _DUCK = 1, 2  # how the keys-only pass reads a tensor type: plain attributes, or getattr with defaults


def _reads_directly(kind: type) -> bool:
    """Whether a tensor type's class defines what the keys-only pass reads (PyTorch's does), so plain
    attribute access works; tensor-likes are read through ``getattr`` with defaults instead."""
    return all(hasattr(kind, name) for name in ("grad_fn", "is_cuda", "retains_grad", "grad"))

# How ``_Walker.fast_lane`` treats a type: skipped (not counted), counted and skipped, read in bulk, or
# handed back to ``collect_keys``' loop.
_LANE_ATOM, _LANE_DROP, _LANE_TENSOR, _LANE_SEQUENCE, _LANE_MAPPING, _LANE_OBJECT, _LANE_SLOW = range(7)
_NOT_A_ROOT = object()  # what ``collect_keys`` compares with for an object handed back below the roots
_IS_CUDA, _GRAD_FN, _GRAD = attrgetter("is_cuda"), attrgetter("grad_fn"), attrgetter("grad")
_DATA_PTR = methodcaller("data_ptr")
_UNTYPED_STORAGE = methodcaller("untyped_storage")


# Callables that keep values alive of their own: a function (defaults, closure cells), a bound method
# (its object, its function), a ``functools.partial`` (its function and arguments).
_CALLABLES_KEEPING = (types.FunctionType, types.MethodType, partial)


def function_captures(function: Any) -> list[tuple[str, Any]]:
    """What a Python function keeps alive of its own: its default arguments and the contents of its
    closure cells (not its globals, not its code); a bound method, its object and function; a
    ``functools.partial``, its function and arguments. Each with the expression that reads it."""
    if isinstance(function, types.MethodType):
        return [("__self__", function.__self__), ("__func__", function.__func__)]
    if isinstance(function, partial):
        arguments = [(f"args[{i}]", value) for i, value in enumerate(function.args)]
        return [("func", function.func), *arguments, *((f"keywords[{k!r}]", v) for k, v in function.keywords.items())]
    captures: list[tuple[str, Any]] = []
    for index, value in enumerate(function.__defaults__ or ()):
        captures.append((f"__defaults__[{index}]", value))
    for name, value in (function.__kwdefaults__ or {}).items():
        captures.append((f"__kwdefaults__[{name!r}]", value))
    for index, cell in enumerate(function.__closure__ or ()):
        try:
            captures.append((f"__closure__[{index}].cell_contents", cell.cell_contents))
        except ValueError:  # a cell not filled yet (the enclosing function has not bound the name)
            continue
    return captures


def capture_names(function: Any) -> dict[str, str]:
    """The variable each of ``function_captures``' expressions reads: ``{"__defaults__[0]": "t"}``."""
    code = function.__code__
    positional = code.co_varnames[: code.co_argcount]
    defaults = function.__defaults__ or ()
    names = {f"__defaults__[{i}]": name for i, name in enumerate(positional[len(positional) - len(defaults) :])}
    names.update({f"__kwdefaults__[{name!r}]": name for name in function.__kwdefaults__ or {}})
    names.update({f"__closure__[{i}].cell_contents": name for i, name in enumerate(code.co_freevars)})
    return names


def _items_of(containers: list[Any]) -> list[list[Any]]:
    return list(map(list, containers))


def _values_of(mappings: list[Any]) -> list[list[Any]]:
    return list(map(list, map(methodcaller("values"), mappings)))


def _attributes_of(objects: list[Any]) -> list[list[Any]]:
    dicts = list(map(attrgetter("__dict__"), objects))
    if not set(map(type, dicts)) <= {dict}:
        raise TypeError("a __dict__ that is not a dict")
    return list(map(list, map(dict.values, dicts)))


_CHILDREN_OF = {_LANE_SEQUENCE: _items_of, _LANE_MAPPING: _values_of, _LANE_OBJECT: _attributes_of}


def _positions(count: int) -> list[int]:
    return list(range(count))


def _chosen_owners(owners: Callable[[], list[int]], mask: list[bool] | None) -> list[int]:
    return owners() if mask is None else list(compress(owners(), mask))


def _grad_owners(
    owners_of: Callable[[list[bool] | None], list[int]], mask: list[bool] | None, leaf: list[bool], present: list[bool]
) -> list[int]:
    return list(compress(compress(owners_of(mask), leaf), present))


def _children_owners(
    owners_of: Callable[[list[bool] | None], list[int]],
    mask: list[bool] | None,
    first: list[bool] | None,
    children: list[list[Any]],
) -> list[int]:
    owners = owners_of(mask) if first is None else compress(owners_of(mask), first)
    return list(chain.from_iterable(map(repeat, owners, map(len, children))))


def _joined_owners(parts: list[Callable[[], list[int]]]) -> list[int]:
    return list(chain.from_iterable(part() for part in parts))


class _Walker:
    def __init__(
        self,
        probe: TensorProbe,
        skip_ids: frozenset[int],
        follow_grad: bool,
        budget: int,
        root_names: list[str],
        defer_hidden: bool = False,
    ):
        self.probe = probe
        self.types = (probe.tensor_types, probe.module_types, probe.optimizer_types)
        self.skip_ids = skip_ids
        self.follow_grad = follow_grad
        self.budget = budget
        self.root_names = root_names
        self.defer_hidden = defer_hidden
        self.seen: set[int] = set()
        # Graph nodes and unpacked tensors are new Python objects: keep them alive while walking, or
        # their ids could be reused by the next ones and those would be taken as already seen.
        self.keep_alive: list[Any] = []
        self.pending: deque[tuple[Any, str, int, tuple[Step, ...], bool, int]] = deque()
        self.deferred: deque[tuple[Any, str, int, tuple[Step, ...], bool, int]] = deque()
        self.storages: dict[Any, Hit] = {}
        self.reach = Reach(storages=self.storages)
        self.codes: dict[type, int] = {}
        self.lanes: dict[type, int] = {}
        # Paths are only read for what a holder is named by; a walk of unchanged roots skips them
        # until it reaches what modules keep out of sight.
        self.track_paths = not defer_hidden

    def push(
        self, item: Any, category: str, position: int, path: tuple[Step, ...], owner: int, hidden: bool = False
    ) -> None:
        if type(item) in ATOM_TYPES:
            return
        if self.budget <= 0:
            self.reach.truncated = True
            return
        self.budget -= 1
        (self.deferred if hidden and self.defer_hidden else self.pending).append(
            (item, category, position, path, False, owner)
        )

    def run(self, roots: list[Any], keys_only: bool = False) -> Reach:
        if keys_only:
            self.collect_keys(roots)
        else:
            for owner, root in enumerate(roots):
                self.pending.append((root, TENSORS, -1, (), True, owner))
        self.drain()
        self.reach.reached.update(self.storages)
        if self.deferred:
            # What modules keep out of sight is walked last: what anything else reaches was seen first.
            self.storages = self.reach.late
            self.pending, self.deferred = self.deferred, deque()
            self.defer_hidden = False
            self.track_paths = True
            self.drain()
        return self.reach

    def collect_keys(self, roots: list[Any]) -> None:
        """The first pass of a walk of unchanged roots, where only which storages are reached matters:
        tensors, containers and plain objects are handled here on a stack of bare objects, without the
        categories, positions and paths a ``Hit`` records; everything else (modules, optimizers,
        tracebacks, frames, exceptions, a root of the machinery) goes through ``visit`` as in any walk,
        so the outcome is the same set of storages, modules' hidden parts deferred the same way. Same
        budget: each object queued counts one.

        A namespace is mostly tensors and small containers of tensors, so a tensor met in a container
        is read where it is met, never queued: its storage's key, its ``.grad`` and its graph (each
        queued only where there is one). Tensor types whose class defines ``grad_fn``, ``is_cuda``,
        ``retains_grad`` and ``grad`` (PyTorch's) are read by plain attribute access, a third of what
        ``getattr`` with a default costs; others (tensor-likes) through ``getattr``."""
        seen, codes, probe = self.seen, self.codes, self.probe
        seen.update(self.skip_ids)  # one set to ask instead of two; ``drain`` asks both anyway
        keys = self.reach.reached
        storage_key, on_device = probe.storage_key, probe.on_device
        is_cuda_attribute = on_device is _is_cuda
        address = probe.storage_address
        atoms = ATOM_TYPES
        tensor_reads: dict[type, int] = {}  # tensor type -> _DIRECT or _DUCK
        graph_saved = self.graph_saved
        slots_of: dict[type, tuple[str, ...]] = {}
        handed = self.fast_lane(roots)
        # Roots are not queued, so they do not count (the loop below counts what it meets, atoms aside).
        self.budget += sum(is_root for _, _, is_root in handed)
        for owner, start, is_root in handed:
            root = start if is_root else _NOT_A_ROOT
            stack: list[Any] = []
            more: Any = (start,)
            while True:
                budget = self.budget
                for value in more:
                    kind = type(value)
                    reads = tensor_reads.get(kind)  # tensors first: most of what a namespace holds
                    if reads is None:
                        if kind in atoms:
                            continue
                        code = codes.get(kind)
                        if code is None:
                            code = codes[kind] = type_code(kind, probe)
                        if code != _TENSOR:
                            if budget <= 0:
                                self.reach.truncated = True
                                break
                            budget -= 1
                            stack.append(value)
                            continue
                        reads = tensor_reads[kind] = _DIRECT if _reads_directly(kind) else _DUCK
                    if budget <= 0:
                        self.reach.truncated = True
                        break
                    budget -= 1
                    # Not asked whether seen: a tensor met twice adds its key twice, and what it leads
                    # to (its gradient, its graph's nodes) is asked when met.
                    try:
                        if is_cuda_attribute:
                            counted = value.is_cuda if reads == _DIRECT else getattr(value, "is_cuda", False)
                        else:
                            counted = on_device(value)
                        if counted:
                            try:
                                if address is not None:
                                    keys.add(("storage", address(value)))
                                else:
                                    keys.add(("storage", value.untyped_storage().data_ptr()))
                            except Exception:
                                key = storage_key(value)
                                if key is not None:
                                    keys.add(key)
                        if reads == _DIRECT:
                            # PyTorch: a tensor is a leaf exactly when it has no grad_fn
                            node = value.grad_fn
                            grad = value.grad if node is None or value.retains_grad else None
                        else:
                            node = getattr(value, "grad_fn", None)
                            grad = (
                                getattr(value, "grad", None)
                                if getattr(value, "is_leaf", True) or getattr(value, "retains_grad", False)
                                else None
                            )
                    except Exception:  # a tensor that cannot be inspected holds nothing we can name
                        continue
                    if grad is not None and budget > 0:
                        budget -= 1
                        stack.append(grad)
                    if node is not None:
                        self.budget = budget
                        stack.extend(saved for saved in graph_saved(node) if type(saved) not in atoms)
                        budget = self.budget
                self.budget = budget
                if not stack:
                    break
                obj = stack.pop()
                more = ()
                ident = id(obj)
                kind = type(obj)
                code = codes.get(kind)
                if code is None:  # a root
                    code = codes[kind] = type_code(kind, probe)
                if ident in seen:
                    continue
                seen.add(ident)  # tensors too: a gradient or saved tensor met again is not read again
                if code == _TENSOR:  # through the loop above
                    more = (obj,)
                    self.budget += 1  # counted when queued
                    continue
                try:
                    if code == _SEQUENCE:
                        more = list(obj)
                    elif code == _MAPPING:
                        more = list(obj.values())
                    elif code == _SET:
                        more = list(obj)
                    elif code == _OBJECT:
                        attributes = getattr(obj, "__dict__", None)
                        more = list(attributes.values()) if isinstance(attributes, dict) else []
                        slots = slots_of.get(kind)
                        if slots is None:
                            slots = slots_of[kind] = _slots_of(kind)
                        for slot in slots:
                            if hasattr(obj, slot):
                                more.append(getattr(obj, slot))
                    elif code == _FUNCTION:
                        more = [value for _, value in function_captures(obj)]
                    elif code == _OPAQUE or (code == _MACHINERY and obj is not root):
                        continue
                    else:
                        self.visit(obj, TENSORS, -1, (), obj is root, owner)
                except Exception:  # an object that cannot be inspected holds nothing we can name
                    more = ()

    def fast_lane(self, roots: list[Any]) -> list[tuple[int, Any, bool]]:
        """The bulk of ``collect_keys``: PyTorch's tensors without a graph, lists, tuples, dicts and plain
        objects without ``__slots__``, a level at a time, each step one C loop over the level's part of
        that kind (``map``, ``compress``, ``chain``) instead of a Python loop per object. What it does
        not handle (a tensor with a graph, a module, an optimizer, a set, a traceback, an object with
        slots, a tensor-like) is handed back as ``(owner, object, is_root)`` to ``collect_keys``' own
        loop, and so is a whole level that would run past the budget, or a part whose read raises.
        Which root each object hangs under is worked out only for what is handed back (``functools.cache``
        over the level's owners). Same storages
        reached and the same count per object queued as that loop (``tests/attribution``: both ways
        over the same namespaces), in a fraction of its time on a namespace of many small values
        (``benchmarks/leaks.py``, part ``cost``)."""
        seen, keys, probe, lanes = self.seen, self.reach.reached, self.probe, self.lanes
        on_device, address = probe.on_device, probe.storage_address
        handed: list[tuple[int, Any, bool]] = []
        level: list[Any] = list(roots)
        owners: Callable[[], list[int]] = cache(partial(_positions, len(roots)))
        depth = 0
        while level:
            kinds = list(map(type, level))
            present = set(kinds)
            for kind in present.difference(lanes):
                lanes[kind] = self._lane(kind)
            kinds_by_lane: dict[int, set[type]] = {}
            for kind in present:
                kinds_by_lane.setdefault(lanes[kind], set()).add(kind)
            kinds_by_lane.pop(_LANE_ATOM, None)
            if not kinds_by_lane:
                break
            whole = len(kinds_by_lane) == 1 and len(present) == len(next(iter(kinds_by_lane.values())))

            parts: dict[int, tuple[list[Any], list[bool] | None]] = {}
            for lane, lane_kinds in kinds_by_lane.items():
                # the level's objects of ``lane``, and which positions they are (``None``: all)
                mask = None if whole else list(map(lane_kinds.__contains__, kinds))
                parts[lane] = (level, None) if mask is None else (list(compress(level, mask)), mask)

            owners_of = partial(_chosen_owners, owners)
            queued = sum(len(chosen) for chosen, _ in parts.values())
            if depth and queued > self.budget:  # the loop below stops where the budget runs out
                for chosen, mask in parts.values():
                    handed.extend(zip(owners_of(mask), chosen, repeat(False)))
                break
            is_root = depth == 0
            next_level: list[Any] = []
            next_parts: list[Callable[[], list[int]]] = []  # the owners of next_level, piece by piece
            counted = 0
            for lane, (chosen, mask) in sorted(parts.items(), key=itemgetter(0)):
                if lane == _LANE_DROP:
                    counted += len(chosen)
                    continue
                if lane == _LANE_SLOW:
                    handed.extend(zip(owners_of(mask), chosen, repeat(is_root)))
                    continue
                if lane == _LANE_TENSOR:
                    try:
                        on = list(map(_IS_CUDA, chosen)) if on_device is _is_cuda else list(map(on_device, chosen))
                        counted_here = list(compress(chosen, on))
                        if address is not None:
                            keys.update(zip(repeat("storage"), map(address, counted_here)))
                        else:
                            keys.update(zip(repeat("storage"), map(_DATA_PTR, map(_UNTYPED_STORAGE, counted_here))))
                        leaf = list(map(is_, map(_GRAD_FN, chosen), repeat(None)))
                        grads = list(map(_GRAD, compress(chosen, leaf)))
                    except Exception:  # a layout without one storage, a tensor that cannot be read: one by one
                        handed.extend(zip(owners_of(mask), chosen, repeat(is_root)))
                        continue
                    counted += sum(leaf)
                    if not all(leaf):  # a graph to walk: collect_keys' own loop does it
                        grown = list(map(not_, leaf))
                        handed.extend(zip(compress(owners_of(mask), grown), compress(chosen, grown), repeat(is_root)))
                    present_grads = list(map(is_not, grads, repeat(None)))
                    if any(present_grads):
                        next_level.extend(compress(grads, present_grads))
                        next_parts.append(partial(_grad_owners, owners_of, mask, leaf, present_grads))
                    continue
                children_of = _CHILDREN_OF[lane]
                try:
                    children = children_of(chosen)
                except Exception:  # a __dict__ that is not a dict, a container changed while read
                    handed.extend(zip(owners_of(mask), chosen, repeat(is_root)))
                    continue
                counted += len(chosen)
                identities = list(map(id, chosen))
                fresh = set(identities)
                first: list[bool] | None = None
                if len(fresh) == len(identities) and fresh.isdisjoint(seen):
                    seen.update(fresh)
                else:  # met before, or twice in this level: walked once, counted each time as queued
                    first = [ident not in seen and not seen.add(ident) for ident in identities]  # type: ignore[func-returns-value]
                    children = list(compress(children, first))
                next_level.extend(chain.from_iterable(children))
                next_parts.append(partial(_children_owners, owners_of, mask, first, children))
            if depth:
                self.budget -= counted
            level, depth = next_level, depth + 1
            owners = cache(partial(_joined_owners, next_parts))  # made on first use, for what is handed back
        return handed

    def _lane(self, kind: type) -> int:
        """How ``fast_lane`` treats objects of this type."""
        if kind in ATOM_TYPES:
            return _LANE_ATOM
        code = self.codes.get(kind)
        if code is None:
            code = self.codes[kind] = type_code(kind, self.probe)
        if code == _TENSOR:
            return _LANE_TENSOR if _reads_directly(kind) else _LANE_SLOW
        if code == _OPAQUE:
            return _LANE_DROP
        if code == _SEQUENCE:
            return _LANE_SEQUENCE
        if code == _MAPPING:
            return _LANE_MAPPING
        if code == _OBJECT and not _slots_of(kind):
            # ``__dictoffset__`` 0: instances have no ``__dict__`` either, so nothing to walk
            return _LANE_OBJECT if getattr(kind, "__dictoffset__", 1) else _LANE_DROP
        return _LANE_SLOW

    def drain(self) -> None:
        pending, seen, skip = self.pending, self.seen, self.skip_ids
        while pending:
            obj, category, position, path, is_root, owner = pending.popleft()
            ident = id(obj)
            if ident in seen or ident in skip:
                continue
            seen.add(ident)
            try:
                self.visit(obj, category, position, path, is_root, owner)
            except Exception:  # an object that cannot be inspected holds nothing we can name
                continue

    def visit(self, obj: Any, category: str, position: int, path: tuple[Step, ...], is_root: bool, owner: int) -> None:
        kind = type(obj)
        code = self.codes.get(kind)
        if code is None:
            code = self.codes[kind] = type_code(kind, self.probe)
        push = self.push
        if code == _TENSOR:
            self.visit_tensor(obj, category, position, path, is_root, owner)
        elif code == _MODULE:
            self.visit_module(obj, position, path, owner)
        elif code == _OPTIMIZER:
            # Only the state: the parameters in ``param_groups`` belong to the model.
            for value in list(getattr(obj, "state", {}).values()):
                push(value, STATE, position, path, owner)
        elif code == _MAPPING:
            deeper = self.track_paths and len(path) < PATH_STEPS
            for index, (key, value) in enumerate(list(obj.items())):
                step = path + ((ITEM, key, index),) if deeper else path
                push(value, category, index if is_root else position, step, owner)
        elif code == _SEQUENCE:
            deeper = self.track_paths and len(path) < PATH_STEPS
            for index, value in enumerate(list(obj)):
                step = path + ((ITEM, index, index),) if deeper else path
                push(value, category, index if is_root else position, step, owner)
        elif code == _SET:
            for value in list(obj):
                push(value, category, position, path, owner)
        elif code == _TRACEBACK:
            push(obj.tb_frame, category, position, path, owner)
            push(obj.tb_next, category, position, path, owner)
        elif code == _FRAME:
            # A module-level frame's locals are its globals: the user namespace, reported name by name.
            if obj.f_code.co_name != "<module>" and obj.f_locals is not obj.f_globals:
                for value in list(obj.f_locals.values()):
                    push(value, category, position, path, owner)
        elif code == _EXCEPTION:
            for value in (obj.__traceback__, obj.__cause__, obj.__context__, *obj.args):
                push(value, category, position, path, owner)
            for value in list(getattr(obj, "__dict__", {}).values()):
                push(value, category, position, path, owner)
        elif code == _FUNCTION:
            deeper = self.track_paths and len(path) < PATH_STEPS
            for expression, value in function_captures(obj):
                push(value, category, position, path + ((ATTRIBUTE, expression, -1),) if deeper else path, owner)
        elif code == _OBJECT or (code == _MACHINERY and is_root):
            deeper = self.track_paths and len(path) < PATH_STEPS
            attributes = getattr(obj, "__dict__", None)
            if isinstance(attributes, dict):
                for name, value in list(attributes.items()):
                    push(value, category, position, path + ((ATTRIBUTE, name, -1),) if deeper else path, owner)
            for slot in _slots_of(type(obj)):
                if hasattr(obj, slot):
                    step = path + ((ATTRIBUTE, slot, -1),) if deeper else path
                    push(getattr(obj, slot), category, position, step, owner)

    def visit_tensor(
        self, tensor: Any, category: str, position: int, path: tuple[Step, ...], is_root: bool, owner: int
    ) -> None:
        found = self.probe.device_storage(tensor)
        node = grad_fn_of(tensor)
        if found is not None:
            key, size = found
            graph = NO_GRAPH
            if node is not None and category != GRAPH:
                graph = GRAPH_SCALAR if _numel(tensor) == 1 else WITH_GRAPH
                self.reach.graph_tensors += 1
                self.reach.scalar_graph_tensors += graph == GRAPH_SCALAR
            if key not in self.storages:
                self.storages[key] = Hit(size, category, position, path, graph, owner)
            if category != GRAPH:
                self.reach.tensors += 1
        if self.follow_grad or not is_root:
            grad = grad_of(tensor)
            if grad is not None:
                self.push(grad, GRADIENTS, position, path, owner)
        if node is not None:
            self.visit_graph(node, position, path, owner)

    def visit_graph(self, start: Any, position: int, path: tuple[Step, ...], owner: int) -> None:
        """Every node not yet seen from ``start``, then what each keeps for its backward."""
        for saved in self.graph_saved(start):
            self.push(saved, GRAPH, position, path, owner)

    def graph_saved(self, start: Any) -> list[Any]:
        """What the graph nodes not yet seen from ``start`` keep for their backward (kept alive)."""
        nodes: list[Any] = []
        frontier = [start]
        while frontier and self.budget > 0:
            node = frontier.pop()
            if id(node) in self.seen:
                continue
            self.seen.add(id(node))
            self.keep_alive.append(node)
            nodes.append(node)
            self.budget -= 1
            frontier.extend(next_nodes(node))
        if frontier:
            self.reach.truncated = True
        may_unpack = not graph_is_hooked(nodes)
        found: list[Any] = []
        for node in nodes:
            for saved in saved_by(node, may_unpack):
                self.keep_alive.append(saved)
                found.append(saved)
        return found

    def visit_module(self, module: Any, position: int, path: tuple[Step, ...], owner: int) -> None:
        deeper = len(path) < PATH_STEPS
        parameters = list(module.parameters())
        for parameter in parameters:
            self.push(parameter, PARAMETERS, position, path, owner)
        for parameter in parameters:
            grad = grad_of(parameter)
            if grad is not None:
                self.push(grad, GRADIENTS, position, path, owner)
        for buffer in module.buffers():
            self.push(buffer, BUFFERS, position, path, owner)
        label = describe_path(self.root_names[owner] or type(module).__name__, path)
        for attribute_path, value in module_attributes(module, label):
            step = path + ((ATTRIBUTE, attribute_path[len(label) + 1 :], -1),) if deeper else path
            self.push(value, MODULE_ATTRIBUTES, position, step, owner, hidden=True)
        for hook in module_hooks(module, label):
            self.reach.hooks.append(hook)
            step = path + ((HOOK, hook.describe(), -1),) if deeper else path
            for captured in hook.captured:
                self.push(captured, HOOKS, position, step, owner, hidden=True)


def walk(
    root: Any,
    probe: TensorProbe,
    skip_ids: frozenset[int] = frozenset(),
    follow_grad: bool = True,
    root_name: str = "",
    limit: int = WALK_LIMIT,
) -> Reach:
    """The storages ``root`` keeps alive (see the module docstring). ``follow_grad`` False leaves a root
    tensor's own ``.grad`` out (it is reported as a holder of its own)."""
    walker = _Walker(probe, skip_ids, follow_grad, limit, [root_name])
    reach = walker.run([root])
    walker.keep_alive.clear()
    return reach


def walk_together(
    roots: list[tuple[str, Any]],
    probe: TensorProbe,
    skip_ids: frozenset[int] = frozenset(),
    limit: int = WALK_LIMIT,
) -> Reach:
    """One walk of many roots, each object visited once whichever root leads to it, with what modules
    keep out of sight (hooks' captures, plain attributes) walked last, into ``Reach.late``: where those
    are also reached otherwise, they are counted there. ``Hit.owner`` is the index of the root. Cheaper
    than a walk per root when only the union matters (``left`` walks every unchanged name this way).

    Only which storages are reached is kept of the first part, in ``Reach.reached``: ``storages`` holds
    ``Hit``s only for what went through the full visit (modules' own tensors, optimizers' state...).
    Tensors, containers and plain objects, nearly all of a namespace, take a keys-only path (no
    categories, positions or paths: about half the cost per object or less; ``benchmarks/leaks.py``,
    part ``cost``, measures the whole attribution)."""
    walker = _Walker(probe, skip_ids, True, limit, list(map(itemgetter(0), roots)), defer_hidden=True)
    reach = walker.run(list(map(itemgetter(1), roots)), keys_only=True)
    walker.keep_alive.clear()
    return reach




def describe_path(root: str, path: tuple[Step, ...]) -> str:
    """``losses[3]``, ``tracker.history``, ``model.fc.cache``, ``forward hook save on model.fc``."""
    text = root
    for kind, value, _ in path:
        if kind == HOOK:
            return str(value)
        if kind == ATTRIBUTE:
            text += f".{value}"
        else:
            shown = repr(value)
            text += f"[{shown if len(shown) <= 24 else shown[:23] + '…'}]"
    return text
