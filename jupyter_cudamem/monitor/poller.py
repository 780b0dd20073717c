"""The monitor's background thread: reads NVML at an interval and keeps a bounded history.

No widgets here. A ``Poller`` reads every selected device through the shared ``Hardware`` (so it
uses the one process-wide NVML session that ``%%cudamem`` uses too), keeps the last ``history_s``
seconds of samples per device in a ring buffer, tracks the peak since it started, and tells its
listeners (the views) about a new state only when a shown value changed, and at most
``max_updates_per_s`` times a second whatever the interval: a view sends a frontend message per
notification, and a kernel must not be flooded.

This module holds the thread's life cycle; the read is ``reading``'s, the samples and peaks
``store.SampleStore``'s, the rate limit ``notify.Notifier``'s, the settings' bounds ``settings``'s.

The thread never raises into the kernel: an error while reading is recorded, shown through the
state, and the next read waits longer each time (exponential back-off) until a read succeeds.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from collections.abc import Callable, Sequence

from ..errors import CudaMemError
from ..hardware import Hardware
from .notify import Notifier
from .reading import NOT_IN_NVML, PROCESS_NOT_AVAILABLE, describe_error, read_devices
from .settings import (
    DEFAULT_HISTORY_S,
    DEFAULT_INTERVAL_S,
    DEFAULT_MAX_UPDATES_PER_S,
    MAX_BACKOFF_S,
    MAX_INTERVAL_S,
    MAX_SAMPLES_PER_DEVICE,
    MIN_INTERVAL_S,
    OWN_NAMES,
    history_length,
    validate_settings,
)
from .state import DeviceState, Listener, MonitorState, Sample
from .store import SampleStore

__all__ = [
    "DEFAULT_HISTORY_S",
    "DEFAULT_INTERVAL_S",
    "DEFAULT_MAX_UPDATES_PER_S",
    "MAX_BACKOFF_S",
    "MAX_INTERVAL_S",
    "MAX_SAMPLES_PER_DEVICE",
    "MIN_INTERVAL_S",
    "NOT_IN_NVML",
    "OWN_NAMES",
    "PROCESS_NOT_AVAILABLE",
    "THREAD_NAME",
    "DeviceState",
    "Listener",
    "MonitorState",
    "Poller",
    "Sample",
    "stop_all",
    "validate_settings",
]

logger = logging.getLogger(__name__)

_JOIN_TIMEOUT_S = 5.0
THREAD_NAME = "cudamem-monitor"


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
        self._max_backoff_s = max(max_backoff_s, interval_s)
        self._clock = clock

        self._lock = threading.RLock()  # one lock for the whole state: the store's and the notifier's too
        self._store = SampleStore()
        self._notifier = Notifier(self._lock, max_updates_per_s, monotonic, keepalive_s)
        self._unavailable: str | None = None
        self._stop_reason: str | None = None

        self._thread: threading.Thread | None = None
        self._active = False
        self._stop_event = threading.Event()
        self._wake = threading.Event()
        self._cpu_time_s = 0.0

    # -- configuration ----------------------------------------------------------------------
    @property
    def interval_s(self) -> float:
        return self._interval_s

    @property
    def history_s(self) -> float:
        return self._history_s

    @property
    def max_updates_per_s(self) -> float:
        return 1.0 / self._notifier.min_gap_s

    @property
    def selection(self) -> tuple[int, ...] | None:
        return self._selection

    @property
    def keepalive_s(self) -> float | None:
        """How often listeners hear the unchanged state (an engine's feed: silence means "not
        answering"); ``None``: only of changes."""
        return self._notifier.keepalive_s

    @keepalive_s.setter
    def keepalive_s(self, seconds: float | None) -> None:
        self._notifier.keepalive_s = seconds

    @property
    def notifications(self) -> int:
        """How many states were handed to listeners, for tests and benchmarks."""
        return self._notifier.notifications

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
            rate = self.max_updates_per_s if max_updates_per_s is None else float(max_updates_per_s)
            validate_settings(interval, history, rate)
            changed = interval != self._interval_s
            self._interval_s, self._history_s, self._notifier.min_gap_s = interval, history, 1.0 / rate
            self._max_backoff_s = max(self._max_backoff_s, interval)
            self._store.resize(history_length(interval, history))
            if changed:
                self._wake.set()  # read now, so a long old interval does not delay the new one

    def select(self, devices: Sequence[int] | None) -> None:
        """Watch these ``cuda:N`` devices from the next read on; ``None`` watches all."""
        with self._lock:
            self._selection = None if devices is None else tuple(devices)

    # -- listeners --------------------------------------------------------------------------
    def subscribe(self, listener: Listener) -> Callable[[], None]:
        """Call ``listener(state)`` on each shown change (from the poller thread); returns an unsubscribe."""
        return self._notifier.subscribe(listener)

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
            self._store.clear()
            self._stop_reason = None
            self._cpu_time_s = 0.0
            self._notifier.reset()
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
                    self._store.error = "internal error in the monitor (details in the kernel's log)"
                delay = min(self._max_backoff_s, MAX_INTERVAL_S)
            self._cpu_time_s = time.thread_time()

    # -- reading ----------------------------------------------------------------------------
    def tick(self) -> float:
        """Read every selected device once; return the seconds to wait before the next read.

        Never raises: a failure is recorded as the state's ``error`` and lengthens the wait.
        """
        try:
            readings = read_devices(self.hardware, self._selection, self._clock)
        except Exception as error:  # a background thread must not raise into the kernel
            with self._lock:
                message = describe_error(error)
                if not isinstance(error, CudaMemError) and self._store.consecutive_errors == 0:
                    logger.warning("cudamem monitor: unexpected error while polling", exc_info=True)
                failures = self._store.record_failure(message)
                delay = min(self._interval_s * 2**failures, self._max_backoff_s)
            return self._after_tick(delay)
        with self._lock:
            self._store.record(readings, history_length(self._interval_s, self._history_s))
            delay = self._interval_s
        return self._after_tick(delay)

    def _after_tick(self, delay: float) -> float:
        self._notify()
        return self._notifier.next_delay(delay)

    # -- state and notification -------------------------------------------------------------
    def state(self) -> MonitorState:
        with self._lock:
            return MonitorState(
                running=self.running,
                interval_s=self._interval_s,
                history_s=self._history_s,
                devices=self._store.device_states(),
                error=self._store.error,
                unavailable=self._unavailable,
                stop_reason=None if self.running else self._stop_reason,
            )

    def history(self, nvml_index: int) -> list[Sample]:
        """The recorded samples of one device, oldest first (a copy)."""
        with self._lock:
            return self._store.history(nvml_index)

    def histories(self) -> dict[int, list[Sample]]:
        with self._lock:
            return self._store.histories()

    def _notify(self, force: bool = False) -> None:
        self._notifier.notify(self.state(), force)


# Every poller that was started, so interpreter exit (which is also how a kernel shuts down)
# can stop and join them before Python tears down the modules their thread uses.
_live_pollers: weakref.WeakSet[Poller] = weakref.WeakSet()


def stop_all(reason: str = "interpreter exit") -> None:
    for poller in list(_live_pollers):
        if poller.running:
            poller.stop(reason=reason, timeout_s=2.0)


atexit.register(stop_all)
