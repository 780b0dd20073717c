"""What a cell left, as records: ``LeftHolder`` (one holder, its cause and what to change) and
``LeftBehind`` (all of them, with what nothing explains), in their words: ``Cause`` (why a holder holds it,
and whether that is a leak) and ``Change`` (what happened to a name). Made by ``left.left_behind``; shown
by ``report``."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from .holders import HolderKind, Origin
from .walk import ReachedAs


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


class Change(StrEnum):
    """What happened to a name in the cell, as its fingerprint tells: decides which of the storages it
    reaches are new (``left.judge_namespace``), and what ``text.leak_advice`` says of a container that grew."""

    NEW = "new"
    REBOUND = "rebound"
    GREW = "grew"  # a container gained items, or a child container grew in place
    CHANGED = "changed"  # in place (``Judged.detail`` says what, where the fingerprint can)
    UNCHANGED = "unchanged"


@dataclass(frozen=True)
class LeftHolder:
    """One holder of what the cell left, with the cause and what to change.

    ``nbytes`` is what the cell left through it (storages attributed to it and no other holder);
    ``by_category`` splits it (``ReachedAs.GRAPH``: saved tensors of graphs; ``ReachedAs.TENSORS``:
    tensors held directly...). ``change`` says what happened to the name (``Change.UNCHANGED``: then
    ``likely`` is set, counted to explain what the new storages do not). ``kind`` names a container by
    its type (``HolderKind.LIST``...). ``also`` are other holders reaching the same storages, ``hooks``
    the module hooks that fill it.
    """

    name: str
    origin: Origin
    kind: HolderKind
    nbytes: int
    cause: Cause
    description: str
    change: Change
    by_category: dict[ReachedAs, int] = field(default_factory=dict)
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
        return self.cause.leak

    @property
    def graph_bytes(self) -> int:
        return self.by_category.get(ReachedAs.GRAPH, 0)


@dataclass(frozen=True)
class LeftBehind:
    """What a cell left allocated and who holds it.

    ``left_bytes`` is the allocator's growth over the cell; ``holders`` name the part attributed (largest
    first), ``smaller_bytes`` sums holders under ``left.MIN_HOLDER_BYTES``, and ``remainder_bytes`` is what
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
    def freed_bytes(self) -> int:
        """What the cell freed of what was allocated before it, at least: the holders name new storages only,
        so where they add up to more than the cell left, it freed the difference (a rebound name's old tensor)."""
        return max(self.attributed_bytes - self.left_bytes, 0)

    @property
    def leaks(self) -> tuple[LeftHolder, ...]:
        return tuple(holder for holder in self.holders if holder.leak)

    @property
    def has_leak(self) -> bool:
        return bool(self.leaks)
