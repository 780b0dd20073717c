"""PyTorch's allocator history and snapshot, read into the replay's words (``growth.replay``).

The one reader of torch's format for the replay: the dicts ``torch.cuda.memory._snapshot()`` returns
(``segments`` with their ``blocks``, ``device_traces`` with one entry per allocator event) become
``StartSegment``s and ``(action, address, size, stream)`` rows, and the rows become replayable
``Event``s. ``sources.torch_alloc`` records the history; ``reruns.recording`` decides what of a run
to keep; ``growth`` replays it, knowing nothing of torch. No torch is imported here: a snapshot is
plain data.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from ..growth.replay import ALLOC, FREE, TRY, Event, StartSegment, allocated_blocks, same_block, start_keys
from .base import STEP_MARK_BYTES

Row = tuple[str | None, int | None, int | None, int | None]
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


def device_traces(snapshot: Mapping[str, Any]) -> Sequence[Sequence[Any]]:
    """Each device's recorded history in ``snapshot``, by device index, as torch lists it."""
    return snapshot.get("device_traces") or ()


def device_trace(snapshot: Mapping[str, Any], device: int) -> Sequence[Any]:
    """``device``'s recorded history in ``snapshot`` (empty where none is recorded)."""
    traces = device_traces(snapshot)
    return traces[device] if device < len(traces) else ()


def trace_rows(snapshot: Mapping[str, Any], device: int) -> list[Row]:
    """``(action, address, size, stream)`` of each event of ``device``'s recorded history."""
    return [(entry.get("action"), entry.get("addr"), entry.get("size"), entry.get("stream"))
            for entry in device_trace(snapshot, device)]


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
        begin = next((i for i in range(cursor, len(rows) - 1) if _opens_mark(rows[i], rows[i + 1], first, second)),
                     None)
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


def _opens_mark(row: Row, after: Row, first: int, second: int) -> bool:
    """Whether two rows are a step mark's requests: its addresses and its sizes (``STEP_MARK_BYTES``)."""
    return (row[0] == "alloc" and after[0] == "alloc" and (row[1], after[1]) == (first, second)
            and (row[2], after[2]) == STEP_MARK_BYTES)


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


def events_from_trace(trace: Iterable[Sequence[object]], start: Sequence[StartSegment],
                      failed: bool = False) -> list[Event]:
    """Turn a recorded trace into replayable events (``read_trace`` without what the run left)."""
    return read_trace(trace, start, failed)[0]


def read_trace(trace: Iterable[Sequence[object]], start: Sequence[StartSegment],
               failed: bool = False) -> tuple[list[Event], tuple[tuple[int, int], ...]]:
    """Turn a recorded trace into replayable events, and say what the run left allocated.

    ``alloc`` keys are the event's index (so two runs of the same code give the same keys); a block is
    returned at ``free_completed``, when torch puts it back in the pool. Segment events are dropped: they
    are the allocator's doing, which the replay recomputes. Each ``oom`` event becomes a ``try`` (the
    program caught it), except the last one of a run that ``failed``, which is the allocation that
    raised. A free of an address the trace never allocated and the start did not hold is ignored
    (memory outside the traced allocator). What the run left is ``(address, key)`` of each allocation
    it did not free (``growth.replay.held_elsewhere``).
    """
    events, left, _ = read_trace_within(trace, start, failed)
    return events, left


def read_trace_within(trace: Iterable[Sequence[object]], start: Sequence[StartSegment], failed: bool = False,
                      spans: Sequence[tuple[int, int]] = ()
                      ) -> tuple[list[Event], tuple[tuple[int, int], ...], tuple[tuple[int, int], ...]]:
    """``read_trace``, and ``spans`` (``(first row, row after the last)`` of the trace: an optimizer's
    steps) as the same of the events."""
    events: list[Event] = []
    live = dict(start_keys(start))
    rows = [(str(row[0]), row[1], row[2], row[3]) for row in trace]
    ooms = [i for i, row in enumerate(rows) if row[0] == "oom"]
    fatal = ooms[-1] if failed and ooms else None
    made_before = [0] * (len(rows) + 1)  # how many events the rows before each row made
    for i, (action, address, size, stream) in enumerate(rows):
        stream_id = int(stream) if isinstance(stream, int) else 0
        if action == "alloc" and isinstance(address, int) and isinstance(size, int):
            live[address] = len(events)
            events.append((ALLOC, len(events), size, stream_id))
        elif action == "free_completed" and isinstance(address, int) and address in live:
            events.append((FREE, live.pop(address), 0, stream_id))
        elif action == "oom" and isinstance(size, int):
            events.append((ALLOC if i == fatal else TRY, len(events), size, stream_id))
        made_before[i + 1] = len(events)
    left = tuple((address, key) for address, key in live.items() if key >= 0)
    return events, left, tuple((made_before[first], made_before[after]) for first, after in spans)
