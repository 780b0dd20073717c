"""Record what a rerun allocates and frees, for the allocator replay (``replay``).

PyTorch keeps the history itself when asked (``torch.cuda.memory._record_memory_history``, torch 2.1
and later): every allocation and free in order, with its size and address. Recorded without Python
stacks, which is what makes it cheap enough to leave on for a rerun. The allocator source
(``sources.torch_alloc``) switches it on and off; this module only reads its snapshots.

A rerun is not recorded when the history is already being recorded (the user's own recording, or
``%%cudamem --trace``): switching it off would end theirs. Nor when the snapshot API is missing. The
batch search then does without a replay.

A rerun that makes more events than the history keeps (a ring buffer: its beginning is dropped) is
kept as a **window**, where the recorder is asked for one (``%oomfix``'s, ``WINDOW_EVENTS``): its last
events, after what was allocated when they began, read back from the end (each allocation undone, each
free undone). What the run had allocated by then is replayed as made at the window's start, in address
order, at the size it had whatever the batch (the outputs of the passes before, mostly, whose total
the data sets, not the batch), and what it had freed of what it started with as freed there. A window
is kept only where its replay at the run's own batch reaches the run's measured peak without what it
carried and frees (a pass in progress when it began): the window holds the run's largest moment, made
within it (a cell that loops over its data in batches, whose passes are alike). Why: such a cell is
where a replay is most worth having (a GPT-2 medium ``generate()`` over 96 prompts a batch at a time,
24 layers making a key/value cache one token longer each step, makes about 100,000 events per prompt;
the line alone ended on 22-23 where 29 fits, its window's replay on 29: the project's
``benchmarks/oomfix.py`` on an H100). Two windows are not paired request by request (they begin at
different places in the loop), so the search replays the larger of them alone (``Tries.replayed``).
``%%cudamem_plan`` keeps whole runs only, as it always has.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..sources.base import OPTIMIZER_STEPS, AllocatorSource
from ..growth.fitting import REPLAY_MARGIN
from ..growth.replay import (ALLOC, FREE, Event, StartSegment, allocated_blocks, held_elsewhere, read_trace_within, replay,
                             same_block)

MAX_EVENTS = 100_000
"""The history kept per run where no window is asked for (``%%cudamem_plan``'s runs). The benchmark's
training steps make 100-3,000 events each (ResNet-50 under autocast: 2,200); a cell running dozens of
steps stays far below this, and replaying 100,000 events a dozen times (the search's bisection) takes
seconds in Python, which is where it stops being worth it against a rerun."""

WINDOW_EVENTS = 400_000
"""The history kept per rerun where windows are asked for (``%oomfix``'s): a run up to this long is
kept whole, a longer one as a window of its last this many events, which must hold one whole pass of
the cell's loop for the window to reach the run's peak. On an H100 (the project's
``benchmarks/oomfix.py``), GPT-2 medium's ``generate()`` of 64 tokens after a prompt of 512 made about
100,000 events per prompt, and a window of 100,000 missed the prompt's first forward pass, its peak."""


@dataclass(frozen=True)
class RecordedRun:
    """One rerun as the replay reads it: the segments it started from, its events, and what it left
    allocated as ``(address, key)`` (``replay.read_trace``). ``whole`` is false for a window of a run
    too long to keep (see the module docstring); ``carried`` are then the keys of the allocations it
    had made before the window and still held, replayed at the window's start at the size they had."""

    start: tuple[StartSegment, ...]
    events: tuple[Event, ...]
    left: tuple[tuple[int, int], ...] = ()
    whole: bool = True
    carried: frozenset[int] = frozenset()  # a window's: keys of what the run held when the window began
    steps: tuple[tuple[int, int], ...] = ()  # each optimizer step() as (first event, event after its last)

    def events_from(self, start: tuple[StartSegment, ...], remade: frozenset[int] = frozenset()) -> list[Event]:
        """The events a run from ``start`` makes (``replay.held_elsewhere``; ``remade`` as there)."""
        return held_elsewhere(self.events, self.left, start, remade)


Row = tuple[Any, Any, Any, Any]
"""One event of the recorded history: ``(action, address, size, stream)``."""


def _segments_of(snapshot: Mapping[str, Any], device: int) -> Iterator[Mapping[str, Any]]:
    """The segments of ``device`` in an allocator snapshot, as the snapshot gives them."""
    for segment in snapshot.get("segments") or ():
        if segment.get("device", device) == device:
            yield segment


def start_segments(snapshot: Mapping[str, Any], device: int) -> tuple[StartSegment, ...]:
    """The segments of ``device`` in an allocator snapshot, blocks in address order."""
    segments = []
    for segment in _segments_of(snapshot, device):
        blocks = tuple((int(block["size"]), str(block.get("state", "")).startswith("active"))
                       for block in segment.get("blocks") or ())
        segments.append(StartSegment(int(segment["address"]), segment.get("segment_type") == "small", blocks,
                                     int(segment.get("stream") or 0)))
    return tuple(sorted(segments, key=lambda s: s.address))


def trace_rows(snapshot: Mapping[str, Any], device: int) -> list[Row]:
    """``(action, address, size, stream)`` of each event of ``device``'s recorded history."""
    traces: Sequence[Any] = snapshot.get("device_traces") or ()
    entries = traces[device] if device < len(traces) else ()
    return [(entry.get("action"), entry.get("addr"), entry.get("size"), entry.get("stream")) for entry in entries]


def without_step_marks(rows: Sequence[Row], marks: Sequence[Sequence[int]],
                       device: int) -> tuple[list[Row], list[tuple[int, int]]]:
    """``rows`` without the requests that mark the optimizer's steps (``sources.base.OPTIMIZER_STEPS``), and
    each marked step's span in what is left, ``(first row, row after the last)``; a step still open when
    the history ends (it raised) runs to the end.

    Why: what a step allocates (its state, its temporaries) is the parameters' size at every batch. One
    run cannot tell that from sizes alone: at a batch of one a sequence as long as the model is wide
    makes activations the size of a weight, and in a loop every step but the last looks like the batch's."""
    if not marks:
        return list(rows), []
    # The allocator's own rows (a segment it opened for the second request) stand between the pair's.
    rows = [row for row in rows if not str(row[0]).startswith("segment")]
    dropped: set[int] = set()
    spans: list[tuple[int, int]] = []
    cursor = 0
    for mark_device, first, second in marks:
        if mark_device != device:
            continue
        begin = next((i for i in range(cursor, len(rows) - 1) if rows[i][0] == "alloc" and rows[i][1] == first
                      and rows[i + 1][0] == "alloc" and rows[i + 1][1] == second), None)
        if begin is None:
            continue
        end = _drop_mark_frees(rows, begin, first, second, dropped)
        dropped.update((begin, begin + 1))
        spans.append((begin, end))
        cursor = begin + 2
    kept = [row for i, row in enumerate(rows) if i not in dropped]
    position = [0] * (len(rows) + 1)  # how many rows are kept before each row
    for i in range(len(rows)):
        position[i + 1] = position[i] + (i not in dropped)
    return kept, [(position[begin], position[end]) for begin, end in spans]


def _drop_mark_frees(rows: Sequence[Row], begin: int, first: int, second: int, dropped: set[int]) -> int:
    """Add to ``dropped`` the frees of a step's two mark requests (at ``first`` and ``second``, allocated at
    ``begin``); the row where the first is freed, which ends the step (the end of ``rows``: never)."""
    second_freed = False
    for i in range(begin + 2, len(rows)):
        action, address = rows[i][0], rows[i][1]
        if not str(action).startswith("free"):
            continue
        if address == second and not second_freed:
            dropped.add(i)
            second_freed = action == "free_completed"
        elif address == first:
            dropped.add(i)
            if action == "free_completed":
                return i
    return len(rows)


def _held_at_end(snapshot: Mapping[str, Any], device: int) -> dict[int, tuple[int | None, int, int]]:
    """The blocks ``device``'s segments hold in ``snapshot``: address -> (block bytes, requested, stream)."""
    held: dict[int, tuple[int | None, int, int]] = {}
    for segment in _segments_of(snapshot, device):
        address = int(segment["address"])
        for block in segment.get("blocks") or ():
            size = int(block["size"])
            if str(block.get("state", "")).startswith("active"):
                held[address] = (size, int(block.get("requested_size") or size), int(segment.get("stream") or 0))
            address += size
    return held


def _undo(held: dict[int, tuple[int | None, int, int]], rows: Sequence[Row]) -> bool:
    """Take ``held`` back to before ``rows``, last row first; ``False`` where they do not undo consistently."""
    for action, address, size, stream in reversed(rows):
        if not isinstance(address, int):
            continue
        if action == "alloc":
            if held.pop(address, None) is None:
                return False
        elif action == "free_completed" and isinstance(size, int):
            if address in held:
                return False
            held[address] = (None, size, int(stream) if isinstance(stream, int) else 0)
    return True


def window_prologue(snapshot: Mapping[str, Any], rows: Sequence[Row], start: Sequence[StartSegment],
                    device: int) -> list[Row] | None:
    """Rows that take a run from ``start`` to where its recorded ``rows`` begin (see the module
    docstring): a free of each block it started with that was gone by then, and an allocation of each
    block it had made and still held, in address order. ``None`` where the rows do not undo to a
    consistent state (an allocation of a block not held, a free of one held)."""
    held = _held_at_end(snapshot, device)  # address -> (block bytes where known, requested, stream)
    if not _undo(held, rows):
        return None
    started = allocated_blocks(start)

    def started_with(address: int) -> bool:
        """Whether the block held at ``address`` when the window began is the one the run started with."""
        if address not in started:
            return False
        size, requested, _ = held[address]
        return size == started[address] if size is not None else same_block(started[address], requested)

    prologue: list[Row] = [("free_completed", address, size, 0)  # a free's stream is its block's: not read
                           for address, size in sorted(started.items()) if address not in held or not started_with(address)]
    prologue += [("alloc", address, requested, stream) for address, (_, requested, stream) in sorted(held.items())
                 if not started_with(address)]
    return prologue


class Recorder:
    """Starts and stops the history around one rerun; every failure to do so means "not recorded".
    ``windows``: keep a run too long for the history as its last events (see the module docstring)."""

    def __init__(self, allocator: AllocatorSource, windows: bool = False):
        self.allocator = allocator
        self.windows = windows
        self.max_events = WINDOW_EVENTS if windows else MAX_EVENTS

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
            self.allocator.start_trace(self.max_events, stacks=False, mark_steps=True)
        except Exception:  # noqa: BLE001
            return None
        return start

    def stop(self, start: tuple[StartSegment, ...] | None, device: int, failed: bool) -> RecordedRun | None:
        """Stop recording (when ``start`` says it started) and read the rerun's events."""
        if start is None:
            return None
        try:
            snapshot = self.allocator.stop_trace()
            rows = trace_rows(snapshot, device)
        except Exception:  # noqa: BLE001
            return None
        whole = len(rows) < self.max_events  # else the history's ring dropped its beginning
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
        """Whether the window's replay at its own batch reaches the run's measured peak (within the
        replay's margin of what the run added), without what was carried into it that it frees: else the
        run's largest moment came before the window, or began before it (a pass whose tensors were made
        before the window, which the replay would keep at their size at every batch)."""
        try:
            measured = self.allocator.read(device).peak_allocated_bytes
        except Exception:  # noqa: BLE001
            return False
        freed = {key for kind, key, _, _ in events if kind == FREE and key in carried}
        own = [event for event in events if event[1] not in freed]
        at_start = sum(allocated_blocks(start).values())
        replayed = replay(own, start, 1 << 62).peak_allocated_bytes
        return replayed >= measured - REPLAY_MARGIN * max(measured - at_start, 0)
