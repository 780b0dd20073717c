"""Why a holder holds what a cell left: the causes, and which of them are leaks.

Memory reached through autograd graphs, a module hook, IPython's output cache or a failed cell's
traceback is a leak (``LEAK_CAUSES``); a module's parameters, an optimizer's state, gradients, module
attributes and plain data are results, reported as what they are. ``cause_of`` tells them apart from
what a holder's storages were reached as.
"""

from __future__ import annotations

from .holders import EXCEPTION, FRAME, OUTPUT_CACHE, Root
from .walk import BUFFERS, GRADIENTS, GRAPH, HOOK, HOOKS, MODULE_ATTRIBUTES, PARAMETERS, STATE, Hit

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


def cause_of(
    root: Root, categories: dict[str, int], graph_direct: int, direct: int, hooks: tuple[str, ...], hits: list[Hit]
) -> str:
    """The holder's cause: where it comes from (IPython's output cache, a traceback), else what most
    of its storages were reached as; ``graph_direct`` and ``direct`` are the bytes of tensors it holds
    directly, with a graph and in all; ``hooks`` the hooks linked to it."""
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
