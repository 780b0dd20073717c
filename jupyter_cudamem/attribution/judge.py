"""After a cell: which storages each root reaches are new, old or unknown to the cell.

The names whose fingerprint changed since the ``snapshot`` (and IPython's references that appeared)
are walked one by one (``walk.walk``), the unchanged ones together in one walk
(``fast_walk.walk_together``), and each storage is sorted by what the fingerprint says of the part of
the root it hangs under:

- *new*: under a name that is new or rebound, the items a list or dict gained (by position), an
  object's changed attributes, a module whose parameters moved or got gradients, an optimizer that
  gained state, an output-cache entry or traceback that appeared;
- *old*: under anything the fingerprint says is unchanged. Old wins: parameters that a loss's graph
  saved (``mat2`` of a linear layer) stay the model's;
- *unknown*: what an unchanged module keeps through its hooks or plain attributes, which the
  fingerprint cannot see grow. ``left`` counts unknown storages (as "likely") only up to what the
  cell left and the new storages do not explain.
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Mapping
from dataclasses import dataclass
from enum import Enum, StrEnum
from itertools import compress, islice
from operator import itemgetter, ne, not_
from typing import Any

from .fast_walk import walk_together
from .holders import HolderKind, Origin, Reference, Root, list_roots, root_kind, user_items
from .probe import ModuleHook, TensorProbe
from .snapshot import CHILDREN_FINGERPRINTED, NamespaceSnapshot, fingerprint, fingerprints, grows_in_place, sized
from .type_codes import MAPPING_CODE, SEQUENCE_CODE, type_code
from .walk import ATTRIBUTE, HOOK, ITEM, Hit, Reach, ReachedAs, walk

NEW, OLD, UNKNOWN = 2, 0, 1


class Change(StrEnum):
    """What happened to a name in the cell, as its fingerprint tells: decides which of the storages it
    reaches are new, and what ``text.leak_advice`` says of a container that grew."""

    NEW = "new"
    REBOUND = "rebound"
    GREW = "grew"  # a container gained items, or a child container grew in place
    CHANGED = "changed"  # in place (``Judged.detail`` says what, where the fingerprint can)
    UNCHANGED = "unchanged"


class InPlace(Enum):
    """What changed in place in a module, tensor or optimizer: which of its storages are new."""

    MOVED = "moved"  # a module's parameters moved (``.to``, ``.cuda()``)
    GRADIENTS = "gradients"  # a module or tensor got gradients
    STATE = "state"  # an optimizer gained state


@dataclass
class Judged:
    """A root with what the fingerprint says of each part of it."""

    root: Root
    change: Change
    novelty: dict[Any, int]  # storage -> NEW / OLD / UNKNOWN as this root reaches it
    detail: Any = None  # what ``_variable_change`` said besides the change


def _variable_change(root: Root, before: Mapping[str, tuple[Any, ...]], probe: TensorProbe) -> tuple[Change, Any]:
    """``(change, detail)``: how the name's object differs from the snapshot."""
    is_gradient = root.kind is HolderKind.GRADIENT
    name = root.name.removesuffix(".grad") if is_gradient else root.name
    old = before.get(name)
    if old is None:
        return Change.NEW, None
    if is_gradient:
        return (Change.CHANGED, None) if old[1:2] != (id(root.value),) else (Change.UNCHANGED, None)
    value = root.value
    now = fingerprint(value, probe)
    if now[0] != old[0]:
        return Change.REBOUND, None
    if now == old:
        return Change.UNCHANGED, None
    if len(now) == 3 and len(old) == 3 and type_code(type(value), probe) in (SEQUENCE_CODE, MAPPING_CODE):
        return _container_change(value, now, old)
    if isinstance(value, (list, tuple, dict)) or type(value).__name__ == "deque":
        grown = len(now) > 1 and len(old) > 1 and now[1] > old[1]
        return (Change.GREW, (old[1], {})) if grown else (Change.CHANGED, None)
    if isinstance(value, (set, frozenset)):
        return Change.CHANGED, None
    if isinstance(value, probe.module_types):
        moved = len(old) > 1 and now[1] != old[1]
        return Change.CHANGED, (InPlace.MOVED if moved else InPlace.GRADIENTS)
    if probe.is_tensor(value):
        return Change.CHANGED, InPlace.GRADIENTS
    if isinstance(value, probe.optimizer_types):
        return Change.CHANGED, InPlace.STATE
    if len(now) > 1 and len(old) > 1 and isinstance(now[1], tuple) and isinstance(old[1], tuple):
        earlier = {name: (ident, size) for name, ident, size in old[1]}
        changed: dict[str, int] = {}
        for attribute, ident, size in now[1]:
            previous = earlier.get(attribute)
            if previous is None or previous[0] != ident:
                changed[attribute] = -1  # new or rebound attribute: all of it is new
            elif previous[1] != size:
                changed[attribute] = previous[1]  # grown in place: the items past the old length
        return Change.CHANGED, changed
    return Change.UNCHANGED, None


def _container_change(value: Iterable[object], now: tuple[Any, ...], old: tuple[Any, ...]) -> tuple[Change, Any]:
    """A list, tuple, dict or deque whose fingerprint changed: ``(Change.GREW, (old length, {position: old
    length of the child container there, or -1 for one that was not there}))`` when it gained items or
    a child container grew in place or was put where something else was (``history['losses'].append``,
    ``history['best'] = [...]``); ``(Change.CHANGED, None)`` when it shrank (what it holds can no longer be
    told apart by position); ``(Change.UNCHANGED, None)`` when only a child shrank or went."""
    old_length, old_sizes = old[1], dict(old[2])
    if now[1] < old_length:
        return Change.CHANGED, None
    grown: dict[int, int] = {}
    children = value.values() if isinstance(value, Mapping) else value
    for position, child in enumerate(islice(children, min(old_length, CHILDREN_FINGERPRINTED))):
        if not grows_in_place(type(child)):
            continue
        length_before = old_sizes.get(id(child))
        if length_before is None:
            grown[position] = -1  # a container put where something else was: all it holds is new
        elif sized(child) > length_before:
            grown[position] = length_before
    if now[1] > old_length or grown:
        return Change.GREW, (old_length, grown)
    return Change.UNCHANGED, None


def _novelty_of(hit: Hit, change: Change, detail: Any) -> int:
    if change in (Change.NEW, Change.REBOUND):
        return NEW
    if change is Change.UNCHANGED:
        return UNKNOWN if _hidden(hit) else OLD
    if change is Change.GREW:
        old_length, children = detail
        if hit.position >= old_length:
            return NEW  # an item the container gained
        length_before = children.get(hit.position)
        if length_before is None:
            return OLD
        if length_before < 0:
            return NEW
        if len(hit.path) < 2 or hit.path[1][0] != ITEM:
            return OLD  # not told where in the child: counted as what was there
        return NEW if hit.path[1][2] >= length_before else OLD
    # changed in place
    if detail is InPlace.MOVED:
        return UNKNOWN if _hidden(hit) else NEW
    if detail is InPlace.GRADIENTS:
        if hit.category is ReachedAs.GRADIENTS:
            return NEW
        return UNKNOWN if _hidden(hit) else OLD
    if detail is InPlace.STATE:
        return NEW if hit.category is ReachedAs.STATE else OLD
    if isinstance(detail, dict):
        if not hit.path or hit.path[0][0] != ATTRIBUTE or hit.path[0][1] not in detail:
            return OLD
        old_size = detail[hit.path[0][1]]
        if old_size < 0 or len(hit.path) < 2 or hit.path[1][0] != ITEM:
            return NEW
        return NEW if hit.path[1][2] >= old_size else OLD
    return NEW  # a set or a container that shrank and grew: what it holds cannot be told apart


_HIDDEN = frozenset({ReachedAs.HOOKS, ReachedAs.MODULE_ATTRIBUTES})


def _hidden(hit: Hit) -> bool:
    """Reached through what a module keeps out of the fingerprint's sight: hooks, plain attributes."""
    return hit.category in _HIDDEN or bool(hit.path and hit.path[0][0] == HOOK)


def judge_namespace(
    namespace: Mapping[str, Any],
    references: Iterable[Reference] | Mapping[str, object],
    before: NamespaceSnapshot,
    probe: TensorProbe,
    skip: frozenset[int],
    left_bytes: int | None = None,
) -> tuple[list[Judged], list[ModuleHook]]:
    """Walk the roots whose fingerprint changed one by one, and the unchanged ones in one walk: their
    storages are old, except what only their modules' hooks and attributes reach (unknown).

    The unchanged modules are walked first (their parameters are what a new graph most often saves,
    and their hooks are what a hook's leak is named by). When the storages the changed roots hold,
    less those, account for ``left_bytes`` (up to ``ALLOCATION_ROUNDING_BYTES``), the rest of the unchanged
    names is not walked: nothing is left for them to hold, and walking every name is most of the cost
    on a large namespace (``benchmarks/leaks.py``, part ``cost``)."""
    judged: list[Judged] = []
    made: dict[int, Root] = {}  # position in ``unchanged`` -> the root already made for it
    earlier = before.names
    items = user_items(namespace)
    now = fingerprints(items, probe)  # the snapshot's own loop: a name costs here what it cost there
    # Most names are decided here without a second look, by C loops: whether each fingerprint differs
    # from the one before the cell (a name that is new has ``None`` there), then the split by that.
    flags = list(map(ne, now.values(), map(earlier.get, now)))
    unchanged = list(compress(items, map(not_, flags)))
    roots = [
        Root(name, root_kind(value, probe), value, True, Origin.VARIABLE, 1) for name, value in compress(items, flags)
    ]
    roots.extend(list_roots({}, references, probe))
    for root in roots:
        if root.user_variable:
            change, detail = _variable_change(root, before.names, probe)
        else:
            change, detail = (Change.UNCHANGED if id(root.value) in before.references else Change.NEW), None
        if change is Change.UNCHANGED:
            made[len(unchanged)] = root
            unchanged.append((root.name, root.value))
            continue
        root.reach = walk(root.value, probe, skip, True, root.name)
        novelty = {key: _novelty_of(hit, change, detail) for key, hit in root.reach.storages.items()}
        judged.append(Judged(root, change, novelty, detail))
    kinds = list(map(type, map(itemgetter(1), unchanged)))
    module_kinds = {kind for kind in set(kinds) if issubclass(kind, probe.module_types)}
    is_module = list(map(module_kinds.__contains__, kinds))

    def walk_part(chosen: Iterable[bool]) -> tuple[Reach, list[int]]:
        """One walk of the chosen part of ``unchanged``; the positions map its ``Hit.owner`` back."""
        positions = list(compress(range(len(unchanged)), chosen))
        part = walk_together(list(map(unchanged.__getitem__, positions)), probe, skip)
        _mark_old(judged, part.reached)
        return part, positions

    walks = [walk_part(is_module)]
    if not _explained(judged, left_bytes):
        walks.append(walk_part(map(not_, is_module)))
    reached = set().union(*(part.reached for part, _ in walks))
    walked_hooks = [hook for part, _ in walks for hook in part.hooks]
    truncated = any(part.truncated for part, _ in walks)
    for owner, hits in _hidden_by_owner(walks, reached).items():
        name, value = unchanged[owner]
        root = made.get(owner) or Root(name, root_kind(value, probe), value, True, Origin.VARIABLE, 1)
        root.reach = Reach(storages=hits, hooks=walked_hooks, truncated=truncated)
        judged.append(Judged(root, Change.UNCHANGED, dict.fromkeys(hits, UNKNOWN)))
    hooks = walked_hooks + [hook for entry in judged for hook in entry.root.reach.hooks]
    if truncated and judged:
        judged[0].root.reach.truncated = True
    return judged, hooks


def _hidden_by_owner(walks: list[tuple[Reach, list[int]]], reached: set[Any]) -> dict[int, dict[Any, Hit]]:
    """What the unchanged names reach only through their modules' hooks and attributes (``Reach.late``)
    and nothing reached otherwise, by the owner's position in the unchanged names."""
    hidden: dict[int, dict[Any, Hit]] = {}
    for part, positions in walks:
        for key, hit in part.late.items():
            if key not in reached:
                hidden.setdefault(positions[hit.owner], {})[key] = hit
    return hidden


ALLOCATION_ROUNDING_BYTES = 512
"""PyTorch's caching allocator rounds every allocation up to a multiple of 512 bytes, and its allocated
count is of those rounded blocks: a cell's allocated delta is the bytes of the storages it made plus less
than 512 bytes per storage (``benchmarks/leaks.py``'s cases on the H100: 40 losses left 10 KiB more than
their storages). So the new storages account for what the cell left when they are at most that much less.
A storage counted as new that is old (a weight a new graph saved) makes them more than the cell left; a
workspace a library made in the cell (cuBLAS's, megabytes) or anything held out of sight makes them less:
either way, everything is walked."""


def _mark_old(judged: list[Judged], reached: Container[object]) -> None:
    for entry in judged:
        for key in entry.novelty:
            if key in reached:
                entry.novelty[key] = OLD


def _explained(judged: list[Judged], left_bytes: int | None) -> bool:
    """Whether the new storages under the changed roots account for all the cell left (see ``judge_namespace``)."""
    if left_bytes is None or not judged:
        return False
    sizes: dict[Any, int] = {}
    for entry in judged:
        for key, novelty in entry.novelty.items():
            if novelty == NEW:
                sizes[key] = entry.root.reach.storages[key].nbytes
    short = left_bytes - sum(sizes.values())
    return 0 <= short < ALLOCATION_ROUNDING_BYTES * max(len(sizes), 1)
