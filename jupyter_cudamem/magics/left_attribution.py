"""Who holds what a measured cell left, for ``%%cudamem`` and the every-cell mode: the namespace's
fingerprint as the cell starts, and, when the cell left at least ``CudaMem.attribute_threshold`` more
allocated, the holders (``attribution.left``). Never fails the cell."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..attribution.left import DEFAULT_THRESHOLD_BYTES, LeftBehind, NamespaceSnapshot, left_behind
from ..attribution.probe import default_probe
from ..attribution.tracked import TrackedNamespace
from ..measure import Measurement
from .cellrun import NO_VALUE
from .options import size_setting

if TYPE_CHECKING:
    from .cudamem import CudaMem

ATTRIBUTE_ALLOWED = "a size such as 64MiB or 1GB, or 'off' (or 0) to never name holders"


class LeftAttribution:
    """Attribution around one ``CudaMem``'s cells, with its threshold and its tensor probe as they are set now."""

    def __init__(self, cudamem: CudaMem):
        self.cudamem = cudamem
        self._threshold_text: str | int | None = None
        self._threshold_value: int | None = DEFAULT_THRESHOLD_BYTES
        # While the every-cell mode is on, the fingerprints are kept from cell to cell (``attribution.tracked``).
        self.tracked: TrackedNamespace | None = None

    def track(self, on: bool) -> None:
        """Keep the namespace's fingerprints from cell to cell (every cell is then seen), or stop."""
        self.tracked = TrackedNamespace(self.threshold_bytes() or DEFAULT_THRESHOLD_BYTES) if on else None

    def threshold_bytes(self) -> int | None:
        """The attribution threshold in bytes, ``None`` when it is off."""
        setting = self.cudamem.attribute_threshold
        if setting != self._threshold_text:  # parsed once per setting, not once per cell
            value = size_setting("CudaMem.attribute_threshold", setting, ATTRIBUTE_ALLOWED)
            self._threshold_text, self._threshold_value = setting, value
        return self._threshold_value

    def snapshot(self) -> NamespaceSnapshot | None:
        """The namespace's fingerprint as the cell starts (see ``attribution.left``); ``None`` when
        attribution is off or nothing can hold device memory (torch not imported)."""
        if self.threshold_bytes() is None:
            return None
        cudamem = self.cudamem
        probe = cudamem.probe if cudamem.probe is not None else default_probe()
        if probe is None:
            return None
        if not cudamem.hardware.allocator.is_initialized():
            return NamespaceSnapshot({}, frozenset())  # nothing on the device yet: all it will hold is new
        from ..ipython_state import ipython_references

        references = ipython_references(cudamem.shell)
        tracked = self.tracked
        if tracked is not None:
            tracked.guard_bytes = self.threshold_bytes() or DEFAULT_THRESHOLD_BYTES
            return tracked.take(cudamem.shell.user_ns, references, probe)
        return NamespaceSnapshot.take(cudamem.shell.user_ns, references, probe)

    def left_behind(
        self, measurement: Measurement, snapshot: NamespaceSnapshot | None, value: Any = None, error: Any = None
    ) -> LeftBehind | None:
        """Who holds what the cell left, when it left at least the threshold; never fails the cell."""
        threshold = self.threshold_bytes()
        if snapshot is None or threshold is None:
            return None
        left = measurement.left_allocated_bytes
        if self.tracked is not None:
            self.tracked.left(left)
        if left < threshold:
            return None
        from ..ipython_state import cell_references

        cudamem = self.cudamem
        try:
            references = cell_references(cudamem.shell, None if value is NO_VALUE else value, error)
            return left_behind(cudamem.shell.user_ns, references, snapshot, left, cudamem.probe)
        except Exception as failure:  # a bug of ours must not cost the user the report
            cudamem.note(f"could not attribute what the cell left: {type(failure).__name__}: {failure}")
            return None
