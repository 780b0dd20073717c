"""torch.compile's CUDA graph pools between the runs a feature makes of a cell: reset before each run where
they hold memory (a pool outlives its run and serves no other allocation), and one note naming the most a
reset freed. The reset itself is the allocator adapter's (``AllocatorSource.release_graph_pools``).
"""

from __future__ import annotations

from collections.abc import Callable

from ..units import format_bytes


class GraphPools:
    """Resets the pools through ``release(device) -> bytes freed`` and keeps the most one reset freed."""

    def __init__(self, release: Callable[[int], int]):
        self._release = release
        self.most_freed_bytes = 0

    def reset(self, device: int) -> bool:
        """Reset the pools on ``device``; whether this reset freed more than any before (the note changed)."""
        freed = self._release(device)
        if freed <= self.most_freed_bytes:
            return False
        self.most_freed_bytes = freed
        return True

    def note(self, run: str) -> str | None:
        """What the user is told, ``run`` naming what each reset came before (``None``: no pool held memory)."""
        if not self.most_freed_bytes:
            return None
        return ("torch.compile's CUDA graphs (mode=\"reduce-overhead\") held up to "
                f"{format_bytes(self.most_freed_bytes)} in memory pools no other allocation uses: reset "
                f"(torch.compiler.reset()) before each {run}, which compiles again")
