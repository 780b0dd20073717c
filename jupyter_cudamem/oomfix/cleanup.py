"""Free what a failed cell left behind, and measure what that gave back.

Order matters: what was held before the failed cell goes first, measured on its own (the output cache,
each ``--del`` variable); then the failed cell's references, ``gc.collect()`` for the cycles a traceback
forms, and only then ``empty_cache()``.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..hardware import Hardware
from ..report.text import TextReport
from ..sources.base import AllocatorReading
from ..units import format_bytes
from ..attribution.holders import reaches_cuda
from ..ipython_state import release_ipython_references, release_output_cache

if TYPE_CHECKING:
    from IPython.core.interactiveshell import InteractiveShell


@dataclass(frozen=True, repr=False)
class CleanupResult(TextReport):
    """What a cleanup released and freed: allocated and reserved bytes before less after, summed over
    devices (``None`` where PyTorch cannot read a GPU)."""

    freed_bytes: int | None
    freed_reserved_bytes: int | None
    cleared: tuple[str, ...]
    deleted: tuple[str, ...]
    before: dict[int, AllocatorReading] = field(default_factory=dict)
    after: dict[int, AllocatorReading] = field(default_factory=dict)
    freed_output_cache_bytes: int | None = None
    freed_by_name: dict[str, int | None] = field(default_factory=dict)
    """What releasing the output cache, and deleting each ``--del`` variable, freed (each measured on its
    own, before the failed cell's frames are released): memory held before the failed cell."""

    def text(self) -> str:
        """One line for the user."""
        if self.freed_bytes is None:
            freed = "freed memory not measured (no GPU readable by PyTorch)"
        else:
            freed = (
                f"freed {format_bytes(self.freed_bytes)} allocated, "
                f"{format_bytes(self.freed_reserved_bytes)} returned to the driver"
            )
        what = "; ".join(self.cleared) if self.cleared else "nothing held by IPython"
        deleted = f"; deleted {', '.join(self.deleted)}" if self.deleted else ""
        return f"cleanup {freed} (released: {what}{deleted})"


def _freed(before: dict[int, AllocatorReading] | None, after: dict[int, AllocatorReading] | None,
           attribute: str) -> int | None:
    if before is None or after is None:
        return None
    return sum(getattr(before[i], attribute) - getattr(after[i], attribute) for i in before if i in after)


def cleanup(shell: InteractiveShell, hardware: Hardware, exception: BaseException | None = None,
            delete_names: tuple[str, ...] = (), *, holds_cuda: Callable[[object], bool] | None = None) -> CleanupResult:
    """Release what IPython keeps from the failed cell, delete ``delete_names`` (through ``del_var``, as
    ``%xdel``; the caller checks they exist), collect, empty the cache. ``holds_cuda``: which output-cache
    entries to drop (default: those reaching a CUDA tensor)."""
    holds_cuda = holds_cuda if holds_cuda is not None else reaches_cuda
    before = hardware.allocator_readings()
    # What was held before the failed cell goes first, each measured on its own: room a rerun has.
    cached = release_output_cache(shell, holds_cuda)
    gc.collect()
    after_cache = hardware.allocator_readings()
    freed_by_name: dict[str, int | None] = {}
    deleted = tuple(dict.fromkeys(delete_names))
    last = after_cache
    for name in deleted:
        shell.del_var(name)
        gc.collect()
        now = hardware.allocator_readings()
        freed_by_name[name] = _freed(last, now, "allocated_bytes")
        last = now
    cleared = cached + release_ipython_references(shell, exception, holds_cuda=holds_cuda)
    exception = None  # our own reference must not outlive the release
    gc.collect()
    if before:
        hardware.allocator.empty_cache()
    after = hardware.allocator_readings()
    return CleanupResult(_freed(before, after, "allocated_bytes"), _freed(before, after, "reserved_bytes"),
                         tuple(cleared), deleted, before or {}, after or {},
                         freed_output_cache_bytes=_freed(before, after_cache, "allocated_bytes"),
                         freed_by_name=freed_by_name)
