"""Who holds what a measured cell left, for ``%%cudamem`` and the every-cell mode: the namespace's
fingerprint as the cell starts, and, when the cell left at least ``CudaMem.attribute_threshold`` more
allocated, the holders (``attribution.left``). Never fails the cell."""

from __future__ import annotations

from typing import Any

from ..attribution.left import DEFAULT_THRESHOLD_BYTES, LeftBehind, NamespaceSnapshot, left_behind
from ..attribution.probe import default_probe
from ..attribution.tracked import TrackedNamespace
from ..hardware import Hardware
from ..measure import Measurement
from .base import note
from .cellrun import NO_VALUE
from .measuring import CellSettings


class LeftAttribution:
    """Attribution around the cells of one shell, with the settings each cell started with."""

    def __init__(self, shell: Any, hardware: Hardware):
        self.shell = shell
        self.hardware = hardware
        # While the every-cell mode is on, the fingerprints are kept from cell to cell (``attribution.tracked``).
        self.tracked: TrackedNamespace | None = None

    def track(self, settings: CellSettings | None) -> None:
        """Keep the namespace's fingerprints from cell to cell (every cell is then seen), or stop (``None``)."""
        self.tracked = None if settings is None else TrackedNamespace(
            settings.attribute_threshold_bytes or DEFAULT_THRESHOLD_BYTES)

    def snapshot(self, settings: CellSettings) -> NamespaceSnapshot | None:
        """The namespace's fingerprint as the cell starts (see ``attribution.left``); ``None`` when
        attribution is off or nothing can hold device memory (torch not imported)."""
        if settings.attribute_threshold_bytes is None:
            return None
        probe = settings.probe if settings.probe is not None else default_probe()
        if probe is None:
            return None
        if not self.hardware.allocator.is_initialized():
            return NamespaceSnapshot({}, frozenset())  # nothing on the device yet: all it will hold is new
        from ..ipython_state import ipython_references

        references = ipython_references(self.shell)
        tracked = self.tracked
        if tracked is not None:
            tracked.guard_bytes = settings.attribute_threshold_bytes or DEFAULT_THRESHOLD_BYTES
            return tracked.take(self.shell.user_ns, references, probe)
        return NamespaceSnapshot.take(self.shell.user_ns, references, probe)

    def left_behind(
        self, settings: CellSettings, measurement: Measurement, snapshot: NamespaceSnapshot | None, value: Any = None,
        error: Any = None,
    ) -> LeftBehind | None:
        """Who holds what the cell left, when it left at least the threshold; never fails the cell."""
        threshold = settings.attribute_threshold_bytes
        if snapshot is None or threshold is None:
            return None
        left = measurement.left_allocated_bytes
        if self.tracked is not None:
            self.tracked.left(left)
        if left < threshold:
            return None
        from ..ipython_state import cell_references

        try:
            references = cell_references(self.shell, None if value is NO_VALUE else value, error)
            return left_behind(self.shell.user_ns, references, snapshot, left, settings.probe)
        except Exception as failure:  # a bug of ours must not cost the user the report
            note(f"could not attribute what the cell left: {type(failure).__name__}: {failure}")
            return None
