"""The English text of what a cell left: each holder's cause, description and what to change about it.

``cause_of`` says why a holder holds what the cell left: memory reached through autograd graphs, a module
hook, IPython's output cache or a failed cell's traceback is a leak (``Cause.leak``); a module's parameters,
an optimizer's state, gradients, module attributes and plain data are results, reported as what they are.
``describe_holder`` names what a holder is (``list of 40 tensors holding their autograd graphs, 10.00
MiB of saved activations``) from the storages gathered under it; ``leak_advice`` says what to change,
matched to its cause (a result that is not a leak gets what to know about it). They live beside the
attribution rather than in ``report``: the description reads the holder's own objects (a function's
closure names, a tensor's shape), which the records keep no reference to, so it is written while the
attribution runs, and ``report`` only lays the records out.
"""

from __future__ import annotations

import types
from typing import TypedDict

from ..units import format_bytes
from .holders import MODULE_PARTS, HolderKind, Origin, Root, tensor_text
from .left_records import Cause, Change, LeftHolder
from .walk import ATTRIBUTE, HOOK, Capture, Hit, ReachedAs, capture_names


class Gathered(TypedDict):
    """What ``left.left_behind`` gathered under one holder of the storages it counts."""

    categories: dict[ReachedAs, int]  # bytes by category
    tensors: int  # tensors met outside graphs
    graph_tensors: int  # of those, the ones carrying an autograd graph
    scalars: int  # of those, single numbers (a loss, a metric)
    storages: int
    hits: list[Hit]
    also: set[str]  # the other roots that reach them


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


_CONTAINER_KINDS = (
    (list, HolderKind.LIST),
    (tuple, HolderKind.TUPLE),
    (dict, HolderKind.DICT),
    (set, HolderKind.SET),
    (frozenset, HolderKind.FROZENSET),
)


def container_kind(value: object) -> HolderKind | None:
    """The kind a container is shown by (``list``, ``dict``, ``deque``...); ``None`` for anything else."""
    for container, kind in _CONTAINER_KINDS:
        if isinstance(value, container):
            return kind
    return HolderKind.DEQUE if type(value).__name__ == "deque" else None


def captured_by(hit: Hit) -> Capture | None:
    """How a callable on the hit's path keeps it (the steps ``walk.function_captures`` names), or ``None``."""
    for kind, name, _ in hit.path:
        if kind == ATTRIBUTE and isinstance(name, str):
            if name.startswith(("__defaults__", "__kwdefaults__")):
                return Capture.DEFAULT_ARGUMENT
            if name.startswith("__closure__"):
                return Capture.CLOSURE
            if name in ("__self__", "__func__"):
                return Capture.BOUND_OBJECT
            if name.startswith(("args[", "keywords[")):  # an attribute's name has no bracket: a partial's
                return Capture.PARTIAL_ARGUMENT
    return None


def _capture_words(capture: Capture, functions: int = 1) -> str:
    """``default arguments``, ``closure`` (``closures`` for several functions): a function may have
    several arguments, and one closure, one bound object."""
    if capture in (Capture.DEFAULT_ARGUMENT, Capture.PARTIAL_ARGUMENT) or functions > 1:
        return f"{capture}s"
    return str(capture)


# -- what each holder is ------------------------------------------------------------------------------
def describe_holder(root: Root, cause: Cause, holder: Gathered) -> str:
    """What the holder is, from its root and what ``left.left_behind`` gathered under it (``holder``:
    bytes by category, tensor and storage counts, the hits): ``list of 40 tensors holding their
    autograd graphs, 10.00 MiB of saved activations``, ``Linear: parameters 4.00 MiB``."""
    categories: dict[ReachedAs, int] = holder["categories"]
    graph = categories.get(ReachedAs.GRAPH, 0)
    tensors = holder["tensors"]
    graph_tensors = holder["graph_tensors"]
    value = root.value
    container = container_kind(value)
    saved = f"{format_bytes(graph)} of saved activations" if graph else ""
    if root.origin is not Origin.VARIABLE:
        return _kept_by_ipython(root)
    if root.kind is HolderKind.MODULE:
        parts = [f"{label} {format_bytes(categories[label])}" for label in MODULE_PARTS if categories.get(label)]
        return f"{type(value).__name__}: " + ", ".join(parts)
    if root.kind is HolderKind.OPTIMIZER:
        return f"{type(value).__name__} state: {plural(holder['storages'], 'tensor')}"
    if root.kind is HolderKind.GRADIENT:
        return f"gradient {tensor_text(value)}"
    if root.kind is HolderKind.TENSOR:
        text = f"tensor {tensor_text(value)}"
        if graph_tensors:
            text += " holding its autograd graph" + (f", {saved}" if saved else "")
        return text
    captures = _captures_text(value, container, holder)
    if captures is not None:
        return captures
    if container is not None:
        return _container_text(container, holder, saved)
    text = f"{type(value).__name__} reaching {plural(tensors or holder['storages'], 'tensor')}"
    if graph_tensors:
        text += " with autograd graphs" + (f", {saved}" if saved else "")
    return text


def _container_text(container: str, holder: Gathered, saved: str) -> str:
    """``list of 40 tensors holding their autograd graphs, 10.00 MiB of saved activations``."""
    tensors, graph_tensors = holder["tensors"], holder["graph_tensors"]
    noun = (
        f"{container} of {plural(tensors, 'tensor')}"
        if tensors
        else f"{container} reaching {plural(holder['storages'], 'storage')}"
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


def _kept_by_ipython(root: Root) -> str:
    """What IPython keeps: a cell's value in its output cache, a traceback's frame or its exception."""
    if root.origin is Origin.OUTPUT_CACHE:
        value = root.value
        tensor_like = hasattr(value, "shape") and hasattr(value, "dtype")
        what = f"tensor {tensor_text(value)}" if tensor_like else type(value).__name__
        return f"a cell's value kept by IPython's output cache ({what})"
    if root.origin is Origin.FRAME:
        return f"locals of {root.name}, kept by the failed cell's traceback"
    # an exception: shown after its name, the name is not said again
    return "its frames' tensors, kept by the failed cell's traceback"


def _captures_text(value: object, container: str | None, holder: Gathered) -> str | None:
    """A function, or a container of functions, that keeps every tensor it reaches in what it captured
    (defaults, closures, a partial's arguments); ``None`` when something else keeps one of them."""
    captured = sorted({capture for capture in map(captured_by, holder["hits"]) if capture is not None})
    if not captured or not all(captured_by(hit) for hit in holder["hits"]):
        return None
    kept = plural(holder["tensors"] or holder["storages"], "tensor")
    if isinstance(value, types.FunctionType):
        names = capture_names(value)
        variables = dict.fromkeys(names.get(str(hit.path[0][1]), "?") for hit in holder["hits"] if hit.path)
        how = " and ".join(f"its {_capture_words(capture)}" for capture in captured)
        return f"function {value.__qualname__} keeping {kept} in {how} ({', '.join(variables)})"
    if container is not None:
        functions = len({hit.position for hit in holder["hits"]})
        owner = "its" if functions == 1 else "their"
        how = " and ".join(f"{owner} {_capture_words(capture, functions)}" for capture in captured)
        return f"{container} of {plural(functions, 'function')} keeping {kept} in {how}"
    return None


# -- what to change about each holder ------------------------------------------------------------------
def _del_names(holder: LeftHolder) -> str:
    names = [holder.name] + [name for name in holder.also if name.isidentifier()]
    return ", ".join(dict.fromkeys(names))


def _graph_advice(holder: LeftHolder) -> str:
    """Keep numbers, not graphs: what to store instead of tensors that hold their autograd graphs."""
    name = holder.where or holder.name  # tracker.outputs, where an object's attribute keeps them
    scalars = holder.scalar_graph_tensors
    if holder.kind is HolderKind.TENSOR and scalars:
        return (
            f"accumulate numbers, not graphs: {name} += value.item() (or value.detach()), so each step's "
            "graph and the activations it saved are freed"
        )
    if scalars and scalars * 2 >= max(holder.graph_tensors, 1):
        return (
            f"keep numbers, not graphs: store loss.item() (a Python float) or loss.detach() in {name}, "
            "so each step's graph with its saved activations is freed"
        )
    return (
        "if nothing needs their gradients, compute them under `with torch.no_grad():` (or "
        f"torch.inference_mode()); otherwise store .detach() in {name}, which drops the graph"
    )


def _hook_advice(holder: LeftHolder, free_now: str) -> tuple[str, ...]:
    """A module hook keeps what it is given: what to store instead, and how to free what it kept."""
    hook = holder.hooks[0] if holder.hooks else "a module hook"
    fix = (
        f"the {hook} keeps what it is given: store output.detach() (or a summary such as "
        "output.mean().item()), or remove the hook when done (handle.remove() on what "
        "register_forward_hook returned)"
    )
    if holder.origin is Origin.VARIABLE and holder.kind is not HolderKind.MODULE:
        return (fix, free_now)
    return (fix, "removing the hook frees what it kept (its closure or object goes with it)")


def leak_advice(holder: LeftHolder) -> tuple[str, ...]:
    """What to change, matched to the cause; a result that is not a leak gets what to know about it."""
    name = holder.name
    free_now = f"free it now: del {_del_names(holder)}, then torch.cuda.empty_cache() returns it to the driver"
    if holder.cause is Cause.GRAPH:
        return (_graph_advice(holder), free_now)
    if holder.cause is Cause.HOOK:
        return _hook_advice(holder, free_now)
    if holder.cause is Cause.OUTPUT_CACHE:
        fix = (
            f"{name} keeps a cell's value: end the cell with ';' or assign the value to a name; "
            "%reset -f out empties IPython's output cache"
        )
        return (fix,)
    if holder.cause is Cause.TRACEBACK:
        fix = (
            "a failed cell's traceback keeps its frames' tensors until the next error replaces it; "
            "after an out-of-memory error %oomfix releases them"
        )
        return (fix,)
    if holder.cause is Cause.MODEL:
        has_gradients = holder.by_category.get(ReachedAs.GRADIENTS)
        grads = " (and its gradients until zero_grad(set_to_none=True))" if has_gradients else ""
        return (f"a model's weights{grads}: expected; it stays until the model is deleted",)
    if holder.cause is Cause.OPTIMIZER_STATE:
        note = (
            "an optimizer's state, made on its first step (Adam: two tensors per parameter): expected, "
            "it does not grow on later steps"
        )
        return (note,)
    if holder.cause is Cause.GRADIENTS:
        return ("gradients from backward(): expected; optimizer.zero_grad(set_to_none=True) frees them between steps",)
    if holder.cause is Cause.MODULE_ATTRIBUTES:
        return (f"tensors kept as module attributes ({holder.where or name}): expected if the module needs them",)
    if holder.change is Change.GREW:
        fix = (
            f"{name} gained {plural(holder.tensors, 'tensor')} in this cell: a container that grows every run "
            "fills the card; keep what you need as numbers (.item()) or on the CPU (.cpu())"
        )
        return (fix, free_now)
    return (f"data on the GPU: expected if you meant to keep it; {free_now}",)


# The cause of a holder whose storages were mostly reached as one category.
_BY_CATEGORY = {
    ReachedAs.PARAMETERS: Cause.MODEL,
    ReachedAs.BUFFERS: Cause.MODEL,
    ReachedAs.STATE: Cause.OPTIMIZER_STATE,
    ReachedAs.GRADIENTS: Cause.GRADIENTS,
    ReachedAs.MODULE_ATTRIBUTES: Cause.MODULE_ATTRIBUTES,
    ReachedAs.HOOKS: Cause.HOOK,
    ReachedAs.GRAPH: Cause.GRAPH,
}


def cause_of(
    root: Root,
    categories: dict[ReachedAs, int],
    graph_direct: int,
    direct: int,
    hooks: tuple[str, ...],
    hits: list[Hit],
) -> Cause:
    """The holder's cause: where it comes from (IPython's output cache, a traceback), else what most
    of its storages were reached as; ``graph_direct`` and ``direct`` are the bytes of tensors it holds
    directly, with a graph and in all; ``hooks`` the hooks linked to it."""
    total = sum(categories.values())
    if root.origin is Origin.OUTPUT_CACHE:
        return Cause.OUTPUT_CACHE
    if root.origin in (Origin.EXCEPTION, Origin.FRAME):
        return Cause.TRACEBACK
    if hooks or categories.get(ReachedAs.HOOKS, 0) * 2 >= total:
        return Cause.HOOK
    if categories.get(ReachedAs.MODULE_ATTRIBUTES, 0) * 2 >= total and any(
        hit.path and hit.path[0][0] == HOOK for hit in hits
    ):
        return Cause.HOOK
    graph = categories.get(ReachedAs.GRAPH, 0)
    # A tensor whose graph a backward already freed holds only itself: data, not a graph leak.
    if graph and (graph * 2 >= total or (direct and graph_direct * 2 >= direct)):
        return Cause.GRAPH
    if categories.get(ReachedAs.PARAMETERS, 0) + categories.get(ReachedAs.BUFFERS, 0) > 0:
        return Cause.MODEL  # a model built or moved here, with whatever gradients it also got
    largest = max(categories, key=lambda category: categories[category])
    return _BY_CATEGORY.get(largest, Cause.DATA)
