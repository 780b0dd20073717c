"""A plain model of the caching allocator's rules as ``growth/replay.py``'s docstring states them: the free
blocks in one list searched from end to end, each block an object. Slow and easy to read, it is what the
replay's fast loop is held to (``tests/growth/test_replay_reference.py``), and the allocator a test plays
requests through one at a time (``tests/reruns/torch_like.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from jupyter_cudamem.growth.replay import (ALLOC, FREE, SMALL_REQUEST_BYTES, TRY, Event, Replay, StartSegment,
                                           block_bytes, segment_bytes, start_keys)


@dataclass(eq=False)
class Block:
    address: int
    size: int
    stream: int
    small: bool
    allocated: bool = False
    prev: Block | None = None
    next: Block | None = None


class ReferenceAllocator:
    """``malloc`` and ``release`` one request at a time; ``free`` holds every cached (free) block."""

    def __init__(self, cap_bytes: int):
        self.cap_bytes = cap_bytes
        self.free: list[Block] = []
        self.reserved = self.allocated = self.next_address = 0
        self.segment_allocs: list[int] = []
        self.segment_frees: list[int] = []

    def add_segment(self, address: int, small: bool, stream: int,
                    blocks: Sequence[tuple[int, bool]]) -> list[Block]:
        made: list[Block] = []
        for size, allocated in blocks:
            block = Block(address, size, stream, small, allocated, made[-1] if made else None)
            if made:
                made[-1].next = block
            if allocated:
                self.allocated += size
            else:
                self.free.append(block)
            made.append(block)
            address += size
        self.reserved += address - made[0].address
        self.next_address = max(self.next_address, address)
        return made

    def release_cached(self) -> None:
        """Every wholly free segment back to the driver: the large pool first, each pool by stream, size, address."""
        for small in (False, True):
            for block in sorted((b for b in self.free if b.small == small), key=lambda b: (b.stream, b.size, b.address)):
                if block.prev is None and block.next is None:
                    self.free.remove(block)
                    self.reserved -= block.size
                    self.segment_frees.append(block.size)

    def malloc(self, requested_bytes: int, stream: int) -> Block | None:
        size = block_bytes(requested_bytes)
        small = size <= SMALL_REQUEST_BYTES
        candidates = [b for b in self.free if b.small == small and b.stream == stream and b.size >= size]
        if candidates:
            block = min(candidates, key=lambda b: (b.size, b.address))
            self.free.remove(block)
        else:
            segment = segment_bytes(size)
            if self.reserved + segment > self.cap_bytes:
                self.release_cached()
                if self.reserved + segment > self.cap_bytes:
                    return None
            self.segment_allocs.append(segment)
            block = Block(self.next_address, segment, stream, small)
            self.reserved += segment
            self.next_address += segment
        rest = block.size - size
        if (small and rest >= 512) or (not small and rest > SMALL_REQUEST_BYTES):
            tail = Block(block.address + size, rest, stream, small, False, block, block.next)
            if block.next is not None:
                block.next.prev = tail
            block.next = tail
            block.size = size
            self.free.append(tail)
        block.allocated = True
        self.allocated += block.size
        return block

    def release(self, block: Block) -> None:
        block.allocated = False
        self.allocated -= block.size
        before, after = block.prev, block.next
        if before is not None and not before.allocated:
            self.free.remove(before)
            block.address, block.size, block.prev = before.address, before.size + block.size, before.prev
            if block.prev is not None:
                block.prev.next = block
        if after is not None and not after.allocated:
            self.free.remove(after)
            block.size, block.next = block.size + after.size, after.next
            if block.next is not None:
                block.next.prev = block
        self.free.append(block)


def reference_replay(events: Sequence[Event], start: Sequence[StartSegment], cap_bytes: int) -> Replay:
    """What ``growth.replay.replay`` must return, event by event through ``ReferenceAllocator``."""
    allocator = ReferenceAllocator(cap_bytes)
    keys = start_keys(start)
    live = {keys[b.address]: b for s in start for b in allocator.add_segment(s.address, s.small, s.stream, s.blocks)
            if b.allocated}
    peak_allocated, peak_reserved = allocator.allocated, allocator.reserved
    refused: list[int] = []
    for index, (kind, key, size, stream) in enumerate(events):
        if kind == FREE:
            if key in live:
                allocator.release(live.pop(key))
            continue
        block = allocator.malloc(size, stream)
        peak_reserved = max(peak_reserved, allocator.reserved)
        if block is None and kind == ALLOC:
            return Replay(False, index, peak_allocated, peak_reserved, tuple(allocator.segment_allocs),
                          tuple(allocator.segment_frees), tuple(refused), allocator.allocated, allocator.reserved)
        if block is None:
            refused.append(index)
            continue
        peak_allocated = max(peak_allocated, allocator.allocated)
        if kind == TRY:
            allocator.release(block)
        else:
            live[key] = block
    return Replay(True, None, peak_allocated, peak_reserved, tuple(allocator.segment_allocs),
                  tuple(allocator.segment_frees), tuple(refused))
