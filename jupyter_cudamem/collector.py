"""Holding off Python's cyclic garbage collector around work that makes many small objects at once.

A full collection walks every object the kernel holds (a 100,000-cell history alone is about 700,000;
a namespace of 10,000 tensors as many again), and making thousands of tuples, lists or matplotlib artists
starts collections. Measured: those passes were 0.35-0.55 s of a first history plot taking 1.7 s
(``benchmarks/history.py``), and in attributing what a cell left they made the median run twice the
fastest (``benchmarks/leaks.py``, part ``cost``). The work inside is bounded, so the garbage it leaves is
small and the collector takes it after, as usual.
"""

from __future__ import annotations

import gc
from types import TracebackType


class collector_paused:  # lower case: called like a function, ``with collector_paused():``
    """Disable the cyclic collector inside, and put it back as it was (never enable one that was off).

    A class, not ``@contextmanager``: it runs before every measured cell, and a generator's context
    costs about ten times as much."""

    __slots__ = ("_enabled",)

    def __enter__(self) -> None:
        self._enabled = gc.isenabled()
        gc.disable()

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        if self._enabled:
            gc.enable()
