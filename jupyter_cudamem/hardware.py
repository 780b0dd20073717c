"""The sources one kernel measures with, bundled so every feature shares them.

``%%cudamem``, the monitor and ``%oomfix`` all read through one ``Hardware``: one NVML session (see
``sources/nvml.py`` for why there must be only one) and one map of devices; and the headroom a cell starting
now has on a device (``headroom_bytes``, ``reserved_limit_bytes``), read through them. Tests build a
``Hardware`` from the fakes in ``tests/fakes.py``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from .devices import DeviceMap
from .errors import CudaMemError
from .sources.base import AllocatorReading, AllocatorSource, NvmlSource
from .units import format_bytes


@dataclass
class Hardware:
    allocator: AllocatorSource
    nvml: NvmlSource
    pid: int = field(default_factory=os.getpid)
    environ: dict[str, str] | None = None
    pid_exists: Callable[[int], bool] = field(default=lambda pid: os.path.exists(f"/proc/{pid}"))
    device_map: DeviceMap = field(init=False)
    _process_cache: dict[int, tuple[int, int | None]] = field(init=False, default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.device_map = DeviceMap(self.allocator, self.nvml, self.environ)

    def unavailable(self) -> list[str]:
        """One line for each source that cannot measure here, saying why."""
        reasons = []
        for source in (self.allocator, self.nvml):
            reason = source.status()
            if reason:
                reasons.append(reason)
        return reasons

    def allocator_readings(self) -> dict[int, AllocatorReading] | None:
        """PyTorch's counters of every device now; ``None`` without CUDA, ``{}`` before CUDA starts.

        Before the user's code initialises CUDA nothing can be held, and reading would create a
        ~500 MiB context of our own.
        """
        if self.allocator.status() is not None:
            return None
        if not self.allocator.is_initialized():
            return {}
        return {index: self.allocator.read(index) for index in range(self.allocator.device_count())}

    @contextmanager
    def pytorch_capped(self, limit_bytes: int, devices: list[int] | None = None) -> Iterator[int]:
        """``%%cudamem --limit``: a smaller card played on this one, PyTorch capped at exactly ``limit_bytes``
        on each of ``devices`` (every device when ``None``) and put back after (``capped``). One line when
        the cap is more than a device has."""
        allocator = self.allocator
        indexes = devices if devices is not None else list(range(allocator.device_count()))
        allocator.empty_cache()  # cached blocks from earlier cells would count against the cap
        for index in indexes:
            total = allocator.device(index).total_bytes
            if limit_bytes > total:
                raise CudaMemError(
                    f"--limit {format_bytes(limit_bytes)} is more than cuda:{index} has ({format_bytes(total)}): "
                    "a cap can only play a smaller card"
                )
        with self.capped(limit_bytes, indexes, keep_tighter=False):
            yield limit_bytes

    @contextmanager
    def capped(self, limit_bytes: int | None, devices: Iterable[int], *, keep_tighter: bool = True,
               unread_fraction: float | None = 1.0) -> Iterator[list[int]]:
        """PyTorch's allocator capped at ``limit_bytes`` on each of ``devices`` for the block, through its
        per-process memory fraction, and each fraction put back after, error or not; yields the devices it
        capped. The cap covers PyTorch's allocator only, not the CUDA context or other libraries. The one
        place a cap is set: ``--limit`` (``pytorch_capped``), ``%oomfix``'s reruns under a cell's cap and the
        plan's runs at a smaller card all come here.

        ``limit_bytes`` ``None``, or no PyTorch CUDA here: nothing capped (an empty list).
        ``keep_tighter``: never above a cap already set (a rerun replays a cap, it must not loosen one).
        ``unread_fraction``: what a cap PyTorch cannot report counts as (torch before
        ``get_per_process_memory_fraction``); ``None`` leaves that device alone, since putting back a cap we
        never read could loosen the user's."""
        allocator = self.allocator
        previous: dict[int, float] = {}
        if limit_bytes is None or allocator.status() is not None:
            yield []
            return
        try:
            for index in devices:
                before = self.memory_fraction(index)
                if before is None:
                    before = unread_fraction
                if before is None:
                    continue
                fraction = max(limit_bytes, 0) / allocator.device(index).total_bytes
                previous[index] = before
                allocator.set_memory_fraction(index, min(fraction, before) if keep_tighter else fraction)
            yield list(previous)
        finally:
            for index, fraction in previous.items():
                allocator.set_memory_fraction(index, fraction)

    def memory_fraction(self, index: int) -> float | None:
        """PyTorch's per-process cap on ``cuda:index`` as a fraction of the card; ``None`` where it cannot say
        (an unreadable cap is one we must not overwrite)."""
        try:
            return self.allocator.memory_fraction(index)
        except Exception:  # noqa: BLE001 - unreadable, whatever the reason
            return None

    def own_process_bytes(self, nvml_index: int, device_used_bytes: int | None = None) -> int | None:
        """GPU memory NVML attributes to this process, or ``None`` where it cannot tell.

        Inside a container NVML lists host PIDs, none of which is ours: then we cannot know which
        entry is us, and say so rather than report 0 or another process's figure.
        Listing processes costs ~40 µs; given the device's "used" bytes, the last answer is reused
        while that figure has not moved (our memory cannot change without the device's changing).
        """
        if device_used_bytes is not None:
            cached = self._process_cache.get(nvml_index)
            if cached is not None and cached[0] == device_used_bytes:
                return cached[1]
            own = self._own_process_bytes(nvml_index)
            self._process_cache[nvml_index] = (device_used_bytes, own)
            return own
        return self._own_process_bytes(nvml_index)

    def _own_process_bytes(self, nvml_index: int) -> int | None:
        listed = self.nvml.processes(nvml_index)
        if listed is None:
            return None
        own = [p for p in listed if p.pid == self.pid]
        if own:
            if any(p.used_bytes is None for p in own):
                return None
            return sum(p.used_bytes or 0 for p in own)
        if any(not self.pid_exists(p.pid) for p in listed):
            return None
        return 0


def default_hardware() -> Hardware:
    """The real sources: PyTorch's allocator and the process-wide NVML session."""
    from .sources.nvml import shared_session
    from .sources.torch_alloc import TorchAllocator

    return Hardware(allocator=TorchAllocator(), nvml=shared_session())


# -- headroom: what a cell starting now may use ---------------------------------------------------------
def _room(hardware: Hardware, torch_index: int) -> tuple[int, AllocatorReading] | None:
    """What PyTorch may still reserve on ``cuda:torch_index`` (the least of the per-process cap less
    what it has reserved, and what the device has free by NVML, so other processes count), with the
    allocator's reading; ``None`` when the allocator cannot be read."""
    allocator = hardware.allocator
    if allocator.status() is not None or not allocator.is_initialized():
        return None
    reading = allocator.read(torch_index)
    total = allocator.device(torch_index).total_bytes
    fraction = allocator.memory_fraction(torch_index)
    room = int(total * (fraction if fraction is not None else 1.0)) - reading.reserved_bytes
    device = next((d for d in hardware.device_map.devices() if d.torch_index == torch_index), None)
    if device is not None and device.nvml_index is not None and hardware.nvml.status() is None:
        try:
            room = min(room, hardware.nvml.memory(device.nvml_index).free_bytes)
        except CudaMemError:
            pass
    return max(room, 0), reading


def headroom_bytes(hardware: Hardware, torch_index: int) -> int | None:
    """What a cell starting now may allocate on ``cuda:torch_index``, in bytes: what PyTorch may still
    reserve (``_room``) plus what it has reserved but not allocated, which it reuses first. ``None``
    when the allocator cannot be read.
    """
    found = _room(hardware, torch_index)
    return None if found is None else found[0] + found[1].reserved_unallocated_bytes


def reserved_limit_bytes(hardware: Hardware, torch_index: int) -> int | None:
    """The reserved bytes PyTorch may reach on ``cuda:torch_index``: the cap the allocator replay
    plays under (what it has reserved plus what it may still reserve)."""
    found = _room(hardware, torch_index)
    return None if found is None else found[0] + found[1].reserved_bytes
