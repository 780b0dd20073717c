"""PyTorch's allocated bytes per device as each recent cell started, kept from IPython's ``pre_run_cell``:
with an OOM's figures they bound what the failed cell itself needed (``%oomfix``'s diagnosis)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..hardware import Hardware

if TYPE_CHECKING:
    from IPython.core.interactiveshell import ExecutionInfo, InteractiveShell

_KEPT_CELLS = 8


class CellStarts:
    """The readings of the last few cells' starts, each with the cell's source (execution counts are
    numbered differently across IPython versions). One allocator read per cell."""

    def __init__(self, shell: InteractiveShell, hardware: Hardware):
        self.shell = shell
        self.hardware = hardware
        self._readings: list[tuple[str, dict[int, int]]] = []
        shell.events.register("pre_run_cell", self._note_cell_start)

    def close(self) -> None:
        try:
            self.shell.events.unregister("pre_run_cell", self._note_cell_start)
        except ValueError:
            pass

    def of(self, source: str) -> dict[int, int] | None:
        """What the last cell with this source started with; ``None`` when it was not read."""
        return next((r for cell, r in reversed(self._readings) if cell == source), None)

    def allocated_now(self) -> dict[int, int] | None:
        """PyTorch's allocated bytes per device now; ``None`` where unreadable."""
        readings = self.hardware.allocator_readings() or None
        return None if readings is None else {index: r.allocated_bytes for index, r in readings.items()}

    def _note_cell_start(self, info: ExecutionInfo | None = None) -> None:
        # A callback must never raise into the kernel: a reading we cannot take is simply missing.
        try:
            readings = self.allocated_now()
            if readings is None:
                return
            raw_cell = getattr(info, "raw_cell", None)
            if isinstance(raw_cell, str):
                self._readings = self._readings[-(_KEPT_CELLS - 1):] + [(raw_cell, readings)]
        except Exception:
            return
