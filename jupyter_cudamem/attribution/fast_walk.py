"""The fast path of the walk of many roots, held to the plain walk: ``walk_together``.

**Which is the specification.** ``walk._Walker`` (``walk.walk``) is the specification of what a root
reaches: one object at a time, each visited by type (``_Walker.visit``), with the category, position and
path of every storage. This module is the fast path of the first pass of ``walk_together``, the walk of
every unchanged name of a namespace after a cell, where only *which* storages are reached matters and
a namespace of 10,000 names must cost milliseconds: that walk is most of the attribution's cost, which
``benchmarks/leaks.py`` (part ``cost``) holds to a goal of 50 ms, met with this path (docs/leaks.md,
"Cost"). It runs two loops, each a faster way to do what ``visit`` does for the kinds most of a
namespace is made of:

- ``_KeysOnlyWalker.fast_lane``, the bulk lane: PyTorch's tensors without a graph, lists, tuples, dicts
  and plain objects without ``__slots__``, a level at a time, each step one C loop (``map``,
  ``compress``, ``chain``) over the level's part of one kind;
- ``_KeysOnlyWalker.collect_keys``, one object at a time on a stack of bare objects, without a
  ``Hit`` per storage: what the bulk lane hands back (a tensor with a graph, a set, an object with
  slots, a tensor-like, a part whose read raises, a level that would pass the budget).

Everything else (modules, optimizers, tracebacks, frames, exceptions, a root of the machinery) goes
through ``visit`` itself, and what modules keep out of sight (hooks' captures, plain attributes) is
walked last by the plain walk, with its owners and paths. Same storages reached, same count against
the budget per object queued: ``tests/attribution/test_walk.py`` walks the same namespaces three ways
(as it runs, with the bulk lane off, and by the plain walk) and proves they agree.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache, partial
from itertools import chain, compress, repeat
from operator import attrgetter, is_, is_not, itemgetter, methodcaller, not_
from typing import Any

from .probe import TensorProbe, _is_cuda
from .walk import (
    ATOM_TYPES,
    FUNCTION_CODE,
    MACHINERY_CODE,
    MAPPING_CODE,
    OBJECT_CODE,
    OPAQUE_CODE,
    SEQUENCE_CODE,
    SET_CODE,
    TENSOR_CODE,
    WALK_LIMIT,
    Reach,
    ReachedAs,
    _Walker,
    function_captures,
    slots_of,
    type_code,
)

_DIRECT, _DUCK = 1, 2  # how the keys-only pass reads a tensor type: plain attributes, or getattr with defaults


def _reads_directly(kind: type) -> bool:
    """Whether a tensor type's class defines what the keys-only pass reads (PyTorch's does), so plain
    attribute access works; tensor-likes are read through ``getattr`` with defaults instead."""
    return all(hasattr(kind, name) for name in ("grad_fn", "is_cuda", "retains_grad", "grad"))


# How ``_KeysOnlyWalker.fast_lane`` treats a type: skipped (not counted), counted and skipped, read in bulk, or
# handed back to ``collect_keys``' loop.
_LANE_ATOM, _LANE_DROP, _LANE_TENSOR, _LANE_SEQUENCE, _LANE_MAPPING, _LANE_OBJECT, _LANE_SLOW = range(7)
_NOT_A_ROOT = object()  # what ``collect_keys`` compares with for an object handed back below the roots
_IS_CUDA, _GRAD_FN, _GRAD = attrgetter("is_cuda"), attrgetter("grad_fn"), attrgetter("grad")
_DATA_PTR = methodcaller("data_ptr")
_UNTYPED_STORAGE = methodcaller("untyped_storage")


def _items_of(containers: list[Any]) -> list[list[object]]:
    return list(map(list, containers))


def _values_of(mappings: list[Any]) -> list[list[object]]:
    return list(map(list, map(methodcaller("values"), mappings)))


def _attributes_of(objects: list[object]) -> list[list[object]]:
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
    children: list[list[object]],
) -> list[int]:
    owners = owners_of(mask) if first is None else compress(owners_of(mask), first)
    return list(chain.from_iterable(map(repeat, owners, map(len, children))))


def _joined_owners(parts: list[Callable[[], list[int]]]) -> list[int]:
    return list(chain.from_iterable(part() for part in parts))


class _KeysOnlyWalker(_Walker):
    """The plain walk with its first pass replaced by ``collect_keys`` and ``fast_lane`` (see the
    module docstring); ``visit`` and the deferred pass are the plain walk's own."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lanes: dict[type, int] = {}

    def start(self, roots: list[object]) -> None:
        self.collect_keys(roots)

    def collect_keys(self, roots: list[object]) -> None:
        """The first pass of a walk of unchanged roots, where only which storages are reached matters:
        tensors, containers and plain objects are handled here on a stack of bare objects, without the
        categories, positions and paths a ``Hit`` records; everything else (modules, optimizers,
        tracebacks, frames, exceptions, a root of the machinery) goes through ``visit`` as in any walk,
        modules' hidden parts deferred the same way. Each object queued counts one against the budget.

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
        slots_by_type: dict[type, tuple[str, ...]] = {}
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
                        if code != TENSOR_CODE:
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
                if code == TENSOR_CODE:  # through the loop above
                    more = (obj,)
                    self.budget += 1  # counted when queued
                    continue
                try:
                    if code == SEQUENCE_CODE:
                        more = list(obj)
                    elif code == MAPPING_CODE:
                        more = list(obj.values())
                    elif code == SET_CODE:
                        more = list(obj)
                    elif code == OBJECT_CODE:
                        attributes = getattr(obj, "__dict__", None)
                        more = list(attributes.values()) if isinstance(attributes, dict) else []
                        slots = slots_by_type.get(kind)
                        if slots is None:
                            slots = slots_by_type[kind] = slots_of(kind)
                        for slot in slots:
                            if hasattr(obj, slot):
                                more.append(getattr(obj, slot))
                    elif code == FUNCTION_CODE:
                        more = [value for _, value in function_captures(obj)]
                    elif code == OPAQUE_CODE or (code == MACHINERY_CODE and obj is not root):
                        continue
                    else:
                        self.visit(obj, ReachedAs.TENSORS, -1, (), obj is root, owner)
                except Exception:  # an object that cannot be inspected holds nothing we can name
                    more = ()

    def fast_lane(self, roots: list[object]) -> list[tuple[int, object, bool]]:
        """The bulk of ``collect_keys``: PyTorch's tensors without a graph, lists, tuples, dicts and plain
        objects without ``__slots__``, a level at a time, each step one C loop over the level's part of
        that kind (``map``, ``compress``, ``chain``) instead of a Python loop per object. What it does
        not handle (a tensor with a graph, a module, an optimizer, a set, a traceback, an object with
        slots, a tensor-like) is handed back as ``(owner, object, is_root)`` to ``collect_keys``' own
        loop, and so is a whole level that would run past the budget, or a part whose read raises.
        Which root each object hangs under is worked out only for what is handed back (``functools.cache``
        over the level's owners)."""
        seen, keys, probe, lanes = self.seen, self.reach.reached, self.probe, self.lanes
        on_device, address = probe.on_device, probe.storage_address
        handed: list[tuple[int, object, bool]] = []
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
        if code == TENSOR_CODE:
            return _LANE_TENSOR if _reads_directly(kind) else _LANE_SLOW
        if code == OPAQUE_CODE:
            return _LANE_DROP
        if code == SEQUENCE_CODE:
            return _LANE_SEQUENCE
        if code == MAPPING_CODE:
            return _LANE_MAPPING
        if code == OBJECT_CODE and not slots_of(kind):
            # ``__dictoffset__`` 0: instances have no ``__dict__`` either, so nothing to walk
            return _LANE_OBJECT if getattr(kind, "__dictoffset__", 1) else _LANE_DROP
        return _LANE_SLOW


def walk_together(
    roots: list[tuple[str, object]],
    probe: TensorProbe,
    skip_ids: frozenset[int] = frozenset(),
    limit: int = WALK_LIMIT,
) -> Reach:
    """One walk of many roots, each object visited once whichever root leads to it, with what modules
    keep out of sight (hooks' captures, plain attributes) walked last, into ``Reach.late``: where those
    are also reached otherwise, they are counted there. ``Hit.owner`` is the index of the root. Cheaper
    than a walk per root when only the union matters (``left.judge_namespace`` walks every unchanged name this way).

    Only which storages are reached is kept of the first part, in ``Reach.reached``: ``storages`` holds
    ``Hit``s only for what went through the full visit (modules' own tensors, optimizers' state...).
    Tensors, containers and plain objects, nearly all of a namespace, take a keys-only path (no
    categories, positions or paths: about half the cost per object or less; ``benchmarks/leaks.py``,
    part ``cost``, measures the whole attribution)."""
    walker = _KeysOnlyWalker(probe, skip_ids, True, limit, list(map(itemgetter(0), roots)), defer_hidden=True)
    reach = walker.run(list(map(itemgetter(1), roots)))
    walker.keep_alive.clear()
    return reach
