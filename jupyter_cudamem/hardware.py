"""The sources one kernel measures with, bundled so every feature shares them.

``%%cudamem``, the monitor and ``%oomfix`` all read through one ``Hardware``: one NVML session (see
``sources/nvml.py`` for why there must be only one) and one map of devices; and the headroom a cell starting
now has on a device (``headroom_bytes``, ``reserved_limit_bytes``), read through them. Tests build a
``Hardware`` from the fakes in ``tests/fakes.py``.

One notion of "a GPU" for the whole extension (``Device``, ``DeviceMap``): PyTorch's ``cuda:N`` matched to
NVML's device. NVML numbers every GPU on the machine in PCI order; PyTorch numbers only the visible ones, in
CUDA's order, after ``CUDA_VISIBLE_DEVICES``. Indexes therefore disagree (``CUDA_VISIBLE_DEVICES=1`` makes
NVML's GPU 1 PyTorch's ``cuda:0``), so devices are matched by UUID, then by PCI bus id, and only as a last
resort by position.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from .errors import CudaMemError
from .sources.base import AllocatorReading, AllocatorSource, GpuIdentity, NvmlSource, TorchDevice
from .units import format_bytes, whole_number


@dataclass(frozen=True)
class Device:
    """A GPU this process can use, with both numberings (either may be ``None``)."""

    torch_index: int | None
    nvml_index: int | None
    name: str
    uuid: str | None
    total_bytes: int

    @property
    def label(self) -> str:
        if self.torch_index is not None:
            return f"cuda:{self.torch_index}"
        return f"GPU {self.nvml_index}"


def normalize_uuid(uuid: str | None) -> str | None:
    """NVML writes ``GPU-8f4a...``, PyTorch ``8f4a...``: compare without prefix and case."""
    if not uuid:
        return None
    text = uuid.strip().lower()
    for prefix in ("gpu-", "mig-"):
        if text.startswith(prefix):
            text = text[len(prefix) :]
    return text


def _normalize_bus(bus_id: str | None) -> str | None:
    if not bus_id:
        return None
    parts = bus_id.strip().lower().split(":")
    # NVML may write the domain with 4 or 8 digits; compare on its value.
    if len(parts) == 3:
        return f"{int(parts[0], 16):08x}:{parts[1]}:{parts[2]}"
    return bus_id.strip().lower()


def visible_gpus(gpus: list[GpuIdentity], cuda_visible_devices: str | None) -> list[GpuIdentity]:
    """The NVML devices CUDA will show, in CUDA's order, read from ``CUDA_VISIBLE_DEVICES``.

    Used before PyTorch has initialised CUDA (asking it would create a context). Like CUDA, an
    unknown entry ends the list. Ordinals assume PCI order, as NVML numbers devices.
    """
    if cuda_visible_devices is None:
        return list(gpus)
    chosen: list[GpuIdentity] = []
    for token in cuda_visible_devices.split(","):
        token = token.strip()
        if not token:
            break
        match: GpuIdentity | None = None
        number = whole_number(token.removeprefix("-"))
        if number is not None:
            ordinal = -number if token.startswith("-") else number
            match = next((gpu for gpu in gpus if gpu.nvml_index == ordinal), None)
        else:
            wanted = normalize_uuid(token)
            match = next(
                (gpu for gpu in gpus if wanted and (normalize_uuid(gpu.uuid) or "").startswith(wanted)), None
            )
        if match is None or match in chosen:
            break
        chosen.append(match)
    return chosen


def match_devices(
    torch_devices: list[TorchDevice], gpus: list[GpuIdentity], cuda_visible_devices: str | None
) -> list[Device]:
    """Pair each PyTorch device with its NVML device: UUID, then PCI bus id, then position."""
    by_position = visible_gpus(gpus, cuda_visible_devices)
    result = []
    for torch_device in torch_devices:
        gpu = next(
            (g for g in gpus if torch_device.uuid and normalize_uuid(g.uuid) == normalize_uuid(torch_device.uuid)),
            None,
        )
        if gpu is None and torch_device.pci_bus_id:
            gpu = next((g for g in gpus if _normalize_bus(g.pci_bus_id) == _normalize_bus(torch_device.pci_bus_id)), None)
        if gpu is None and torch_device.uuid is None and torch_device.pci_bus_id is None:
            if torch_device.index < len(by_position):
                gpu = by_position[torch_device.index]
        result.append(
            Device(
                torch_index=torch_device.index,
                nvml_index=None if gpu is None else gpu.nvml_index,
                name=torch_device.name,
                uuid=torch_device.uuid or (gpu.uuid if gpu else None),
                total_bytes=torch_device.total_bytes,
            )
        )
    return result


class DeviceMap:
    """The devices of this process, resolved through both sources and cached once final.

    Until PyTorch has initialised CUDA we do not ask it (that would create a ~500 MiB context);
    the NVML devices named by ``CUDA_VISIBLE_DEVICES`` stand in, and the map is rebuilt later.
    """

    def __init__(self, allocator: AllocatorSource, nvml: NvmlSource, environ: dict[str, str] | None = None):
        self.allocator = allocator
        self.nvml = nvml
        self._environ = os.environ if environ is None else environ
        self._final: list[Device] | None = None
        self._final_nvml: tuple[int, ...] = ()  # the NVML indexes of ``_final``, read on every measured cell

    def _gpus(self) -> list[GpuIdentity]:
        if self.nvml.status() is not None:
            return []
        try:
            return self.nvml.devices()
        except CudaMemError:
            return []

    def devices(self) -> list[Device]:
        if self._final is not None:
            return list(self._final)
        gpus = self._gpus()
        visible = self._environ.get("CUDA_VISIBLE_DEVICES")
        if self.allocator.is_initialized() and self.allocator.status() is None:
            torch_devices = [self.allocator.device(i) for i in range(self.allocator.device_count())]
            self._final = match_devices(torch_devices, gpus, visible)
            self._final_nvml = tuple(d.nvml_index for d in self._final if d.nvml_index is not None)
            return list(self._final)
        return [
            Device(torch_index=None, nvml_index=g.nvml_index, name=g.name, uuid=g.uuid, total_bytes=g.total_bytes)
            for g in visible_gpus(gpus, visible)
        ]

    def nvml_indexes(self) -> tuple[int, ...]:
        """The NVML indexes of ``devices()`` that have one (twice a measured cell: kept once the map is final)."""
        if self._final is not None:
            return self._final_nvml
        return tuple(d.nvml_index for d in self.devices() if d.nvml_index is not None)

    def torch_device_count(self) -> int:
        """How many ``cuda:N`` exist, without initialising CUDA (``device_count`` does not)."""
        if self.allocator.status() is not None:
            return 0
        return self.allocator.device_count()

    def forget(self) -> None:
        self._final = None


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
        if self.allocator.status() is None and self.nvml.status() is None:  # as every measured cell finds it
            return []
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
