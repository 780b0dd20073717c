"""The ids of the values in IPython's output cache (``Out``, ``_oh``), kept from call to call: read before every
measured cell (``ipython_state.ipython_reference_ids``), where a cache of 1,000 outputs read whole costs 80 µs."""

from __future__ import annotations

import itertools
from typing import Any


class OutputIds:
    """The ids of the output cache's values, kept from call to call (read whole, 1,000 outputs cost 80 µs a
    cell). IPython writes the cache at its end only, so while the newest entry last seen is still there with
    its value, only those added since are read; a cell that may write elsewhere in it (``touched``: it names
    ``Out`` or ``_oh``, or its names cannot be told) has the next call read it whole."""

    def __init__(self) -> None:
        # The cache's id, its length, its newest key and that value's id, as last read; None: read it whole.
        self._seen: tuple[int, int, Any, int] | None = None
        self._ids: frozenset[int] = frozenset()

    def touched(self) -> None:
        self._seen = None

    def of(self, cache: dict[Any, Any]) -> frozenset[int]:
        seen, length = self._seen, len(cache)
        if seen is not None and seen[0] == id(cache) and 0 < seen[1] <= length:
            newest = list(itertools.islice(reversed(cache.items()), length - seen[1] + 1))  # newest first
            key, value = newest[-1]
            if key == seen[2] and id(value) == seen[3]:
                if len(newest) > 1:
                    self._ids = self._ids.union(id(value) for _, value in newest[:-1])
                    self._seen = (id(cache), length, newest[0][0], id(newest[0][1]))
                return self._ids
        values = list(cache.items())
        self._ids = frozenset(id(value) for _, value in values)
        self._seen = (id(cache), length, values[-1][0], id(values[-1][1])) if values else None
        return self._ids
