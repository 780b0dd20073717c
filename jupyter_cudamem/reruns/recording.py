"""Record what a rerun allocates and frees, for the allocator replay (``replay``).

PyTorch keeps the history itself when asked (``torch.cuda.memory._record_memory_history``, torch 2.1
and later): every allocation and free in order, with its size and address. Recorded without Python
stacks, which is what makes it cheap enough to leave on for a rerun. The allocator source
(``sources.torch_alloc``) switches it on and off; this module only reads its snapshots.

A rerun is not recorded when the history is already being recorded (the user's own recording, or
``%%cudamem --trace``): switching it off would end theirs. Nor when the snapshot API is missing, or
when the rerun made more events than ``MAX_EVENTS``: the history is a ring buffer, and a run whose
beginning was dropped cannot be replayed. The batch search then does without a replay.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..sources.base import AllocatorSource
from ..growth.replay import Event, StartSegment, held_elsewhere, read_trace

MAX_EVENTS = 100_000
"""The history kept per rerun. The benchmark's training steps make 100-3,000 events each (ResNet-50
under autocast: 2,200); a cell running dozens of steps stays far below this, and replaying 100,000
events a dozen times (the search's bisection) takes seconds in Python, which is where it stops being
worth it against a rerun."""


@dataclass(frozen=True)
class RecordedRun:
    """One rerun as the replay reads it: the segments it started from, its events, and what it left
    allocated as ``(address, key)`` (``replay.read_trace``)."""

    start: tuple[StartSegment, ...]
    events: tuple[Event, ...]
    left: tuple[tuple[int, int], ...] = ()

    def events_from(self, start: tuple[StartSegment, ...]) -> list[Event]:
        """The events a run from ``start`` makes (``replay.held_elsewhere``)."""
        return held_elsewhere(self.events, self.left, start)


def start_segments(snapshot: Mapping[str, Any], device: int) -> tuple[StartSegment, ...]:
    """The segments of ``device`` in an allocator snapshot, blocks in address order."""
    segments = []
    for segment in snapshot.get("segments") or ():
        if segment.get("device", device) != device:
            continue
        blocks = tuple((int(block["size"]), str(block.get("state", "")).startswith("active"))
                       for block in segment.get("blocks") or ())
        segments.append(StartSegment(int(segment["address"]), segment.get("segment_type") == "small", blocks,
                                     int(segment.get("stream") or 0)))
    return tuple(sorted(segments, key=lambda s: s.address))


def trace_rows(snapshot: Mapping[str, Any], device: int) -> list[tuple[Any, Any, Any, Any]]:
    """``(action, address, size, stream)`` of each event of ``device``'s recorded history."""
    traces: Sequence[Any] = snapshot.get("device_traces") or ()
    entries = traces[device] if device < len(traces) else ()
    return [(entry.get("action"), entry.get("addr"), entry.get("size"), entry.get("stream")) for entry in entries]


class Recorder:
    """Starts and stops the history around one rerun; every failure to do so means "not recorded"."""

    def __init__(self, allocator: AllocatorSource):
        self.allocator = allocator

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
            if any(snapshot.get("device_traces") or ()):
                return None  # someone else is recording: leave their history alone
            start = start_segments(snapshot, device)
            self.allocator.start_trace(MAX_EVENTS, stacks=False)
        except Exception:  # noqa: BLE001
            return None
        return start

    def stop(self, start: tuple[StartSegment, ...] | None, device: int, failed: bool) -> RecordedRun | None:
        """Stop recording (when ``start`` says it started) and read the rerun's events."""
        if start is None:
            return None
        try:
            rows = trace_rows(self.allocator.stop_trace(), device)
        except Exception:  # noqa: BLE001
            return None
        if len(rows) >= MAX_EVENTS:
            return None
        events, left = read_trace(rows, start, failed=failed)
        return RecordedRun(start, tuple(events), left)
