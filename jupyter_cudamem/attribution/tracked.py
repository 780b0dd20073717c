"""The namespace's fingerprints kept from cell to cell: before each cell, only the names the cells since
the last snapshot can have changed are fingerprinted again, so the cost follows the cell, not the namespace.

What a cell can have changed, cheapest first:

- the names its text holds (``cell.names.cell_names``: everything it binds, deletes or reads, where a
  read may be a change in place: ``losses.append``, ``model.cuda()``);
- the globals named by the code of the notebook's own functions and classes it names, and by the
  functions those name in turn (``train()`` appending to ``history``, ``global step``);
- the names that share an object with those: an alias (``h = history``), a container holding one of
  them or held by one (``log = {'losses': losses}``), as far as a fingerprint looks (one level down).

Every name is fingerprinted again (a full walk, as ``NamespaceSnapshot.take``) where that cannot be
decided: the first snapshot, a cell whose text cannot tell (``exec``, ``globals()``, ``import *``, ``%run``:
see ``cell_names``), a cell not seen, and once the cells since the last full walk have left
``GUARD_FRACTION`` of the attribution threshold allocated in all (the measured ones each, those between
two measured cells together). That last one bounds what no name shows:
code stored earlier and run by a library (a forward hook appending activations, a closure, a callback),
or a thread, can grow an object no name of the cell leads to; whatever it added since the last full walk
is less than that, so it cannot turn into a holder the report would name.
"""

from __future__ import annotations

import types
import warnings
from collections.abc import Iterable, Mapping
from operator import itemgetter

from ..cell.names import code_names
from ..collector import collector_paused
from .probe import TensorProbe
from .snapshot import Fingerprint, NamespaceSnapshot, fingerprints
from .walk import ATOM_TYPES

# Why a quarter: storages a stale fingerprint hides are counted as the next attributed cell's; a quarter
# of the threshold (16 MiB of the default 64 MiB) stays under the 1% (or 1 MiB) below which holders are
# summed into one line for any cell that reaches the threshold plus what stays hidden, and cells that
# leave little in a row (a loop over small steps) still walk everything only every few dozen MiB.
GUARD_FRACTION = 4
_GONE = object()  # a name the namespace no longer has


def _held_ids(fingerprint: Fingerprint) -> list[int]:
    """The ids of the objects whose change in place changes this fingerprint: the object's own (unless
    the fingerprint is its id alone: numbers, strings, functions), and its children's or attributes'
    whose length it records (a child without one can change in place without this fingerprint moving)."""
    if len(fingerprint) == 1:
        return []
    ids = [fingerprint[0]]
    if len(fingerprint) == 3 and type(fingerprint[1]) is int and type(fingerprint[2]) is tuple:
        ids.extend(child for child, _ in fingerprint[2])  # a container: (id, length) of children
    elif len(fingerprint) == 2 and type(fingerprint[1]) is tuple:
        ids.extend(ident for _, ident, size in fingerprint[1] if size >= 0)  # an object: (name, id, length)
    return ids


class TrackedNamespace:
    """One namespace's fingerprints, refreshed from cell to cell (see the module docstring)."""

    def __init__(self, guard_bytes: int):
        self.guard_bytes = guard_bytes
        self.full_walks = 0  # how many snapshots walked every name (for tests and benchmarks)
        # The fingerprints of the last full walk (never changed after: snapshots share it), and those taken
        # again since (``None``: the name went); merged into a new base once they are an eighth of it.
        self._base: dict[str, Fingerprint] | None = None
        self._changed: dict[str, Fingerprint | None] = {}
        self._probe: TensorProbe | None = None
        self._touched: set[str] = set()
        self._left_bytes = 0
        self._allocated: dict[int, int] = {}  # device -> allocated bytes, as last known
        # Who holds what, for finding the names that share an object: the object's id -> the name, and
        # the ids of children and attributes (and of objects two names are bound to) -> those names.
        self._owner: dict[int, str] = {}
        self._sharing: dict[int, set[str]] = {}
        self._code: dict[types.CodeType, frozenset[str]] = {}

    def forget(self) -> None:
        """Walk every name at the next snapshot."""
        self._base = None

    def ran(self, names: Iterable[str] | None) -> None:
        """A cell ran that can have touched ``names`` (``None``: it cannot tell)."""
        if names is None:
            self._base = None
        elif self._base is not None:
            self._touched.update(names)

    def left(self, nbytes: int, ended: Mapping[int, int] | None = None) -> None:
        """A measured cell left ``nbytes`` more allocated (counted towards the guard), ending with
        ``ended`` allocated bytes on each device it touched."""
        self._left_bytes += max(nbytes, 0)
        self._allocated.update(ended or {})

    def unmeasured(self, allocated: Mapping[int, int]) -> None:
        """Cells not measured may have run since the last measured one: what they left on each device
        (``allocated`` bytes now, less what it was as that one ended) counts towards the guard."""
        self._left_bytes += sum(max(now - self._allocated.get(device, now), 0) for device, now in allocated.items())
        self._allocated = dict(allocated)

    def take(self, namespace: Mapping[str, object], reference_ids: frozenset[int], probe: TensorProbe) -> NamespaceSnapshot:
        """The namespace as it is now, as ``NamespaceSnapshot.take`` would fingerprint it, with the ids of
        what IPython keeps (``ipython_state.ipython_reference_ids``)."""
        walk_all = self._base is None or probe != self._probe or self._left_bytes * GUARD_FRACTION >= self.guard_bytes
        if walk_all or not self._refresh_atoms(namespace):
            with warnings.catch_warnings(), collector_paused():
                warnings.simplefilter("ignore")
                if walk_all:
                    self._walk_all(namespace, probe)
                else:
                    self._refresh(namespace, probe)
        self._touched = set()
        base, changed = self._base, self._changed
        assert base is not None
        if len(changed) > max(64, len(base) // 8):  # merged now and then: a cost per name taken again
            base = self._base = dict(NamespaceSnapshot(base, frozenset(), changed).names)
            changed = self._changed = {}
        return NamespaceSnapshot(base, reference_ids, changed)

    # -- every name -------------------------------------------------------------------------------
    def _walk_all(self, namespace: Mapping[str, object], probe: TensorProbe) -> None:
        self.full_walks += 1
        self._probe, self._left_bytes = probe, 0
        items = list(namespace.items())
        names = self._base = fingerprints(items, probe)
        self._changed = {}
        keys = list(names)
        # Numbers, strings and functions (a fingerprint of one id) included: they only cost a look.
        self._owner = dict(zip(map(itemgetter(0), names.values()), keys))
        self._sharing = {}
        if len(self._owner) < len(keys):  # two names bound to one object: each finds the other
            for name, print_ in names.items():
                if self._owner[print_[0]] != name and len(print_) > 1:
                    self._sharing.setdefault(print_[0], {self._owner[print_[0]]}).add(name)
        # Only fingerprints with children or attributes record other ids (containers of tensors record none).
        for name, print_ in names.items():
            if type(print_[-1]) is tuple and print_[-1]:
                for ident in _held_ids(print_)[1:]:
                    self._sharing.setdefault(ident, set()).add(name)

    # -- the names a cell can have changed ----------------------------------------------------------
    def _current(self, name: str) -> Fingerprint | None:
        if name in self._changed:
            return self._changed[name]
        return self._base.get(name) if self._base is not None else None

    def _refresh(self, namespace: Mapping[str, object], probe: TensorProbe) -> None:
        """Fingerprint again the names the cells since the last snapshot can have changed. The snapshot
        handed out before keeps its own ``changed``: this one is a new dict."""
        changed = self._changed = dict(self._changed)
        touched = self._withcode_names(namespace)
        related: set[str] = set()
        for name in touched:
            old = self._current(name)
            if old is not None:
                related.update(self._sharers(old))
        now = fingerprints([(name, namespace[name]) for name in touched | related if name in namespace], probe)
        later: set[str] = set()
        for name in touched | related:
            old = self._current(name)
            new = now.get(name)
            if old is not None:
                self._unindex(name, old)
            if old is None and new is None:
                continue
            changed[name] = new
            if new is not None:
                self._index(name, new)
                # A name the cell bound now may share an object with another one that it changed.
                later |= self._sharers(new)
        for other in later - touched - related:
            old = self._current(other)
            if other in namespace and old is not None:
                new = fingerprints([(other, namespace[other])], probe)[other]
                self._unindex(other, old)
                changed[other] = new
                self._index(other, new)

    def _refresh_atoms(self, namespace: Mapping[str, object]) -> bool:
        """``_refresh`` where every touched name is gone, or bound to an atom (a number, a string, ``None``) and
        was one or unbound before: such a fingerprint is the object's id alone, shares nothing and names no
        code, so no user code runs and neither the warnings filter nor the collector's pause is needed (in a
        running cell they cost more than the rest of a trivial cell's snapshot). ``False``, changing nothing,
        where a touched name is anything else."""
        fresh: dict[str, tuple[Fingerprint | None, Fingerprint | None]] = {}  # name: (old, new)
        for name in self._touched:
            old = self._current(name)
            if old is not None and len(old) > 1:
                return False
            value = namespace.get(name, _GONE)
            if value is _GONE:
                if old is not None:
                    fresh[name] = (old, None)
            elif type(value) in ATOM_TYPES:
                fresh[name] = (old, (id(value),))
            else:
                return False
        if fresh:  # a new dict, as ``_refresh`` makes: the snapshot handed out before keeps its own
            changed = self._changed = dict(self._changed)
            for name, (old, new) in fresh.items():
                if old is not None:
                    self._unindex(name, old)
                changed[name] = new
        return True

    def _withcode_names(self, namespace: Mapping[str, object]) -> set[str]:
        """The touched names, with the globals the notebook's own code among them names, transitively."""
        touched = set(self._touched)
        queue = list(touched)
        while queue:
            value = namespace.get(queue.pop())
            for code in self._codes_of(value, namespace):
                found = self._code.get(code)
                if found is None:
                    found = self._code[code] = frozenset(code_names(code))
                fresh = found - touched
                touched |= fresh
                queue.extend(name for name in fresh if name in namespace)
        return touched

    @staticmethod
    def _codes_of(value: object, namespace: Mapping[str, object]) -> list[types.CodeType]:
        """The code objects of a function, class or instance of a class defined in this namespace."""
        if isinstance(value, types.MethodType):
            value = value.__func__
        if isinstance(value, types.FunctionType):
            return [value.__code__] if value.__globals__ is namespace else []
        kind = value if isinstance(value, type) else type(value)
        if getattr(kind, "__module__", None) != namespace.get("__name__") or kind.__module__ in (None, "builtins"):
            return []
        codes = []
        for klass in kind.__mro__:
            if klass.__module__ != kind.__module__:
                continue
            for member in vars(klass).values():
                member = getattr(member, "__func__", member)  # staticmethod, classmethod
                if isinstance(member, types.FunctionType) and member.__globals__ is namespace:
                    codes.append(member.__code__)
                elif isinstance(member, property):
                    codes.extend(f.__code__ for f in (member.fget, member.fset, member.fdel)
                                 if isinstance(f, types.FunctionType) and f.__globals__ is namespace)
        return codes

    def _sharers(self, fingerprint: Fingerprint) -> set[str]:
        """The names whose fingerprint records an object this one records."""
        found: set[str] = set()
        for ident in _held_ids(fingerprint):
            owner = self._owner.get(ident)
            if owner is not None:
                found.add(owner)
            found.update(self._sharing.get(ident, ()))
        return found

    def _index(self, name: str, fingerprint: Fingerprint) -> None:
        held = _held_ids(fingerprint)
        if not held:
            return
        owner = self._owner.setdefault(held[0], name)
        if owner != name:
            self._sharing.setdefault(held[0], {owner}).add(name)
        for child in held[1:]:
            self._sharing.setdefault(child, set()).add(name)

    def _unindex(self, name: str, fingerprint: Fingerprint) -> None:
        if self._owner.get(fingerprint[0]) == name:
            del self._owner[fingerprint[0]]
        for ident in _held_ids(fingerprint):
            if self._owner.get(ident) == name:
                del self._owner[ident]
            holders = self._sharing.get(ident)
            if holders is not None:
                holders.discard(name)
                if not holders:
                    del self._sharing[ident]
