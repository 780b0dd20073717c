"""Telling the monitor's views about a new state: only when a shown value changed, and at most
``max_updates_per_s`` times a second whatever the interval, since a view sends a frontend message per
notification and a kernel must not be flooded. A change held back by the rate limit goes out as soon
as the limit allows; a listener that must hear even of no change (an engine's feed) gets a keepalive.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

from ..units import MiB
from .state import Listener, MonitorState

logger = logging.getLogger("jupyter_cudamem.monitor.poller")  # where the poller's warnings always went


def shown_key(state: MonitorState) -> object:
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


S = TypeVar("S")


class Listeners(Generic[S]):
    """The views told of each new state: added and removed from any thread under the owner's lock, and
    called outside it; one that raises is detached with a warning (a broken view must not stop the
    thread that tells it, nor reach the kernel). The monitor's poller and the engines' gatherer share it."""

    def __init__(self, lock: threading.RLock, who: str, log: logging.Logger = logger):
        self._lock = lock
        self._who, self._log = who, log  # the warning's words ("cudamem monitor") and its logger
        self._items: list[Callable[[S], None]] = []

    def subscribe(self, listener: Callable[[S], None]) -> Callable[[], None]:
        """Call ``listener(state)`` on each state told; returns an unsubscribe."""
        with self._lock:
            self._items.append(listener)

        def unsubscribe() -> None:
            self._remove(listener)

        return unsubscribe

    def _remove(self, listener: Callable[[S], None]) -> None:
        with self._lock:
            if listener in self._items:
                self._items.remove(listener)

    def snapshot(self) -> list[Callable[[S], None]]:
        """The listeners now (taken under the lock; call them outside it with ``tell``)."""
        with self._lock:
            return list(self._items)

    def tell(self, listeners: list[Callable[[S], None]], state: S) -> None:
        for listener in listeners:
            try:
                listener(state)
            except Exception:  # noqa: BLE001 - see the class docstring
                self._log.warning("%s: a view failed and was detached", self._who, exc_info=True)
                self._remove(listener)


class Notifier:
    """The listeners of one poller and the rate limit on what they are told.

    Guarded by the poller's ``lock`` (one lock for the poller's whole state); listeners are called
    outside it, from whichever thread notifies.
    """

    def __init__(
        self,
        lock: threading.RLock,
        max_updates_per_s: float,
        monotonic: Callable[[], float],
        keepalive_s: float | None = None,
    ):
        self._lock = lock
        self.min_gap_s = 1.0 / max_updates_per_s
        self._monotonic = monotonic
        # Listeners that must hear from the poller even while nothing changes (an engine's feed to the
        # client: silence there means "not answering") are told the unchanged state this often.
        self.keepalive_s = keepalive_s
        self._listeners: Listeners[MonitorState] = Listeners(lock, "cudamem monitor")
        self._last_key: object = None
        self._last_notified_at: float | None = None
        self._pending = False
        self.notifications = 0  # how many states were handed to listeners, for tests and benchmarks

    def subscribe(self, listener: Listener) -> Callable[[], None]:
        """Call ``listener(state)`` on each shown change; returns an unsubscribe."""
        return self._listeners.subscribe(listener)

    def reset(self) -> None:
        """A new run: its first state goes out whatever the last run showed."""
        with self._lock:
            self._last_key = None
            self._last_notified_at = None
            self._pending = False

    def notify(self, state: MonitorState, force: bool = False) -> None:
        """Hand ``state`` to the listeners if it shows a change and the rate allows (``force``: always)."""
        key = shown_key(state)
        now = self._monotonic()
        with self._lock:
            quiet_s = None if self._last_notified_at is None else now - self._last_notified_at
            if key == self._last_key and not force:
                if self.keepalive_s is None or quiet_s is None or quiet_s < self.keepalive_s:
                    self._pending = False
                    return
            if not force and self._last_notified_at is not None and now - self._last_notified_at < self.min_gap_s:
                self._pending = True
                return
            self._last_key = key
            self._last_notified_at = now
            self._pending = False
            self.notifications += 1
            listeners = self._listeners.snapshot()
        self._listeners.tell(listeners, state)

    def next_delay(self, delay: float) -> float:
        """``delay`` to the next read, shortened so that a change held back by the rate limit goes out
        as soon as the limit allows."""
        if self._pending and self._last_notified_at is not None:
            wait = self.min_gap_s - (self._monotonic() - self._last_notified_at)
            delay = min(delay, max(wait, 0.0))
        return delay
