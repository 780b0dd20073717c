"""The monitor's background thread: reads NVML at an interval and keeps a bounded history.

No widgets here. A ``Poller`` reads every selected device through the shared ``Hardware`` (so it
uses the one process-wide NVML session that ``%%cudamem`` uses too), keeps the last ``history_s``
seconds of samples per device in a ring buffer, tracks the peak since it started, and tells its
listeners (the views) about a new state only when a shown value changed, and at most
``max_updates_per_s`` times a second whatever the interval: a view sends a frontend message per
notification, and a kernel must not be flooded.

The thread never raises into the kernel: an error while reading is recorded, shown through the
state, and the next read waits longer each time (exponential back-off) until a read succeeds.
"""

from __future__ import annotations

import atexit
import logging
import math
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from ..units import MiB
from ..devices import Device
from ..errors import CudaMemError
from ..hardware import Hardware

logger = logging.getLogger(__name__)

PROCESS_NOT_AVAILABLE = "per-process memory not available here"
NOT_IN_NVML = "not found among NVML's devices, so not monitored"
DEFAULT_INTERVAL_S = 1.0
DEFAULT_HISTORY_S = 300.0
DEFAULT_MAX_UPDATES_PER_S = 4.0
MIN_INTERVAL_S = 0.05
# A live view that reads less than once an hour shows nothing live; longer waits also overflow
# ``threading.Event.wait`` on some platforms (1e10 s does), which would kill the thread.
MAX_INTERVAL_S = 3600.0
# A monitor may be left running for days; this caps the memory its history can take
# (a sample is ~100 bytes, so 100k samples are ~10 MB per device).
MAX_SAMPLES_PER_DEVICE = 100_000
MAX_BACKOFF_S = 30.0
_JOIN_TIMEOUT_S = 5.0
THREAD_NAME = "cudamem-monitor"


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


OWN_NAMES = {"interval_s": "interval_s", "history_s": "history_s", "max_updates_per_s": "max_updates_per_s"}
"""The settings as ``Poller`` spells them; a front end passes its own spelling (``--interval``) instead."""


def validate_settings(
    interval_s: float,
    history_s: float,
    max_updates_per_s: float = DEFAULT_MAX_UPDATES_PER_S,
    names: Mapping[str, str] = OWN_NAMES,
) -> None:
    """Raise ``CudaMemError`` with what to do when the settings make no sense, each setting named as
    ``names`` spells it (so an error names what the user typed)."""
    if not math.isfinite(interval_s) or not MIN_INTERVAL_S <= interval_s <= MAX_INTERVAL_S:
        raise CudaMemError(
            f"{names['interval_s']} takes seconds between readings, at least {MIN_INTERVAL_S} and at most "
            f"{MAX_INTERVAL_S:g}; got {interval_s:g} (for example 0.5)"
        )
    if not math.isfinite(history_s) or history_s <= 0:
        raise CudaMemError(
            f"{names['history_s']} takes a positive number of seconds of history; got {history_s:g} (for example 600)"
        )
    if history_s / interval_s > MAX_SAMPLES_PER_DEVICE:
        raise CudaMemError(
            f"{names['history_s']} {history_s:g} at {names['interval_s']} {interval_s:g} keeps more than "
            f"{MAX_SAMPLES_PER_DEVICE} samples per device; raise the interval or shorten the history"
        )
    if not math.isfinite(max_updates_per_s) or max_updates_per_s <= 0:
        raise CudaMemError(f"{names['max_updates_per_s']} takes a positive number; got {max_updates_per_s:g}")


def _history_length(interval_s: float, history_s: float) -> int:
    return min(max(math.ceil(history_s / interval_s) + 1, 2), MAX_SAMPLES_PER_DEVICE)


def _describe(error: BaseException) -> str:
    if isinstance(error, CudaMemError):
        return str(error)
    return f"{type(error).__name__}: {error}"


class Poller:
    """Polls NVML on a daemon thread; one per shell, started and stopped any number of times.

    ``devices`` selects by position in ``hardware.device_map.devices()``, which is PyTorch's
    ``cuda:N`` numbering (before PyTorch initialises CUDA, the devices ``CUDA_VISIBLE_DEVICES``
    names, in CUDA's order). ``None`` monitors them all.

    ``clock`` stamps samples; ``monotonic`` paces notifications. Tests pass their own and drive
    ``tick()`` directly, without a thread.
    """

    def __init__(
        self,
        hardware: Hardware,
        *,
        interval_s: float = DEFAULT_INTERVAL_S,
        history_s: float = DEFAULT_HISTORY_S,
        devices: Sequence[int] | None = None,
        max_updates_per_s: float = DEFAULT_MAX_UPDATES_PER_S,
        max_backoff_s: float = MAX_BACKOFF_S,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        keepalive_s: float | None = None,
    ):
        validate_settings(interval_s, history_s, max_updates_per_s)
        self.hardware = hardware
        self._interval_s = float(interval_s)
        self._history_s = float(history_s)
        self._selection: tuple[int, ...] | None = None if devices is None else tuple(devices)
        self._min_gap_s = 1.0 / max_updates_per_s
        self._max_backoff_s = max(max_backoff_s, interval_s)
        self._clock = clock
        self._monotonic = monotonic
        # Listeners that must hear from the poller even while nothing changes (an engine's feed to the
        # client: silence there means "not answering") are told the unchanged state this often.
        self.keepalive_s = keepalive_s

        self._lock = threading.RLock()
        self._history: dict[int, deque[Sample]] = {}
        self._peaks: dict[int, tuple[int, float]] = {}
        self._rows: tuple[tuple[Device, str | None], ...] = ()  # devices of the last read, with remarks
        self._error: str | None = None
        self._consecutive_errors = 0
        self._unavailable: str | None = None
        self._stop_reason: str | None = None
        self._listeners: list[Listener] = []

        self._thread: threading.Thread | None = None
        self._active = False
        self._stop_event = threading.Event()
        self._wake = threading.Event()
        self._last_key: object = None
        self._last_notified_at: float | None = None
        self._pending = False
        self._cpu_time_s = 0.0
        self.notifications = 0  # how many states were handed to listeners, for tests and benchmarks

    # -- configuration ----------------------------------------------------------------------
    @property
    def interval_s(self) -> float:
        return self._interval_s

    @property
    def history_s(self) -> float:
        return self._history_s

    @property
    def max_updates_per_s(self) -> float:
        return 1.0 / self._min_gap_s

    @property
    def selection(self) -> tuple[int, ...] | None:
        return self._selection

    def reconfigure(
        self,
        *,
        interval_s: float | None = None,
        history_s: float | None = None,
        max_updates_per_s: float | None = None,
    ) -> None:
        """Change the timing of this poller, running or not; recorded history is kept."""
        with self._lock:
            interval = self._interval_s if interval_s is None else float(interval_s)
            history = self._history_s if history_s is None else float(history_s)
            rate = 1.0 / self._min_gap_s if max_updates_per_s is None else float(max_updates_per_s)
            validate_settings(interval, history, rate)
            changed = interval != self._interval_s
            self._interval_s, self._history_s, self._min_gap_s = interval, history, 1.0 / rate
            self._max_backoff_s = max(self._max_backoff_s, interval)
            length = _history_length(interval, history)
            for key, samples in self._history.items():
                if samples.maxlen != length:
                    self._history[key] = deque(samples, maxlen=length)
            if changed:
                self._wake.set()  # read now, so a long old interval does not delay the new one

    def select(self, devices: Sequence[int] | None) -> None:
        """Watch these ``cuda:N`` devices from the next read on; ``None`` watches all."""
        with self._lock:
            self._selection = None if devices is None else tuple(devices)

    # -- listeners --------------------------------------------------------------------------
    def subscribe(self, listener: Listener) -> Callable[[], None]:
        """Call ``listener(state)`` on each shown change (from the poller thread); returns an unsubscribe."""
        with self._lock:
            self._listeners.append(listener)

        def unsubscribe() -> None:
            with self._lock:
                if listener in self._listeners:
                    self._listeners.remove(listener)

        return unsubscribe

    # -- lifecycle --------------------------------------------------------------------------
    @property
    def running(self) -> bool:
        thread = self._thread
        return self._active and (thread is None or thread.is_alive())

    @property
    def thread(self) -> threading.Thread | None:
        return self._thread

    @property
    def cpu_time_s(self) -> float:
        """CPU seconds the poller thread has used in its current (or last) run."""
        return self._cpu_time_s

    def start(self) -> bool:
        """Start polling; returns ``False`` (and says why in ``state().unavailable``) where nothing can be.

        Starting a running poller does nothing. A restart begins a new history and a new peak.
        """
        with self._lock:
            if self.running:
                return True
            previous = self._thread
        if previous is not None and previous.is_alive() and previous is not threading.current_thread():
            previous.join(_JOIN_TIMEOUT_S)  # outside the lock: it may need the lock to finish
        reason = self.hardware.nvml.status()
        if reason is not None:
            with self._lock:
                self._unavailable = "no GPU to monitor: " + "; ".join(self.hardware.unavailable() or [reason])
            self._notify(force=True)
            return False
        with self._lock:
            self._unavailable = None
            self._history.clear()
            self._peaks.clear()
            self._rows = ()
            self._error = None
            self._consecutive_errors = 0
            self._stop_reason = None
            self._cpu_time_s = 0.0
            self._last_key = None
            self._last_notified_at = None
            self._pending = False
            self._stop_event = threading.Event()
            self._wake = threading.Event()
            self._thread = None
            self._active = True
        # The first read happens here, so whoever shows the monitor right after has a reading.
        first_delay = self.tick()
        with self._lock:
            self._thread = threading.Thread(
                target=self._run, args=(self._stop_event, self._wake, first_delay), name=THREAD_NAME, daemon=True
            )
            _live_pollers.add(self)
            self._thread.start()
            return True

    def stop(self, reason: str | None = None, timeout_s: float = _JOIN_TIMEOUT_S) -> None:
        """Stop the thread and wait for it (unless called from it), then show the final state."""
        with self._lock:
            thread, was_active = self._thread, self._active
            self._active = False
            self._stop_event.set()
            self._wake.set()
            if thread is None or not was_active:
                return
            self._stop_reason = reason
        if thread is not threading.current_thread():
            # Waiting matters: NVML may be shut down right after (on unload), and a thread still
            # inside an NVML call then would use freed memory.
            thread.join(timeout_s)
        self._notify(force=True)

    def _run(self, stop_event: threading.Event, wake: threading.Event, delay: float) -> None:
        # Each run has its own events, so a thread still finishing after a restart cannot be
        # confused with the new one.
        while True:
            try:
                wake.wait(min(delay, MAX_INTERVAL_S))
                wake.clear()
                if stop_event.is_set():
                    break
                delay = self.tick()
            except Exception:  # tick() guards the reads; this is a bug of ours, kept from the kernel
                logger.exception("cudamem monitor: internal error")
                with self._lock:
                    self._error = "internal error in the monitor (details in the kernel's log)"
                delay = min(self._max_backoff_s, MAX_INTERVAL_S)
            self._cpu_time_s = time.thread_time()

    # -- reading ----------------------------------------------------------------------------
    def _selected(self, devices: list[Device]) -> list[Device]:
        if self._selection is None:
            return devices
        return [devices[i] for i in self._selection if 0 <= i < len(devices)]

    def tick(self) -> float:
        """Read every selected device once; return the seconds to wait before the next read.

        Never raises: a failure is recorded as the state's ``error`` and lengthens the wait.
        """
        try:
            readings = self._read()
        except Exception as error:  # a background thread must not raise into the kernel
            with self._lock:
                message = _describe(error)
                if not isinstance(error, CudaMemError) and self._consecutive_errors == 0:
                    logger.warning("cudamem monitor: unexpected error while polling", exc_info=True)
                self._consecutive_errors += 1
                self._error = message
                delay = min(self._interval_s * 2**self._consecutive_errors, self._max_backoff_s)
            return self._after_tick(delay)
        with self._lock:
            self._consecutive_errors = 0
            self._error = None
            length = _history_length(self._interval_s, self._history_s)
            self._rows = tuple((device, note) for device, _, note in readings)
            for device, sample, _ in readings:
                key = device.nvml_index
                if key is None or sample is None:
                    continue
                self._history.setdefault(key, deque(maxlen=length)).append(sample)
                peak = self._peaks.get(key)
                if peak is None or sample.used_bytes > peak[0]:
                    self._peaks[key] = (sample.used_bytes, sample.time_s)
            delay = self._interval_s
        return self._after_tick(delay)

    def _read(self) -> list[tuple[Device, Sample | None, str | None]]:
        hardware = self.hardware
        nvml = hardware.nvml
        readings: list[tuple[Device, Sample | None, str | None]] = []
        for device in self._selected(hardware.device_map.devices()):
            index = device.nvml_index
            if index is None:
                readings.append((device, None, NOT_IN_NVML))
                continue
            memory = nvml.memory(index)
            own = hardware.own_process_bytes(index, memory.used_bytes)  # reused while "used" stands
            utilization = nvml.utilization_percent(index)
            sample = Sample(
                time_s=self._clock(),
                used_bytes=memory.used_bytes,
                total_bytes=memory.total_bytes,
                process_bytes=own,
                utilization_percent=utilization,
            )
            readings.append((device, sample, PROCESS_NOT_AVAILABLE if own is None else None))
        return readings

    def _after_tick(self, delay: float) -> float:
        self._notify()
        if self._pending and self._last_notified_at is not None:
            # A change held back by the rate limit goes out as soon as the limit allows.
            wait = self._min_gap_s - (self._monotonic() - self._last_notified_at)
            delay = min(delay, max(wait, 0.0))
        return delay

    # -- state and notification -------------------------------------------------------------
    def state(self) -> MonitorState:
        with self._lock:
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
            return MonitorState(
                running=self.running,
                interval_s=self._interval_s,
                history_s=self._history_s,
                devices=tuple(devices),
                error=self._error,
                unavailable=self._unavailable,
                stop_reason=None if self.running else self._stop_reason,
            )

    def history(self, nvml_index: int) -> list[Sample]:
        """The recorded samples of one device, oldest first (a copy)."""
        with self._lock:
            return list(self._history.get(nvml_index, ()))

    def histories(self) -> dict[int, list[Sample]]:
        with self._lock:
            return {key: list(samples) for key, samples in self._history.items()}

    @staticmethod
    def _shown_key(state: MonitorState) -> object:
        """What a view shows, at the resolution it shows it: equal keys need no new message."""
        rows = []
        for row in state.devices:
            latest = row.latest
            rows.append(
                (
                    row.device.label,
                    row.note,
                    None if latest is None else latest.used_bytes // MiB,
                    None if latest is None else latest.total_bytes // MiB,
                    None if latest is None or latest.process_bytes is None else latest.process_bytes // MiB,
                    None if latest is None else latest.utilization_percent,
                    None if row.peak_used_bytes is None else row.peak_used_bytes // MiB,
                )
            )
        return (state.running, state.interval_s, state.error, state.unavailable, state.stop_reason, tuple(rows))

    def _notify(self, force: bool = False) -> None:
        state = self.state()
        key = self._shown_key(state)
        now = self._monotonic()
        with self._lock:
            quiet_s = None if self._last_notified_at is None else now - self._last_notified_at
            if key == self._last_key and not force:
                if self.keepalive_s is None or quiet_s is None or quiet_s < self.keepalive_s:
                    self._pending = False
                    return
            if not force and self._last_notified_at is not None and now - self._last_notified_at < self._min_gap_s:
                self._pending = True
                return
            self._last_key = key
            self._last_notified_at = now
            self._pending = False
            self.notifications += 1
            listeners = list(self._listeners)
        for listener in listeners:
            try:
                listener(state)
            except Exception:  # a broken view must not stop the polling, nor reach the kernel
                logger.warning("cudamem monitor: a view failed and was detached", exc_info=True)
                with self._lock:
                    if listener in self._listeners:
                        self._listeners.remove(listener)


# Every poller that was started, so interpreter exit (which is also how a kernel shuts down)
# can stop and join them before Python tears down the modules their thread uses.
_live_pollers: weakref.WeakSet[Poller] = weakref.WeakSet()


def stop_all(reason: str = "interpreter exit") -> None:
    for poller in list(_live_pollers):
        if poller.running:
            poller.stop(reason=reason, timeout_s=2.0)


atexit.register(stop_all)
