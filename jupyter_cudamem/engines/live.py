"""The live monitor across engines: each engine polls its own GPUs, the client shows them all.

On each engine the monitor's own ``Poller`` reads NVML (the engine's NVML: its host, its cards, its
process). An ``EngineFeed`` subscribed to it sends each *shown change* to the client as a plain
``EngineReading`` (the poller already sends at most ``max_updates_per_s`` a second, and only when a shown
figure moved) plus a keepalive every few intervals, so silence means "not answering", not "nothing moved".

On the client an ``EnginesLive`` thread wakes at the monitor's interval, reads the latest reading of each
engine from wherever the transport left it (ipyparallel keeps them in the client's metadata: see
``gather.feed_sender``), and tells its views only when what they show changed. An engine the controller no
longer lists is shown as gone, one silent for longer than ``silent_after_s`` as not answering; neither
stops the thread nor the other engines' rows. Like the poller, the thread never raises into the kernel.
"""

from __future__ import annotations

import enum
import html
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from ..monitor.notify import Listeners
from ..monitor.poller import MonitorState
from ..units import format_bytes, format_seconds
from .records import EngineIdentity
from .table import short_uuid

logger = logging.getLogger(__name__)

THREAD_NAME = "cudamem-engines-monitor"
KEEPALIVE_INTERVALS = 5  # an engine with nothing new still says so every this many intervals
SILENT_INTERVALS = 3 * KEEPALIVE_INTERVALS  # and is shown as not answering after this many without a word
_JOIN_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class ReadingDevice:
    """One GPU as an engine's poller last read it. Sizes in bytes."""

    uuid: str | None
    name: str
    label: str
    used_bytes: int | None
    total_bytes: int | None
    process_bytes: int | None  # the engine's own process on this card (NVML); None where NVML cannot tell
    utilization_percent: int | None
    peak_used_bytes: int | None
    note: str | None


@dataclass(frozen=True)
class EngineReading:
    """What one engine's monitor showed at one instant, as sent to the client."""

    engine_id: int
    identity: EngineIdentity
    sequence: int  # counts the engine's sends, so the client sees a new reading even when nothing moved
    time_s: float  # the engine's wall clock
    devices: tuple[ReadingDevice, ...]
    running: bool
    error: str | None
    unavailable: str | None


def reading_of(engine_id: int, identity: EngineIdentity, sequence: int, state: MonitorState, now_s: float) -> EngineReading:
    devices = []
    for row in state.devices:
        latest = row.latest
        devices.append(
            ReadingDevice(
                uuid=row.device.uuid,
                name=row.device.name,
                label=row.device.label,
                used_bytes=None if latest is None else latest.used_bytes,
                total_bytes=None if latest is None else latest.total_bytes,
                process_bytes=None if latest is None else latest.process_bytes,
                utilization_percent=None if latest is None else latest.utilization_percent,
                peak_used_bytes=row.peak_used_bytes,
                note=row.note,
            )
        )
    return EngineReading(
        engine_id=engine_id,
        identity=identity,
        sequence=sequence,
        time_s=now_s,
        devices=tuple(devices),
        running=state.running,
        error=state.error,
        unavailable=state.unavailable,
    )


class EngineFeed:
    """Engine side: turns each state a poller hands its listeners into an ``EngineReading`` and sends it.

    ``send`` may raise (the transport is gone); the poller catches a listener's error and detaches it, so a
    broken feed costs the engine nothing but its feed.
    """

    def __init__(
        self, engine_id: int, identity: EngineIdentity, send: Callable[[EngineReading], None], clock: Callable[[], float] = time.time
    ):
        self.engine_id = engine_id
        self.identity = identity
        self._send = send
        self._clock = clock
        self.sent = 0

    def __call__(self, state: MonitorState) -> None:
        self.sent += 1
        self._send(reading_of(self.engine_id, self.identity, self.sent, state, self._clock()))


class EngineLiveStatus(enum.Enum):
    """What the client knows of an engine's feed."""

    WAITING = "waiting for a first reading"
    LIVE = "live"
    SILENT = "not answering"
    GONE = "gone"


@dataclass(frozen=True)
class EngineLiveRow:
    engine_id: int
    status: EngineLiveStatus
    reading: EngineReading | None
    silent_s: float | None  # seconds since the client last saw a new reading from it


@dataclass(frozen=True)
class LiveState:
    running: bool
    interval_s: float
    engines: tuple[EngineLiveRow, ...]
    stop_reason: str | None = None
    error: str | None = None


Listener = Callable[[LiveState], None]


class EnginesLive:
    """Client side: one daemon thread that gathers the engines' readings at an interval.

    ``readings()`` returns the latest reading per engine id as the transport holds them (never blocking on
    an engine); ``registered()`` the engine ids the controller lists now. Tests drive ``tick()`` by hand.
    """

    def __init__(
        self,
        engines: Iterable[int],
        readings: Callable[[], Mapping[int, EngineReading]],
        registered: Callable[[], Iterable[int]],
        *,
        interval_s: float,
        silent_after_s: float | None = None,
        monotonic: Callable[[], float] = time.monotonic,
    ):
        self.engines = tuple(sorted(set(engines)))
        self._readings = readings
        self._registered = registered
        self.interval_s = interval_s
        self.silent_after_s = silent_after_s if silent_after_s is not None else SILENT_INTERVALS * interval_s
        self._monotonic = monotonic
        self._lock = threading.RLock()
        self._latest: dict[int, EngineReading] = {}
        self._seen_at: dict[int, float] = {}
        self._started_at = monotonic()
        self._gone: set[int] = set()
        self._error: str | None = None
        self._stop_reason: str | None = None
        self._listeners: Listeners[LiveState] = Listeners(self._lock, "cudamem engines monitor", logger)
        self._last_key: object = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.notifications = 0

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stop.is_set()

    def subscribe(self, listener: Listener) -> Callable[[], None]:
        return self._listeners.subscribe(listener)

    def start(self) -> None:
        if self.running:
            return
        self._stop = threading.Event()
        self.tick()
        self._thread = threading.Thread(target=self._run, args=(self._stop,), name=THREAD_NAME, daemon=True)
        self._thread.start()

    def stop(self, reason: str = "stopped", timeout_s: float = _JOIN_TIMEOUT_S) -> None:
        thread = self._thread
        self._stop.set()
        with self._lock:
            self._stop_reason = reason
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)
        self._notify(force=True)

    def _run(self, stop: threading.Event) -> None:
        while not stop.wait(self.interval_s):
            self.tick()

    def tick(self) -> None:
        """Read what the engines sent; never raises (an error is shown, and the next tick tries again)."""
        try:
            readings = dict(self._readings())
            registered = set(self._registered())
            now = self._monotonic()
            with self._lock:
                self._error = None
                for engine in self.engines:
                    reading = readings.get(engine)
                    previous = self._latest.get(engine)
                    if reading is not None and (previous is None or reading.sequence != previous.sequence or reading.time_s != previous.time_s):
                        self._latest[engine] = reading
                        self._seen_at[engine] = now
                    if engine not in registered:
                        self._gone.add(engine)
        except Exception as error:  # a background thread must not raise into the kernel
            logger.warning("cudamem engines monitor: reading failed", exc_info=True)
            with self._lock:
                self._error = f"{type(error).__name__}: {error}"
        self._notify()

    def state(self) -> LiveState:
        now = self._monotonic()
        with self._lock:
            rows = []
            for engine in self.engines:
                reading = self._latest.get(engine)
                seen = self._seen_at.get(engine)
                silent_s = now - (seen if seen is not None else self._started_at)
                if engine in self._gone:
                    status = EngineLiveStatus.GONE
                elif silent_s > self.silent_after_s:
                    status = EngineLiveStatus.SILENT
                elif reading is None:
                    status = EngineLiveStatus.WAITING
                else:
                    status = EngineLiveStatus.LIVE
                rows.append(EngineLiveRow(engine, status, reading, silent_s if seen is not None else None))
            return LiveState(
                running=self.running,
                interval_s=self.interval_s,
                engines=tuple(rows),
                stop_reason=None if self.running else self._stop_reason,
                error=self._error,
            )

    def _notify(self, force: bool = False) -> None:
        state = self.state()
        key = live_text(state, with_ages=False)
        with self._lock:
            if key == self._last_key and not force:
                return
            self._last_key = key
            self.notifications += 1
            listeners = self._listeners.snapshot()
        self._listeners.tell(listeners, state)


# -- rendering ----------------------------------------------------------------------------------------
def _device_words(device: ReadingDevice) -> str:
    if device.used_bytes is None or device.total_bytes is None:
        return f"{device.label} {device.note or 'no reading yet'}"
    share = device.used_bytes / device.total_bytes if device.total_bytes else 0.0
    parts = [f"{device.label} {short_uuid(device.uuid)} {format_bytes(device.used_bytes)} / {format_bytes(device.total_bytes)} ({share:.0%})"]
    parts.append("this engine " + (format_bytes(device.process_bytes) if device.process_bytes is not None else "n/a"))
    if device.utilization_percent is not None:
        parts.append(f"util {device.utilization_percent}%")
    if device.peak_used_bytes is not None:
        parts.append(f"peak {format_bytes(device.peak_used_bytes)}")
    return " · ".join(parts)


def _row_words(row: EngineLiveRow, with_ages: bool) -> tuple[str, str, str]:
    reading = row.reading
    where = "" if reading is None else f"{reading.identity.host} pid {reading.identity.pid}"
    status = row.status.value
    if row.status is EngineLiveStatus.SILENT and with_ages and row.silent_s is not None:
        status += f" for {format_seconds(row.silent_s)}"
    if reading is None:
        return where, status, ""
    if reading.unavailable:
        return where, status, reading.unavailable
    words = " | ".join(_device_words(device) for device in reading.devices) or "no GPU selected"
    if reading.error:
        words += f"; error: {reading.error}"
    return where, status, words


def _header(state: LiveState) -> str:
    words = f"every {format_seconds(state.interval_s)}" if state.running else "stopped" + (
        f" ({state.stop_reason})" if state.stop_reason else ""
    )
    if state.error:
        words += f"; error: {state.error}"
    return f"cudamem engines monitor ({words})"


def live_text(state: LiveState, with_ages: bool = True) -> str:
    lines = [_header(state)]
    for row in state.engines:
        where, status, words = _row_words(row, with_ages)
        lines.append(f"  engine {row.engine_id} [{where}] {status}: {words}".replace(" []", ""))
    return "\n".join(lines)


_STATUS_COLOR = {EngineLiveStatus.SILENT: "#d62728", EngineLiveStatus.GONE: "#7f7f7f"}


def live_html(state: LiveState) -> str:
    rows = []
    for row in state.engines:
        where, status, words = _row_words(row, with_ages=True)
        color = _STATUS_COLOR.get(row.status)
        style = f' style="color:{color}"' if color else ""
        rows.append(
            f"<tr{style}><td>{row.engine_id}</td><td>{html.escape(where)}</td><td>{html.escape(status)}</td>"
            f"<td>{html.escape(words)}</td></tr>"
        )
    return (
        f"<div><b>{html.escape(_header(state))}</b></div><table class=\"cudamem-engines-live\" style=\"white-space:nowrap\">"
        "<thead><tr><th>engine</th><th>where</th><th>status</th><th>GPUs</th></tr></thead>"
        f"<tbody>{''.join(rows)}</tbody></table>"
    )


class LiveView:
    """The engines monitor in the notebook: an ipywidgets HTML panel, or a text line updated in place."""

    def __init__(self, live: EnginesLive, use_widgets: bool = True):
        self.live = live
        self.updates_sent = 0
        self._widget = None
        self._handle = None
        self._shown: str | None = None
        if use_widgets:
            try:
                import ipywidgets

                self._widget = ipywidgets.HTML(value=live_html(live.state()))
            except ImportError:
                self._widget = None
        self._unsubscribe: Callable[[], None] | None = live.subscribe(self.render)

    def show(self) -> None:
        from IPython.display import display

        state = self.live.state()
        if self._widget is not None:
            bundle = self._widget._repr_mimebundle_()
            bundle["text/plain"] = live_text(state)
            display(bundle, raw=True)
        else:
            self._shown = live_text(state)
            self._handle = display({"text/plain": self._shown}, raw=True, display_id=True)

    def render(self, state: LiveState) -> None:
        if self._widget is not None:
            value = live_html(state)
            if self._widget.value != value:
                self._widget.value = value
                self.updates_sent += 1
        elif self._handle is not None:
            text = live_text(state)
            if text != self._shown:
                self._shown = text
                self._handle.update({"text/plain": text}, raw=True)
                self.updates_sent += 1

    def detach(self) -> None:
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
