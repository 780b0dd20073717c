"""What one cell left behind on the device: who holds it, whether it is a leak, and what to change.

**Before the cell** ``snapshot.NamespaceSnapshot.take`` fingerprints every name, walking nothing and
keeping nothing alive. **After a cell that left more allocated than the threshold**
(``DEFAULT_THRESHOLD_BYTES``), ``judge`` walks the names whose fingerprint changed and sorts each
storage they reach as *new*, *old* or *unknown* to the cell; ``left_behind`` (here) gives each storage
not old to one holder and names the holders.

A new storage belongs to one holder: a variable before IPython's caches, a tensor held directly before
one reached through an autograd graph. Unknown storages (an unchanged module's hooks and attributes)
are counted (as "likely") only up to what the cell left and the new storages do not explain. What
nothing explains is the remainder, shown, never hidden. Each holder gets a cause (``causes``: memory
reached through autograd graphs, a module hook, IPython's output cache or a failed cell's traceback is
a leak; a module's parameters, an optimizer's state, gradients and plain data are results), its
description and what to change (``text``), in the records of ``left_records``.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from ..collector import collector_paused
from ..units import MiB
from .causes import cause_of
from .holders import Origin, Reference, Root, root_kind
from .judge import NEW, OLD, UNKNOWN, Change, Judged, judge_namespace
from .left_records import LeftBehind, LeftHolder
from .probe import ModuleHook, TensorProbe, default_probe
from .snapshot import NamespaceSnapshot
from .text import captured_by, container_kind, describe_holder, leak_advice
from .walk import ATTRIBUTE, GRAPH_SCALAR, HOOK, ITEM, NO_GRAPH, Hit, ReachedAs, describe_path

__all__ = [
    "DEFAULT_THRESHOLD_BYTES",
    "MIN_HOLDER_BYTES",
    "LeftBehind",
    "LeftHolder",
    "NamespaceSnapshot",
    "left_behind",
]

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
    judged: list[Judged], verdict: Mapping[Any, int]
) -> tuple[dict[Any, tuple[tuple[int, int], int]], dict[Any, list[int]]]:
    """Each storage the cell may have left (not ``OLD``): the root that owns it (storage -> (rank, index
    of the root), the best ``_rank``) and every root that reaches it (storage -> indexes)."""
    owners: dict[Any, tuple[tuple[int, int], int]] = {}
    reachers: dict[Any, list[int]] = {}
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
    counted: set[Any],
    owners: Mapping[Any, tuple[tuple[int, int], int]],
    reachers: Mapping[Any, list[int]],
) -> dict[int, dict[str, Any]]:
    """What each owning root holds of the storages counted: bytes by category, tensor, graph and storage
    counts, the hits, and the names of the other roots that reach them."""
    gathered: dict[int, dict[str, Any]] = {}
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
    namespace: Mapping[str, Any],
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

    verdict: dict[Any, int] = {}
    for entry in judged:
        for key, novelty in entry.novelty.items():
            verdict[key] = min(verdict.get(key, NEW), novelty)
    owners, reachers = _owners(judged, verdict)

    certain = sum(
        judged[index].root.reach.storages[key].nbytes for key, (_, index) in owners.items() if verdict[key] == NEW
    )
    unexplained = max(left_bytes - certain, 0)
    counted: set[Any] = {key for key in owners if verdict[key] == NEW}
    likely_roots: set[int] = set()
    # Unknown storages (an unchanged module's hooks and attributes), hooks first, up to what is unexplained.
    def hooks_first(key: object) -> tuple[bool, int]:
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
