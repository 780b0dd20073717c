"""Reruns leave no trace in the notebook's plain Python state either: the containers a cell adds to, the
names it rebinds from their old value and the attributes of the notebook's own objects are put back
before each rerun, copied shallowly along paths of plain values only (``PlainState.keep``). Not undone:
other libraries' objects, arrays or tensors changed in place, iterators, files. No torch, no IPython.
"""

from __future__ import annotations

import argparse
import collections
import types
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from typing import Any, TypeAlias

CONTAINERS = (list, dict, set, bytearray, collections.deque)
"""The builtin containers whose contents are kept and put back."""

NAMESPACE_OBJECTS = (types.SimpleNamespace, argparse.Namespace)
"""Objects that are only their attributes (a config bag), kept as a notebook instance is."""

MAX_ITEMS = 2_000_000
"""At most this many items are copied in all (16 MB of references); a larger container is left, and said."""


Container: TypeAlias = (list[object] | dict[object, object] | dict[str, object] | set[object] | bytearray
                        | collections.deque[object])
"""One of ``CONTAINERS`` or an object's ``__dict__``, or a copy of their contents."""


def _copy(value: Container) -> Container:
    if isinstance(value, dict):
        return dict(value)  # a plain dict: a Counter's ``update`` would add to its counts
    if isinstance(value, bytearray):
        return bytearray(value)
    return set(value) if isinstance(value, set) else list(value)  # a list or a deque


def _put_back(value: Container, saved: Any) -> None:
    """In place, through the container's own methods (an OrderedDict keeps its order); ``saved``: what
    ``_copy`` made of ``value``, the container of its kind."""
    if isinstance(value, (list, bytearray)):
        value[:] = saved
    elif isinstance(value, collections.deque):
        value.clear()
        value.extend(saved)
    else:  # dict or set
        value.clear()
        value.update(saved)


def _same(value: Container, saved: Any) -> bool:
    """Whether ``value`` still holds what ``saved`` holds (the same objects, in the same order)."""
    if isinstance(value, dict):
        return len(value) == len(saved) and all(k in saved and saved[k] is v for k, v in value.items())
    if isinstance(value, (set, bytearray)):
        return value == saved
    return len(value) == len(saved) and all(a is b for a, b in zip(value, saved))


@dataclass
class PlainState:
    """The plain state a cell may change: what ``keep`` and ``bind`` were shown, as ``save`` found it."""

    names: list[str] = field(default_factory=list)  # names the cell reads
    kept: list[tuple[object, str]] = field(default_factory=list)  # (container or instance, path)
    too_large: list[str] = field(default_factory=list)  # paths of containers over ``MAX_ITEMS``
    changed: list[str] = field(default_factory=list)  # paths a rerun changed and ``restore`` put back
    _items: int = 0
    _bindings: dict[str, object] = field(default_factory=dict)
    _saved: list[tuple[object, Container, str]] = field(default_factory=list)  # (value, its items or attributes, path)

    @property
    def empty(self) -> bool:
        return not (self.names or self.kept)

    def bind(self, name: str) -> None:
        """The cell reads ``name``: its binding is put back."""
        if name not in self.names:
            self.names.append(name)

    def keep(self, value: object, path: str, notebook_class: bool) -> bool:
        """Keep ``value``'s contents when it is plain (``notebook_class``: its class is the notebook's);
        whether its items are plain paths to follow."""
        if isinstance(value, CONTAINERS):
            try:
                size = len(value)
            except Exception:  # noqa: BLE001 - a subclass's own __len__ may fail: not kept
                return False
            if self._items + size > MAX_ITEMS:
                self.too_large.append(path)
                return False
            self._items += size
        elif notebook_class or isinstance(value, NAMESPACE_OBJECTS):
            if not isinstance(getattr(value, "__dict__", None), dict):
                return False  # __slots__ only
        else:
            return isinstance(value, (tuple, frozenset))  # immutable, but may hold a list
        self.kept.append((value, path))
        return True

    def save(self, namespace: MutableMapping[str, object]) -> list[str]:
        """Copy what is kept, and the names' bindings, as they are now; the paths that could not be (with why)."""
        self._bindings = {name: namespace[name] for name in self.names if name in namespace}
        self._saved, failed = [], []
        for value, path in self.kept:
            try:
                copy = _copy(value) if isinstance(value, CONTAINERS) else dict(value.__dict__)
                self._saved.append((value, copy, path))
            except Exception as error:  # noqa: BLE001 - a subclass's own __iter__ may fail
                failed.append(f"{path} ({type(error).__name__}: {error})")
        return failed

    def restore(self, namespace: MutableMapping[str, object]) -> list[str]:
        """Put back what ``save`` copied; the paths that could not be (one line each, with why)."""
        failed: list[str] = []
        for value, saved, path in self._saved:
            try:
                contents = value if isinstance(value, CONTAINERS) else value.__dict__
                if _same(contents, saved):
                    continue
                self._note(path)
                _put_back(contents, saved)
            except Exception as error:  # noqa: BLE001 - a subclass's own methods may refuse
                failed.append(f"{path} ({type(error).__name__}: {error})")
        for name, value in self._bindings.items():
            if namespace.get(name, _MISSING) is not value:
                self._note(name)
                namespace[name] = value
        return failed

    def drop(self) -> None:
        """Let go of the copies (the reruns are over)."""
        self._bindings, self._saved = {}, []

    def _note(self, path: str) -> None:
        if path not in self.changed:
            self.changed.append(path)


_MISSING = object()
