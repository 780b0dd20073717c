"""Record what a rerun allocates and frees, for the allocator replay (``replay``), through PyTorch's own
history without Python stacks; where the user records already, their history is read and left running as
they set it (no replay where its ring dropped where the rerun began, or the API is missing).
A run longer than the history is kept as a **window** of its last events where ``%oomfix`` asks, and only
where its replay reaches the run's measured peak (why: ``docs/oomfix.md``, "Why the reruns work this way").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..sources.base import OPTIMIZER_STEPS, AllocatorSource
from ..sources.torch_trace import (device_trace, device_traces, read_trace_within, start_segments, trace_rows,
                                   window_prologue, without_step_marks)
from ..growth.fitting import REPLAY_MARGIN
from ..growth.replay import ALLOC, FREE, Event, RecordedRun, StartSegment, allocated_blocks, replay

MAX_EVENTS = 100_000
"""The history kept per run where no window is asked for (``%%cudamem_plan``'s runs): far above a
training step's events, and below where replaying stops being cheaper than a rerun."""

WINDOW_EVENTS = 400_000
"""The history kept per rerun where windows are asked for (``%oomfix``'s): a window must hold one whole
pass of the cell's loop to reach the run's peak."""


class Recorder:
    """Starts and stops the history around one rerun; every failure to do so means "not recorded".
    ``windows``: keep a run too long for the history as its last events (see the module docstring)."""

    def __init__(self, allocator: AllocatorSource, windows: bool = False):
        self.allocator = allocator
        self.windows = windows
        self.max_events = WINDOW_EVENTS if windows else MAX_EVENTS
        self._joined: _HistoryEnd | None = None  # where the user's history stood when the rerun began

    def state(self, device: int) -> tuple[StartSegment, ...] | None:
        """The segments now (where the next rerun starts); ``None`` when they cannot be read."""
        try:
            return start_segments(self.allocator.snapshot(), device)
        except Exception:  # noqa: BLE001  an old torch, no CUDA: the search does without a replay
            return None

    def start(self, device: int) -> tuple[StartSegment, ...] | None:
        """Start recording; the segments the rerun starts from, or ``None`` when not recording."""
        try:
            snapshot = self.allocator.snapshot()
            joined = _HistoryEnd.of(snapshot, device) if any(device_traces(snapshot)) else None
            start = start_segments(snapshot, device)
            self.allocator.start_trace(self.max_events, stacks=False, mark_steps=True, join=joined is not None)
        except Exception:  # noqa: BLE001
            return None
        self._joined = joined
        return start

    def stop(self, start: tuple[StartSegment, ...] | None, device: int, failed: bool) -> RecordedRun | None:
        """Stop recording (when ``start`` says it started) and read the rerun's events."""
        if start is None:
            return None
        joined, self._joined = self._joined, None
        try:
            snapshot = self.allocator.stop_trace(leave_running=joined is not None)
            rows = trace_rows(snapshot, device)
        except Exception:  # noqa: BLE001
            return None
        if joined is not None:
            begun = joined.found_in(snapshot, device)
            if begun is None:
                return None  # the user's ring dropped where the rerun began
            rows = rows[begun:]
        whole = joined is not None or len(rows) < self.max_events  # else the ring dropped its beginning
        rows, steps = without_step_marks(rows, snapshot.get(OPTIMIZER_STEPS) or (), device)
        if whole:
            events, left, spans = read_trace_within(rows, start, failed, steps)
            return RecordedRun(start, tuple(events), left, steps=spans)
        if not self.windows:
            return None
        prologue = window_prologue(snapshot, rows, start, device)
        if prologue is None:
            return None
        shift = len(prologue)
        events, left, spans = read_trace_within(prologue + rows, start, failed,
                                                [(first + shift, after + shift) for first, after in steps])
        carried = frozenset(key for kind, key, _, _ in events[:len(prologue)] if kind == ALLOC)
        if not self._reaches_the_peak(events, carried, start, device):
            return None
        return RecordedRun(start, tuple(events), left, whole=False, carried=carried, steps=spans)

    def _reaches_the_peak(self, events: Sequence[Event], carried: frozenset[int], start: tuple[StartSegment, ...],
                          device: int) -> bool:
        """Whether the window's replay reaches the run's measured peak (within the replay's margin) without
        what was carried into it that it frees: else the run's largest moment began before the window."""
        try:
            measured = self.allocator.read(device).peak_allocated_bytes
        except Exception:  # noqa: BLE001
            return False
        freed = {key for kind, key, _, _ in events if kind == FREE and key in carried}
        own = [event for event in events if event[1] not in freed]
        at_start = sum(allocated_blocks(start).values())
        replayed = replay(own, start, 1 << 62).peak_allocated_bytes
        return replayed >= measured - REPLAY_MARGIN * max(measured - at_start, 0)


@dataclass(frozen=True)
class _HistoryEnd:
    """Where a history someone else records stood on one device: its length and its last entry."""

    length: int
    last: object

    @classmethod
    def of(cls, snapshot: dict, device: int) -> _HistoryEnd:
        entries = device_trace(snapshot, device)
        return cls(len(entries), entries[-1] if entries else None)

    def found_in(self, snapshot: dict, device: int) -> int | None:
        """The index in ``snapshot``'s history of the first entry after this end; ``None`` where the history
        did not grow past it unchanged: a full ring drops its oldest entries, and where the rerun began is
        then lost (torch's default ring is unbounded)."""
        entries = device_trace(snapshot, device)
        if len(entries) <= self.length or (self.length and entries[self.length - 1] != self.last):
            return None
        return self.length
