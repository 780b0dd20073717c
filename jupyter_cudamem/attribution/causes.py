"""Why a holder holds what a cell left: the causes, and which of them are leaks.

Memory reached through autograd graphs, a module hook, IPython's output cache or a failed cell's
traceback is a leak (``Cause.leak``); a module's parameters, an optimizer's state, gradients, module
attributes and plain data are results, reported as what they are. ``cause_of`` tells them apart from
what a holder's storages were reached as.
"""

from __future__ import annotations

from enum import StrEnum

from .holders import Origin, Root
from .walk import HOOK, Hit, ReachedAs


class Cause(StrEnum):
    """Why a holder holds what a cell left: decides leak or result and what to advise, and is shown by
    its value (``leak losses 420.00 MiB (autograd graph)``)."""

    GRAPH = "autograd graph"
    HOOK = "module hook"
    OUTPUT_CACHE = "output cache"
    TRACEBACK = "traceback"
    MODEL = "model"
    OPTIMIZER_STATE = "optimizer state"
    GRADIENTS = "gradients"
    DATA = "data"
    MODULE_ATTRIBUTES = "module attributes"

    @property
    def leak(self) -> bool:
        """Memory kept by what the user did not mean to keep: a graph, a hook, IPython's caches."""
        return self in _LEAKS


_LEAKS = frozenset({Cause.GRAPH, Cause.HOOK, Cause.OUTPUT_CACHE, Cause.TRACEBACK})

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
