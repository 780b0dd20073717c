"""Who holds device memory now: the user's variables and what IPython keeps, each with its bytes.

Every root is walked by ``walk.walk`` (containers, objects, modules and their hooks, optimizers'
state, exceptions and frames, autograd graphs); what each reaches is then compared across roots, so
a holder also says how much of it no other root reaches (what deleting it would free). ``%oomfix``'s
diagnosis lists these holders; ``left.left_behind`` starts from the same walk to name what one cell
left.
"""

from __future__ import annotations

import types
import warnings
from collections.abc import Collection, Iterable, Mapping
from itertools import compress, repeat
from operator import itemgetter
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from ..units import format_bytes
from .probe import StorageKey, TensorProbe, default_probe, grad_of
from .walk import (
    ATOMS,
    EXCEPTION_CODE,
    FRAME_CODE,
    MACHINERY_PREFIXES,
    MODULE_CODE,
    OPAQUE,
    OPTIMIZER_CODE,
    Reach,
    ReachedAs,
    TENSOR_CODE,
    TRACEBACK_CODE,
    memo_by_type,
    type_code,
    walk,
)

# Names IPython itself puts in the user namespace: its output cache and input history are reported
# under their own holders (from ``ipython_state.ipython_references``), the rest hold no tensors.
from ..ipython_names import IPYTHON_NAME_PATTERN as _IPYTHON_NAME_PATTERN
from ..ipython_names import IPYTHON_NAMES as _IPYTHON_NAMES
# What IPython keeps, named by where it comes from: ``ipython_state`` lists them, the walk takes them as roots.
from ..ipython_state import Origin, Reference


class HolderKind(StrEnum):
    """What a holder is, shown beside its name (``%oomfix``'s table) and matched to what to advise.

    ``OBJECT`` is a container or object reaching tensors; what a cell left names a container by its
    type instead (``LIST``...``DEQUE``, from ``text.container_kind``). ``IPYTHON`` is the output cache
    or the execution result; ``TRACEBACK`` exceptions, tracebacks and their frames.
    """

    TENSOR = "tensor"
    MODULE = "module"
    OPTIMIZER = "optimizer"
    GRADIENT = "gradient"
    OBJECT = "object"
    IPYTHON = "ipython"
    TRACEBACK = "traceback"
    LIST = "list"
    TUPLE = "tuple"
    DICT = "dict"
    SET = "set"
    FROZENSET = "frozenset"
    DEQUE = "deque"


def as_references(refs: Iterable[Reference] | Mapping[str, object]) -> list[Reference]:
    """``Reference``s as given, or made from a ``{name: object}`` mapping (tracebacks and frames are
    taken as the failed cell's, anything else as the output cache)."""
    import types

    if isinstance(refs, Mapping):
        made = []
        for name, value in refs.items():
            if isinstance(value, types.FrameType):
                origin = Origin.FRAME
            elif isinstance(value, (BaseException, types.TracebackType)):
                origin = Origin.EXCEPTION
            else:
                origin = Origin.OUTPUT_CACHE
            made.append(Reference(name, origin, value))
        return made
    return list(refs)


@dataclass(frozen=True)
class Holder:
    """One root through which device memory is reachable.

    ``name`` is the variable's name or the IPython reference's (several references to one object are
    one holder, their names joined by `` / ``); ``origin`` where it comes from; ``kind`` what it is
    (``HolderKind``: a tensor, module, optimizer, gradient, object, IPython's cache or a traceback).

    ``cuda_bytes`` counts each storage reachable through it once; ``graph_bytes`` is the part first
    reached through autograd graphs (saved activations). ``exclusive_bytes`` is the part no other root
    reaches: for a variable, storages no other variable reaches (what ``--del NAME`` plus the cleanup
    would free); for what IPython holds, storages no variable reaches (what the cleanup frees).
    """

    name: str
    kind: HolderKind
    cuda_bytes: int
    user_variable: bool
    exclusive_bytes: int = 0
    tensor_count: int = 0
    detail: str = ""
    origin: Origin = Origin.VARIABLE
    occurrence: int = 1
    graph_bytes: int = 0
    type_name: str = ""
    # Python's and IPython's own names for what holds it (``sys.last_exc``, a frame of
    # ``Module._call_impl()``): kept for ``-o`` and a report's collapsed details, never in its text.
    internals: str = ""

    @property
    def label(self) -> str:
        """The name as shown: ``opt (Adam state)``, ``frame of f() #2 (from the failed cell's traceback)``."""
        if self.kind is HolderKind.OPTIMIZER and self.type_name:
            return f"{self.name} ({self.type_name} state)"
        if self.origin is Origin.FRAME:
            return Reference(self.name, Origin.FRAME, None, self.occurrence).label
        return self.name

    def describe(self) -> str:
        """One line: name, size and what makes it up."""
        extra = f" ({self.detail})" if self.detail else ""
        return f"{self.label}: {format_bytes(self.cuda_bytes)}{extra}"


class Holders(list[Holder]):
    """The largest holders, plus totals that per-holder figures cannot give (they overlap).

    ``namespace_bytes``: bytes reachable from the user's variables; ``ipython_only_bytes``: bytes
    reachable only through what IPython keeps (what releasing it frees); ``cache_only_bytes``: the part
    of those reachable through IPython's output cache and last result, as opposed to a failed cell's own
    exception and traceback frames.
    """

    namespace_bytes: int = 0
    ipython_only_bytes: int = 0
    cache_only_bytes: int = 0


def is_user_name(name: str, value: object) -> bool:
    """A variable of the user's own: not IPython's names, and not a handle on the machinery
    (``ip = get_ipython()`` reaches every namespace; our own recorder or results are not the user's data)."""
    if name in _IPYTHON_NAMES or (name[:1] == "_" and _IPYTHON_NAME_PATTERN.match(name)):
        return False
    return _is_user_type(type(value))


def user_items(namespace: Mapping[str, object]) -> list[tuple[str, object]]:
    """``(name, value)`` of the namespace's user variables (``is_user_name``), in its order.

    Run on every name after a measured cell, so by C loops (``map``, ``compress``): the per-type answer
    is looked up, and only names starting with ``_`` (few) are matched against IPython's patterns."""
    items = list(namespace.items())
    keys = list(map(itemgetter(0), items))
    kinds = list(map(type, map(itemgetter(1), items)))
    user_types = set(filter(_is_user_type, set(kinds)))  # a few types: one call each, not one per name
    keep = list(map(user_types.__contains__, kinds))
    for index in compress(range(len(keys)), map(str.startswith, keys, repeat("_"))):
        if _IPYTHON_NAME_PATTERN.match(keys[index]) or keys[index] in _IPYTHON_NAMES:
            keep[index] = False
    for name in _IPYTHON_NAMES.intersection(keys):
        keep[keys.index(name)] = False
    return list(compress(items, keep))


@memo_by_type
def _is_user_type(kind: type) -> bool:
    if issubclass(kind, types.FunctionType):
        return True  # a function the notebook made keeps its defaults and closure alive (``walk``)
    if issubclass(kind, OPAQUE):
        return False
    module = getattr(kind, "__module__", "") or ""
    return not module.startswith(MACHINERY_PREFIXES) and not module.startswith("jupyter_cudamem.")


_ROOT_KINDS = {
    TENSOR_CODE: HolderKind.TENSOR,
    MODULE_CODE: HolderKind.MODULE,
    OPTIMIZER_CODE: HolderKind.OPTIMIZER,
    EXCEPTION_CODE: HolderKind.TRACEBACK,
    TRACEBACK_CODE: HolderKind.TRACEBACK,
    FRAME_CODE: HolderKind.TRACEBACK,
}


def root_kind(value: object, probe: TensorProbe) -> HolderKind:
    return _ROOT_KINDS.get(type_code(type(value), probe), HolderKind.OBJECT)


def tensor_text(value: object) -> str:
    """``(4096, 1024), torch.float32`` for a tensor."""
    shape = getattr(value, "shape", None)
    dtype = getattr(value, "dtype", None)
    return ", ".join(str(x) for x in (tuple(shape) if shape is not None else None, dtype) if x is not None)


# What a module's description lists, in this order, each by its value: ``parameters 4.00 MiB``.
MODULE_PARTS = (
    ReachedAs.PARAMETERS,
    ReachedAs.GRADIENTS,
    ReachedAs.BUFFERS,
    ReachedAs.MODULE_ATTRIBUTES,
    ReachedAs.HOOKS,
    ReachedAs.GRAPH,
)


def _detail(kind: HolderKind, value: object, reach: Reach) -> str:
    count = len(reach.storages)
    parts = reach.by_category()
    graph = parts.get(ReachedAs.GRAPH, 0)
    graph_text = f"autograd graph {format_bytes(graph)} of saved tensors" if graph else ""
    if kind is HolderKind.MODULE:
        return ", ".join(f"{label} {format_bytes(parts[label])}" for label in MODULE_PARTS if parts.get(label))
    if kind is HolderKind.OPTIMIZER:
        return f"{count} state tensor{'s' if count != 1 else ''}"
    if kind in (HolderKind.TENSOR, HolderKind.GRADIENT):
        return "; ".join(part for part in (tensor_text(value), graph_text) if part)
    noun = type(value).__name__
    text = f"{noun} reaching {count} CUDA storage{'s' if count != 1 else ''}"
    return f"{text}; {graph_text}" if graph_text else text


# The reach of a root not walked (yet): shared, never changed (a walk assigns a new one).
NOT_WALKED = Reach()


@dataclass
class Root:
    """A root as walked: the holder it becomes, before the figures that need every root are known."""

    name: str
    kind: HolderKind
    value: Any
    user_variable: bool
    origin: Origin
    occurrence: int
    reach: Reach = field(default_factory=lambda: NOT_WALKED)


def list_roots(
    namespace: Mapping[str, object],
    refs: Iterable[Reference] | Mapping[str, object],
    probe: TensorProbe,
    split_gradients: bool = True,
) -> list[Root]:
    """Every user variable (with ``split_gradients``, a tensor's ``.grad`` as a root of its own) and
    every IPython reference (references to one object grouped into one root), not walked yet."""
    roots: list[Root] = []
    for name, value in list(namespace.items()):
        if not is_user_name(name, value):
            continue
        kind = root_kind(value, probe)
        roots.append(Root(name, kind, value, True, Origin.VARIABLE, 1))
        grad = grad_of(value) if kind is HolderKind.TENSOR and split_gradients else None
        if grad is not None and probe.is_tensor(grad):
            roots.append(Root(f"{name}.grad", HolderKind.GRADIENT, grad, True, Origin.VARIABLE, 1))
    grouped: dict[int, list[Reference]] = {}
    for reference in as_references(refs):
        if reference.value is None or isinstance(reference.value, ATOMS):
            continue
        grouped.setdefault(id(reference.value), []).append(reference)
    for group in grouped.values():
        first = group[0]
        kind = HolderKind.TRACEBACK if first.origin in (Origin.EXCEPTION, Origin.FRAME) else HolderKind.IPYTHON
        names = (r.label if r.origin is Origin.FRAME else r.name for r in group)
        name = " / ".join(names) if len(group) > 1 else first.name
        roots.append(Root(name, kind, first.value, False, first.origin, first.occurrence))
    return roots


def walk_roots(
    namespace: Mapping[str, object],
    refs: Iterable[Reference] | Mapping[str, object],
    probe: TensorProbe,
    extra_skip: Iterable[int] = (),
) -> list[Root]:
    """``list_roots``, each walked on its own (a tensor's walk leaves out its ``.grad``, a root of its
    own). Warnings raised while inspecting objects (torch.distributed deprecations) are silenced."""
    skip = frozenset({id(namespace), id(refs), *extra_skip})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        roots = list_roots(namespace, refs, probe)
        for root in roots:
            root.reach = walk(root.value, probe, skip, root.kind is not HolderKind.TENSOR, root.name)
    return roots


def find_holders(
    namespace: Mapping[str, object],
    ipython_refs: Iterable[Reference] | Mapping[str, object],
    top: int = 10,
    probe: TensorProbe | None = None,
    remade: Collection[str] = (),
) -> Holders:
    """The ``top`` largest holders of device memory, largest first; holders of nothing are left out.

    ``namespace`` is the user's namespace (IPython's own names in it are skipped: they are reported
    through ``ipython_refs``, ``Reference``s or a ``{"Out[3]": obj}`` mapping). ``probe`` defaults to
    PyTorch's types; without torch imported there is nothing to find. ``remade``: names a failed cell
    bound before it failed, which any rerun binds again: what they reach is held by a name (no cleanup
    frees it) but is the cell's own memory, so they are neither listed nor counted in ``namespace_bytes``.
    """
    probe = probe if probe is not None else default_probe()
    result = Holders()
    if probe is None:
        return result
    roots = walk_roots(namespace, ipython_refs, probe)
    listed = [root for root in roots if not (root.user_variable and root.name.removesuffix(".grad") in remade)]

    user_reach: dict[StorageKey, int] = {}  # storage -> how many user roots reach it
    for root in roots:
        if root.user_variable:
            for key in root.reach.storages:
                user_reach[key] = user_reach.get(key, 0) + 1
    namespace_storages: dict[StorageKey, int] = {}
    ipython_only: dict[StorageKey, int] = {}
    cache_only: dict[StorageKey, int] = {}
    for root in listed:
        for key, hit in root.reach.storages.items():
            if root.user_variable:
                namespace_storages[key] = hit.nbytes
            elif key not in user_reach:
                ipython_only[key] = hit.nbytes
                if root.kind is HolderKind.IPYTHON:
                    cache_only[key] = hit.nbytes

    holders = [_holder(root, user_reach) for root in listed if root.reach.total]
    holders.sort(key=lambda h: (-h.cuda_bytes, not h.user_variable, h.name))
    result.extend(holders[: max(top, 0)])
    result.namespace_bytes = sum(namespace_storages.values())
    result.ipython_only_bytes = sum(ipython_only.values())
    result.cache_only_bytes = sum(cache_only.values())
    return result


def _holder(root: Root, user_reach: Mapping[StorageKey, int]) -> Holder:
    """A walked root as a holder; ``user_reach`` says how many user variables reach each storage."""
    reach = root.reach
    if root.user_variable:
        exclusive = sum(hit.nbytes for key, hit in reach.storages.items() if user_reach[key] == 1)
    else:
        exclusive = sum(hit.nbytes for key, hit in reach.storages.items() if key not in user_reach)
    return Holder(
        name=root.name,
        kind=root.kind,
        cuda_bytes=reach.total,
        user_variable=root.user_variable,
        exclusive_bytes=exclusive,
        tensor_count=len(reach.storages),
        detail=_detail(root.kind, root.value, reach) if root.user_variable else "",
        origin=root.origin,
        occurrence=root.occurrence,
        graph_bytes=reach.by_category().get(ReachedAs.GRAPH, 0),
        type_name=type(root.value).__name__,
    )


def reaches_cuda(obj: object, probe: TensorProbe | None = None) -> bool:
    """Whether any device storage is reachable through ``obj`` (by the same walk as ``find_holders``)."""
    probe = probe if probe is not None else default_probe()
    if probe is None or obj is None or isinstance(obj, ATOMS):
        return False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return bool(walk(obj, probe).storages)
