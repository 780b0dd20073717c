"""Replay of PyTorch's CUDA caching allocator, to find the largest batch whose cell fits under a cap.

Why: a line fitted to a cell's *allocated* peak cannot see memory that is reserved but unusable. Under
a per-process cap the caching allocator refuses a new segment once its *reserved* bytes would exceed
the cap, and free bytes left in split segments cannot serve a request larger than the largest free
piece. For a cell that allocates a few large tensors (an MLP, an LSTM) the largest batch that fits can
hold 10-20% less allocated memory than the cap. Replaying the cell's own sequence of allocations and
frees through a model of the allocator sees that, because it knows which block each request lands in.

The model follows ``c10/cuda/CUDACachingAllocator.cpp`` in its default configuration (no
``expandable_segments``, ``max_split_size`` unset, no garbage-collection threshold, no power-of-two
rounding divisions):

- a request is rounded up to a multiple of 512 bytes; rounded requests of at most 1 MiB come from the
  small pool, larger ones from the large pool, and blocks are only reused on the stream they were
  allocated on;
- a request takes the smallest cached free block of its pool and stream that is large enough (lowest
  address on a tie), and splits it when the rest is worth keeping: at least 512 bytes in the small
  pool, more than 1 MiB in the large pool (otherwise the whole block is handed out);
- with no such block it asks for a new segment: 2 MiB for small requests, 20 MiB for requests under
  10 MiB, else the request rounded up to 2 MiB. Under the cap a segment that would take the reserved
  bytes above the cap is refused; the allocator then returns every cached segment that is wholly free
  to the driver and asks once more; a second refusal is the out-of-memory error;
- a freed block merges with its free neighbours in the same segment, and a segment stays reserved
  (cached) until such a refusal releases it.

Left out, because the default configuration and single-stream cells do not use them: cross-stream
frees (a block is returned when its ``free_completed`` event says so), expandable segments,
``max_split_size`` and CUDA-graph pools. Addresses of new segments are invented (each above the last);
the driver's real addresses only break ties between equal free blocks.

Pure Python, no torch: sizes in bytes, events as plain tuples. A recorded trace is the list of
``(action, address, size, stream)`` that ``torch.cuda.memory._snapshot()['device_traces']`` holds.
"""

from __future__ import annotations

import bisect
import difflib
import math
from dataclasses import dataclass, field
from typing import Callable, Collection, Iterable, Literal, Sequence

from ..units import MiB

MIN_BLOCK_BYTES = 512
"""Every request is rounded up to a multiple of this (torch's ``kMinBlockSize``)."""
SMALL_REQUEST_BYTES = MiB
"""Rounded requests up to this size come from the small pool (``kSmallSize``); it is also the most a
large block may leave unsplit."""
SMALL_SEGMENT_BYTES = 2 * MiB
"""Segment size of the small pool (``kSmallBuffer``)."""
MID_REQUEST_BYTES = 10 * MiB
"""Large requests under this share 20 MiB segments (``kMinLargeAlloc``)."""
MID_SEGMENT_BYTES = 20 * MiB
"""Segment size for large requests under 10 MiB (``kLargeBuffer``)."""
LARGE_ROUND_BYTES = 2 * MiB
"""Larger requests get a segment of their size rounded up to this (``kRoundLarge``)."""

EventKind = Literal["alloc", "free", "try"]
Event = tuple[EventKind, int, int, int]
"""``(kind, key, requested_bytes, stream)``. ``alloc`` must be satisfied for the cell to fit; ``free``
returns the block allocated under ``key``; ``try`` is an allocation the program survives being refused
(cuDNN asks for a workspace and falls back to a smaller algorithm), kept only to replay the release of
cached segments that the refusal causes, and freed at once when granted."""


def block_bytes(requested_bytes: int) -> int:
    """The block size the allocator reserves for a request: at least 512 bytes, a multiple of 512."""
    return max(MIN_BLOCK_BYTES, -(-requested_bytes // MIN_BLOCK_BYTES) * MIN_BLOCK_BYTES)


def segment_bytes(block: int) -> int:
    """The segment the allocator asks the driver for when no cached block fits ``block`` bytes."""
    if block <= SMALL_REQUEST_BYTES:
        return SMALL_SEGMENT_BYTES
    if block < MID_REQUEST_BYTES:
        return MID_SEGMENT_BYTES
    return -(-block // LARGE_ROUND_BYTES) * LARGE_ROUND_BYTES


@dataclass(frozen=True)
class StartSegment:
    """A segment reserved when the cell starts, as ``torch.cuda.memory._snapshot()`` lists it.

    ``blocks`` are ``(size_bytes, allocated)`` in address order. Only split segments survive an
    ``empty_cache()``, and their free pieces are where the cell's first small requests land.
    """

    address: int
    small: bool
    blocks: tuple[tuple[int, bool], ...]
    stream: int = 0


@dataclass(frozen=True)
class Replay:
    """What a replay did. ``fits``: every ``alloc`` was satisfied; ``failed_at``: index of the first
    that was not (the replay stops there). Peaks include what was allocated/reserved at the start."""

    fits: bool
    failed_at: int | None
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    segment_allocs: tuple[int, ...]
    segment_frees: tuple[int, ...]
    refused_tries: tuple[int, ...]
    allocated_at_failure_bytes: int | None = None
    reserved_at_failure_bytes: int | None = None


@dataclass(eq=False, slots=True)
class _Block:
    address: int
    size: int
    stream: int
    small: bool
    allocated: bool = False
    prev: _Block | None = None
    next: _Block | None = None


@dataclass
class _Allocator:
    """The caching allocator's state: blocks linked within segments, free blocks sorted per pool."""

    cap_bytes: int
    free: dict[bool, list[tuple[int, int, int]]] = field(default_factory=lambda: {True: [], False: []})
    by_address: dict[int, _Block] = field(default_factory=dict)
    reserved: int = 0
    allocated: int = 0
    next_address: int = 0
    segment_allocs: list[int] = field(default_factory=list)
    segment_frees: list[int] = field(default_factory=list)

    def _cache(self, block: _Block) -> None:
        bisect.insort(self.free[block.small], (block.stream, block.size, block.address))
        self.by_address[block.address] = block

    def _uncache(self, block: _Block) -> None:
        pool = self.free[block.small]
        del pool[bisect.bisect_left(pool, (block.stream, block.size, block.address))]

    def add_segment(self, address: int, small: bool, stream: int,
                    blocks: Sequence[tuple[int, bool]]) -> list[_Block]:
        """Create a segment of ``(size, allocated)`` blocks in address order; only the free ones are cached."""
        made: list[_Block] = []
        prev: _Block | None = None
        for size, allocated in blocks:
            block = _Block(address, size, stream, small, allocated, prev)
            if prev is not None:
                prev.next = block
            if allocated:
                self.allocated += size
            else:
                self._cache(block)
            made.append(block)
            prev = block
            address += size
        self.reserved += address - made[0].address
        self.next_address = max(self.next_address, address)
        return made

    def _new_segment(self, size: int, small: bool, stream: int) -> _Block | None:
        """A new segment of one block, not cached (its caller takes it at once), or ``None`` where the
        cap refuses it even after the wholly free segments are returned."""
        if self.reserved + size > self.cap_bytes:
            self._release_cached()
            if self.reserved + size > self.cap_bytes:
                return None
        self.segment_allocs.append(size)
        block = _Block(self.next_address, size, stream, small)
        self.reserved += size
        self.next_address += size
        return block

    def _release_cached(self) -> None:
        """Return every wholly free segment to the driver, large pool first (as torch does)."""
        for small in (False, True):
            for stream, size, address in list(self.free[small]):
                block = self.by_address[address]
                if block.prev is None and block.next is None:
                    self._uncache(block)
                    del self.by_address[address]
                    self.reserved -= size
                    self.segment_frees.append(size)

    def malloc(self, requested_bytes: int, stream: int) -> _Block | None:
        size = -(-requested_bytes // MIN_BLOCK_BYTES) * MIN_BLOCK_BYTES  # block_bytes, inlined: the hot path
        if size < MIN_BLOCK_BYTES:
            size = MIN_BLOCK_BYTES
        small = size <= SMALL_REQUEST_BYTES
        pool = self.free[small]
        i = bisect.bisect_left(pool, (stream, size, -1))
        if i < len(pool) and pool[i][0] == stream:
            block = self.by_address[pool[i][2]]
            del pool[i]
        else:
            # No cached block of this stream is large enough, so a new segment's is the only one.
            fresh = self._new_segment(segment_bytes(size), small, stream)
            if fresh is None:
                return None
            block = fresh
        rest = block.size - size
        if rest >= MIN_BLOCK_BYTES if small else rest > SMALL_REQUEST_BYTES:
            tail = _Block(block.address + size, rest, stream, small, False, block, block.next)
            if block.next is not None:
                block.next.prev = tail
            block.next = tail
            block.size = size
            self._cache(tail)
        block.allocated = True
        self.allocated += block.size
        return block

    def release(self, block: _Block) -> None:
        block.allocated = False
        self.allocated -= block.size
        for neighbour in (block.prev, block.next):
            if neighbour is None or neighbour.allocated:
                continue
            self._uncache(neighbour)
            del self.by_address[neighbour.address]
            if neighbour is block.prev:
                block.address = neighbour.address
                block.prev = neighbour.prev
                if block.prev is not None:
                    block.prev.next = block
            else:
                block.next = neighbour.next
                if block.next is not None:
                    block.next.prev = block
            block.size += neighbour.size
        self._cache(block)


def start_keys(start: Sequence[StartSegment]) -> dict[int, int]:
    """Keys (negative) for the blocks allocated at the start, by address.

    Ranked by (pool, size, address), not by address alone, so that two runs of a cell whose start
    states hold the same tensors at different addresses give them the same keys and their traces align.
    """
    allocated = []
    for segment in start:
        address = segment.address
        for size, is_allocated in segment.blocks:
            if is_allocated:
                allocated.append((segment.small, size, address))
            address += size
    return {address: -1 - rank for rank, (_, _, address) in enumerate(sorted(allocated))}


def replay(events: Sequence[Event], start: Sequence[StartSegment], cap_bytes: int) -> Replay:
    """Replay ``events`` from the ``start`` segments with reserved bytes capped at ``cap_bytes``."""
    allocator = _Allocator(cap_bytes)
    live: dict[int, _Block] = {}
    keys = start_keys(start)
    for segment in start:
        for block in allocator.add_segment(segment.address, segment.small, segment.stream, segment.blocks):
            if block.allocated:
                live[keys[block.address]] = block
    peak_allocated, peak_reserved = allocator.allocated, allocator.reserved
    refused: list[int] = []
    failed_at: int | None = None
    at_failure: tuple[int | None, int | None] = (None, None)
    malloc, release = allocator.malloc, allocator.release
    for index, (kind, key, size, stream) in enumerate(events):
        if kind == "free":
            block = live.pop(key, None)
            if block is not None:
                release(block)
            continue
        granted = malloc(size, stream)
        if allocator.reserved > peak_reserved:
            peak_reserved = allocator.reserved
        if granted is None:
            if kind == "alloc":
                failed_at = index
                at_failure = (allocator.allocated, allocator.reserved)
                break
            refused.append(index)
            continue
        if allocator.allocated > peak_allocated:
            peak_allocated = allocator.allocated
        if kind == "try":
            release(granted)
        else:
            live[key] = granted
    return Replay(failed_at is None, failed_at, peak_allocated, peak_reserved,
                  tuple(allocator.segment_allocs), tuple(allocator.segment_frees), tuple(refused), *at_failure)


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
    it did not free (``held_elsewhere``).
    """
    events: list[Event] = []
    live = dict(start_keys(start))
    rows = [(str(row[0]), row[1], row[2], row[3]) for row in trace]
    ooms = [i for i, row in enumerate(rows) if row[0] == "oom"]
    fatal = ooms[-1] if failed and ooms else None
    for i, (action, address, size, stream) in enumerate(rows):
        stream_id = int(stream) if isinstance(stream, int) else 0
        if action == "alloc" and isinstance(address, int) and isinstance(size, int):
            live[address] = len(events)
            events.append(("alloc", len(events), size, stream_id))
        elif action == "free_completed" and isinstance(address, int) and address in live:
            events.append(("free", live.pop(address), 0, stream_id))
        elif action == "oom" and isinstance(size, int):
            events.append(("alloc" if i == fatal else "try", len(events), size, stream_id))
    return events, tuple((address, key) for address, key in live.items() if key >= 0)


def allocated_addresses(start: Sequence[StartSegment]) -> frozenset[int]:
    """The addresses of the blocks allocated in ``start``."""
    found = set()
    for segment in start:
        address = segment.address
        for size, is_allocated in segment.blocks:
            if is_allocated:
                found.add(address)
            address += size
    return frozenset(found)


def held_elsewhere(events: Sequence[Event], left: Sequence[tuple[int, int]],
                   start: Sequence[StartSegment]) -> list[Event]:
    """``events`` as a run from ``start`` makes them: without the allocations an earlier run made and
    left (``left``, ``(address, key)``) that ``start`` still holds at the same address.

    Why: a run replayed for the next try starts from the segments that try starts with. What the
    recorded run created once and kept, AdamW's state at its first step, gradients kept after it, is in
    those segments already, and the next run does not create it again: replayed as recorded it would be
    counted twice. What the next run does create again (a model the cell builds, set aside before it)
    is no longer held there, and stays."""
    held = allocated_addresses(start)
    again = {key for address, key in left if address in held}
    if not again:
        return list(events)
    return [event for event in events if not (event[0] == "alloc" and event[1] in again)]


def match(first: Sequence[Event], batch_first: int, second: Sequence[Event],
          batch_second: int) -> list[int | None]:
    """For each event of ``second``, the index of the same request in ``first`` (``None``: no partner).

    Two runs of a cell at different batches mostly make the same requests in the same order, but not
    always: cuDNN and cuBLAS pick algorithms (and workspaces) by the tensors' sizes, so a few requests
    appear in one run only. The longest common subsequence of the event kinds pairs the rest, and a
    pair is kept only if its sizes can be one tensor's at the two batches (``_one_tensor``).
    """
    ratio = batch_second / batch_first
    kinds_first, kinds_second = [e[0] for e in first], [e[0] for e in second]
    partner: list[int | None] = [None] * len(second)
    for low, high, length in _common_runs(kinds_first, kinds_second, first, second, ratio):
        for offset in range(length):
            a, b = first[low + offset], second[high + offset]
            if a[0] != "free" and a[3] == b[3] and _one_tensor(a[2], b[2], ratio):
                partner[high + offset] = low + offset
    return partner


MAX_PAIRING_WORK = 4_000_000
"""The most ``difflib`` may be given to pair (the product of the two middles' lengths; about a second
in Python). Longer middles are paired by walking both runs (``_walked_runs``), which costs at most
this many comparisons: a training step of a large model makes thousands of events, and runs at two
batches differ by a few inserted requests (another cuBLAS workspace, a gradient accumulated in another
order), so a walk that steps over them pairs nearly all (on an H100, a ViT-L fine-tune's 6,000-event
runs at batches 1 and 2 paired 45% of their bytes without it, 100% with it, and the replay put the
largest batch at 23, where 23 fits, instead of 3). Runs whose middles differ throughout (a cell that
loops over chunks of its data makes as many events per chunk as there are chunks) pair little either
way; the rest is unpaired, taken as proportional to the batch, which errs towards a smaller batch.
Measured before any bound (``benchmarks/oomfix.py``, H100): on a ResNet-50 inference over 3,552 rows
chunked by 43 and by 132 rows, ``%oomfix`` took 213 s, against 5-7 s over 333 and 888 rows."""

RESYNC_WINDOW = 64
"""How far ahead (in events, in both runs together) the walk looks for the two runs to agree again."""
RESYNC_EVENTS = 8
"""How many events in a row must agree for the walk to take a place as the two runs' common ground."""


def _common_runs(first: Sequence[str], second: Sequence[str], first_events: Sequence[Event] = (),
                 second_events: Sequence[Event] = (), ratio: float = 1.0) -> list[tuple[int, int, int]]:
    """Runs ``(start_in_first, start_in_second, length)`` of a common subsequence of the two lists of kinds.

    ``difflib`` costs the product of the lengths on a two-letter alphabet, so it only sees what lies
    between the common prefix and suffix (most runs of a cell differ in a few places, or none), and
    only up to ``MAX_PAIRING_WORK``; a longer middle is walked (``_walked_runs``) where the events
    themselves are given.
    """
    head = 0
    while head < min(len(first), len(second)) and first[head] == second[head]:
        head += 1
    tail = 0
    while tail < min(len(first), len(second)) - head and first[-1 - tail] == second[-1 - tail]:
        tail += 1
    first_middle, second_middle = first[head:len(first) - tail], second[head:len(second) - tail]
    if len(first_middle) * len(second_middle) <= MAX_PAIRING_WORK:
        matcher = difflib.SequenceMatcher(None, first_middle, second_middle, autojunk=False)
        middle = [(a, b, n) for a, b, n in matcher.get_matching_blocks()]
    elif first_events and second_events:
        middle = _walked_runs(first_events[head:len(first) - tail], second_events[head:len(second) - tail], ratio)
    else:
        middle = []
    return ([(0, 0, head)] + [(a + head, b + head, n) for a, b, n in middle]
            + [(len(first) - tail, len(second) - tail, tail)])


def _walked_runs(first: Sequence[Event], second: Sequence[Event], ratio: float) -> list[tuple[int, int, int]]:
    """Common runs found by walking both runs at once: events agree (same kind and stream, and an
    allocation's sizes can be one tensor's at the two batches) and are paired while they do; where they
    stop agreeing, the nearest place within ``RESYNC_WINDOW`` events where ``RESYNC_EVENTS`` in a row
    agree again is where the walk goes on. At most ``MAX_PAIRING_WORK`` comparisons: past that, the rest
    is left unpaired."""
    work = 0

    def agree(i: int, j: int) -> bool:
        a, b = first[i], second[j]
        return a[0] == b[0] and a[3] == b[3] and (a[0] == "free" or _one_tensor(a[2], b[2], ratio))

    def agree_from(i: int, j: int) -> bool:
        nonlocal work
        length = min(RESYNC_EVENTS, len(first) - i, len(second) - j)
        work += length
        return length > 0 and all(agree(i + k, j + k) for k in range(length))

    runs: list[tuple[int, int, int]] = []
    i = j = 0
    while i < len(first) and j < len(second) and work < MAX_PAIRING_WORK:
        start_i, start_j = i, j
        while i < len(first) and j < len(second) and agree(i, j):
            i, j = i + 1, j + 1
        work += i - start_i + 1
        if i > start_i:
            runs.append((start_i, start_j, i - start_i))
            continue
        found = next(((i + di, j + distance - di) for distance in range(1, RESYNC_WINDOW + 1)
                      for di in range(distance + 1)
                      if i + di < len(first) and j + distance - di < len(second)
                      and agree_from(i + di, j + distance - di)), None)
        if found is None:  # nothing agrees nearby: step both over this event
            i, j = i + 1, j + 1
        else:
            i, j = found
    runs.append((len(first), len(second), 0))
    return runs


def _one_tensor(low: int, high: int, ratio: float) -> bool:
    """Whether ``low`` and ``high`` requested bytes at two batches (``ratio`` apart) can be one tensor.

    A tensor that does not depend on the batch has the same shape, so exactly the same bytes. One that
    does is batch-major: the batch multiplies its bytes, and a fixed part (concatenated batch-independent
    data) is the smaller share; so at the smaller batch at least half its bytes are the per-sample part,
    and the sizes grow by between (1 + ratio) / 2 and ratio times (512 bytes of slack for rounding).
    Sizes nearly equal but not equal are two different tensors that the kinds' subsequence paired by
    position (a layer later, half the spatial size and twice the batch), whose line would say memory
    hardly grows with the batch.
    """
    return low == high or (1 + ratio) / 2 * low - MIN_BLOCK_BYTES <= high <= ratio * low + MIN_BLOCK_BYTES


Line = tuple[EventKind, int, int, float, float]
"""An event as ``(kind, key, stream, fixed_bytes, bytes_per_sample)``: its request at batch ``b`` is
``fixed_bytes + bytes_per_sample * b``."""


def growth_lines(first: Sequence[Event], batch_first: int, second: Sequence[Event],
                 batch_second: int) -> tuple[list[Line], float]:
    """The events of the run at the larger batch, each request on a line; and the share of its
    requested bytes whose line two measured sizes fix (1.0 when every request has a partner).

    The larger run is the template (its order of requests and frees is kept), being the closer to the
    batches searched. A request with a partner in the other run gets the line through both sizes; one
    without (an algorithm chosen at this batch only) is taken as proportional to the batch, the larger
    of the two guesses its single size allows, so the prediction errs towards a smaller batch.
    """
    if batch_first > batch_second:
        first, batch_first, second, batch_second = second, batch_second, first, batch_first
    partner = match(first, batch_first, second, batch_second)
    lines: list[Line] = []
    matched = total = 0
    for (kind, key, size, stream), index in zip(second, partner):
        if kind == "free":
            lines.append((kind, key, stream, 0.0, 0.0))
            continue
        total += size
        if index is None:
            lines.append((kind, key, stream, 0.0, size / batch_second))
        else:
            matched += size
            per_sample = (size - first[index][2]) / (batch_second - batch_first)
            lines.append((kind, key, stream, size - per_sample * batch_second, per_sample))
    return lines, matched / total if total else 1.0


def events_at(lines: Sequence[Line], batch: float) -> list[Event]:
    """The events at ``batch`` (a fraction of a sample too: a margin is taken on the per-sample part):
    each request on its line, rounded up to whole bytes, never below zero (the allocator rounds it
    further)."""
    return [(kind, key, max(0, math.ceil(fixed + per_sample * batch)) if kind != "free" else 0, stream)
            for kind, key, stream, fixed, per_sample in lines]


PREDICTION_RESOLUTION = 1 / 512
"""How close a prediction settles on the largest batch: a replay per halving of the gap, and below 512
samples to the sample; above, a 0.2% error is noise beside the next run's own (another algorithm)."""


@dataclass(frozen=True)
class Fitting:
    """Whether a batch fits, by replaying requests put on lines through measured runs (``fitting``,
    ``fitting_from_one``); ``largest`` the largest batch that does."""

    fits: Callable[[int], bool]
    largest_up_to: Callable[[int], int]  # the largest batch up to a bound close above it that fits
    allocated_bound: Callable[[int], int]  # quick: the largest batch up to a bound its allocated bytes allow
    measured_batch: int

    def largest(self, max_batch: int = 1 << 30) -> int:
        """The largest batch up to ``max_batch`` that fits (``max_batch`` when even that fits: nothing grows
        with the batch; 0 when none does). Fitting is assumed at every batch below one that fits.

        The allocated bytes alone give a bound first (no replay), which is often the answer; below it
        the replay steps down (``largest_below``), so it runs a handful of times, not twice the
        batch's bits."""
        return self.largest_up_to(self.allocated_bound(max_batch))

def fitting(first: Sequence[Event], batch_first: int, second: Sequence[Event], batch_second: int,
            start: Sequence[StartSegment], cap_bytes: int, margin: float = 0.0) -> Fitting | None:
    """Whether a batch fits under ``cap_bytes``, from two runs' events.

    ``None`` when the two runs do not align: not one request of the larger run can be paired with one
    of the smaller (a different program ran; no measured line exists), or one of them made none.
    Requests left unpaired where others pair must fit both as proportional to the batch and at their
    measured size (``_fits_either_way``); ``growth_lines`` gives the paired share for a caller that
    wants to judge it. ``margin``: a batch fits when its requests' per-sample parts ``1 + margin`` times
    as large do (the next run is another run: another cuDNN algorithm, a block of rounding).
    """
    if batch_first == batch_second or min(batch_first, batch_second) <= 0:
        return None
    if not any(kind != "free" for kind, *_ in first) or not any(kind != "free" for kind, *_ in second):
        return None  # a run that allocated nothing was not recorded where the allocations were made
    lines, share = growth_lines(first, batch_first, second, batch_second)
    if share == 0.0:
        return None
    unpaired = [i for i, line in enumerate(lines) if line[0] != "free" and line[3] == 0.0 and line[4] > 0.0]
    measured = max(batch_first, batch_second)
    return Fitting(*_fits_either_way(lines, unpaired, measured, start, cap_bytes, margin), measured)


def fitting_from_one(events: Sequence[Event], batch: int, start: Sequence[StartSegment], cap_bytes: int,
                     batch_independent: Collection[int] = (),
                     margin: float = 0.0) -> Fitting | None:
    """The same from one run: every request taken as proportional to the batch, but those whose keys
    ``batch_independent`` lists (the optimizer's state, a model's parameters: ``growth.fixed``), which
    keep their size; a temporary (freed before the next request) must fit both ways.

    A request is a fixed part plus a per-sample part, neither negative, so scaling all of it with the
    batch overstates every request above ``batch``: the replay then errs towards a smaller batch in
    bytes, as the line through the origin and one measured peak does (``growth.through_origin``). Where
    the parameters, their gradients and AdamW's state are most of a run (a fine-tune whose largest batch
    is a few dozen), scaling them too would put the largest batch at 0 or 1."""
    if batch <= 0 or not any(kind != "free" for kind, *_ in events):
        return None
    fixed = set(batch_independent)
    lines: list[Line] = [(kind, key, stream, float(size), 0.0) if kind != "free" and key in fixed
                         else (kind, key, stream, 0.0, 0.0 if kind == "free" else size / batch)
                         for kind, key, size, stream in events]
    temporaries = [i for i in range(len(events) - 1) if events[i][0] != "free" and events[i][1] not in fixed
                   and events[i + 1][0] == "free" and events[i + 1][1] == events[i][1]]
    return Fitting(*_fits_either_way(lines, temporaries, batch, start, cap_bytes, margin), batch)


def largest_fitting_batch(first: Sequence[Event], batch_first: int, second: Sequence[Event],
                          batch_second: int, start: Sequence[StartSegment], cap_bytes: int,
                          max_batch: int = 1 << 30, margin: float = 0.0) -> int | None:
    """``fitting(...).largest(max_batch)``; ``None`` where the runs give no fitting."""
    found = fitting(first, batch_first, second, batch_second, start, cap_bytes, margin)
    return None if found is None else found.largest(max_batch)


def largest_fitting_batch_from_one(events: Sequence[Event], batch: int, start: Sequence[StartSegment],
                                   cap_bytes: int, max_batch: int = 1 << 30,
                                   batch_independent: Collection[int] = (),
                                   margin: float = 0.0) -> int | None:
    """``fitting_from_one(...).largest(max_batch)``; ``None`` where the run gives no fitting."""
    found = fitting_from_one(events, batch, start, cap_bytes, batch_independent, margin)
    return None if found is None else found.largest(max_batch)


def _fits_either_way(lines: Sequence[Line], unknown: Sequence[int], measured_batch: int,
                     start: Sequence[StartSegment], cap_bytes: int,
                     margin: float) -> tuple[Callable[[int], bool], Callable[[int], int], Callable[[int], int]]:
    """Whether a batch fits both when the ``unknown`` requests grow with the batch as their lines say and
    when they keep the size measured at ``measured_batch`` (margins as in ``largest_fitting_batch``).

    Why both: a request whose growth two runs do not tell (one run, or two sizes that cannot be one
    tensor's: a workspace another algorithm sized) is either a batch's or a library's. Scaling it errs
    towards a smaller batch in bytes, but not always in the allocator: a larger block freed early is
    cached and serves later requests, so a run can fit with the larger block and fail with the real one.
    The batch must fit either way, with its per-sample parts ``1 + margin`` and ``1 + margin / 2`` times as
    large. Returned with a quick test that only rules batches out (their allocated bytes alone pass the
    cap)."""
    kept = list(lines)
    for index in unknown:
        kind, key, stream, fixed, per_sample = lines[index]
        kept[index] = (kind, key, stream, fixed + per_sample * measured_batch, 0.0)

    held = sum(size for segment in start for size, used in segment.blocks if used)
    variants = [lines, kept] if unknown else [lines]

    def could_fit(batch: int) -> bool:
        # Reserved bytes are never below allocated ones: a run whose allocated bytes alone pass the cap
        # fails whatever the allocator does.
        return all(peak_allocated_bytes(events_at(v, batch * (1 + margin)), held) <= cap_bytes for v in variants)

    def allocated_bound(max_batch: int) -> int:
        limit = min(allocated_limit(v, held, cap_bytes) / (1 + margin) for v in variants)
        return largest_below(could_fit, max(0, min(max_batch, math.floor(limit)) if limit < math.inf else max_batch))

    def fits_at(batch: int, scales: Sequence[float]) -> bool:
        return all(replay(events_at(v, batch * scale), start, cap_bytes).fits for scale in scales for v in variants)

    def fits(batch: int) -> bool:
        # Across the sizes the next run may have: the caching allocator is not monotone in them (a block a
        # little larger is cached where a later request reuses it), so fitting at the margin alone is luck.
        return fits_at(batch, (1 + margin, 1 + margin / 2))

    def largest(high: int) -> int:
        # The search settles on the larger sizes alone, then checks the batch it found at the smaller: the
        # same answer where the allocator is monotone, in about half the replays.
        found = largest_below(lambda batch: fits_at(batch, (1 + margin,)), high, PREDICTION_RESOLUTION)
        while found > 0 and not fits_at(found, (1 + margin / 2,)):
            found = largest_below(fits, found - 1, PREDICTION_RESOLUTION)
        return found

    return fits, largest, allocated_bound


def allocated_limit(lines: Sequence[Line], start_bytes: int, cap_bytes: int) -> float:
    """A batch above which the requests on ``lines`` hold more than ``cap_bytes`` at once, with
    ``start_bytes`` held from the start (``math.inf``: none; a bound, not the answer: each block is at
    least its line's bytes, and the allocator's rounding and refusals only lower the real one).

    One pass: at each request the bytes held are ``fixed + per_sample * batch`` summed over what is
    live, so each request bounds the batch by a division; ``peak_allocated_bytes`` at the batches
    around it then settles it in a few passes, where bisecting on it alone takes the batch's bits."""
    live: dict[int, tuple[float, float]] = {}
    fixed_now = per_sample_now = 0.0
    limit = math.inf
    room = cap_bytes - start_bytes
    for kind, key, _, fixed, per_sample in lines:
        if kind == "free":
            gone = live.pop(key, None)
            if gone is not None:
                fixed_now -= gone[0]
                per_sample_now -= gone[1]
        elif kind == "alloc":
            live[key] = (fixed, per_sample)
            fixed_now += fixed
            per_sample_now += per_sample
            if per_sample_now > 0:
                limit = min(limit, (room - fixed_now) / per_sample_now)
    return max(limit, 0.0)


def peak_allocated_bytes(events: Sequence[Event], start_bytes: int = 0) -> int:
    """The most ``events`` hold allocated at once, with ``start_bytes`` held from the start (blocks rounded
    as the allocator rounds them; a ``try``, which the run survives being refused, counts nothing)."""
    live: dict[int, int] = {}
    now = peak = start_bytes
    for kind, key, size, _ in events:
        if kind == "free":
            now -= live.pop(key, 0)
        elif kind == "alloc":
            block = block_bytes(size)
            live[key] = block
            now += block
            peak = max(peak, now)
    return peak


def largest_below(fits: Callable[[int], bool], high: int, resolution: float = 0.0) -> int:
    """The largest batch up to ``high`` that ``fits`` (0 when none does), where fitting is assumed at every
    batch below one that fits and ``high`` is a bound close above the answer: from ``high`` it steps down
    in widening steps to a batch that fits, then bisects between it and the last that failed, until
    they are within ``resolution`` of the batch (0: to the sample)."""
    if high <= 0 or fits(high):
        return max(high, 0)
    failed, step = high, max(1, high // 64)
    while (below := max(high - step, 0)) > 0 and not fits(below):
        failed, step = below, 2 * step
    while failed - below > max(1, int(below * resolution)):
        middle = (below + failed) // 2
        if fits(middle):
            below = middle
        else:
            failed = middle
    return below
