"""A failed ``%%cudamem --limit`` cell ran under its cap, and ``%oomfix``'s reruns of it do again: the fix
plans under it, with PyTorch's allocator capped as the cell capped it while the fix runs (put back after)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from ..hardware import Hardware

if TYPE_CHECKING:
    from . import Extension


@contextmanager
def cell_cap(extension: Extension, hardware: Hardware, source: str, device: int) -> Iterator[int | None]:
    """The cap (bytes) ``source`` ran under, applied to ``device`` while inside; ``None``: no cap, nothing applied."""
    from .cudamem import CudaMem

    measuring = extension.get(CudaMem)
    cap = measuring.limit_of(source) if isinstance(measuring, CudaMem) else None
    if cap is None or hardware.allocator.status() is not None:
        yield None
        return
    with hardware.capped(cap, [device]):
        yield cap


def cap_note(cap: int | None) -> tuple[str, ...]:
    """What the outcome says of the cap it was planned under."""
    from ..units import format_bytes

    if cap is None:
        return ()
    return (f"planned under the cell's --limit {format_bytes(cap)}: its reruns run under it too",)
