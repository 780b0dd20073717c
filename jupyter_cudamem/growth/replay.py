"""Replay of PyTorch's CUDA caching allocator, to find the largest batch whose cell fits under a cap.

Why: under a cap the allocator refuses a new segment once its *reserved* bytes would pass it, and free pieces
of split segments cannot serve a larger request. A line through *allocated* peaks cannot see that; a replay of
the cell's own allocations and frees through a model of the allocator can (``docs/oomfix.md``).

The model follows ``c10/cuda/CUDACachingAllocator.cpp`` in its default configuration (no
``expandable_segments``, ``max_split_size`` unset, no garbage-collection threshold, no power-of-two
rounding divisions). A request is rounded up to 512 bytes and served, on its stream, from the small or the
large pool by the smallest cached free block that is large enough (lowest address on a tie), split where
the rest is worth keeping; with none, from a new segment (sizes: the constants below). A segment that
would take the reserved bytes above the cap is refused; every wholly free cached segment then goes back to
the driver and the allocator asks once more, and a second refusal is the out-of-memory error. A freed block
merges with its free neighbours, and a segment stays cached until such a refusal releases it. Left out, as
single-stream cells in the default configuration do not use them: cross-stream frees and CUDA-graph pools.
New segments' addresses are invented (each above the last): real ones would only break ties.

Pure Python, no torch: sizes in bytes, events as plain tuples, read from a recorded trace by
``sources.torch_trace`` and kept for a rerun as a ``RecordedRun``.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Collection
from dataclasses import dataclass, replace
from enum import StrEnum
from operator import itemgetter
from typing import Any, Mapping, Sequence

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
"""``(kind, key, requested_bytes, stream)``. ``alloc`` must be satisfied for the cell to fit; ``free`` returns
the block allocated under ``key``; ``try`` is a request the program survives being refused (cuDNN then takes
an algorithm with a smaller workspace), replayed for the cached segments a refusal releases, freed when granted."""


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
    """A segment reserved when the cell starts, as ``torch.cuda.memory._snapshot()`` lists it; ``blocks`` are
    ``(size_bytes, allocated)`` in address order. Their free pieces are where the first small requests land."""

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
    end: tuple[tuple[StartSegment, ...], dict[int, int]] | None = None
    """With ``keep_end``, where a run that fits leaves the allocator: its segments, and each allocated
    block's key by address (what the next run starts from: ``growth.fitting.fits_in_a_row``)."""


def _allocated_in(start: Sequence[StartSegment]) -> list[tuple[bool, int, int]]:
    """Each block allocated in ``start`` as ``(small, size, address)``."""
    found = []
    for segment in start:
        address = segment.address
        for size, is_allocated in segment.blocks:
            if is_allocated:
                found.append((segment.small, size, address))
            address += size
    return found


def start_keys(start: Sequence[StartSegment]) -> dict[int, int]:
    """Keys (negative) for the blocks allocated at the start, by address. Ranked by (pool, size, address), so
    that two starts holding the same tensors at other addresses give them the same keys and their traces align."""
    return {address: -1 - rank for rank, (_, _, address) in enumerate(sorted(_allocated_in(start)))}


def allocated_blocks(start: Sequence[StartSegment]) -> dict[int, int]:
    """The size of each block allocated in ``start``, by address."""
    return {address: size for _, size, address in _allocated_in(start)}


_Block = list[Any]
"""A block in the replay: ``[address, size, allocated, prev, next, pool]``, the neighbours in its segment
(``None`` at its ends) and the free list it goes back to. A list, not an object: the cheapest to make and change."""
_ADDRESS, _SIZE, _ALLOCATED, _PREV, _NEXT, _POOL = range(6)

_Pool = list[tuple[int, int, _Block]]
"""The free blocks of one pool and stream as ``(size, address, block)``, kept sorted: the smallest block that
is large enough is one bisection away, the lowest address first on a tie (addresses are unique, so blocks
themselves are never compared). A list: a cell caches a few dozen blocks, too few for a tree to pay."""


def _release_cached(pools: dict[int, tuple[_Pool, _Pool]], segment_frees: list[int]) -> int:
    """Return every wholly free segment to the driver, large pool first (as torch does), streams in order: bytes."""
    before = len(segment_frees)
    for small in (False, True):
        for stream in sorted(pools):
            pool = pools[stream][small]
            whole = [size for size, _, block in pool if block[_PREV] is None and block[_NEXT] is None]
            if whole:  # often none: an earlier refusal in the run emptied the cache
                segment_frees += whole
                pool[:] = [cached for cached in pool if cached[2][_PREV] is not None or cached[2][_NEXT] is not None]
    return sum(segment_frees[before:])


def replay(events: Sequence[Event], start: Sequence[StartSegment], cap_bytes: int,
           keys: Mapping[int, int] | None = None, keep_end: bool = False) -> Replay:
    """Replay ``events`` from the ``start`` segments with reserved bytes capped at ``cap_bytes``; ``keys``
    names the blocks allocated in ``start`` by address (``start_keys`` by default)."""
    allocator = Allocator(start, keys)
    played = allocator.play(events, cap_bytes)
    fits = played[0] is None
    end = allocator.layout() if keep_end and fits else None
    allocator.close()
    return Replay(fits, *played, None if fits else allocator.allocated, None if fits else allocator.reserved, end)


class Allocator:
    """The replay's allocator: free blocks by stream and pool, allocated ones by key, bytes reserved and
    allocated, where the next segment goes. An object, so that a cell's next run plays on from where its last
    left it (``carry``, ``growth.fitting.fits_in_a_row``). ``close`` when done."""

    __slots__ = ("allocated", "live", "next_address", "pools", "reserved")

    def __init__(self, start: Sequence[StartSegment], keys: Mapping[int, int] | None = None) -> None:
        """The allocator at ``start``, its allocated blocks named by ``keys`` (as ``replay``'s)."""
        keys = _keys_of(start) if keys is None else keys
        pools: dict[int, tuple[_Pool, _Pool]] = {}  # by stream: the large pool's free blocks, then the small's
        live: dict[int, _Block] = {}
        reserved = allocated = next_address = 0
        block: _Block
        before: _Block | None
        for segment in start:
            pool = (pools.get(segment.stream) or pools.setdefault(segment.stream, ([], [])))[segment.small]
            address, before = segment.address, None
            for size, is_allocated in segment.blocks:
                block = [address, size, is_allocated, before, None, pool]
                if before is not None:
                    before[_NEXT] = block
                if is_allocated:
                    allocated += size
                    live[keys[address]] = block
                else:
                    insort(pool, (size, address, block))
                before = block
                address += size
            reserved += address - segment.address
            next_address = max(next_address, address)
        self.pools, self.live = pools, live
        self.reserved, self.allocated, self.next_address = reserved, allocated, next_address

    def play(self, events: Sequence[Event], cap_bytes: int
             ) -> tuple[int | None, int, int, tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        """Play ``events`` under ``cap_bytes``, stopping at the first ``alloc`` refused: its index (``None``: all
        fitted), then the rest of ``Replay``'s fields to ``refused_tries``. One loop, its state and names in
        locals: a search plays a cell's requests thousands of times."""
        pools, live = self.pools, self.live
        reserved, allocated, next_address = self.reserved, self.allocated, self.next_address
        block: _Block
        before: _Block | None
        after: _Block | None
        peak_allocated, peak_reserved = allocated, reserved
        segment_allocs: list[int] = []
        segment_frees: list[int] = []
        refused: list[int] = []
        failed_at: int | None = None
        bisect, put = bisect_left, insort
        free_kind, try_kind, alloc_kind = FREE, TRY, ALLOC
        min_block, small_request = MIN_BLOCK_BYTES, SMALL_REQUEST_BYTES
        take_live = live.pop
        small_segment, mid_request = SMALL_SEGMENT_BYTES, MID_REQUEST_BYTES
        mid_segment, large_round = MID_SEGMENT_BYTES, LARGE_ROUND_BYTES
        last_stream: int | None = None  # the pools of the last request's stream are at hand: most share one
        stream_pools: tuple[_Pool, _Pool] = ([], [])
        for index, (kind, key, requested, stream) in enumerate(events):
            if kind == free_kind:
                freed = take_live(key, None)
                if freed is None:
                    continue
                block = freed
            else:
                size = -(-requested // min_block) * min_block
                if size < min_block:
                    size = min_block
                small = size <= small_request
                if stream != last_stream:
                    stream_pools = pools.get(stream) or pools.setdefault(stream, ([], []))
                    last_stream = stream
                pool = stream_pools[small]
                i = bisect(pool, (size,))
                if i < len(pool):
                    block = pool.pop(i)[2]
                else:
                    # ``segment_bytes``, inline
                    if small:
                        fresh = small_segment
                    elif size < mid_request:
                        fresh = mid_segment
                    else:
                        fresh = -(-size // large_round) * large_round
                    if reserved + fresh > cap_bytes:
                        reserved -= _release_cached(pools, segment_frees)
                        if reserved + fresh > cap_bytes:
                            if kind == alloc_kind:
                                failed_at = index
                                break
                            refused.append(index)
                            continue
                    segment_allocs.append(fresh)
                    block = [next_address, fresh, False, None, None, pool]
                    next_address += fresh
                    reserved += fresh
                    if reserved > peak_reserved:
                        peak_reserved = reserved
                rest = block[1] - size  # _SIZE
                if rest >= min_block if small else rest > small_request:
                    after = block[4]  # _NEXT
                    tail = [block[0] + size, rest, False, block, after, pool]
                    if after is not None:
                        after[3] = tail  # _PREV
                    block[4] = tail
                    block[1] = size
                    put(pool, (rest, tail[0], tail))
                block[2] = True  # _ALLOCATED
                allocated += block[1]
                if allocated > peak_allocated:
                    peak_allocated = allocated
                if kind != try_kind:
                    live[key] = block
                    continue
            # The block goes back, merged with its free neighbours (indices as _Block names them).
            block[2] = False
            size = block[1]
            allocated -= size
            pool = block[5]
            before = block[3]
            if before is not None and not before[2]:
                del pool[bisect(pool, (before[1], before[0]))]
                block[0] = before[0]
                size += before[1]
                before = block[3] = before[3]
                if before is not None:
                    before[4] = block
            after = block[4]
            if after is not None and not after[2]:
                del pool[bisect(pool, (after[1], after[0]))]
                size += after[1]
                after = block[4] = after[4]
                if after is not None:
                    after[3] = block
            block[1] = size
            put(pool, (size, block[0], block))
        self.reserved, self.allocated, self.next_address = reserved, allocated, next_address
        return (failed_at, peak_allocated, peak_reserved, tuple(segment_allocs), tuple(segment_frees),
                tuple(refused))

    def carry(self, made_below: int, empty_cache: bool) -> None:
        """Where the next run starts: as a run that fitted left it, each block it made (a key from 0 up) under
        the key ``made_below - key`` (the start's, below 0, keep theirs), the cache emptied first where
        ``empty_cache``, the next segment above the highest left (as from ``layout``)."""
        if empty_cache:
            self.reserved -= _release_cached(self.pools, [])
        self.live = {key if key < 0 else made_below - key: block for key, block in self.live.items()}
        ends = [block[_ADDRESS] + block[_SIZE] for block in self.live.values()]
        ends += [address + size for both in self.pools.values() for pool in both for size, address, _ in pool]
        self.next_address = max(ends, default=0)

    def layout(self) -> tuple[tuple[StartSegment, ...], dict[int, int]]:
        """The segments as a snapshot lists them, in address order, and the key of each allocated block by address."""
        kinds = {id(pool): (stream, small) for stream, both in self.pools.items()
                 for small, pool in zip((False, True), both)}
        heads = [block for block in self.live.values() if block[_PREV] is None]
        heads += [block for both in self.pools.values() for pool in both for *_, block in pool if block[_PREV] is None]
        heads.sort(key=itemgetter(_ADDRESS))
        segments = []
        for head in heads:
            sizes: list[tuple[int, bool]] = []
            block: _Block | None = head
            while block is not None:
                sizes.append((block[_SIZE], block[_ALLOCATED]))
                block = block[_NEXT]
            stream, small = kinds[id(head[_POOL])]
            segments.append(StartSegment(head[_ADDRESS], small, tuple(sizes), stream))
        return tuple(segments), {block[_ADDRESS]: key for key, block in self.live.items()}

    def close(self) -> None:
        """Empty every block: blocks link each other and their pool, cycles only the cyclic collector frees."""
        for block in self.live.values():
            block.clear()
        for both in self.pools.values():
            for pool in both:
                for cached in pool:
                    cached[2].clear()


_last_keys: tuple[tuple[StartSegment, ...], dict[int, int]] | None = None


def _keys_of(start: Sequence[StartSegment]) -> dict[int, int]:
    """``start_keys(start)``, kept for the last tuple asked (by identity: a tuple of frozen segments cannot change,
    and the one kept cannot be freed and its id reused): a search replays thousands of runs from one start."""
    global _last_keys
    last = _last_keys
    if last is not None and last[0] is start:
        return last[1]
    keys = start_keys(start)
    if type(start) is tuple:
        _last_keys = (start, keys)
    return keys


def given_back_at_once(events: Sequence[Event]) -> list[int]:
    """The indices of the requests that the next event frees: a temporary, or a library's workspace."""
    return [index for index, (event, after) in enumerate(zip(events, events[1:]))
            if event[0] == ALLOC and after[0] == FREE and after[1] == event[1]]


def optional_workspaces(events: Sequence[Event]) -> list[Event]:
    """``events`` with each request freed right after it was made (``given_back_at_once``) as a ``try``: a
    library's workspace, which it sizes by what it can get (refused, cuDNN picks an algorithm that needs less).
    Only for a cell shown to cope without them (``capacity.runs.probe_workspaces``): cuDNN's RNNs do not."""
    at_once = set(given_back_at_once(events))
    # The free right after a workspace goes: a try frees itself.
    return [(TRY, event[1], event[2], event[3]) if index in at_once else event
            for index, event in enumerate(events) if index - 1 not in at_once]


def held_elsewhere(events: Sequence[Event], left: Sequence[tuple[int, int]],
                   start: Sequence[StartSegment], remade: frozenset[int] = frozenset(),
                   let_go: Collection[int] = frozenset()) -> list[Event]:
    """``events`` without the allocations the run made and left (``left``, ``(address, key)``) that ``start``
    still holds at that address in a block of that request's size (``same_block``): what it made once and
    kept (AdamW's state, gradients) is in the next try's segments already, and would be counted twice.
    ``remade``: addresses ``start`` holds for values the cell binds again with no binding in the run to go
    by: made anew, the old one freed right after. ``let_go``: addresses ``start`` holds that the run lets go
    (``RecordedRun.events_from``): what the run left at them is made anew."""
    held = allocated_blocks(start)
    sizes = {key: size for kind, key, size, _ in events if kind == ALLOC}
    again = {key: address for address, key in left
             if key in sizes and address not in let_go and same_block(held.get(address), sizes[key])}
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


def keys_at(start: Sequence[StartSegment], addresses: Collection[int]) -> frozenset[int]:
    """The keys (``start_keys``) of the blocks ``start`` holds at ``addresses``."""
    keys = start_keys(start) if addresses else {}
    return frozenset(keys[address] for address in addresses if address in keys)


def with_released(events: Sequence[Event], recorded: Collection[int], released: Collection[int],
                  at: int, keys: Mapping[int, int | None] | None = None) -> list[Event]:
    """``events`` with the frees of ``recorded`` (start keys the run let go as its first optimizer step
    began) made instead for ``released`` (those another start lets go there), before the first of them, else
    before event ``at``; its other frees of its start made for their images (``keys``, as ``with_keys``).
    Why: a try's put-back holds the last run's optimizer state until the step, and the step makes its own."""
    first = next((i for i, (kind, key, _, _) in enumerate(events) if kind == FREE and key in recorded), at)
    stream = events[first][3] if first < len(events) else 0
    kept = [event for event in events[first:] if not (event[0] == FREE and event[1] in recorded)]
    frees = [(FREE, key, 0, stream) for key in sorted(released)]
    return with_keys(events[:first], keys or {}) + frees + with_keys(kept, keys or {})


def rebound_keys(recorded_start: Sequence[StartSegment], recorded: Sequence[Collection[int]],
                 start: Sequence[StartSegment], remade: Sequence[Collection[int]]) -> dict[int, int | None]:
    """For the values the cell binds again, name by name (``recorded`` and ``remade``: the addresses each
    name's value holds in ``recorded_start`` and in ``start``), the key in ``start`` of each block
    ``recorded_start`` held for the same name, paired largest first (``None``: ``start`` holds none for it):
    replayed from another start, a run lets that start's value go where it let its own go."""
    recorded_keys, keys = start_keys(recorded_start), start_keys(start)
    recorded_sizes, sizes = allocated_blocks(recorded_start), allocated_blocks(start)
    paired: dict[int, int | None] = {}
    for name, own in enumerate(recorded):
        other = remade[name] if name < len(remade) else ()
        theirs = sorted((a for a in other if a in keys), key=lambda a: (-sizes[a], a))
        mine = sorted((a for a in own if a in recorded_keys), key=lambda a: (-recorded_sizes[a], a))
        for index, address in enumerate(mine):
            paired[recorded_keys[address]] = keys[theirs[index]] if index < len(theirs) else None
    return paired


def with_keys(events: Sequence[Event], keys: Mapping[int, int | None]) -> list[Event]:
    """``events`` with each free of a key ``keys`` names made for its image (none where that is ``None``)."""
    made: list[Event] = []
    for event in events:
        if event[0] == FREE and event[1] in keys:
            image = keys[event[1]]
            if image is not None:
                made.append((FREE, image, 0, event[3]))
        else:
            made.append(event)
    return made


def raised_at(events: Sequence[Event]) -> int | None:
    """The index of a failed run's request that raised: its last ``alloc`` (``sources.torch_trace.read_trace``
    makes the fatal ``oom`` one, and what the error unwound after it only frees)."""
    return next((i for i in range(len(events) - 1, -1, -1) if events[i][0] == ALLOC), None)


@dataclass(frozen=True)
class RecordedRun:
    """One rerun as the replay reads it: its start, its events, and what it left allocated as ``(address, key)``.
    ``whole`` is false for a window of a run longer than the history kept (``reruns.recording``)."""

    start: tuple[StartSegment, ...]
    events: tuple[Event, ...]
    left: tuple[tuple[int, int], ...] = ()
    whole: bool = True
    carried: frozenset[int] = frozenset()  # a window's: keys of what the run held when the window began
    steps: tuple[tuple[int, int], ...] = ()  # each optimizer step() as (first event, event after its last)
    remade: tuple[frozenset[int], ...] = ()  # addresses in ``start`` for ``rebound_keys``
    released: frozenset[int] = frozenset()  # addresses in ``start`` for ``with_released``

    @property
    def released_keys(self) -> frozenset[int]:
        """``released`` as ``start``'s keys: what the replay of this run from its own start lets go."""
        return keys_at(self.start, self.released)

    def without_the_request_that_raised(self) -> RecordedRun:
        """The run of a try that failed as its work ran, without the request that raised (a failed run's last
        ``alloc``, ``sources.torch_trace.read_trace``): its work fitted, and only what came after it, moving a
        joined result back to the GPU, ran out of memory; replayed, that request would fail every batch."""
        last = raised_at(self.events)
        return self if last is None else replace(self, events=self.events[:last] + self.events[last + 1:])

    def events_from(self, start: tuple[StartSegment, ...], remade: Sequence[frozenset[int]] = (),
                    released: frozenset[int] = frozenset()) -> list[Event]:
        """The events a run from ``start`` makes (``remade``, ``released``: as ``self``'s): the last run's values
        go where this run let its own go (``rebound_keys``), its optimizer state where the step begins
        (``with_released``), the gradients it zeroed where it zeroed its own (``_made_again_in``), and what it
        made and left that ``start`` holds is not made again (``held_elsewhere``)."""
        recorded = self.released_keys
        rebound = rebound_keys(self.start, self.remade, start, remade)
        if tuple(start) != self.start:  # by address: in its own start, a reused address held another block
            rebound.update(self._made_again_in(start, set(rebound) | recorded, released))
        if (self.steps or not self.whole) and (recorded or released):
            # A window begins after the cell's first step: what the put-back held is gone before it.
            at = self.steps[0][0] if self.whole else 0
            events = with_released(self.events, recorded, keys_at(start, released), at, rebound)
        else:
            events = with_keys(self.events, rebound)
        freed_where_bound = {key for key in rebound.values() if key is not None}
        let_go = {address for address, key in start_keys(start).items() if key in freed_where_bound}
        unpaired = frozenset(address for addresses in remade for address in addresses) - let_go
        return held_elsewhere(events, self.left, start, unpaired, released | let_go)

    def _made_again_in(self, start: Sequence[StartSegment], known: Collection[int],
                       released: Collection[int]) -> dict[int, int | None]:
        """For each block of ``self.start`` the run freed (but ``known``), the key in another ``start`` of a
        block of its size the run left where ``start`` holds it (but ``released``): a loop that zeroes the
        last run's gradients first leaves its own, and from a start after it frees those."""
        own = start_keys(self.start)
        held = {own[address]: size for address, size in allocated_blocks(self.start).items()}
        there, sizes = start_keys(start), allocated_blocks(start)
        made = {key for kind, key, _, _ in self.events if kind == ALLOC}
        kept: dict[int, list[int]] = {}
        for address, key in self.left:
            if key in made and address in there and address not in released:
                kept.setdefault(sizes[address], []).append(there[address])
        again: dict[int, int | None] = {}
        for kind, key, _, _ in self.events:
            if kind == FREE and key in held and key not in known and key not in again and kept.get(held[key]):
                again[key] = kept[held[key]].pop()
        return again
