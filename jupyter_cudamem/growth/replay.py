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

Pure Python, no torch: sizes in bytes, events as plain tuples. ``sources.torch_trace`` reads a
recorded trace (``torch.cuda.memory._snapshot()``) into these events and start segments.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Sequence

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

class EventKind(StrEnum):
    """What an event does to the allocator: the words of torch's trace, so a recorded trace reads as one."""

    ALLOC = "alloc"
    FREE = "free"
    TRY = "try"


ALLOC, FREE, TRY = EventKind.ALLOC, EventKind.FREE, EventKind.TRY  # read in the replay's hot loops

Event = tuple[EventKind, int, int, int]
"""``(kind, key, requested_bytes, stream)``. ``alloc`` must be satisfied for the cell to fit; ``free``
returns the block allocated under ``key``; ``try`` is an allocation the program survives being refused
(cuDNN asks for a workspace and falls back to a smaller algorithm), kept only to replay the release of
cached segments that the refusal causes, and freed at once when granted."""


def same_block(block_size: int | None, requested_bytes: int) -> bool:
    """Whether a block of ``block_size`` can be the one the allocator gave a request of ``requested_bytes``:
    its rounded size, or more by at most the remainder a large block is left unsplit with (1 MiB)."""
    return block_size is not None and 0 <= block_size - block_bytes(requested_bytes) <= SMALL_REQUEST_BYTES


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
        for held in allocator.add_segment(segment.address, segment.small, segment.stream, segment.blocks):
            if held.allocated:
                live[keys[held.address]] = held
    peak_allocated, peak_reserved = allocator.allocated, allocator.reserved
    refused: list[int] = []
    failed_at: int | None = None
    at_failure: tuple[int | None, int | None] = (None, None)
    malloc, release = allocator.malloc, allocator.release
    for index, (kind, key, size, stream) in enumerate(events):
        if kind == FREE:
            block = live.pop(key, None)
            if block is not None:
                release(block)
            continue
        granted = malloc(size, stream)
        if allocator.reserved > peak_reserved:
            peak_reserved = allocator.reserved
        if granted is None:
            if kind == ALLOC:
                failed_at = index
                at_failure = (allocator.allocated, allocator.reserved)
                break
            refused.append(index)
            continue
        if allocator.allocated > peak_allocated:
            peak_allocated = allocator.allocated
        if kind == TRY:
            release(granted)
        else:
            live[key] = granted
    return Replay(failed_at is None, failed_at, peak_allocated, peak_reserved,
                  tuple(allocator.segment_allocs), tuple(allocator.segment_frees), tuple(refused), *at_failure)


def given_back_at_once(events: Sequence[Event]) -> list[int]:
    """The indices of the requests that the next event frees: a temporary, or a library's workspace."""
    return [index for index, (event, after) in enumerate(zip(events, events[1:]))
            if event[0] == ALLOC and after[0] == FREE and after[1] == event[1]]


def optional_workspaces(events: Sequence[Event]) -> list[Event]:
    """``events`` with each request freed right after it was made (``given_back_at_once``) as a ``try``.

    Why: that is how a library's workspace looks (cuDNN's convolutions take one for the call and give it
    back), and a library sizes it by what it can get: refused, cuDNN falls back to an algorithm that needs
    less. Runs recorded with room to spare made every workspace they asked for, so replayed under a
    smaller cap each would count as needed. On the H100 (``benchmarks/plan.py``), a convnet's inference
    asked for 2.3 GiB workspaces uncapped; near a 16 GiB cap's limit it asked for 14.8 GiB, was refused,
    and fitted at 413 where a replay that needs them found 271 and one that may skip them 405. Only for a
    cell shown to cope without them (``capacity.runs.probe_workspaces``): cuDNN's RNNs fail without
    theirs."""
    at_once = set(given_back_at_once(events))
    kept: list[Event] = []
    for index, event in enumerate(events):
        if index in at_once:
            kept.append((TRY, event[1], event[2], event[3]))
        elif index - 1 not in at_once:
            kept.append(event)  # the free right after a workspace goes: a try frees itself
    return kept


def allocated_blocks(start: Sequence[StartSegment]) -> dict[int, int]:
    """The size of each block allocated in ``start``, by address."""
    found = {}
    for segment in start:
        address = segment.address
        for size, is_allocated in segment.blocks:
            if is_allocated:
                found[address] = size
            address += size
    return found


def held_elsewhere(events: Sequence[Event], left: Sequence[tuple[int, int]],
                   start: Sequence[StartSegment], remade: frozenset[int] = frozenset()) -> list[Event]:
    """``events`` as a run from ``start`` makes them: without the allocations an earlier run made and
    left (``left``, ``(address, key)``) that ``start`` still holds at the same address, in a block of
    the size the allocator gives that request.

    Why: a run replayed for the next try starts from the segments that try starts with. What the
    recorded run created once and kept, AdamW's state at its first step, gradients kept after it, is in
    those segments already, and the next run does not create it again: replayed as recorded it would be
    counted twice. What the next run does create again (a model the cell builds, set aside before it)
    is no longer held there, and stays, though the driver may hand its address to another block (on an
    H100, cuBLAS's 32 MiB workspace, made again where a ViT-L's 16 MiB weight had been: taken for the
    weight, the weight's request left one run, the two runs' requests no longer paired, and the replay
    put the largest batch at 8 where 23 fits).

    ``remade``: addresses of blocks ``start`` holds for values the cell binds again (its input, its
    outputs, a model it builds, still bound from its last run): the run makes each anew, and the old one
    goes when the name is bound again, taken as right after the new one is made."""
    held = allocated_blocks(start)
    sizes = {key: size for kind, key, size, _ in events if kind == ALLOC}
    again = {key: address for address, key in left
             if key in sizes and same_block(held.get(address), sizes[key])}
    if not again:
        return list(events)
    old_keys = start_keys(start) if remade else {}
    made: list[Event] = []
    for event in events:
        address = again.get(event[1]) if event[0] == ALLOC else None
        if address is None:
            made.append(event)
        elif address in remade:
            made += [event, (FREE, old_keys[address], 0, event[3])]
    return made
