"""Who holds what a measured cell left, for ``%%cudamem`` and the every-cell mode: the namespace's
fingerprint as the cell starts, and, when the cell left at least ``CudaMem.attribute_threshold`` more
allocated, the holders (``attribution.left``). Never fails the cell.

From the first snapshot on, the fingerprints are kept from cell to cell (``attribution.tracked``): every
cell the shell runs, measured or not, says through IPython's ``pre_run_cell`` and ``post_run_cell`` events
which names it can have touched (``cell.names``), so a snapshot costs what the cell names, not what the
namespace holds."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from ..attribution.left import DEFAULT_THRESHOLD_BYTES, LeftBehind, NamespaceSnapshot, left_behind
from ..attribution.probe import default_probe
from ..attribution.tracked import TrackedNamespace
from ..cell.names import SAFE_MAGICS, cell_names
from ..hardware import Hardware
from ..ipython_outputs import OutputIds
from ..ipython_state import ipython_reference_ids
from ..measure import Measurement
from ..sources.base import AllocatorReading
from .base import note
from .cellrun import NO_VALUE
from .measuring import CellSettings

if TYPE_CHECKING:
    from IPython.core.interactiveshell import ExecutionInfo, ExecutionResult, InteractiveShell


# The names of IPython's output cache: a cell naming one may write anywhere in it (``OutputIds``).
_OUTPUT_CACHE = frozenset({"Out", "_oh"})


class LeftAttribution:
    """Attribution around the cells of one shell, with the settings each cell started with."""

    def __init__(self, shell: InteractiveShell, hardware: Hardware):
        self.shell = shell
        self.hardware = hardware
        self.tracked: TrackedNamespace | None = None  # from the first snapshot on
        self.outputs = OutputIds()  # the output cache's ids, kept as the fingerprints are
        self._unsafe_magics: tuple[int, frozenset[str]] = (-1, frozenset())
        # Cells the shell ran and cells measured (-1: none yet): where they differ, cells not measured ran
        # in between, and what they left is read.
        self._cells_ran, self._cells_measured = 0, -1
        # The cell whose names were told last, until a snapshot takes them: the events and the snapshot tell
        # the same cell up to three times, and telling it again changes nothing.
        self._told: str | None = None

    def _track(self, threshold_bytes: int | None) -> TrackedNamespace:
        if self.tracked is None:
            self.tracked = TrackedNamespace(threshold_bytes or DEFAULT_THRESHOLD_BYTES)
            events = self.shell.events
            events.register("pre_run_cell", self._pre_run_cell)
            events.register("post_run_cell", self._post_run_cell)
        return self.tracked

    def close(self) -> None:
        """Stop keeping fingerprints (the extension unloads)."""
        self.outputs = OutputIds()
        if self.tracked is None:
            return
        events = self.shell.events
        for name, callback in (("pre_run_cell", self._pre_run_cell), ("post_run_cell", self._post_run_cell)):
            try:
                events.unregister(name, callback)
            except ValueError:
                pass
        self.tracked = None

    def _ran(self, raw: str | None) -> None:
        """Tell the kept fingerprints which names a cell can have touched (``None``: it cannot tell)."""
        if self.tracked is None or (raw is not None and raw is self._told):
            return
        self._told = raw
        if raw is None:
            self.tracked.ran(None)
            self.outputs.touched()
            return
        line_magics = self.shell.magics_manager.magics.get("line", {})
        if self._unsafe_magics[0] != len(line_magics):  # IPython's automagic: ``run x.py`` runs %run
            self._unsafe_magics = (len(line_magics), frozenset(line_magics).difference(SAFE_MAGICS))
        names = cell_names(raw, self._unsafe_magics[1])
        self.tracked.ran(names)
        if names is None or not _OUTPUT_CACHE.isdisjoint(names):
            self.outputs.touched()

    def _pre_run_cell(self, info: ExecutionInfo | None = None) -> None:
        # Before too: a snapshot of a cell this one runs must see what this one changed.
        self._ran(getattr(info, "raw_cell", None))

    def _post_run_cell(self, result: ExecutionResult | None = None) -> None:
        raw = getattr(getattr(result, "info", None), "raw_cell", None)
        if raw is not None and not raw.strip():
            return  # IPython skips pre_run_cell for a blank cell but still sends post_run_cell
        self._cells_ran += 1
        self._ran(raw)

    def snapshot(self, settings: CellSettings, cell: str | None = None,
                 started: Mapping[int, AllocatorReading] | None = None) -> NamespaceSnapshot | None:
        """The namespace's fingerprint as ``cell`` starts (see ``attribution.left``); ``None`` when
        attribution is off or nothing can hold device memory (torch not imported). ``started``: PyTorch's
        counters as the cell started, where they were read already (``cell_starts``)."""
        if settings.attribute_threshold_bytes is None:
            return None
        probe = settings.probe if settings.probe is not None else default_probe()
        if probe is None:
            return None
        if not self.hardware.allocator.is_initialized():
            return NamespaceSnapshot({}, frozenset())  # nothing on the device yet: all it will hold is new
        tracked = self._track(settings.attribute_threshold_bytes)
        tracked.guard_bytes = settings.attribute_threshold_bytes or DEFAULT_THRESHOLD_BYTES
        if self._cells_ran != self._cells_measured:  # what cells not measured left counts towards the guard
            allocator = self.hardware.allocator
            try:
                readings = started or {index: allocator.read(index) for index in range(allocator.device_count())}
                tracked.unmeasured({index: reading.allocated_bytes for index, reading in readings.items()})
            except Exception:  # noqa: BLE001  unreadable (a sticky CUDA error): what they left is unknown
                tracked.forget()
            self._cells_measured = self._cells_ran
        snapshot = tracked.take(self.shell.user_ns, ipython_reference_ids(self.shell, self.outputs), probe)
        self._told = None  # taken: the next cell's names are news again
        if cell is not None:  # the names it can change, also where it runs without the shell's events
            self._ran(cell)
        return snapshot

    def left_behind(
        self, settings: CellSettings, measurement: Measurement, snapshot: NamespaceSnapshot | None, value: object = None,
        error: BaseException | None = None,
    ) -> LeftBehind | None:
        """Who holds what the cell left, when it left at least the threshold; never fails the cell."""
        self._cells_measured += 1
        threshold = settings.attribute_threshold_bytes
        if snapshot is None or threshold is None:
            return None
        left = measurement.left_allocated_bytes
        if self.tracked is not None:
            self.tracked.left(left, _ended(measurement))
        if left < threshold:
            return None
        from ..ipython_state import cell_references

        try:
            references = cell_references(self.shell, None if value is NO_VALUE else value, error)
            return left_behind(self.shell.user_ns, references, snapshot, left, settings.probe)
        except Exception as failure:  # a bug of ours must not cost the user the report
            note(f"could not attribute what the cell left: {type(failure).__name__}: {failure}")
            return None


def _ended(measurement: Measurement) -> Mapping[int, int]:
    """Each measured device's allocated bytes as the cell ended."""
    return {device.device.torch_index: device.after.allocator.allocated_bytes for device in measurement.devices
            if device.device.torch_index is not None and device.after.allocator is not None}
