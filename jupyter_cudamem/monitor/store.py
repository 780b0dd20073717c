"""What the monitor remembers between reads: per device a ring buffer of the last samples and the peak
since the poller started, the devices of the last read with their remarks, and the last read's failure.

Not locked itself: the poller holds its lock around every call, so a state is read whole.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from ..hardware import Device
from .reading import Reading
from .state import DeviceState, Sample


class SampleStore:
    """The samples and peaks of the devices read, keyed by NVML index; bounded by ``length`` per device."""

    def __init__(self) -> None:
        self._history: dict[int, deque[Sample]] = {}
        self._peaks: dict[int, tuple[int, float]] = {}  # NVML index -> (used bytes, time_s)
        self._rows: tuple[tuple[Device, str | None], ...] = ()  # devices of the last read, with remarks
        self.error: str | None = None  # the last read's failure, shown until a read succeeds
        self.consecutive_errors = 0

    def clear(self) -> None:
        """Forget everything: a restart begins a new history and a new peak."""
        self._history.clear()
        self._peaks.clear()
        self._rows = ()
        self.error = None
        self.consecutive_errors = 0

    def resize(self, length: int) -> None:
        """Keep at most ``length`` samples per device from now on; the newest recorded stay."""
        for key, samples in self._history.items():
            if samples.maxlen != length:
                self._history[key] = deque(samples, maxlen=length)

    def record(self, readings: Sequence[Reading], length: int) -> None:
        """A read that succeeded: its samples, its devices, and no error any more."""
        self.consecutive_errors = 0
        self.error = None
        self._rows = tuple((device, note) for device, _, note in readings)
        for device, sample, _ in readings:
            key = device.nvml_index
            if key is None or sample is None:
                continue
            self._history.setdefault(key, deque(maxlen=length)).append(sample)
            peak = self._peaks.get(key)
            if peak is None or sample.used_bytes > peak[0]:
                self._peaks[key] = (sample.used_bytes, sample.time_s)

    def record_failure(self, message: str) -> int:
        """A read that failed; returns how many have failed in a row (the back-off grows with it)."""
        self.consecutive_errors += 1
        self.error = message
        return self.consecutive_errors

    def device_states(self) -> tuple[DeviceState, ...]:
        """Each device of the last read with its latest sample and its peak."""
        devices = []
        for device, note in self._rows:
            key = device.nvml_index
            samples = None if key is None else self._history.get(key)
            peak = None if key is None else self._peaks.get(key)
            devices.append(
                DeviceState(
                    device=device,
                    latest=samples[-1] if samples else None,
                    peak_used_bytes=None if peak is None else peak[0],
                    peak_time_s=None if peak is None else peak[1],
                    note=note,
                )
            )
        return tuple(devices)

    def history(self, nvml_index: int) -> list[Sample]:
        """The recorded samples of one device, oldest first (a copy)."""
        return list(self._history.get(nvml_index, ()))

    def histories(self) -> dict[int, list[Sample]]:
        return {key: list(samples) for key, samples in self._history.items()}
