"""A failed try leaves nothing. ``set_aside`` moves to the host, and unbinds, the values holding GPU memory
that the failed cell binds again before reading them (left bound, a rerun would build the new value beside
the old); ``give_back`` binds them again if no try fits; ``restore_bindings`` undoes a failed try's names.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from ..ipython_names import OUTPUT_CACHE_NAMES, is_ipython_name

if TYPE_CHECKING:
    import torch


class Mover(Protocol):
    """How values holding GPU memory are recognised and moved to the host and back."""

    def holds_gpu(self, value: object) -> bool: ...

    def to_host(self, value: object) -> tuple[object, Callable[[], object]] | None:
        """``(host value, give back)`` where ``give back()`` returns the value on its device again;
        ``None`` when this value cannot be moved (it is then left bound)."""
        ...

    def addresses(self, value: object) -> frozenset[int]:
        """Where on the device the memory ``value`` holds starts (each tensor's storage)."""
        ...

    def grown(self, value: object, from_batch: int, to_batch: int) -> list[list[torch.Tensor]]:
        """Memory held beside ``value``'s tensors of ``from_batch`` rows so they hold what they would at
        ``to_batch``, each block in a list that lets it go when cleared."""
        ...


@dataclass
class SetAside:
    """What ``set_aside`` took out of the namespace: ``give_back()`` if no try fits, ``drop()`` if one did."""

    namespace: MutableMapping[str, object]
    entries: dict[str, tuple[object, Callable[[], object]]] = field(default_factory=dict)
    kept: tuple[str, ...] = ()  # names holding GPU memory that could not be moved (left bound)
    freed_bytes: int = 0  # what setting them aside freed, where the caller measured it
    left_on_host: list[str] = field(default_factory=list)  # given back as their host copies (``give_back``)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.entries)

    def give_back(self) -> list[str]:
        """Bind each set-aside name again, moved back to its device (names a try bound since are left alone);
        one that no longer fits there is bound as its host copy and named in ``left_on_host``: never lost."""
        given = []
        for name, (host, back) in self.entries.items():
            if name not in self.namespace:
                try:
                    self.namespace[name] = back()
                except Exception:  # noqa: BLE001  out of memory on the way back: the host copy is the data
                    self.namespace[name] = host
                    self.left_on_host.append(name)
                given.append(name)
        self.entries.clear()
        return given

    def drop(self) -> None:
        self.entries.clear()

    def drop_rebound(self) -> None:
        """Forget the names a try that fitted bound anew; the others stay set aside until the fix ends."""
        for name in [n for n in self.entries if n in self.namespace]:
            del self.entries[name]

    def merge(self, other: SetAside) -> None:
        """Keep ``other``'s entries too (the first value set aside under a name wins: it is the oldest)."""
        for name, entry in other.entries.items():
            self.entries.setdefault(name, entry)
        self.freed_bytes += other.freed_bytes


def set_aside(namespace: MutableMapping[str, object], rebinds: tuple[str, ...], mover: Mover) -> SetAside:
    """Move to the host and unbind what the failed cell bound and will bind again (``rebinds``)."""
    aside = SetAside(namespace)
    kept = []
    for name in rebinds:
        if name.startswith("_") or is_ipython_name(name) or name not in namespace:
            continue
        value = namespace[name]
        try:
            if not mover.holds_gpu(value):
                continue
            moved = mover.to_host(value)
        except Exception:
            moved = None
        if moved is None:
            kept.append(name)
            continue
        aside.entries[name] = moved
        del namespace[name]
        del value
    aside.kept = tuple(kept)
    return aside


def restore_bindings(namespace: MutableMapping[str, object], before: Mapping[str, object]) -> list[str]:
    """Put ``namespace`` back as it was in ``before`` (the output cache's ``_``, ``__``, ``___`` too), so
    nothing a failed try bound (a ``loss`` holding its autograd graph) stays alive; the names changed."""
    changed = []
    for name in list(namespace):
        # IPython's own names and private names, but for the output cache's: a failed try's are not undone.
        if name not in OUTPUT_CACHE_NAMES and (name.startswith("_") or is_ipython_name(name)):
            continue
        if name not in before:
            del namespace[name]
            changed.append(name)
        elif namespace[name] is not before[name]:
            namespace[name] = before[name]
            changed.append(name)
    for name, value in before.items():
        if name not in namespace and (not name.startswith("_") or name in OUTPUT_CACHE_NAMES):
            namespace[name] = value
            changed.append(name)
    return changed
