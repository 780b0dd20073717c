"""What ``%%cudamem`` and the every-cell mode share: ``CudaMem``'s settings read once as a cell starts
(``CellSettings``), whether a GPU can be measured at all, and the record a measured cell leaves in the
history. The helpers (``measured_cell``, ``left_attribution``, ``every_cell``) take these, never the magic."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Protocol, Self

from ..attribution.left import DEFAULT_THRESHOLD_BYTES
from ..attribution.probe import TensorProbe
from ..hardware import Hardware
from ..history import CellRecord, History, source_head
from ..measure import Measurement, Meter
from ..repeats import run_growth, source_key
from ..units import MiB
from .options import size_setting

if TYPE_CHECKING:
    from ..breakdown import TrackedPeak

AUTO_ALLOWED = "a size such as 1MiB, 512KB or 4096 (bytes), or 0 for a line after every cell"
AUTO_OFF = ("0",)
"""The every-cell mode has no "off" threshold (``%cudamem off`` turns the mode off): only 0, every cell."""
ATTRIBUTE_ALLOWED = "a size such as 64MiB or 1GB, or 'off' (or 0) to never name holders"


class PeakCounter(Protocol):
    """What --breakdown counts a cell's tensors with while it runs (``sources.torch_breakdown.PeakTracker``)."""

    def __enter__(self) -> Self: ...

    def __exit__(self, *exc: object) -> None: ...

    def peaks(self) -> Mapping[str, TrackedPeak]: ...


class NvtxRanges(Protocol):
    """What --nvtx marks a cell with (``sources.nvtx.TorchNvtx``)."""

    def range(self, name: str) -> AbstractContextManager[None]: ...


@dataclass(frozen=True)
class CellSettings:
    """``CudaMem``'s settings as one cell starts. Thresholds in bytes; ``attribute_threshold_bytes`` is
    ``None`` when attribution is off. ``probe`` says how tensors are recognised (``None``: PyTorch's
    types); ``breakdown_tracker`` what --breakdown counts with (``namespace -> tracker``; ``None``:
    ``sources.torch_breakdown.PeakTracker``); ``nvtx_ranges`` what --nvtx marks with (``None``:
    ``sources.nvtx.TorchNvtx``)."""

    reset_peak: bool = True
    process_memory: bool = True
    auto_threshold_bytes: int = MiB
    attribute_threshold_bytes: int | None = DEFAULT_THRESHOLD_BYTES
    trace_dir: str = "cudamem_traces"
    trace_max_entries: int = 200_000
    probe: TensorProbe | None = None
    breakdown_tracker: Callable[[Mapping[str, object]], PeakCounter] | None = None
    nvtx_ranges: NvtxRanges | None = None

    def meter(self, hardware: Hardware, devices: list[int] | None = None, reset_peak: bool | None = None) -> Meter:
        return Meter(hardware, reset_peak=self.reset_peak if reset_peak is None else reset_peak, devices=devices,
                     process_memory=self.process_memory)


@lru_cache(maxsize=32)
def auto_threshold_bytes(setting: str | int) -> int:
    """``CudaMem.auto_threshold`` in bytes (parsed once per setting, not once per cell)."""
    return size_setting("CudaMem.auto_threshold", setting, AUTO_ALLOWED, off_words=AUTO_OFF) or 0


@lru_cache(maxsize=32)
def attribute_threshold_bytes(setting: str | int) -> int | None:
    """``CudaMem.attribute_threshold`` in bytes, ``None`` when it is off (parsed once per setting)."""
    return size_setting("CudaMem.attribute_threshold", setting, ATTRIBUTE_ALLOWED)


def gpu_present(hardware: Hardware) -> bool:
    """Whether anything of a GPU can be read here: PyTorch's allocator or NVML."""
    return hardware.allocator.status() is None or hardware.nvml.status() is None


def record(history: History, count: int | None, source: str, measurement: Measurement) -> CellRecord:
    """Add a measured cell to the history, flagged as growing when it left memory again."""
    key = source_key(source)
    growth = run_growth(history, key, measurement)
    cell_record = CellRecord(count, source_head(source), measurement, source_key=key, growth=growth)
    history.add(cell_record)
    return cell_record
