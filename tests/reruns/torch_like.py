"""A run as PyTorch records it, for tests of the recording: requests played through the replay's model of
the caching allocator (``tests/growth/allocator_reference.py``, what ``growth.replay`` is held to), written down as torch writes them (trace rows of
``alloc``/``free_requested``/``free_completed``/``segment_alloc``, and a snapshot's segments with their
blocks' states and requested sizes)."""

from __future__ import annotations

from typing import Any

from jupyter_cudamem.growth.replay import StartSegment
from tests.growth.allocator_reference import Block, ReferenceAllocator


class TorchLikeRun:
    """``alloc(name, bytes)`` and ``free(name)`` from ``start``; ``rows`` is the trace so far, ``segments()``
    the snapshot's segments now, ``live()`` the requested bytes of every block allocated now."""

    def __init__(self, start: tuple[StartSegment, ...], cap_bytes: int = 1 << 40):
        self.allocator = ReferenceAllocator(cap_bytes)
        self.live_blocks: dict[object, tuple[Block, int]] = {}
        for segment in start:
            for block in self.allocator.add_segment(segment.address, segment.small, segment.stream, segment.blocks):
                if block.allocated:
                    self.live_blocks[("start", block.address)] = (block, block.size)
        self.rows: list[dict[str, Any]] = []
        self.peak_allocated = self.allocator.allocated

    def alloc(self, name: object, size: int) -> None:
        made = len(self.allocator.segment_allocs)
        block = self.allocator.malloc(size, 0)
        assert block is not None, "the test's cap is too small for its requests"
        if len(self.allocator.segment_allocs) > made:
            self.rows.append({"action": "segment_alloc", "addr": block.address,
                              "size": self.allocator.segment_allocs[-1], "stream": 0})
        self.rows.append({"action": "alloc", "addr": block.address, "size": size, "stream": 0})
        self.live_blocks[name] = (block, size)
        self.peak_allocated = max(self.peak_allocated, self.allocator.allocated)

    def free(self, name: object) -> None:
        block, size = self.live_blocks.pop(name)
        self.rows.append({"action": "free_requested", "addr": block.address, "size": size, "stream": 0})
        self.rows.append({"action": "free_completed", "addr": block.address, "size": size, "stream": 0})
        self.allocator.release(block)

    def live(self) -> list[int]:
        return sorted(size for _, size in self.live_blocks.values())

    def segments(self) -> list[dict[str, Any]]:
        requested = {id(block): size for block, size in self.live_blocks.values()}
        blocks = [block for block, _ in self.live_blocks.values()]
        blocks += self.allocator.free
        found = []
        for head in sorted((b for b in blocks if b.prev is None), key=lambda b: b.address):
            chain, block = [], head
            while block is not None:
                chain.append({"size": block.size, "state": "active_allocated" if block.allocated else "inactive",
                              "requested_size": requested.get(id(block), block.size)})
                block = block.next
            found.append({"device": 0, "address": head.address, "total_size": sum(b["size"] for b in chain),
                          "segment_type": "small" if head.small else "large", "stream": 0, "blocks": chain})
        return found
