"""torch.compile's CUDA graph pools between the runs a feature makes of a cell (``%oomfix``'s tries, the
plan's runs): reset before each run where they hold memory, and one note naming the most a reset freed.

Why: with ``mode="reduce-overhead"`` the compiled steps run as CUDA graphs, whose memory pool outlives the
run that recorded it and serves no other allocation, so a run at another batch starts with the pools of
every batch run before. On an H100 (``tests/gpu/test_oomfix_compiled_gpu.py``) a reduce-overhead encoder's
pool held 2.7 GiB of a 3 GiB cap after a try at 153 and the next try failed in it; a convnet's plan
(``tests/gpu/test_plan_gpu.py``) replayed its runs from 610 MiB of another batch's pools, which the replay
takes for cached memory its requests may use. Reset, the next call compiles again and each run starts as at
its batch in a fresh process (that plan's prediction moved little: 647, then 633, where 797 fits; why in
``docs/plan.md``). Pure bookkeeping: the reset is the allocator adapter's
(``AllocatorSource.release_graph_pools``).
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
        return (f"torch.compile's CUDA graphs (mode=\"reduce-overhead\") held up to {format_bytes(self.most_freed_bytes)} "
                f"in memory pools no other allocation uses: reset (torch.compiler.reset()) before each {run}, "
                "which compiles again")
