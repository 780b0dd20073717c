"""PyTorch's counters of every device as each recent cell started, read at IPython's ``pre_run_cell``: with an
OOM's figures they bound what the failed cell itself needed (``%oomfix``'s diagnosis), and a measurement of
the cell that just started takes them as its own start (``reading_of``) instead of reading them again."""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from ..hardware import Hardware
from ..sources.base import AllocatorReading

if TYPE_CHECKING:
    from IPython.core.interactiveshell import ExecutionInfo, InteractiveShell

_KEPT_CELLS = 8


class CellStarts:
    """The allocated bytes the last few cells started with, each with the cell's source (execution counts
    are numbered differently across IPython versions), and the last cell's whole reading. One allocator read
    per cell, shared by everything of ours that starts with the cell."""

    def __init__(self, shell: InteractiveShell, hardware: Hardware):
        self.shell = shell
        self.hardware = hardware
        self._readings: deque[tuple[str, dict[int, int]]] = deque(maxlen=_KEPT_CELLS)
        self._last: tuple[ExecutionInfo, dict[int, AllocatorReading]] | None = None
        shell.events.register("pre_run_cell", self._note_cell_start)

    def close(self) -> None:
        try:
            self.shell.events.unregister("pre_run_cell", self._note_cell_start)
        except ValueError:
            pass

    def of(self, source: str) -> dict[int, int] | None:
        """What the last cell with this source started with; ``None`` when it was not read."""
        return next((r for cell, r in reversed(self._readings) if cell == source), None)

    def reading_of(self, info: ExecutionInfo | None) -> dict[int, AllocatorReading] | None:
        """PyTorch's counters as the cell of ``info`` (IPython's) started, while it is the last cell to
        start; ``None`` when they were not read then."""
        last = self._last
        return last[1] if last is not None and info is not None and last[0] is info else None

    def allocated_now(self) -> dict[int, int] | None:
        """PyTorch's allocated bytes per device now; ``None`` where unreadable."""
        readings = self.hardware.allocator_readings() or None
        return None if readings is None else {index: r.allocated_bytes for index, r in readings.items()}

    def _note_cell_start(self, info: ExecutionInfo | None = None) -> None:
        # A callback must never raise into the kernel: a reading we cannot take is simply missing.
        self._last = None
        try:
            # Before the user's torch starts CUDA nothing is held: nothing to read, and no `import torch` of ours
            # (seconds, in the first cell) that a Ctrl-C would leave half done, breaking torch in the kernel.
            if not self.hardware.allocator.is_initialized():
                return
            readings = self.hardware.allocator_readings()
            if not readings:
                return
            if info is not None:
                self._last = (info, readings)
            raw_cell = getattr(info, "raw_cell", None)
            if isinstance(raw_cell, str):
                allocated = {index: reading.allocated_bytes for index, reading in readings.items()}
                self._readings.append((raw_cell, allocated))
        except Exception:
            return
