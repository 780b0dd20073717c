"""Take readings before and after a block of code and turn them into a measurement.

Pure: knows the sources' protocols and nothing of IPython. Counters are read after
``synchronize()`` so kernels still queued when the block returns are counted. The allocator's peak
counters are reset at the start (unless ``reset_peak=False``) so "peak" is the block's own peak.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from .errors import CudaMemError
from .hardware import Device, Hardware
from .sources.base import AllocatorReading, NvmlMemory
from .units import MiB

# NVML "used" of a whole device moves with other processes too; below this we call it noise.
NVML_NOISE_BYTES = 2 * MiB


@dataclass(frozen=True)
class DeviceSample:
    """What both sources said about one device at one instant."""

    allocator: AllocatorReading | None
    nvml: NvmlMemory | None
    process_bytes: int | None  # NVML's figure for this process; None where NVML cannot map processes


@dataclass(frozen=True)
class Baseline:
    """Readings at the start of a block, keyed by NVML index and by PyTorch index."""

    started_s: float
    allocator: dict[int, AllocatorReading]
    nvml: dict[int, NvmlMemory]
    process: dict[int, int | None]
    peak_reset: bool


@dataclass(frozen=True)
class DeviceMeasurement:
    """One device over one block. Sizes in bytes; ``None`` where a source could not tell."""

    device: Device
    before: DeviceSample
    after: DeviceSample
    peak_allocated_bytes: int | None
    peak_reserved_bytes: int | None
    peak_is_block_peak: bool  # False when peak counters were not reset: peak since an earlier reset
    # torch.cuda.set_per_process_memory_fraction's value at the end of the block; None where unread.
    memory_fraction: float | None = None

    @property
    def allocated_delta_bytes(self) -> int | None:
        if self.before.allocator is None or self.after.allocator is None:
            return None
        return self.after.allocator.allocated_bytes - self.before.allocator.allocated_bytes

    @property
    def reserved_delta_bytes(self) -> int | None:
        if self.before.allocator is None or self.after.allocator is None:
            return None
        return self.after.allocator.reserved_bytes - self.before.allocator.reserved_bytes

    @property
    def peak_above_start_bytes(self) -> int | None:
        """How far the block's peak rose above what was allocated when it started."""
        if self.peak_allocated_bytes is None or self.before.allocator is None:
            return None
        return max(self.peak_allocated_bytes - self.before.allocator.allocated_bytes, 0)

    @property
    def nvml_used_delta_bytes(self) -> int | None:
        if self.before.nvml is None or self.after.nvml is None:
            return None
        return self.after.nvml.used_bytes - self.before.nvml.used_bytes

    @property
    def process_delta_bytes(self) -> int | None:
        if self.before.process_bytes is None or self.after.process_bytes is None:
            return None
        return self.after.process_bytes - self.before.process_bytes

    @property
    def outside_pytorch_delta_bytes(self) -> int | None:
        """Growth the driver saw beyond PyTorch's pools: CUDA context, cuBLAS/cuDNN, CuPy, JAX."""
        reserved = self.reserved_delta_bytes or 0
        driver = self.process_delta_bytes
        if driver is None:
            driver = self.nvml_used_delta_bytes
        if driver is None:
            return None
        return driver - reserved

    @property
    def cap_bytes(self) -> int | None:
        """PyTorch's per-process cap in bytes (``set_per_process_memory_fraction``), ``None`` when none is set."""
        if self.memory_fraction is None or self.memory_fraction >= 1.0 or self.device.torch_index is None:
            return None
        return int(self.total_bytes * self.memory_fraction)

    @property
    def limit_bytes(self) -> int:
        """What this process's PyTorch may hold on the device: the cap where one is set, else the card."""
        return self.cap_bytes if self.cap_bytes is not None else self.total_bytes

    @property
    def free_after_bytes(self) -> int | None:
        """Free at the end: NVML's free; under a cap, what PyTorch may still reserve under it (the cap less
        what it has reserved), or NVML's free where that is less (other processes count)."""
        nvml_free = None if self.after.nvml is None else self.after.nvml.free_bytes
        cap = self.cap_bytes
        if cap is None or self.after.allocator is None:
            return nvml_free
        under_cap = max(cap - self.after.allocator.reserved_bytes, 0)
        return under_cap if nvml_free is None else min(under_cap, nvml_free)

    @property
    def total_bytes(self) -> int:
        """The card's one total: PyTorch's (``total_memory``, what CUDA lets processes allocate) where
        PyTorch sees the device, else NVML's. See ``nvml_extra_bytes`` for why NVML's may be larger."""
        if self.device.torch_index is not None or self.after.nvml is None:
            return self.device.total_bytes
        return self.after.nvml.total_bytes

    @property
    def nvml_extra_bytes(self) -> int:
        """How much more NVML's total says than PyTorch's: memory the driver keeps for itself (page
        tables, ECC, reserved regions), which no process can allocate. 0 when they agree or one is unknown."""
        if self.after.nvml is None or self.device.torch_index is None:
            return 0
        return self.after.nvml.total_bytes - self.device.total_bytes

    @property
    def touched(self) -> bool:
        """Did the block change anything on this device?"""
        return _touched(self.before, self.after, self.peak_allocated_bytes)


def _touched(before: DeviceSample, after: DeviceSample, peak_allocated_bytes: int | None) -> bool:
    """``DeviceMeasurement.touched`` from the samples alone, so that ``Meter.stop`` decides before it asks the cap
    and makes the measurement: a rise of the peak, a change of allocated, reserved or this process's bytes,
    and where NVML cannot tell processes apart, a move of the device's used memory beyond the noise."""
    start, end = before.allocator, after.allocator
    if start is not None and peak_allocated_bytes is not None and peak_allocated_bytes > start.allocated_bytes:
        return True
    if start is not None and end is not None and (end.allocated_bytes != start.allocated_bytes
                                                  or end.reserved_bytes != start.reserved_bytes):
        return True
    if before.process_bytes is not None:
        return after.process_bytes is not None and after.process_bytes != before.process_bytes
    if before.nvml is None or after.nvml is None:
        return False
    return abs(after.nvml.used_bytes - before.nvml.used_bytes) > NVML_NOISE_BYTES


@dataclass(frozen=True)
class Measurement:
    """A block's memory on every device it touched (or was asked about), and its wall time."""

    devices: tuple[DeviceMeasurement, ...]
    wall_s: float
    unavailable: tuple[str, ...] = ()
    error: str | None = None  # the exception's type name when the block failed
    limit_bytes: int | None = None
    extras: dict[str, object] = field(default_factory=dict, compare=False)

    @property
    def peak_allocated_bytes(self) -> int | None:
        peaks = [d.peak_allocated_bytes for d in self.devices if d.peak_allocated_bytes is not None]
        return max(peaks) if peaks else None

    @property
    def left_allocated_bytes(self) -> int:
        """What the block left allocated, over every device: each device's rise (one that freed counts 0)."""
        return sum(max(device.allocated_delta_bytes or 0, 0) for device in self.devices)

    def moved_at_least(self, threshold_bytes: int) -> bool:
        """Whether on some device the peak rose, or allocated, reserved or NVML's used memory changed, by at
        least ``threshold_bytes`` (either way)."""
        for device in self.devices:
            for value in (
                device.peak_above_start_bytes,
                device.allocated_delta_bytes,
                device.reserved_delta_bytes,
                device.nvml_used_delta_bytes,
            ):
                if value is not None and abs(value) >= threshold_bytes:
                    return True
        return False


class Meter:
    """Measures blocks of code on the devices of a ``Hardware``.

    ``devices`` restricts the measurement to those PyTorch indexes (reported even if untouched);
    by default every device is read and only the touched ones are reported.
    """

    def __init__(
        self,
        hardware: Hardware,
        reset_peak: bool = True,
        devices: list[int] | None = None,
        process_memory: bool = True,
    ):
        self.hardware = hardware
        self.reset_peak = reset_peak
        self.devices = devices
        self.process_memory = process_memory

    def check_devices(self) -> None:
        """Raise ``CudaMemError`` for a requested device that does not exist."""
        if not self.devices:
            return
        count = self.hardware.device_map.torch_device_count()
        if count == 0:
            count = len(self.hardware.device_map.devices())
        for index in self.devices:
            if not 0 <= index < count:
                known = ", ".join(f"cuda:{i}" for i in range(count)) or "none"
                raise CudaMemError(f"no CUDA device {index}: this process sees {count} ({known}); pass --device 0..{max(count - 1, 0)}")

    # -- reading ---------------------------------------------------------------------------
    def _read_nvml(self) -> tuple[dict[int, NvmlMemory], dict[int, int | None]]:
        memory: dict[int, NvmlMemory] = {}
        process: dict[int, int | None] = {}
        nvml = self.hardware.nvml
        if nvml.status() is not None:
            return memory, process
        for index in self.hardware.device_map.nvml_indexes():
            try:
                memory[index] = nvml.memory(index)
                process[index] = self._process_bytes(index, memory[index].used_bytes) if self.process_memory else None
            except CudaMemError:
                continue
        return memory, process

    def _process_bytes(self, nvml_index: int, device_used_bytes: int) -> int | None:
        return self.hardware.own_process_bytes(nvml_index, device_used_bytes)

    def _torch_indexes(self) -> list[int]:
        if self.devices is not None:
            return list(self.devices)
        return list(range(self.hardware.allocator.device_count()))

    def _read_allocator(self, synchronize: bool, known: Mapping[int, AllocatorReading] | None = None,
                        initialized: bool | None = None) -> dict[int, AllocatorReading]:
        """``initialized``: whether PyTorch's CUDA is up, where the caller asked already."""
        allocator = self.hardware.allocator
        if not (allocator.is_initialized() if initialized is None else initialized):
            return {}
        readings = {}
        for index in self._torch_indexes():
            if synchronize:
                allocator.synchronize(index)
            reading = known.get(index) if known else None
            readings[index] = reading if reading is not None else allocator.read(index)
        return readings

    # -- the block -------------------------------------------------------------------------
    # Why both ends synchronize (about 4 µs each on an idle device): the allocator's figures are the host's
    # bookkeeping and would read the same without, but the wall time would not (work queued before the
    # block counted in it, the block's own queued kernels not), NVML's figures would not where the
    # stream-ordered allocator (``backend:cudaMallocAsync``) gives its pool back at a synchronization,
    # and an asynchronous CUDA error would surface in a later cell instead of the one that caused it.
    def start(self, readings: Mapping[int, AllocatorReading] | None = None) -> Baseline:
        """``readings``: PyTorch's counters as the block starts where the caller read them already (a
        cell's start, read once for everything measuring it). They are the host's bookkeeping, the same
        before the synchronization as after it, so each saves one read (about 20 µs on the H200)."""
        initialized = self.hardware.allocator.is_initialized()
        allocator_readings = self._read_allocator(synchronize=True, known=readings, initialized=initialized)
        peak_reset = False
        if initialized and self.reset_peak:
            for index in allocator_readings:
                self.hardware.allocator.reset_peak(index)
            peak_reset = True
        nvml_memory, process = self._read_nvml()
        return Baseline(
            started_s=time.perf_counter(),
            allocator=allocator_readings,
            nvml=nvml_memory,
            process=process,
            peak_reset=peak_reset or not initialized,
        )

    def stop(self, baseline: Baseline, error: str | None = None, limit_bytes: int | None = None) -> Measurement:
        after_allocator = self._read_allocator(synchronize=True)
        wall_s = time.perf_counter() - baseline.started_s
        after_nvml, after_process = self._read_nvml()
        measured = []
        for device in self.hardware.device_map.devices():
            if self.devices is not None and device.torch_index not in self.devices:
                continue
            before_reading = None
            after_reading = None
            if device.torch_index is not None and device.torch_index in after_allocator:
                after_reading = after_allocator[device.torch_index]
                # A torch that was not initialised before the block held nothing then.
                before_reading = baseline.allocator.get(device.torch_index, AllocatorReading(0, 0, 0, 0))
            nvml_index = device.nvml_index
            before = DeviceSample(
                before_reading,
                baseline.nvml.get(nvml_index) if nvml_index is not None else None,
                baseline.process.get(nvml_index) if nvml_index is not None else None,
            )
            after = DeviceSample(
                after_reading,
                after_nvml.get(nvml_index) if nvml_index is not None else None,
                after_process.get(nvml_index) if nvml_index is not None else None,
            )
            peak = None if after_reading is None else after_reading.peak_allocated_bytes
            if self.devices is None and not (error is not None and after_reading is not None) and not _touched(
                    before, after, peak):
                continue  # not reported: its cap is not asked (once a cell, for a cell that used no GPU memory)
            measured.append(DeviceMeasurement(
                device=device,
                before=before,
                after=after,
                peak_allocated_bytes=peak,
                peak_reserved_bytes=None if after_reading is None else after_reading.peak_reserved_bytes,
                peak_is_block_peak=baseline.peak_reset,
                memory_fraction=None if after_reading is None else self._memory_fraction(device.torch_index),
            ))
        return Measurement(
            devices=tuple(measured),
            wall_s=wall_s,
            unavailable=tuple(self.hardware.unavailable()),
            error=error,
            limit_bytes=limit_bytes,
        )

    def _memory_fraction(self, torch_index: int | None) -> float | None:
        if torch_index is None:
            return None
        try:
            return self.hardware.allocator.memory_fraction(torch_index)
        except Exception:  # a torch without the getter, or a device it cannot query: no cap is known
            return None
