"""What the monitor hands its views: one device's sample, and the whole state as of one instant.

Immutable, so a view can keep a state while the poller thread goes on reading.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..hardware import Device


@dataclass(frozen=True, slots=True)
class Sample:
    """One reading of one device. ``time_s`` is wall-clock seconds (``time.time()``)."""

    time_s: float
    used_bytes: int
    total_bytes: int
    process_bytes: int | None  # this process's share; None where NVML cannot map processes
    utilization_percent: int | None


@dataclass(frozen=True)
class DeviceState:
    """What a view shows for one device: the latest sample, the peak since start, a remark."""

    device: Device
    latest: Sample | None
    peak_used_bytes: int | None
    peak_time_s: float | None
    note: str | None  # e.g. PROCESS_NOT_AVAILABLE

    @property
    def key(self) -> int | None:
        """The NVML index, under which the history of this device is kept."""
        return self.device.nvml_index


@dataclass(frozen=True)
class MonitorState:
    """Everything a view needs, as of one instant. Immutable, so views can keep it."""

    running: bool
    interval_s: float
    history_s: float
    devices: tuple[DeviceState, ...]
    error: str | None  # the last read's failure, shown until a read succeeds
    unavailable: str | None  # why nothing can be monitored on this machine
    stop_reason: str | None = None


Listener = Callable[[MonitorState], None]
