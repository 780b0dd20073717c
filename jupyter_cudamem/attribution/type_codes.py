"""What the walk (and the snapshot before a cell) does with an object, decided once per type.

``type_code`` sorts a type into one of the ``*_CODE`` constants (a tensor, a module, an optimizer, a
mapping, a sequence, a set, a traceback, a frame, an exception, a callable that keeps values, something
opaque, the machinery around the user, a plain object), cached, because ``isinstance`` chains cost more
than the walk itself. ``ATOM_TYPES`` are never entered nor queued; ``OPAQUE`` and the ``MACHINERY_PREFIXES``
packages are not walked below a root.
"""

from __future__ import annotations

import types
from collections import deque
from collections.abc import Callable
from typing import Any, TypeVar

from .captures import CALLABLES_KEEPING
from .probe import TensorProbe

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
