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

This plain walk, one object at a time (``_Walker.visit``), is the specification of what a root
reaches; ``fast_walk.walk_together`` is the fast path for many roots, held to it (its docstring says
how, and ``tests/attribution/test_walk.py`` proves they agree).

What it does with an object is decided once per type (``type_code``: a tensor, a module, an optimizer, a
mapping, a sequence, a set, a traceback, a frame, an exception, a callable that keeps values, something
opaque, the machinery around the user, a plain object), cached, because ``isinstance`` chains cost more than
the walk itself; the snapshot before a cell sorts objects by the same codes. ``ATOM_TYPES`` are never entered
nor queued; ``OPAQUE`` and the ``MACHINERY_PREFIXES`` packages are not walked below a root. What a callable
keeps of its own is ``function_captures``' (a function its defaults and closure cells, a bound method its
object, a ``functools.partial`` its function and arguments), named by ``capture_names`` in the text of what
a cell left ("keeping 1 tensor in its closure (scale)").
"""

from __future__ import annotations

import types
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from functools import partial
from typing import Any, NamedTuple, TypeVar

from .probe import (
    ModuleHook,
    StorageKey,
    TensorProbe,
    grad_fn_of,
    grad_of,
    graph_is_hooked,
    module_attributes,
    module_hooks,
    next_nodes,
    saved_by,
)


class Capture(StrEnum):
    """How a callable keeps a value, named in the text of what a cell left ("keeping 1 tensor in its closure")."""

    DEFAULT_ARGUMENT = "default argument"
    CLOSURE = "closure"
    BOUND_OBJECT = "bound object"
    PARTIAL_ARGUMENT = "partial argument"


# Callables that keep values alive of their own: a function (defaults, closure cells), a bound method
# (its object, its function), a ``functools.partial`` (its function and arguments).
CALLABLES_KEEPING = (types.FunctionType, types.MethodType, partial)


def function_captures(function: types.FunctionType | types.MethodType | partial[object]) -> list[tuple[str, object]]:
    """What a Python function keeps alive of its own: its default arguments and the contents of its
    closure cells (not its globals, not its code); a bound method, its object and function; a
    ``functools.partial``, its function and arguments. Each with the expression that reads it."""
    if isinstance(function, types.MethodType):
        return [("__self__", function.__self__), ("__func__", function.__func__)]
    if isinstance(function, partial):
        arguments = [(f"args[{i}]", value) for i, value in enumerate(function.args)]
        return [("func", function.func), *arguments, *((f"keywords[{k!r}]", v) for k, v in function.keywords.items())]
    captures: list[tuple[str, object]] = []
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


def capture_names(function: types.FunctionType) -> dict[str, str]:
    """The variable each of ``function_captures``' expressions reads: ``{"__defaults__[0]": "t"}``."""
    code = function.__code__
    positional = code.co_varnames[: code.co_argcount]
    defaults = function.__defaults__ or ()
    names = {f"__defaults__[{i}]": name for i, name in enumerate(positional[len(positional) - len(defaults) :])}
    names.update({f"__kwdefaults__[{name!r}]": name for name in function.__kwdefaults__ or {}})
    names.update({f"__closure__[{i}].cell_contents": name for i, name in enumerate(code.co_freevars)})
    return names


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

# What the walk does with an object, decided once per type (isinstance chains cost more than the walk).
TENSOR_CODE, MODULE_CODE, OPTIMIZER_CODE, MAPPING_CODE, SEQUENCE_CODE, SET_CODE = range(6)
TRACEBACK_CODE, FRAME_CODE, EXCEPTION_CODE, OPAQUE_CODE, MACHINERY_CODE, OBJECT_CODE = range(6, 12)
FUNCTION_CODE = 12
ATOM_TYPES = frozenset(ATOMS)

R = TypeVar("R")
_MEMO_LIMIT = 8192  # distinct types remembered; past it the memo starts again (classes redefined in a loop)


class _TypeMemo(dict[type, R]):
    """A dict from type to ``function(type)``, filled on first use; called like the function. Calling
    it is ``dict.__getitem__`` (C, with ``__missing__`` only for a type not seen yet), a fraction of
    the cost of a Python wrapper: it runs once per name of a namespace, before every cell."""

    def __init__(self, function: Callable[[type], R]) -> None:
        super().__init__()
        self.function = function

    def __missing__(self, kind: type) -> R:
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
        return TENSOR_CODE
    if module_types and issubclass(kind, module_types):
        return MODULE_CODE
    if optimizer_types and issubclass(kind, optimizer_types):
        return OPTIMIZER_CODE
    if issubclass(kind, CALLABLES_KEEPING):
        return FUNCTION_CODE
    for code, bases in (
        (MAPPING_CODE, dict),
        (SEQUENCE_CODE, (list, tuple, deque)),
        (SET_CODE, (set, frozenset)),
        (TRACEBACK_CODE, types.TracebackType),
        (FRAME_CODE, types.FrameType),
        (EXCEPTION_CODE, BaseException),
        (OPAQUE_CODE, OPAQUE),
    ):
        if issubclass(kind, bases):
            return code
    module = getattr(kind, "__module__", "") or ""
    return MACHINERY_CODE if module.startswith(MACHINERY_PREFIXES) else OBJECT_CODE


@memo_by_type
def slots_of(kind: type) -> tuple[str, ...]:
    """The ``__slots__`` of a type and its bases, less ``__dict__`` and ``__weakref__``: what the walk
    reads of an object besides its ``__dict__``."""
    names: list[str] = []
    for klass in kind.__mro__:
        slots = klass.__dict__.get("__slots__", ())
        for slot in (slots,) if isinstance(slots, str) else slots:
            if slot not in ("__dict__", "__weakref__") and slot not in names:
                names.append(slot)
    return tuple(names)


WALK_LIMIT = 200_000  # objects queued per root



class ReachedAs(StrEnum):
    """What a storage was first reached as: the category its bytes are counted under, named by its
    value in descriptions (``Linear: parameters 4.00 MiB``) and in ``Reach.by_category``."""

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
Step = tuple[int, object, int]


class Hit(NamedTuple):
    """One storage as reached from a root: its size, category, and where under the root.

    ``position`` is the index of the root's own item it hangs under (a list's index, a dict's
    insertion position), -1 when the root is not a sequence or mapping; ``path`` the first steps;
    ``owner`` the index of the root it was reached from (in a walk of several roots). A named tuple:
    the walk makes one per storage, and tuples are the cheapest to make.
    """

    nbytes: int
    category: ReachedAs
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

    storages: dict[StorageKey, Hit] = field(default_factory=dict)
    tensors: int = 0  # tensors holding a counted storage, met outside graphs
    graph_tensors: int = 0  # of those, how many carry an autograd graph
    scalar_graph_tensors: int = 0  # of those, how many are single numbers (a loss, a metric)
    hooks: list[ModuleHook] = field(default_factory=list)
    truncated: bool = False
    late: dict[StorageKey, Hit] = field(default_factory=dict)
    # In a walk of several roots: every storage reached outside what modules keep out of sight,
    # including those a keys-only pass met without making a ``Hit`` (see ``fast_walk.walk_together``).
    reached: set[StorageKey] = field(default_factory=set)

    @property
    def total(self) -> int:
        return sum(hit.nbytes for hit in self.storages.values())

    def by_category(self) -> dict[ReachedAs, int]:
        sums: dict[ReachedAs, int] = {}
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


class _Walker:
    """The plain walk, one object at a time: ``visit`` says what each type leads to, ``push`` queues
    it (counted against the budget), ``drain`` visits the queue breadth first. The specification of
    what a root reaches (``fast_walk``'s keys-only pass is held to it)."""

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
        self.skip_ids = skip_ids
        self.follow_grad = follow_grad
        self.budget = budget
        self.root_names = root_names
        self.defer_hidden = defer_hidden
        self.seen: set[int] = set()
        # Graph nodes and unpacked tensors are new Python objects: keep them alive while walking, or
        # their ids could be reused by the next ones and those would be taken as already seen.
        self.keep_alive: list[object] = []
        self.pending: deque[tuple[object, ReachedAs, int, tuple[Step, ...], bool, int]] = deque()
        self.deferred: deque[tuple[object, ReachedAs, int, tuple[Step, ...], bool, int]] = deque()
        self.storages: dict[StorageKey, Hit] = {}
        self.reach = Reach(storages=self.storages)
        self.codes: dict[type, int] = {}
        # Paths are only read for what a holder is named by; a walk of unchanged roots skips them
        # until it reaches what modules keep out of sight.
        self.track_paths = not defer_hidden

    def push(
        self, item: object, category: ReachedAs, position: int, path: tuple[Step, ...], owner: int, hidden: bool = False
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

    def run(self, roots: list[object]) -> Reach:
        self.start(roots)
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

    def start(self, roots: list[object]) -> None:
        """Queue the roots (not counted against the budget)."""
        for owner, root in enumerate(roots):
            self.pending.append((root, ReachedAs.TENSORS, -1, (), True, owner))

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

    def visit(
        self, obj: Any, category: ReachedAs, position: int, path: tuple[Step, ...], is_root: bool, owner: int
    ) -> None:
        kind = type(obj)
        code = self.codes.get(kind)
        if code is None:
            code = self.codes[kind] = type_code(kind, self.probe)
        push = self.push
        if code == TENSOR_CODE:
            self.visit_tensor(obj, category, position, path, is_root, owner)
        elif code == MODULE_CODE:
            self.visit_module(obj, position, path, owner)
        elif code == OPTIMIZER_CODE:
            # Only the state: the parameters in ``param_groups`` belong to the model.
            for value in list(getattr(obj, "state", {}).values()):
                push(value, ReachedAs.STATE, position, path, owner)
        elif code == MAPPING_CODE:
            deeper = self.track_paths and len(path) < PATH_STEPS
            for index, (key, value) in enumerate(list(obj.items())):
                step = path + ((ITEM, key, index),) if deeper else path
                push(value, category, index if is_root else position, step, owner)
        elif code == SEQUENCE_CODE:
            deeper = self.track_paths and len(path) < PATH_STEPS
            for index, value in enumerate(list(obj)):
                step = path + ((ITEM, index, index),) if deeper else path
                push(value, category, index if is_root else position, step, owner)
        elif code == SET_CODE:
            for value in list(obj):
                push(value, category, position, path, owner)
        elif code == TRACEBACK_CODE:
            push(obj.tb_frame, category, position, path, owner)
            push(obj.tb_next, category, position, path, owner)
        elif code == FRAME_CODE:
            # A module-level frame's locals are its globals: the user namespace, reported name by name.
            if obj.f_code.co_name != "<module>" and obj.f_locals is not obj.f_globals:
                for value in list(obj.f_locals.values()):
                    push(value, category, position, path, owner)
        elif code == EXCEPTION_CODE:
            for value in (obj.__traceback__, obj.__cause__, obj.__context__, *obj.args):
                push(value, category, position, path, owner)
            for value in list(getattr(obj, "__dict__", {}).values()):
                push(value, category, position, path, owner)
        elif code == FUNCTION_CODE:
            deeper = self.track_paths and len(path) < PATH_STEPS
            for expression, value in function_captures(obj):
                push(value, category, position, path + ((ATTRIBUTE, expression, -1),) if deeper else path, owner)
        elif code == OBJECT_CODE or (code == MACHINERY_CODE and is_root):
            deeper = self.track_paths and len(path) < PATH_STEPS
            attributes = getattr(obj, "__dict__", None)
            if isinstance(attributes, dict):
                for name, value in list(attributes.items()):
                    push(value, category, position, path + ((ATTRIBUTE, name, -1),) if deeper else path, owner)
            for slot in slots_of(type(obj)):
                if hasattr(obj, slot):
                    step = path + ((ATTRIBUTE, slot, -1),) if deeper else path
                    push(getattr(obj, slot), category, position, step, owner)

    def visit_tensor(
        self, tensor: object, category: ReachedAs, position: int, path: tuple[Step, ...], is_root: bool, owner: int
    ) -> None:
        found = self.probe.device_storage(tensor)
        node = grad_fn_of(tensor)
        if found is not None:
            key, size = found
            graph = NO_GRAPH
            saved = category is ReachedAs.GRAPH  # saved by a graph: counted as the graph's, not as a tensor met
            if node is not None and not saved:
                graph = GRAPH_SCALAR if _numel(tensor) == 1 else WITH_GRAPH
                self.reach.graph_tensors += 1
                self.reach.scalar_graph_tensors += graph == GRAPH_SCALAR
            if key not in self.storages:
                self.storages[key] = Hit(size, category, position, path, graph, owner)
            if not saved:
                self.reach.tensors += 1
        if self.follow_grad or not is_root:
            grad = grad_of(tensor)
            if grad is not None:
                self.push(grad, ReachedAs.GRADIENTS, position, path, owner)
        if node is not None:
            self.visit_graph(node, position, path, owner)

    def visit_graph(self, start: object, position: int, path: tuple[Step, ...], owner: int) -> None:
        """Every node not yet seen from ``start``, then what each keeps for its backward."""
        for saved in self.graph_saved(start):
            self.push(saved, ReachedAs.GRAPH, position, path, owner)

    def graph_saved(self, start: object) -> list[object]:
        """What the graph nodes not yet seen from ``start`` keep for their backward (kept alive)."""
        nodes: list[object] = []
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
        found: list[object] = []
        for node in nodes:
            for saved in saved_by(node, may_unpack):
                self.keep_alive.append(saved)
                found.append(saved)
        return found

    def visit_module(self, module: Any, position: int, path: tuple[Step, ...], owner: int) -> None:
        deeper = len(path) < PATH_STEPS
        parameters = list(module.parameters())
        for parameter in parameters:
            self.push(parameter, ReachedAs.PARAMETERS, position, path, owner)
        for parameter in parameters:
            grad = grad_of(parameter)
            if grad is not None:
                self.push(grad, ReachedAs.GRADIENTS, position, path, owner)
        for buffer in module.buffers():
            self.push(buffer, ReachedAs.BUFFERS, position, path, owner)
        label = describe_path(self.root_names[owner] or type(module).__name__, path)
        for attribute_path, value in module_attributes(module, label):
            step = path + ((ATTRIBUTE, attribute_path[len(label) + 1 :], -1),) if deeper else path
            self.push(value, ReachedAs.MODULE_ATTRIBUTES, position, step, owner, hidden=True)
        for hook in module_hooks(module, label):
            self.reach.hooks.append(hook)
            step = path + ((HOOK, hook.describe(), -1),) if deeper else path
            for captured in hook.captured:
                self.push(captured, ReachedAs.HOOKS, position, step, owner, hidden=True)


def walk(
    root: object,
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
