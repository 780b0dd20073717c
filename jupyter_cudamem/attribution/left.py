"""What one cell left behind on the device: who holds it, whether it is a leak, and what to change.

**Before the cell** ``snapshot.NamespaceSnapshot.take`` fingerprints every name, walking nothing and
keeping nothing alive. **After a cell that left more allocated than the threshold**
(``DEFAULT_THRESHOLD_BYTES``), ``judge_namespace`` walks the names whose fingerprint changed one by one
(``walk.walk``) and the unchanged ones together (``fast_walk.walk_together``), and sorts each storage by
what the fingerprint says of the part of the root it hangs under:

- *new*: under a name that is new or rebound, the items a list or dict gained (by position), an
  object's changed attributes, a module whose parameters moved or got gradients, an optimizer that
  gained state, an output-cache entry or traceback that appeared;
- *old*: under anything the fingerprint says is unchanged. Old wins: parameters that a loss's graph
  saved (``mat2`` of a linear layer) stay the model's;
- *unknown*: what an unchanged module keeps through its hooks or plain attributes, which the
  fingerprint cannot see grow.

``left_behind`` then gives each storage not old to one holder and names the holders.

A new storage belongs to one holder: a variable before IPython's caches, a tensor held directly before
one reached through an autograd graph. Unknown storages (an unchanged module's hooks and attributes)
are counted (as "likely") only up to what the cell left and the new storages do not explain. What
nothing explains is the remainder, shown, never hidden. Each holder gets a cause (``text.cause_of``:
memory reached through autograd graphs, a module hook, IPython's output cache or a failed cell's traceback
is a leak; a module's parameters, an optimizer's state, gradients and plain data are results), its
description and what to change (``text``), in the records of ``left_records``.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Container, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from enum import Enum
from itertools import compress, islice
from operator import itemgetter, ne, not_
from typing import Any, TypeAlias

from ..collector import collector_paused
from ..units import MiB
from .fast_walk import walk_together
from .holders import HolderKind, Origin, Reference, Root, list_roots, root_kind, user_items
from .left_records import Change, LeftBehind, LeftHolder
from .probe import ModuleHook, StorageKey, TensorProbe, default_probe
from .snapshot import CHILDREN_FINGERPRINTED, Fingerprint, NamespaceSnapshot, fingerprint, fingerprints, grows_in_place, sized
from .text import Gathered, captured_by, cause_of, container_kind, describe_holder, leak_advice
from .walk import (
    ATTRIBUTE,
    GRAPH_SCALAR,
    HOOK,
    ITEM,
    MAPPING_CODE,
    NO_GRAPH,
    SEQUENCE_CODE,
    Hit,
    Reach,
    ReachedAs,
    describe_path,
    type_code,
    walk,
)

__all__ = [
    "DEFAULT_THRESHOLD_BYTES",
    "MIN_HOLDER_BYTES",
    "LeftBehind",
    "LeftHolder",
    "NamespaceSnapshot",
    "left_behind",
]


NEW, OLD, UNKNOWN = 2, 0, 1


class InPlace(Enum):
    """What changed in place in a module, tensor or optimizer: which of its storages are new."""

    MOVED = "moved"  # a module's parameters moved (``.to``, ``.cuda()``)
    GRADIENTS = "gradients"  # a module or tensor got gradients
    STATE = "state"  # an optimizer gained state


Detail: TypeAlias = "tuple[int, dict[int, int]] | InPlace | dict[str, int] | None"
"""What ``_variable_change`` says besides the change: a container that grew, its old length and its children
that grew (position: old length, -1 for new); what changed in place; an object's changed attributes (name:
old length, -1 for new)."""


@dataclass
class Judged:
    """A root with what the fingerprint says of each part of it."""

    root: Root
    change: Change
    novelty: dict[StorageKey, int]  # storage -> NEW / OLD / UNKNOWN as this root reaches it
    detail: Detail = None  # what ``_variable_change`` said besides the change


def _variable_change(root: Root, before: Mapping[str, Fingerprint], probe: TensorProbe) -> tuple[Change, Detail]:
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


def _container_change(value: Iterable[object], now: Fingerprint, old: Fingerprint) -> tuple[Change, Detail]:
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
    """``detail``: ``_variable_change``'s, its kind told by ``change`` (a ``GREW``'s is the tuple)."""
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
    namespace: Mapping[str, object],
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


def _hidden_by_owner(
    walks: list[tuple[Reach, list[int]]], reached: set[StorageKey]
) -> dict[int, dict[StorageKey, Hit]]:
    """What the unchanged names reach only through their modules' hooks and attributes (``Reach.late``)
    and nothing reached otherwise, by the owner's position in the unchanged names."""
    hidden: dict[int, dict[StorageKey, Hit]] = {}
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
    sizes: dict[StorageKey, int] = {}
    for entry in judged:
        for key, novelty in entry.novelty.items():
            if novelty == NEW:
                sizes[key] = entry.root.reach.storages[key].nbytes
    short = left_bytes - sum(sizes.values())
    return 0 <= short < ALLOCATION_ROUNDING_BYTES * max(len(sizes), 1)


# Why 64 MiB: below it a cell's leftovers are the normal small change of a notebook (a loss, a batch
# of indices, cuBLAS's workspace on the first matmul: 8-32 MiB), and a leak that small needs over a
# hundred runs to fill even an 8 GiB card, where the across-runs growth flag catches it anyway. At
# 64 MiB the report already names the leaks users actually hit (a hook storing activations: +160 MiB, a
# list of 40 losses: +433 MiB), and a cell that allocates that much ran for milliseconds, so the walk
# (under 50 ms for 10,000 objects, benchmarks/leaks.py) is in proportion.
DEFAULT_THRESHOLD_BYTES = 64 * MiB
# Holders smaller than this (or than 1% of what the cell left) are summed into one line.
MIN_HOLDER_BYTES = 1 * MiB

_DIRECT = frozenset(
    {
        ReachedAs.TENSORS,
        ReachedAs.PARAMETERS,
        ReachedAs.BUFFERS,
        ReachedAs.STATE,
        ReachedAs.GRADIENTS,
        ReachedAs.MODULE_ATTRIBUTES,
    }
)


def _rank(root: Root, hit: Hit) -> tuple[int, int]:
    """Lower owns a storage: a variable before IPython's caches, direct before hooks before graphs."""
    origin = 0 if root.user_variable else (1 if root.origin is Origin.OUTPUT_CACHE else 2)
    category = 0 if hit.category in _DIRECT else (1 if hit.category is ReachedAs.HOOKS else 2)
    return origin, category


def _grown_child(entry: Judged, hits: list[Hit], probe: TensorProbe) -> Root | None:
    """The child of an unchanged-identity container that all of its counted memory hangs under, when
    that child grew in place (``history['losses']`` after ``history['losses'].append(loss)``), as a
    root named by its path; else ``None`` (the container is the holder)."""
    if entry.change is not Change.GREW or not isinstance(entry.detail, tuple) or not entry.root.user_variable:
        return None
    old_length, children = entry.detail
    positions = {hit.position for hit in hits}
    if len(positions) != 1:
        return None
    position = positions.pop()
    if position >= old_length or position not in children:
        return None
    step = next((hit.path[0] for hit in hits if hit.path), None)
    if step is None or step[0] != ITEM:
        return None
    try:
        child = entry.root.value[step[1]]  # the dict's key, the list's index
    except Exception:
        return None
    return Root(describe_path(entry.root.name, (step,)), root_kind(child, probe), child, True, Origin.VARIABLE, 1)


def _linked_hooks(root: Root, hooks: Sequence[ModuleHook]) -> tuple[str, ...]:
    """Hooks that fill this variable: ones naming it as a global, or holding it (closure, bound instance)."""
    if not root.user_variable:
        return ()
    linked = []
    for hook in hooks:
        if root.name in hook.global_names or any(captured is root.value for captured in hook.captured):
            linked.append(hook.describe())
    return tuple(dict.fromkeys(linked))


def _largest_path(root: Root, hits: list[Hit]) -> str:
    """Where under an object most of its new memory hangs: ``tracker.history``, ``forward hook f on model.fc``.

    Containers get none: their items are the holder's own parts, named by its description; except
    functions in a container that keep tensors in their defaults or closures (``callbacks[0].__defaults__[0]``),
    which nothing in the container's own items would name.
    """
    if container_kind(root.value) is not None:
        captured = [hit for hit in hits if captured_by(hit) and len(hit.path) >= 2]
        if not captured or sum(hit.nbytes for hit in captured) * 2 < sum(hit.nbytes for hit in hits):
            return ""
        first = describe_path(root.name, min(captured, key=lambda hit: hit.position).path[:2])
        functions = len({hit.position for hit in captured})
        return first if functions == 1 else f"{first}, and the same in {functions - 1} more"
    sizes: dict[str, int] = {}
    for hit in hits:
        if hit.path and hit.path[0][0] in (ATTRIBUTE, HOOK):
            where = describe_path(root.name, hit.path[:1])
            sizes[where] = sizes.get(where, 0) + hit.nbytes
    if not sizes:
        return ""
    return max(sizes, key=lambda text: sizes[text])


def _owners(
    judged: list[Judged], verdict: Mapping[StorageKey, int]
) -> tuple[dict[StorageKey, tuple[tuple[int, int], int]], dict[StorageKey, list[int]]]:
    """Each storage the cell may have left (not ``OLD``): the root that owns it (storage -> (rank, index
    of the root), the best ``_rank``) and every root that reaches it (storage -> indexes)."""
    owners: dict[StorageKey, tuple[tuple[int, int], int]] = {}
    reachers: dict[StorageKey, list[int]] = {}
    for index, entry in enumerate(judged):
        for key, hit in entry.root.reach.storages.items():
            if verdict[key] == OLD:
                continue
            reachers.setdefault(key, []).append(index)
            rank = _rank(entry.root, hit)
            if key not in owners or rank < owners[key][0]:
                owners[key] = (rank, index)
    return owners, reachers


def _gather(
    judged: list[Judged],
    counted: set[StorageKey],
    owners: Mapping[StorageKey, tuple[tuple[int, int], int]],
    reachers: Mapping[StorageKey, list[int]],
) -> dict[int, Gathered]:
    """What each owning root holds of the storages counted: bytes by category, tensor, graph and storage
    counts, the hits, and the names of the other roots that reach them."""
    gathered: dict[int, Gathered] = {}
    for key in counted:
        index = owners[key][1]
        hit = judged[index].root.reach.storages[key]
        holder = gathered.setdefault(
            index,
            {
                "categories": {},
                "tensors": 0,
                "graph_tensors": 0,
                "scalars": 0,
                "storages": 0,
                "hits": [],
                "also": set(),
            },
        )
        holder["categories"][hit.category] = holder["categories"].get(hit.category, 0) + hit.nbytes
        holder["storages"] += 1
        holder["hits"].append(hit)
        if hit.category is ReachedAs.TENSORS:
            holder["tensors"] += 1
            holder["graph_tensors"] += hit.graph != NO_GRAPH
            holder["scalars"] += hit.graph == GRAPH_SCALAR
        holder["also"].update(judged[other].root.name for other in reachers[key] if other != index)
    return gathered


def left_behind(
    namespace: Mapping[str, object],
    references: Iterable[Reference] | Mapping[str, object],
    before: NamespaceSnapshot,
    left_bytes: int,
    probe: TensorProbe | None = None,
    skip_objects: Iterable[object] = (),
) -> LeftBehind:
    """Who holds the ``left_bytes`` a cell left (see the module docstring); ``before`` was taken when it
    started. ``references`` are IPython's (``ipython_state.ipython_references``), plus, where the caller
    has them, the cell's value and exception not yet handed to IPython. ``skip_objects`` are never
    entered (the shell's own namespace dict, when ``namespace`` is a copy of it)."""
    started = time.perf_counter()
    probe = probe if probe is not None else default_probe()
    if probe is None:
        return LeftBehind(left_bytes, (), elapsed_s=time.perf_counter() - started)
    skip = frozenset({id(namespace), *(id(obj) for obj in skip_objects)})
    with warnings.catch_warnings(), collector_paused():
        warnings.simplefilter("ignore")
        judged, hooks = judge_namespace(namespace, references, before, probe, skip, left_bytes)

    verdict: dict[StorageKey, int] = {}
    for entry in judged:
        for key, novelty in entry.novelty.items():
            verdict[key] = min(verdict.get(key, NEW), novelty)
    owners, reachers = _owners(judged, verdict)

    certain = sum(
        judged[index].root.reach.storages[key].nbytes for key, (_, index) in owners.items() if verdict[key] == NEW
    )
    unexplained = max(left_bytes - certain, 0)
    counted: set[StorageKey] = {key for key in owners if verdict[key] == NEW}
    likely_roots: set[int] = set()
    # Unknown storages (an unchanged module's hooks and attributes), hooks first, up to what is unexplained.
    def hooks_first(key: StorageKey) -> tuple[bool, int]:
        index = owners[key][1]
        return judged[index].root.reach.storages[key].category is not ReachedAs.HOOKS, index

    unknown = sorted((key for key in owners if verdict[key] == UNKNOWN), key=hooks_first)
    for key in unknown:
        if unexplained <= 0:
            break
        index = owners[key][1]
        counted.add(key)
        likely_roots.add(index)
        unexplained -= judged[index].root.reach.storages[key].nbytes

    all_hooks: dict[int, ModuleHook] = {}
    for hook in hooks:
        all_hooks.setdefault(id(hook.hook), hook)

    gathered = _gather(judged, counted, owners, reachers)

    minimum = max(MIN_HOLDER_BYTES, left_bytes // 100)
    holders: list[LeftHolder] = []
    smaller_bytes = smaller_count = 0
    for index, holder in gathered.items():
        root = judged[index].root
        categories = holder["categories"]
        nbytes = sum(categories.values())
        if nbytes < minimum:
            smaller_bytes += nbytes
            smaller_count += 1
            continue
        linked = _linked_hooks(root, list(all_hooks.values()))
        graph_direct = sum(
            hit.nbytes for hit in holder["hits"] if hit.category is ReachedAs.TENSORS and hit.graph != NO_GRAPH
        )
        direct = categories.get(ReachedAs.TENSORS, 0)
        cause = cause_of(root, categories, graph_direct, direct, linked, holder["hits"])
        # A container's new memory all under one child that grew in place is named by its path.
        shown = _grown_child(judged[index], holder["hits"], probe) or root
        where = _largest_path(shown, holder["hits"])
        hook_steps = tuple(
            dict.fromkeys(str(hit.path[0][1]) for hit in holder["hits"] if hit.path and hit.path[0][0] == HOOK)
        )
        made = LeftHolder(
            name=shown.name,
            origin=root.origin,
            kind=container_kind(shown.value) or shown.kind if root.user_variable else root.kind,
            nbytes=nbytes,
            cause=cause,
            description=describe_holder(shown, cause, holder),
            change=judged[index].change,
            by_category=dict(categories),
            tensors=holder["tensors"],
            graph_tensors=holder["graph_tensors"],
            scalar_graph_tensors=holder["scalars"],
            also=tuple(sorted(holder["also"]))[:5],
            hooks=linked + tuple(step for step in hook_steps if step not in linked),
            where=where,
            likely=index in likely_roots,
        )
        holders.append(replace(made, advice=leak_advice(made)))
    holders.sort(key=lambda h: (-h.nbytes, h.name))
    return LeftBehind(
        left_bytes=left_bytes,
        holders=tuple(holders),
        smaller_bytes=smaller_bytes,
        smaller_count=smaller_count,
        elapsed_s=time.perf_counter() - started,
        truncated=any(entry.root.reach.truncated for entry in judged),
    )
