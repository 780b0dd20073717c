"""What one cell left behind on the device: who holds it, whether it is a leak, and what to change.

**Before the cell** ``NamespaceSnapshot.take`` records, per name, the object's id and a cheap
fingerprint of its size: a container's length, an optimizer's number of states, a module's first
parameter's storage and gradient, a tensor's gradient, an object's attributes (ids and lengths, one
level deep); and which references IPython kept. No object is walked and no reference is kept, so
nothing is kept alive and a cell costs microseconds per name.

**After a cell that left more allocated than the threshold** the names whose fingerprint changed (and
IPython's references that appeared) are walked one by one, the unchanged ones together in one walk
(``fast_walk.walk_together``), and each storage is sorted by what the fingerprint says of the part of the
root it hangs under:

- *new*: under a name that is new or rebound, the items a list or dict gained (by position), an
  object's changed attributes, a module whose parameters moved or got gradients, an optimizer that
  gained state, an output-cache entry or traceback that appeared;
- *old*: under anything the fingerprint says is unchanged. Old wins: parameters that a loss's graph
  saved (``mat2`` of a linear layer) stay the model's;
- *unknown*: what an unchanged module keeps through its hooks or plain attributes, which the
  fingerprint cannot see grow. Unknown storages are counted (as "likely") only up to what the cell
  left and the new storages do not explain.

A new storage belongs to one holder: a variable before IPython's caches, a tensor held directly before
one reached through an autograd graph. What nothing explains is the remainder, shown, never hidden.
Each holder gets a cause: memory reached through autograd graphs, a module hook, IPython's output
cache or a failed cell's traceback is a leak; a module's parameters, an optimizer's state, gradients
and plain data are results, reported as what they are. ``advice.leak_advice`` says what to change.
"""

from __future__ import annotations

import time
import types
import warnings
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import compress, islice, repeat
from operator import itemgetter, ne, not_
from typing import Any

from ..collector import collector_paused
from ..units import MiB, format_bytes
from .holders import (
    EXCEPTION,
    FRAME,
    OUTPUT_CACHE,
    VARIABLE,
    Reference,
    Root,
    list_roots,
    user_items,
    root_kind,
    tensor_text,
)
from .probe import ModuleHook, TensorProbe, default_probe, grad_of
from .captures import capture_names
from .fast_walk import walk_together
from .type_codes import (
    ATOM_TYPES,
    ATOMS,
    EXCEPTION_CODE,
    FRAME_CODE,
    FUNCTION_CODE,
    MACHINERY_CODE,
    MAPPING_CODE,
    MODULE_CODE,
    OBJECT_CODE,
    OPAQUE_CODE,
    OPTIMIZER_CODE,
    SEQUENCE_CODE,
    SET_CODE,
    TENSOR_CODE,
    TRACEBACK_CODE,
    memo_by_type,
    type_code,
)
from .walk import (
    ATTRIBUTE,
    BUFFERS,
    GRADIENTS,
    GRAPH,
    GRAPH_SCALAR,
    HOOK,
    HOOKS,
    ITEM,
    MODULE_ATTRIBUTES,
    NO_GRAPH,
    PARAMETERS,
    STATE,
    TENSORS,
    Hit,
    Reach,
    describe_path,
    walk,
)

# Why 64 MiB: below it a cell's leftovers are the normal small change of a notebook (a loss, a batch
# of indices, cuBLAS's workspace on the first matmul: 8-32 MiB), and a leak that small needs over a
# hundred runs to fill even an 8 GiB card, where the across-runs growth flag catches it anyway. At
# 64 MiB the report already names the leaks users actually hit (a hook storing activations: +160 MiB, a
# list of 40 losses: +433 MiB), and a cell that allocates that much ran for milliseconds, so the walk
# (under 50 ms for 10,000 objects, benchmarks/leaks.py) is in proportion.
DEFAULT_THRESHOLD_BYTES = 64 * MiB
# Holders smaller than this (or than 1% of what the cell left) are summed into one line.
MIN_HOLDER_BYTES = 1 * MiB
_ATTRIBUTES_FINGERPRINTED = 64

_SEQUENCES = (list, tuple)
_UNORDERED = (set, frozenset)

# Causes: the first four are leaks.
GRAPH_CAUSE = "autograd graph"
HOOK_CAUSE = "module hook"
OUTPUT_CACHE_CAUSE = "output cache"
TRACEBACK_CAUSE = "traceback"
MODEL = "model"
OPTIMIZER_STATE = "optimizer state"
GRADIENTS_CAUSE = "gradients"
DATA = "data"
MODULE_ATTRIBUTES_CAUSE = "module attributes"
LEAK_CAUSES = (GRAPH_CAUSE, HOOK_CAUSE, OUTPUT_CACHE_CAUSE, TRACEBACK_CAUSE)

NEW, OLD, UNKNOWN = 2, 0, 1
_DIRECT = frozenset({TENSORS, PARAMETERS, BUFFERS, STATE, GRADIENTS, MODULE_ATTRIBUTES})


# -- before the cell ----------------------------------------------------------------------------
def _sized(value: Any) -> int:
    try:
        return len(value)
    except Exception:
        return -1


_CONTAINER_CODES = frozenset({MAPPING_CODE, SEQUENCE_CODE, SET_CODE})
_SIZED_TYPES = (list, tuple, dict, set)
# Why 64: a container's or object's first 64 children are fingerprinted (ids, and lengths of the
# containers among them) so that growth one level down is seen; past 64, a name is a big collection
# whose growth shows in its own length, and reading more would cost every cell (the snapshot is taken
# before each one) for what a notebook rarely does.
_CHILDREN_FINGERPRINTED = 64


@memo_by_type
def _grows_in_place(kind: type) -> bool:
    """Children whose length the fingerprint records: lists, tuples, dicts and deques (and subclasses:
    ``defaultdict(list)``), whose growth inside an unchanged container is what a leak looks like."""
    return issubclass(kind, (list, tuple, dict, deque))


# Types whose values the fingerprint records no length of (tensors, numbers, plain objects): where a
# container's children or an object's attributes are all of these, which is most of a namespace, its
# fingerprint is made by C loops (``issuperset``, ``zip``, ``map(id, ...)``) with no Python per child.
_LENGTHLESS: set[type] = set(ATOMS)
_CONTAINER_TYPES = (dict, list, tuple, deque, set, frozenset)


def _learn_lengthless(children: Iterable[Any]) -> None:
    if len(_LENGTHLESS) >= 8192:  # classes redefined in a loop: start again
        _LENGTHLESS.clear()
        _LENGTHLESS.update(ATOMS)
    for kind in set(map(type, children)).difference(_LENGTHLESS):  # the types not met before only
        if not issubclass(kind, _CONTAINER_TYPES):
            _LENGTHLESS.add(kind)


def _inner_sizes(children: Iterable[Any], count: int) -> tuple[tuple[int, int], ...]:
    """``(id, length)`` of the lists, dicts and deques among the first ``_CHILDREN_FINGERPRINTED``
    ``children`` (``count`` of them): what lets ``history['losses'].append(...)`` be seen in ``history``."""
    first = list(islice(children, _CHILDREN_FINGERPRINTED)) if count > _CHILDREN_FINGERPRINTED else list(children)
    if _LENGTHLESS.issuperset(map(type, first)):
        return ()
    _learn_lengthless(first)
    grows = _grows_in_place
    return tuple([(id(child), len(child)) for child in first if grows(type(child))])


_PLAIN_CODES = frozenset({OPAQUE_CODE, MACHINERY_CODE, EXCEPTION_CODE, TRACEBACK_CODE, FRAME_CODE, FUNCTION_CODE})
_PLAIN = -1  # a code of our own: atoms and the plain codes, whose fingerprint is their id alone
_DUCK_TENSOR = -2  # and another: tensor types without PyTorch's attributes (fakes, tensor-likes)


def _fingerprint(value: Any, probe: TensorProbe, codes: dict[type, int] | None = None) -> tuple[Any, ...]:
    """The id and what can grow in place without the id changing; cheap (one type lookup), never raises.
    ``codes`` caches type codes across one namespace's names."""
    ident = id(value)
    kind = type(value)
    if kind in ATOM_TYPES:
        return (ident,)
    code = codes.get(kind) if codes is not None else None
    if code is None:
        code = type_code(kind, probe)
        if codes is not None:
            codes[kind] = code
    try:
        if code == TENSOR_CODE:  # the commonest first
            return _tensor_fingerprint(value)
        if code in _PLAIN_CODES:
            return (ident,)
        if code == SET_CODE:
            return (ident, len(value))
        if code == MAPPING_CODE:
            size = len(value)
            return (ident, size, _inner_sizes(value.values(), size))
        if code == SEQUENCE_CODE:
            size = len(value)
            return (ident, size, _inner_sizes(value, size))
        if code == MODULE_CODE:
            first = _first_parameter(value)
            if first is None:
                return (ident, None, None)
            return (ident, probe.device_storage(first), id(grad_of(first)))
        if code == OPTIMIZER_CODE:
            return (ident, _sized(getattr(value, "state", ())))
        if code != OBJECT_CODE:
            return (ident,)
        attributes = getattr(value, "__dict__", None)
        if isinstance(attributes, dict):
            return (ident, _attribute_fingerprint(attributes, probe, codes if codes is not None else {}))
    except Exception:
        pass
    return (ident,)


def _attribute_fingerprint(attributes: dict[str, Any], probe: TensorProbe, codes: dict[type, int]) -> tuple[Any, ...]:
    """``(name, id, length or -1)`` of an object's first attributes; a length for containers only.

    Containers are told by type code (cached per type), not ``isinstance``: ``isinstance(tensor, list)``
    reads the tensor's ``__class__`` through PyTorch's attribute lookup, four times per attribute."""
    items = []
    for position, (name, attribute) in enumerate(attributes.items()):
        if position >= _ATTRIBUTES_FINGERPRINTED:
            break
        kind = type(attribute)
        code = codes.get(kind)
        if code is None:
            code = codes[kind] = _PLAIN if kind in ATOM_TYPES else type_code(kind, probe)
        items.append((name, id(attribute), len(attribute) if code in _CONTAINER_CODES else -1))
    return tuple(items)


def _first_parameter(module: Any, depth: int = 0) -> Any:
    """``next(iter(module.parameters()))`` without its generators (a tenth of the cost): the module's
    own first parameter, else its first child's, depth first, as ``named_parameters`` orders them."""
    own = getattr(module, "_parameters", None)
    children = getattr(module, "_modules", None)
    if not isinstance(own, dict) or not isinstance(children, dict) or depth > 64:
        return next(iter(module.parameters()), None)
    for parameter in own.values():
        if parameter is not None:
            return parameter
    for child in children.values():
        if child is not None:
            found = _first_parameter(child, depth + 1)
            if found is not None:
                return found
    return None


def _tensor_fingerprint(value: Any) -> tuple[int, int]:
    try:  # grad_of's test, by plain attribute reads: a third of getattr's cost on a tensor
        grad = value.grad if value.is_leaf or value.retains_grad else None
    except Exception:  # fakes and tensor-likes without is_leaf or retains_grad
        grad = grad_of(value)
    return (id(value), id(grad))


@dataclass(frozen=True)
class NamespaceSnapshot:
    """The namespace as a cell found it: fingerprints by name, and IPython's references by name."""

    names: Mapping[str, tuple[Any, ...]]
    references: frozenset[int]  # ids of what IPython kept

    @classmethod
    def take(
        cls,
        namespace: Mapping[str, Any],
        references: Iterable[Reference] = (),
        probe: TensorProbe | None = None,
    ) -> NamespaceSnapshot:
        probe = probe if probe is not None else default_probe()
        if probe is None:
            return cls({}, frozenset())
        with warnings.catch_warnings(), collector_paused():
            warnings.simplefilter("ignore")
            names = _fingerprints(list(namespace.items()), probe)
        return cls(names, frozenset(id(reference.value) for reference in references))


def _fingerprints(items: list[tuple[str, Any]], probe: TensorProbe) -> dict[str, tuple[Any, ...]]:
    """``_fingerprint`` of every value, equal to it name by name, in one loop.

    Taken before every cell in every-cell mode, on cells that leave nothing as on the rare one that
    leaves enough to attribute, so a namespace of 10,000 names must cost little: the kinds that are
    most of a namespace (atoms, functions, modules, tensors, lists and dicts) are fingerprinted here
    without a function call of their own; the rarer ones go through ``_fingerprint``.
    """
    codes: dict[type, int] = {}
    names: dict[str, tuple[Any, ...]] = {}
    lengthless = _LENGTHLESS.issuperset
    for name, value in items:
        kind = type(value)
        code = codes.get(kind)
        if code is None:
            code = _PLAIN if kind in ATOM_TYPES else type_code(kind, probe)
            if code == TENSOR_CODE and not all(hasattr(kind, name) for name in ("is_leaf", "retains_grad", "grad")):
                code = _DUCK_TENSOR  # read through grad_of: a failed attribute read costs more than getattr
            codes[kind] = _PLAIN if code in _PLAIN_CODES else code
            code = codes[kind]
        if code == _PLAIN:
            names[name] = (id(value),)
        elif code == TENSOR_CODE:
            try:  # _tensor_fingerprint, inline
                grad = value.grad if value.is_leaf or value.retains_grad else None
            except Exception:
                grad = grad_of(value)
            names[name] = (id(value), id(grad))
        elif code == _DUCK_TENSOR:
            names[name] = (id(value), id(grad_of(value)))
        elif code == SEQUENCE_CODE or code == MAPPING_CODE:
            try:  # _fingerprint's, inline
                size = len(value)
                children = value.values() if code == MAPPING_CODE else value
                if size <= _CHILDREN_FINGERPRINTED and lengthless(map(type, children)):
                    names[name] = (id(value), size, ())
                else:
                    names[name] = (id(value), size, _inner_sizes(children, size))
            except Exception:
                names[name] = _fingerprint(value, probe, codes)
        elif code == OBJECT_CODE:
            attributes = getattr(value, "__dict__", None)
            if type(attributes) is dict and len(attributes) <= _ATTRIBUTES_FINGERPRINTED:
                values = attributes.values()
                if lengthless(map(type, values)):  # _attribute_fingerprint's, by C loops
                    names[name] = (id(value), tuple(zip(attributes, map(id, values), repeat(-1))))
                    continue
            names[name] = _fingerprint(value, probe, codes)
        else:
            names[name] = _fingerprint(value, probe, codes)
    return names


# -- the result ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class LeftHolder:
    """One holder of what the cell left, with the cause and what to change.

    ``nbytes`` is what the cell left through it (storages attributed to it and no other holder);
    ``by_category`` splits it (``"autograd graph"``: saved tensors of graphs; ``"tensors"``: tensors
    held directly...). ``change`` says what happened to the name: ``"new"``, ``"rebound"``,
    ``"grew"``, ``"changed"`` (in place) or ``"unchanged"`` (then ``likely`` is set: counted to explain
    what the new storages do not). ``also`` are other holders reaching the same storages, ``hooks``
    the module hooks that fill it.
    """

    name: str
    origin: str
    kind: str
    nbytes: int
    cause: str
    description: str
    change: str
    by_category: dict[str, int] = field(default_factory=dict)
    tensors: int = 0
    graph_tensors: int = 0
    scalar_graph_tensors: int = 0
    also: tuple[str, ...] = ()
    hooks: tuple[str, ...] = ()
    where: str = ""
    likely: bool = False
    advice: tuple[str, ...] = ()

    @property
    def leak(self) -> bool:
        return self.cause in LEAK_CAUSES

    @property
    def graph_bytes(self) -> int:
        return self.by_category.get(GRAPH, 0)


@dataclass(frozen=True)
class LeftBehind:
    """What a cell left allocated and who holds it.

    ``left_bytes`` is the allocator's growth over the cell; ``holders`` name the part attributed (largest
    first), ``smaller_bytes`` sums holders under ``MIN_HOLDER_BYTES``, and ``remainder_bytes`` is what
    nothing explains (PyTorch's internal caches such as cuBLAS's workspace, tensors only C++ or an
    object the walk does not enter keeps). ``elapsed_s`` is what attributing cost; ``truncated`` says a
    walk stopped at its bound.
    """

    left_bytes: int
    holders: tuple[LeftHolder, ...]
    smaller_bytes: int = 0
    smaller_count: int = 0
    elapsed_s: float = 0.0
    truncated: bool = False

    @property
    def attributed_bytes(self) -> int:
        return sum(holder.nbytes for holder in self.holders) + self.smaller_bytes

    @property
    def remainder_bytes(self) -> int:
        return max(self.left_bytes - self.attributed_bytes, 0)

    @property
    def leaks(self) -> tuple[LeftHolder, ...]:
        return tuple(holder for holder in self.holders if holder.leak)

    @property
    def has_leak(self) -> bool:
        return bool(self.leaks)


# -- after the cell -----------------------------------------------------------------------------
@dataclass
class _Judged:
    """A root with what the fingerprint says of each part of it."""

    root: Root
    change: str
    novelty: dict[Any, int]  # storage -> NEW / OLD / UNKNOWN as this root reaches it
    detail: Any = None  # what ``_variable_change`` said besides the change


def _variable_change(root: Root, before: Mapping[str, tuple[Any, ...]], probe: TensorProbe) -> tuple[str, Any]:
    """``(change, detail)``: how the name's object differs from the snapshot."""
    name = root.name.removesuffix(".grad") if root.kind == "gradient" else root.name
    old = before.get(name)
    if old is None:
        return "new", None
    if root.kind == "gradient":
        return ("changed", None) if old[1:2] != (id(root.value),) else ("unchanged", None)
    value = root.value
    now = _fingerprint(value, probe)
    if now[0] != old[0]:
        return "rebound", None
    if now == old:
        return "unchanged", None
    if len(now) == 3 and len(old) == 3 and type_code(type(value), probe) in (SEQUENCE_CODE, MAPPING_CODE):
        return _container_change(value, now, old)
    if isinstance(value, (list, tuple, dict)) or type(value).__name__ == "deque":
        grown = len(now) > 1 and len(old) > 1 and now[1] > old[1]
        return ("grew", (old[1], {})) if grown else ("changed", None)
    if isinstance(value, (set, frozenset)):
        return "changed", None
    if isinstance(value, probe.module_types):
        moved = len(old) > 1 and now[1] != old[1]
        return "changed", ("moved" if moved else "gradients")
    if probe.is_tensor(value):
        return "changed", "gradients"
    if isinstance(value, probe.optimizer_types):
        return "changed", "state"
    if len(now) > 1 and len(old) > 1 and isinstance(now[1], tuple) and isinstance(old[1], tuple):
        earlier = {name: (ident, size) for name, ident, size in old[1]}
        changed: dict[str, int] = {}
        for attribute, ident, size in now[1]:
            previous = earlier.get(attribute)
            if previous is None or previous[0] != ident:
                changed[attribute] = -1  # new or rebound attribute: all of it is new
            elif previous[1] != size:
                changed[attribute] = previous[1]  # grown in place: the items past the old length
        return "changed", changed
    return "unchanged", None


def _container_change(value: Any, now: tuple[Any, ...], old: tuple[Any, ...]) -> tuple[str, Any]:
    """A list, tuple, dict or deque whose fingerprint changed: ``("grew", (old length, {position: old
    length of the child container there, or -1 for one that was not there}))`` when it gained items or
    a child container grew in place or was put where something else was (``history['losses'].append``,
    ``history['best'] = [...]``); ``("changed", None)`` when it shrank (what it holds can no longer be
    told apart by position); ``("unchanged", None)`` when only a child shrank or went."""
    old_length, old_sizes = old[1], dict(old[2])
    if now[1] < old_length:
        return "changed", None
    grown: dict[int, int] = {}
    children = value.values() if isinstance(value, Mapping) else value
    for position, child in enumerate(islice(children, min(old_length, _CHILDREN_FINGERPRINTED))):
        if not _grows_in_place(type(child)):
            continue
        length_before = old_sizes.get(id(child))
        if length_before is None:
            grown[position] = -1  # a container put where something else was: all it holds is new
        elif _sized(child) > length_before:
            grown[position] = length_before
    if now[1] > old_length or grown:
        return "grew", (old_length, grown)
    return "unchanged", None


def _novelty_of(hit: Hit, change: str, detail: Any) -> int:
    if change in ("new", "rebound"):
        return NEW
    if change == "unchanged":
        return UNKNOWN if _hidden(hit) else OLD
    if change == "grew":
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
    if detail == "moved":
        return UNKNOWN if _hidden(hit) else NEW
    if detail == "gradients":
        if hit.category == GRADIENTS:
            return NEW
        return UNKNOWN if _hidden(hit) else OLD
    if detail == "state":
        return NEW if hit.category == STATE else OLD
    if isinstance(detail, dict):
        if not hit.path or hit.path[0][0] != ATTRIBUTE or hit.path[0][1] not in detail:
            return OLD
        old_size = detail[hit.path[0][1]]
        if old_size < 0 or len(hit.path) < 2 or hit.path[1][0] != ITEM:
            return NEW
        return NEW if hit.path[1][2] >= old_size else OLD
    return NEW  # a set or a container that shrank and grew: what it holds cannot be told apart


def _hidden(hit: Hit) -> bool:
    """Reached through what a module keeps out of the fingerprint's sight: hooks, plain attributes."""
    return hit.category in (HOOKS, MODULE_ATTRIBUTES) or bool(hit.path and hit.path[0][0] == HOOK)


def _judge(
    namespace: Mapping[str, Any],
    references: Iterable[Reference] | Mapping[str, object],
    before: NamespaceSnapshot,
    probe: TensorProbe,
    skip: frozenset[int],
    left_bytes: int | None = None,
) -> tuple[list[_Judged], list[ModuleHook]]:
    """Walk the roots whose fingerprint changed one by one, and the unchanged ones in one walk: their
    storages are old, except what only their modules' hooks and attributes reach (unknown).

    The unchanged modules are walked first (their parameters are what a new graph most often saves,
    and their hooks are what a hook's leak is named by). When the storages the changed roots hold,
    less those, account for ``left_bytes`` (up to ``ALLOCATION_ROUNDING_BYTES``), the rest of the unchanged
    names is not walked: nothing is left for them to hold, and walking every name is most of the cost
    on a large namespace (``benchmarks/leaks.py``, part ``cost``)."""
    judged: list[_Judged] = []
    made: dict[int, Root] = {}  # position in ``unchanged`` -> the root already made for it
    earlier = before.names
    items = user_items(namespace)
    now = _fingerprints(items, probe)  # the snapshot's own loop: a name costs here what it cost there
    # Most names are decided here without a second look, by C loops: whether each fingerprint differs
    # from the one before the cell (a name that is new has ``None`` there), then the split by that.
    flags = list(map(ne, now.values(), map(earlier.get, now)))
    unchanged = list(compress(items, map(not_, flags)))
    roots = [Root(name, root_kind(value, probe), value, True, VARIABLE, 1) for name, value in compress(items, flags)]
    roots.extend(list_roots({}, references, probe))
    for root in roots:
        if root.user_variable:
            change, detail = _variable_change(root, before.names, probe)
        else:
            change, detail = ("unchanged" if id(root.value) in before.references else "new"), None
        if change == "unchanged":
            made[len(unchanged)] = root
            unchanged.append((root.name, root.value))
            continue
        root.reach = walk(root.value, probe, skip, True, root.name)
        novelty = {key: _novelty_of(hit, change, detail) for key, hit in root.reach.storages.items()}
        judged.append(_Judged(root, change, novelty, detail))
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
    hidden: dict[int, dict[Any, Hit]] = {}
    for part, positions in walks:
        for key, hit in part.late.items():
            if key not in reached:
                hidden.setdefault(positions[hit.owner], {})[key] = hit
    for owner, hits in hidden.items():
        name, value = unchanged[owner]
        root = made.get(owner) or Root(name, root_kind(value, probe), value, True, VARIABLE, 1)
        root.reach = Reach(storages=hits, hooks=walked_hooks, truncated=truncated)
        judged.append(_Judged(root, "unchanged", dict.fromkeys(hits, UNKNOWN)))
    hooks = walked_hooks + [hook for entry in judged for hook in entry.root.reach.hooks]
    if truncated and judged:
        judged[0].root.reach.truncated = True
    return judged, hooks


ALLOCATION_ROUNDING_BYTES = 512
"""PyTorch's caching allocator rounds every allocation up to a multiple of 512 bytes, and its allocated
count is of those rounded blocks: a cell's allocated delta is the bytes of the storages it made plus less
than 512 bytes per storage (``benchmarks/leaks.py``'s cases on the H100: 40 losses left 10 KiB more than
their storages). So the new storages account for what the cell left when they are at most that much less.
A storage counted as new that is old (a weight a new graph saved) makes them more than the cell left; a
workspace a library made in the cell (cuBLAS's, megabytes) or anything held out of sight makes them less:
either way, everything is walked."""


def _mark_old(judged: list[_Judged], reached: Any) -> None:
    for entry in judged:
        for key in entry.novelty:
            if key in reached:
                entry.novelty[key] = OLD


def _explained(judged: list[_Judged], left_bytes: int | None) -> bool:
    """Whether the new storages under the changed roots account for all the cell left (see ``_judge``)."""
    if left_bytes is None or not judged:
        return False
    sizes: dict[Any, int] = {}
    for entry in judged:
        for key, novelty in entry.novelty.items():
            if novelty == NEW:
                sizes[key] = entry.root.reach.storages[key].nbytes
    short = left_bytes - sum(sizes.values())
    return 0 <= short < ALLOCATION_ROUNDING_BYTES * max(len(sizes), 1)


def _rank(root: Root, hit: Hit) -> tuple[int, int]:
    """Lower owns a storage: a variable before IPython's caches, direct before hooks before graphs."""
    origin = 0 if root.user_variable else (1 if root.origin == OUTPUT_CACHE else 2)
    category = 0 if hit.category in _DIRECT else (1 if hit.category == HOOKS else 2)
    return origin, category


def _container_kind(value: Any) -> str | None:
    for kind in (list, tuple, dict, set, frozenset):
        if isinstance(value, kind):
            return kind.__name__
    return "deque" if type(value).__name__ == "deque" else None


def _grown_child(entry: _Judged, hits: list[Hit], probe: TensorProbe) -> Root | None:
    """The child of an unchanged-identity container that all of its counted memory hangs under, when
    that child grew in place (``history['losses']`` after ``history['losses'].append(loss)``), as a
    root named by its path; else ``None`` (the container is the holder)."""
    if entry.change != "grew" or not isinstance(entry.detail, tuple) or not entry.root.user_variable:
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
    return Root(describe_path(entry.root.name, (step,)), root_kind(child, probe), child, True, VARIABLE, 1)


def _linked_hooks(root: Root, hooks: Sequence[ModuleHook]) -> tuple[str, ...]:
    """Hooks that fill this variable: ones naming it as a global, or holding it (closure, bound instance)."""
    if not root.user_variable:
        return ()
    linked = []
    for hook in hooks:
        if root.name in hook.global_names or any(captured is root.value for captured in hook.captured):
            linked.append(hook.describe())
    return tuple(dict.fromkeys(linked))


def _captured(hit: Hit) -> str | None:
    """How a callable on the hit's path keeps it (the steps ``walk.function_captures`` names): ``"default
    argument"``, ``"closure"``, ``"bound object"``, ``"partial argument"``, or ``None``."""
    for kind, name, _ in hit.path:
        if kind == ATTRIBUTE and isinstance(name, str):
            if name.startswith(("__defaults__", "__kwdefaults__")):
                return "default argument"
            if name.startswith("__closure__"):
                return "closure"
            if name in ("__self__", "__func__"):
                return "bound object"
            if name.startswith(("args[", "keywords[")):  # an attribute's name has no bracket: a partial's
                return "partial argument"
    return None


def _largest_path(root: Root, hits: list[Hit]) -> str:
    """Where under an object most of its new memory hangs: ``tracker.history``, ``forward hook f on model.fc``.

    Containers get none: their items are the holder's own parts, named by its description; except
    functions in a container that keep tensors in their defaults or closures (``callbacks[0].__defaults__[0]``),
    which nothing in the container's own items would name.
    """
    if _container_kind(root.value) is not None:
        captured = [hit for hit in hits if _captured(hit) and len(hit.path) >= 2]
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


def _cause(
    root: Root, categories: dict[str, int], graph_direct: int, direct: int, hooks: tuple[str, ...], hits: list[Hit]
) -> str:
    total = sum(categories.values())
    if root.origin == OUTPUT_CACHE:
        return OUTPUT_CACHE_CAUSE
    if root.origin in (EXCEPTION, FRAME):
        return TRACEBACK_CAUSE
    if hooks or categories.get(HOOKS, 0) * 2 >= total:
        return HOOK_CAUSE
    if categories.get(MODULE_ATTRIBUTES, 0) * 2 >= total and any(hit.path and hit.path[0][0] == HOOK for hit in hits):
        return HOOK_CAUSE
    graph = categories.get(GRAPH, 0)
    # A tensor whose graph a backward already freed holds only itself: data, not a graph leak.
    if graph and (graph * 2 >= total or (direct and graph_direct * 2 >= direct)):
        return GRAPH_CAUSE
    if categories.get(PARAMETERS, 0) + categories.get(BUFFERS, 0) > 0:
        return MODEL  # a model built or moved here, with whatever gradients it also got
    largest = max(categories, key=lambda category: categories[category])
    return {
        PARAMETERS: MODEL,
        BUFFERS: MODEL,
        STATE: OPTIMIZER_STATE,
        GRADIENTS: GRADIENTS_CAUSE,
        MODULE_ATTRIBUTES: MODULE_ATTRIBUTES_CAUSE,
        HOOKS: HOOK_CAUSE,
        GRAPH: GRAPH_CAUSE,
    }.get(largest, DATA)


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def _description(root: Root, cause: str, holder: dict[str, Any]) -> str:
    categories: dict[str, int] = holder["categories"]
    graph = categories.get(GRAPH, 0)
    tensors = holder["tensors"]
    graph_tensors = holder["graph_tensors"]
    value = root.value
    container = _container_kind(value)
    saved = f"{format_bytes(graph)} of saved activations" if graph else ""
    if root.origin == OUTPUT_CACHE:
        tensor_like = hasattr(value, "shape") and hasattr(value, "dtype")
        what = f"tensor {tensor_text(value)}" if tensor_like else type(value).__name__
        return f"a cell's value kept by IPython's output cache ({what})"
    if root.origin in (EXCEPTION, FRAME):
        where = f"locals of {root.name}" if root.origin == FRAME else root.name
        return f"{where}, kept by the failed cell's traceback"
    if root.kind == "module":
        parts = [
            f"{label} {format_bytes(categories[label])}"
            for label in (PARAMETERS, GRADIENTS, BUFFERS, MODULE_ATTRIBUTES, HOOKS, GRAPH)
            if categories.get(label)
        ]
        return f"{type(value).__name__}: " + ", ".join(parts)
    if root.kind == "optimizer":
        return f"{type(value).__name__} state: {_plural(holder['storages'], 'tensor')}"
    if root.kind == "gradient":
        return f"gradient {tensor_text(value)}"
    if root.kind == "tensor":
        text = f"tensor {tensor_text(value)}"
        if graph_tensors:
            text += " holding its autograd graph" + (f", {saved}" if saved else "")
        return text
    captured = sorted({kind for kind in map(_captured, holder["hits"]) if kind is not None})
    if captured and all(_captured(hit) for hit in holder["hits"]):
        kept = _plural(tensors or holder["storages"], "tensor")
        if isinstance(value, types.FunctionType):
            names = capture_names(value)
            variables = dict.fromkeys(names.get(str(hit.path[0][1]), "?") for hit in holder["hits"] if hit.path)
            how = " and ".join(
                f"its {kind + 's' if kind in ('default argument', 'partial argument') else kind}" for kind in captured
            )
            return f"function {value.__qualname__} keeping {kept} in {how} ({', '.join(variables)})"
        if container is not None:
            functions = len({hit.position for hit in holder["hits"]})
            owner = "its" if functions == 1 else "their"
            plural = "s" if functions > 1 else ""
            how = " and ".join(
                f"{owner} {kind + 's' if kind in ('default argument', 'partial argument') else kind + plural}"
                for kind in captured
            )
            return f"{container} of {_plural(functions, 'function')} keeping {kept} in {how}"
    if container is not None:
        noun = (
            f"{container} of {_plural(tensors, 'tensor')}"
            if tensors
            else f"{container} reaching {_plural(holder['storages'], 'storage')}"
        )
        if graph_tensors:
            owner = "its" if tensors == 1 else "their"
            noun += (
                f" holding {owner} autograd graphs"
                if graph_tensors == tensors
                else f" ({graph_tensors} holding autograd graphs)"
            )
            noun += f", {saved}" if saved else ""
        return noun
    text = f"{type(value).__name__} reaching {_plural(tensors or holder['storages'], 'tensor')}"
    if graph_tensors:
        text += " with autograd graphs" + (f", {saved}" if saved else "")
    return text


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
        judged, hooks = _judge(namespace, references, before, probe, skip, left_bytes)

    verdict: dict[Any, int] = {}
    for entry in judged:
        for key, novelty in entry.novelty.items():
            verdict[key] = min(verdict.get(key, NEW), novelty)
    owners: dict[Any, tuple[tuple[int, int], int]] = {}  # storage -> (rank, index of the owning root)
    reachers: dict[Any, list[int]] = {}
    for index, entry in enumerate(judged):
        for key, hit in entry.root.reach.storages.items():
            if verdict[key] == OLD:
                continue
            reachers.setdefault(key, []).append(index)
            rank = _rank(entry.root, hit)
            if key not in owners or rank < owners[key][0]:
                owners[key] = (rank, index)

    certain = sum(
        judged[index].root.reach.storages[key].nbytes for key, (_, index) in owners.items() if verdict[key] == NEW
    )
    unexplained = max(left_bytes - certain, 0)
    counted: set[Any] = {key for key in owners if verdict[key] == NEW}
    likely_roots: set[int] = set()
    # Unknown storages (an unchanged module's hooks and attributes), hooks first, up to what is unexplained.
    unknown = sorted(
        (key for key in owners if verdict[key] == UNKNOWN),
        key=lambda key: (judged[owners[key][1]].root.reach.storages[key].category != HOOKS, owners[key][1]),
    )
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
        if hit.category == TENSORS:
            holder["tensors"] += 1
            holder["graph_tensors"] += hit.graph != NO_GRAPH
            holder["scalars"] += hit.graph == GRAPH_SCALAR
        holder["also"].update(judged[other].root.name for other in reachers[key] if other != index)

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
        graph_direct = sum(hit.nbytes for hit in holder["hits"] if hit.category == TENSORS and hit.graph != NO_GRAPH)
        direct = categories.get(TENSORS, 0)
        cause = _cause(root, categories, graph_direct, direct, linked, holder["hits"])
        # A container's new memory all under one child that grew in place is named by its path.
        shown = _grown_child(judged[index], holder["hits"], probe) or root
        where = _largest_path(shown, holder["hits"])
        hook_steps = tuple(
            dict.fromkeys(str(hit.path[0][1]) for hit in holder["hits"] if hit.path and hit.path[0][0] == HOOK)
        )
        made = LeftHolder(
            name=shown.name,
            origin=root.origin,
            kind=_container_kind(shown.value) or shown.kind if root.user_variable else root.kind,
            nbytes=nbytes,
            cause=cause,
            description=_description(shown, cause, holder),
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
        holders.append(_with_advice(made))
    holders.sort(key=lambda h: (-h.nbytes, h.name))
    return LeftBehind(
        left_bytes=left_bytes,
        holders=tuple(holders),
        smaller_bytes=smaller_bytes,
        smaller_count=smaller_count,
        elapsed_s=time.perf_counter() - started,
        truncated=any(entry.root.reach.truncated for entry in judged),
    )


def _with_advice(holder: LeftHolder) -> LeftHolder:
    from dataclasses import replace

    from ..advice import leak_advice  # advice reads this module's vocabulary: import it late

    return replace(holder, advice=leak_advice(holder))
